"""GEMM2 of the sorted-token fused MoE layer: the intermediate times w2, weighted, summed over top-k.

One program per (block, hidden tile[, K split]) computes inter @ w2[e]^T [+ b2], times the router
weight of each pair, then either a relaxed fp32 atomic add into the (M, H) accumulator (the sum
over top-k happens here; GEMM1 zeroed it) or (PAIR_STORE) a plain store of each pair's row into
(M*K, H), which `topk_sum_kernel` then sums over top-k in one more launch. Arguments that travel
together come as groups (common.Rows, common.Scales, common.Bias); the launcher is
moebench.kernels.triton.launch.launch_gemm2. Accumulation, fp8 scales and the interpreter's
upcasts are as in GEMM1 (moebench.kernels.triton.gemm1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moebench.kernels.triton.common import (
    acc_zeros,
    block_expert,
    cast_rne,
    dequant,
    grouped_tile,
    pdl_release,
    pdl_wait,
    scale_ptrs,
    scaled_mma,
    tile_rows,
    token_rows,
)
from moebench.kernels.triton.wquant import weight_tile, wq_offsets


@triton.jit
def gemm2_weighted_sum_kernel(
    inter_ptr,  # (max_padded, I)
    w2_ptr,  # (E_local, H, I)
    w2_desc,  # USE_TMA: TMA descriptor of w2 as (E_local * H, I), block (BLOCK_SIZE_N, BLOCK_SIZE_K)
    ws_ptr,  # (M, H) fp32, zeroed: the sum over top-k, out (PAIR_STORE: (M*K, H), each pair's row)
    topk_weights_ptr,  # (M*K,) router weights of the flat pairs
    rows,  # common.Rows: the alignment, as in GEMM1
    a_scale_ptr,  # QUANT: (max_padded, G) fp32 scales of inter's sorted rows (stride 0 over rows: per tensor)
    w_scale_ptr,  # QUANT / WQ: scales of w2
    num_pairs,
    H,
    N_INTER,  # I, the K dimension of this GEMM
    num_blocks_m,
    k_per_split,  # multiple of BLOCK_SIZE_K
    stride_im,
    stride_ik,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    sc,  # common.Scales of a_scale and w2
    b2,  # common.Bias: (E_local, H) biases, added once (by the K split 0)
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,  # w2's tiles through TMA
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see pdl_wait)
    PAIR_STORE: tl.constexpr = False,  # ws_ptr is (M*K, H): store each pair's row (no K split, no token rows)
    SWAP_AB: tl.constexpr = False,  # as in GEMM1
):
    # Program id -> (block, hidden tile) grouped as in GEMM1; axis 1 = K split.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(H, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_SIZE_M)

    # Tile: the block's expert. With PDL this runs while GEMM1 finishes; the alignment (two kernels
    # back) is complete, since GEMM1 waited for it before letting this kernel launch: read the
    # block's expert from L2. Nothing GEMM1 writes is touched before pdl_wait.
    # Token rows: the block's rows and each row's router weight from the routing itself.
    if rows.TOKEN_ROWS:
        expert = pid_m.to(tl.int64)
        offs_m, pair, row_ok, token, w_rows = token_rows(expert, rows.sorted_ids_ptr, rows.expert_map_ptr,
                                                         topk_weights_ptr, num_pairs, rows.TOPK, rows.TOPK_PAD,
                                                         BLOCK_SIZE_M, rows.MAPPED, True)
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:
            return
        pdl_wait(PDL)
        pdl_release(PDL)
    else:
        expert = block_expert(pid_m, rows.ntpp_ptr, rows.expert_ids_ptr, rows.expert_map_ptr, BLOCK_SIZE_M, PDL,
                              rows.MAPPED)
        if expert < 0:  # unused padding block, or a remote expert (direct_align)
            return
        pdl_wait(PDL)
        pdl_release(PDL)
        # ... its rows (pairs, tokens), hidden columns, and this program's slice of the K dimension:
        # [k_lo, k_lo + k_per_split) within I.
        offs_m, pair, row_ok, token = tile_rows(pid_m * BLOCK_SIZE_M, rows.sorted_ids_ptr, num_pairs, rows.TOPK,
                                                BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < H
    k_lo = pid_k * k_per_split
    offs_k = k_lo + tl.arange(0, BLOCK_SIZE_K)

    # Pointers: A = inter's rows of the block (contiguous, sorted order; all rows of a used block
    # are written, sentinels as zeros); B (BK, BN) = w2[e, n, k]^T (TMA: its first row in the
    # (E_local * H, I) view); the scales of inter's rows and of w2's output channels n.
    a_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_k[None, :] * stride_ik
    b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + wq_offsets(k_lo, BLOCK_SIZE_K, sc.WQ_PACK)[:, None] * stride_wk
    b_row = (expert * H + pid_n * BLOCK_SIZE_N).to(tl.int32)
    as_ptrs = a_scale_ptr + offs_m.to(tl.int64) * sc.stride_asm
    bs_ptrs = scale_ptrs(w_scale_ptr, expert, offs_n, sc)

    # K loop over this program's slice.
    acc = acc_zeros(BLOCK_SIZE_M, BLOCK_SIZE_N, SWAP_AB)
    k_hi = min(k_lo + k_per_split, N_INTER)
    for k in range(k_lo, k_hi, BLOCK_SIZE_K):
        # A: inter's rows, the K tail of the slice masked (always beside TMA weight tiles); then B.
        k_ok = offs_k < k_hi - (k - k_lo)
        if EVEN_K and not USE_TMA:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if USE_TMA:
            b = w2_desc.load([b_row, k]).T
        else:
            b = weight_tile(b_ptrs, k_ok, k, k_hi, offs_n, col_ok, w_scale_ptr, sc, expert, EVEN_K, BLOCK_SIZE_K,
                            inter_ptr.dtype.element_ty, UPCAST)
        acc = scaled_mma(a, b, acc, k, as_ptrs, bs_ptrs, row_ok, col_ok, sc, UPCAST, IEEE_DOT, SWAP_AB)
        a_ptrs += BLOCK_SIZE_K * stride_ik
        b_ptrs += (BLOCK_SIZE_K // sc.WQ_PACK) * stride_wk
    acc = dequant(acc, as_ptrs, bs_ptrs, row_ok, col_ok, sc.QUANT, SWAP_AB)

    # Epilogue: [+ b2 (the first K split only)], the router weight of each pair.
    if b2.HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(b2.b2_ptr + expert * b2.stride_b2e + offs_n * b2.stride_b2n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if rows.TOKEN_ROWS:
        w = w_rows
    else:
        w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * w[:, None]

    # Store (sentinel rows are masked off): the pair's own row, summed over top-k by the next
    # launch; or the sum over top-k here, as an fp32 atomic add into the pair's token row.
    if PAIR_STORE:
        o_ptrs = ws_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, cast_rne(acc, ws_ptr.dtype.element_ty, UPCAST), mask=row_ok[:, None] & col_ok[None, :])
    else:
        o_ptrs = ws_ptr + token[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.atomic_add(o_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")


@triton.jit
def topk_sum_kernel(x_ptr, y_ptr, row_ptr, w_ptr, H, TOP_K: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr,
                    BLOCK: tl.constexpr, EXACT: tl.constexpr):
    """One program per (token, column block): y[t, h] = sum_k w[t, k] * x[r(t, k), h] in fp32, cast to
    y's dtype (EXACT: rounded to nearest even also under the interpreter). r(t, k) = t * TOP_K + k, or
    row_ptr[t * TOP_K + k] (GATHER; a negative row, a pair whose expert is on another rank, adds
    nothing); w = 1 unless WEIGHTED (w_ptr: (M*K,) fp32)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOP_K):
        row = t * TOP_K + k
        here = ok
        if GATHER:
            row = tl.load(row_ptr + row).to(tl.int64)
            here = ok & (offs * 0 + row >= 0)  # over the block: the interpreter broadcasts no scalar into a mask
        v = tl.load(x_ptr + row * H + offs, mask=here, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(w_ptr + t * TOP_K + k)
        acc += v
    tl.store(y_ptr + t * H + offs, cast_rne(acc, y_ptr.dtype.element_ty, EXACT), mask=ok)
