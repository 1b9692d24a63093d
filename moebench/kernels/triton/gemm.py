"""The two GEMMs of the sorted-token fused MoE layer, and their launchers.

On pairs aligned by moebench.kernels.triton.align (BLOCK_SIZE_M pairs of one expert per block):

    GEMM1   per (block, intermediate tile): x's rows times w13's gate and up rows in the same K
            loop, SiLU(gate) * up in the epilogue -> inter (max_padded, I), rows in sorted order
    GEMM2   per (block, hidden tile[, K split]): inter @ w2[e]^T, times the router weight, then a
            relaxed fp32 atomic add into the (M, H) accumulator: the sum over top-k happens here;
            or (pair_store) a plain store of each pair's row into (M*K, H), which `topk_sum`
            then sums over top-k in one more launch

`fused_moe_gemms` runs both (and the fp8 quantisation of the intermediate between them) with the
code paths its TritonOptions resolve to (moebench.kernels.triton.options). GEMM1's programs also
zero GEMM2's accumulator (no memset launch), so every token's row is written, also when all its
experts are remote. Accumulation is fp32 for every input dtype; fp32 inputs use IEEE dots (no
tf32). Under the Triton interpreter, 16-bit and fp8 operands are upcast to fp32 before `tl.dot`.

GEMM1 walks K in one of two ways: the paired walk loads a gate and an up tile of BLOCK_SIZE_N
columns each and does two dots; the wide walk loads both as one (BK, 2 BN) tile (with TMA one
(2, BN, BK) box of w13 viewed as (2 E_local, I, H)) and does one dot. The launchers take
BLOCK_SIZE_N as the config's total width (half gate, half up: vLLM's unfused GEMM1 register budget).
With `sorted_a`, GEMM1's A tiles come through TMA from x copied into sorted order (`sorted_rows`).

fp8_w8a8 (QuantWeight weights, every scale kind of moebench.quant): x arrives quantised
(float8_e4m3fn + per-row scales); the GEMMs dot fp8 operands with fp32 accumulation. tensor/token
scales multiply the accumulator in the epilogue (x's row scale times the weight's channel scale);
block scales multiply each K step's dot (BLOCK_SIZE_K divides bk, one scale column per step; the
weight scale is read per output column n // bn). The intermediate is stored in the layer's dtype,
quantised with the scheme by moebench.kernels.triton.quant (only rows < num_tokens_post_padded,
read on the device); for per-tensor scales GEMM1 quantises it itself with w2's static input scale
(bit for bit the two-step result). fp8 weight tiles come through TMA at 64-row tiles
(`resolve_use_tma`). On Hopper tensor/token scales accumulate the
whole K loop in the fp8 MMA accumulator, which wgmma keeps at reduced precision (as vLLM's Triton
kernel does: 1-1.5e-2 from the emulating reference at M >= 64 tiles); block scales add each K
step's dot in fp32 (<= 5e-3; up to 5.7e-3 where a 16-row tile is swapped, `resolve_swap_ab`: its
weight columns then fill wgmma's M side and the step's fp8 products are summed at wgmma's reduced
precision). Under the interpreter the bf16 stores round to nearest even
explicitly (the interpreter's cast truncates), so the kernels match the reference's rounding points.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moebench.activation import SILU, Activation
from moebench.errors import MoebenchError
from moebench.kernels.modular import ExpertBias, alloc_output
from moebench.kernels.triton.align import AlignResult
from moebench.kernels.triton.common import (
    acc_zeros,
    block_expert,
    cast_rne,
    dequant,
    gate_up_epilogue,
    gate_up_rows,
    grouped_tile,
    pdl_launch_args,
    pdl_release,
    pdl_wait,
    scale_ptrs,
    scaled_mma,
    tile_rows,
    token_rows,
)
from moebench.kernels.triton.env import interpreter_compat, interpreting, tma_ok
from moebench.kernels.triton.options import (
    TritonOptions,
    gemm1_walk,
    resolve_pair_store,
    resolve_pdl,
    resolve_k_groups,
    resolve_swap_ab,
    resolve_use_tma,
)
from moebench.kernels.triton.quant import check_block_config, quant_group, quant_meta, quantize_rows
from moebench.kernels.triton.wquant import check_wq_config, weight_tile, wq_meta, wq_offsets, wq_zero_args
from moebench.quant import FP8_DTYPE, QuantWeight, scheme_of, stored


@triton.jit
def silu_mul_gemm1_kernel(
    x_ptr,  # (M, H)
    x_desc,  # A_TMA: TMA descriptor of x's rows in sorted order (max_padded, H), block (BLOCK_SIZE_M, BLOCK_SIZE_K)
    w13_ptr,  # (E_local, 2I, H)
    w13_desc,  # USE_TMA: TMA descriptor of w13: paired walk (E_local * 2I, H), block (BLOCK_SIZE_N, BLOCK_SIZE_K);
    #            WIDE (2 E_local, I, H), block (2, BLOCK_SIZE_N, BLOCK_SIZE_K): a gate tile and its up tile
    inter_ptr,  # (max_padded, I) out, rows in sorted order
    sorted_ids_ptr,  # (max_padded,) flat pair ids, sentinel = num_pairs
    expert_ids_ptr,  # (max_blocks,) local expert per block (MAPPED: global id)
    expert_map_ptr,  # MAPPED: (E,) global -> local expert, -1 = remote
    ntpp_ptr,  # (1,) used length of sorted_ids
    a_scale_ptr,  # QUANT: (M, G) fp32 dequantisation scales of x's rows (stride 0 over rows: per tensor)
    w_scale_ptr,  # QUANT: scales of w13 (see stride_ws*)
    zero_ptr,  # ZERO_OUT: fp32 buffer zeroed here (GEMM2's atomic accumulator), zero_numel elements
    zero_numel,
    out_scale_ptr,  # QUANT_OUT: (1,) fp32 static scale of the intermediate (per-tensor fp8)
    num_pairs,
    N_INTER,  # I
    H,
    num_blocks_m,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_im,
    stride_in,
    stride_asm,
    stride_asg,
    stride_wse,  # w13 scale of (expert, row n, K group): e * stride_wse + n' * stride_wsn + g * stride_wsk,
    stride_wsn,  # n' = n (QUANT 1) or n // GROUP_N (QUANT 2); 0 for broadcast dimensions
    stride_wsk,
    wz_ptr,  # WQ_ZP: int4 zero points of w13 (E_local, ceil(2I/2), G) uint8 (moebench.kernels.triton.wquant)
    stride_wze,
    stride_wzn,
    stride_wzk,
    b13_ptr,  # HAS_BIAS: (E_local, 2I) biases in w13's row order
    stride_be,
    stride_bn,  # from one gate column's bias to the next (2 x the row stride when interleaved)
    up_off,  # elements from a gate row of w13 to its up row (I rows, or 1 row when interleaved)
    b_up_off,  # the same from a gate bias to its up bias
    alpha,  # ACTIVATION 2 (swigluoai): sigmoid's slope and the clamp limit
    limit,
    TOPK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,  # intermediate columns per program (gate and up each)
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: 16-bit / fp8 operands -> fp32 before tl.dot
    IEEE_DOT: tl.constexpr,  # fp32 operands: full-precision dot, no tf32
    USE_TMA: tl.constexpr,  # weight tiles through the tensor-memory accelerator (Hopper+)
    QUANT: tl.constexpr = 0,  # fp8: 0 none; 1 per-row x per-channel scales (tensor/token) in the
    #                           epilogue; 2 block scales [GROUP_N, GROUP_K] applied per K step
    GROUP_N: tl.constexpr = 1,
    GROUP_K: tl.constexpr = 1,  # QUANT 2: a multiple of BLOCK_SIZE_K
    ZERO_OUT: tl.constexpr = False,
    WIDE: tl.constexpr = False,  # the wide walk: gate and up tiles as one (BK, 2 BN) tile, one dot
    QUANT_OUT: tl.constexpr = False,  # store the intermediate as per-tensor fp8 (inter_ptr is fp8)
    ACT_DTYPE: tl.constexpr = tl.bfloat16,  # QUANT_OUT: the activation dtype it is rounded to first
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see pdl_wait)
    MAPPED: tl.constexpr = False,  # expert_ids are global ids, mapped through expert_map (direct_align)
    A_TMA: tl.constexpr = False,  # WIDE with USE_TMA: A tiles from x_desc (x gathered into sorted order)
    WQ: tl.constexpr = 0,  # weight-only w13 (wquant.wq_load): 0 none, 1 int8, 2 int4, 3 mxfp4; scales
    #                        through w_scale_ptr / stride_ws* (expert, row, K group)
    WQ_GROUP: tl.constexpr = 1,  # values per weight scale along K
    WQ_ZP: tl.constexpr = False,  # int4 zero points at wz_ptr
    WQ_PACK: tl.constexpr = 1,  # weight codes per byte along K (2: int4 / mxfp4)
    ACTIVATION: tl.constexpr = 0,  # moebench.activation kind: 0 silu, 1 gelu, 2 swigluoai (gate_up_epilogue)
    HAS_BIAS: tl.constexpr = False,  # add b13 before the activation
    INTERLEAVED: tl.constexpr = False,  # w13's gate and up rows interleaved (2j, 2j + 1: swigluoai)
    SWAP_AB: tl.constexpr = False,  # accumulate (BN, BM) = w^T x^T (common.mma), transposed back after the K loop
    K_GROUPS: tl.constexpr = 1,  # paired walk: K steps per loop iteration (H a multiple of K_GROUPS x BLOCK_SIZE_K)
    TOKEN_ROWS: tl.constexpr = False,  # the token-rows layout: sorted_ids_ptr is topk_ids, block = local expert
    TOPK_PAD: tl.constexpr = 1,  # TOKEN_ROWS: TOPK's next power of two
):
    # Program id -> (block of sorted pairs, intermediate tile), grouped for L2 reuse of weights.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N_INTER, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_SIZE_M)
    # Everything here reads the routing or alignment just before: wait for it (PDL), then let
    # GEMM2 launch while this kernel runs.
    pdl_wait(PDL)
    pdl_release(PDL)

    # GEMM2's accumulator is zeroed here, 1024 elements per program in a grid-stride loop, instead
    # of by a memset launch of its own; before the early exit, so that every program takes part.
    if ZERO_OUT:
        offs_z = tl.arange(0, 1024)
        for z in range(pid * 1024, zero_numel, tl.num_programs(0) * 1024):
            tl.store(zero_ptr + z + offs_z, tl.zeros((1024,), tl.float32), mask=z + offs_z < zero_numel)

    # Tile: the block's expert (none past the used length, the padding of the worst-case grid, nor
    # for a remote expert of a direct alignment: nothing to do), its rows (the pairs; token =
    # pair // K; sentinel rows load zeros) and the intermediate columns n0 ..
    # Token rows (decode, M <= BLOCK_SIZE_M): block = local expert pid_m, row t = token t, in use
    # where the token routes to it; a block without such a token has nothing to do.
    if TOKEN_ROWS:
        expert = pid_m.to(tl.int64)
        offs_m, pair, row_ok, token, _ = token_rows(expert, sorted_ids_ptr, expert_map_ptr, sorted_ids_ptr, num_pairs,
                                                    TOPK, TOPK_PAD, BLOCK_SIZE_M, MAPPED, False)
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:
            return
    else:
        expert = block_expert(pid_m, ntpp_ptr, expert_ids_ptr, expert_map_ptr, BLOCK_SIZE_M, False, MAPPED)
        if expert < 0:
            return
        offs_m, pair, row_ok, token = tile_rows(pid_m * BLOCK_SIZE_M, sorted_ids_ptr, num_pairs, TOPK, BLOCK_SIZE_M)
    row0 = pid_m * BLOCK_SIZE_M
    n0 = pid_n * BLOCK_SIZE_N
    offs_n = n0 + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N_INTER
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    # Pointers: A (BM, BK) = x's rows of the pairs' tokens, and their fp8 scales.
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    as_ptrs = a_scale_ptr + token * stride_asm
    if WIDE:
        # B (BK, 2 BN): columns 0..BN-1 are gate rows n0.. of w13[expert], BN..2BN-1 the same up
        # rows I further; each column's fp8 scale follows its row. TMA: the gate rows are in slice
        # 2e of the (2 E_local, I, H) view, the up rows in slice 2e + 1 (rows past I read zeros).
        offs_w = tl.arange(0, 2 * BLOCK_SIZE_N)
        n_w = n0 + offs_w % BLOCK_SIZE_N
        wcol_ok = n_w < N_INTER
        rows_w = n_w + (offs_w // BLOCK_SIZE_N) * N_INTER
        w_ptrs = w13_ptr + expert * stride_we + rows_w[None, :] * stride_wn + wq_offsets(0, BLOCK_SIZE_K, WQ_PACK)[:, None] * stride_wk
        ws_ptrs = scale_ptrs(w_scale_ptr, expert, stride_wse, stride_wsn, rows_w, QUANT, GROUP_N)
        w_slice = (2 * expert).to(tl.int32)

        # K loop: one (BM, 2 BN) dot per step.
        acc = acc_zeros(BLOCK_SIZE_M, 2 * BLOCK_SIZE_N, SWAP_AB)
        for k in range(0, tl.cdiv(H, BLOCK_SIZE_K)):
            # A: the block's rows of the sorted copy through TMA (past H the descriptor reads zeros),
            # or gathered rows, their K tail masked (always beside TMA weight tiles); then B.
            k_ok = offs_k < H - k * BLOCK_SIZE_K
            if A_TMA:
                a = x_desc.load([row0, k * BLOCK_SIZE_K])
            elif EVEN_K and not USE_TMA:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if USE_TMA:  # (2, BN, BK) -> (2 BN, BK): rows 0..BN-1 gate, BN..2BN-1 up, as the columns
                w = tl.reshape(w13_desc.load([w_slice, n0, k * BLOCK_SIZE_K]), (2 * BLOCK_SIZE_N, BLOCK_SIZE_K)).T
            else:
                w = weight_tile(w_ptrs, k_ok, k * BLOCK_SIZE_K, H, rows_w, wcol_ok, w_scale_ptr, stride_wse, stride_wsn,
                                stride_wsk, wz_ptr, stride_wze, stride_wzn, stride_wzk, expert, WQ, WQ_GROUP, WQ_ZP,
                                EVEN_K, BLOCK_SIZE_K, x_ptr.dtype.element_ty, UPCAST)
            acc = scaled_mma(a, w, acc, k * BLOCK_SIZE_K, as_ptrs, ws_ptrs, row_ok, wcol_ok, stride_asg, stride_wsk,
                             QUANT, GROUP_K, UPCAST, IEEE_DOT, SWAP_AB)
            a_ptrs += BLOCK_SIZE_K * stride_xk
            w_ptrs += (BLOCK_SIZE_K // WQ_PACK) * stride_wk
        acc = dequant(acc, as_ptrs, ws_ptrs, row_ok, wcol_ok, QUANT, SWAP_AB)
        # (BM, 2 BN) -> (BM, 2, BN) -> (BM, BN, 2) -> gate, up
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N)), (0, 2, 1)))
    else:
        # B: two (BK, BN) tiles, gate rows n0.. and their up rows (up_off further: I rows, or the
        # next row when interleaved, where stride_wn steps two rows) of w13[expert], and their
        # scales. TMA: the gate tile's first row in the (E_local * 2I, H) view; rows past I (the last
        # tile) read the neighbouring rows or zeros, their columns are masked at the store.
        g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + wq_offsets(0, BLOCK_SIZE_K, WQ_PACK)[:, None] * stride_wk
        u_ptrs = g_ptrs + up_off
        g_row = (expert * 2 * N_INTER + n0).to(tl.int32)
        g_rows, u_rows = gate_up_rows(offs_n, N_INTER, INTERLEAVED)
        gs_ptrs = scale_ptrs(w_scale_ptr, expert, stride_wse, stride_wsn, g_rows, QUANT, GROUP_N)
        us_ptrs = scale_ptrs(w_scale_ptr, expert, stride_wse, stride_wsn, u_rows, QUANT, GROUP_N)

        # K loop: two (BM, BN) dots per step, one A tile for both; K_GROUPS such steps per iteration
        # (fp8 block: that many scale groups, each row's bytes of the steps read together).
        acc_g = acc_zeros(BLOCK_SIZE_M, BLOCK_SIZE_N, SWAP_AB)
        acc_u = acc_zeros(BLOCK_SIZE_M, BLOCK_SIZE_N, SWAP_AB)
        for k in range(0, tl.cdiv(H, BLOCK_SIZE_K * K_GROUPS)):
            for j in tl.static_range(K_GROUPS):
                k0 = (k * K_GROUPS + j) * BLOCK_SIZE_K
                # A: gathered rows, their K tail masked (always beside TMA weight tiles); then B.
                k_ok = offs_k < H - k0
                if EVEN_K and not USE_TMA:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if USE_TMA:
                    g = w13_desc.load([g_row, k0]).T
                    u = w13_desc.load([g_row + N_INTER, k0]).T
                else:
                    g = weight_tile(g_ptrs, k_ok, k0, H, g_rows, col_ok, w_scale_ptr, stride_wse, stride_wsn,
                                    stride_wsk, wz_ptr, stride_wze, stride_wzn, stride_wzk, expert, WQ, WQ_GROUP, WQ_ZP,
                                    EVEN_K, BLOCK_SIZE_K, x_ptr.dtype.element_ty, UPCAST)
                    u = weight_tile(u_ptrs, k_ok, k0, H, u_rows, col_ok, w_scale_ptr, stride_wse, stride_wsn,
                                    stride_wsk, wz_ptr, stride_wze, stride_wzn, stride_wzk, expert, WQ, WQ_GROUP, WQ_ZP,
                                    EVEN_K, BLOCK_SIZE_K, x_ptr.dtype.element_ty, UPCAST)
                acc_g = scaled_mma(a, g, acc_g, k0, as_ptrs, gs_ptrs, row_ok, col_ok, stride_asg, stride_wsk,
                                   QUANT, GROUP_K, UPCAST, IEEE_DOT, SWAP_AB)
                acc_u = scaled_mma(a, u, acc_u, k0, as_ptrs, us_ptrs, row_ok, col_ok, stride_asg, stride_wsk,
                                   QUANT, GROUP_K, UPCAST, IEEE_DOT, SWAP_AB)
                a_ptrs += BLOCK_SIZE_K * stride_xk
                g_ptrs += (BLOCK_SIZE_K // WQ_PACK) * stride_wk
                u_ptrs += (BLOCK_SIZE_K // WQ_PACK) * stride_wk
        acc_g = dequant(acc_g, as_ptrs, gs_ptrs, row_ok, col_ok, QUANT, SWAP_AB)
        acc_u = dequant(acc_u, as_ptrs, us_ptrs, row_ok, col_ok, QUANT, SWAP_AB)

    # Epilogue: [+ b13], the activation: SiLU(gate) * up by default.
    h = gate_up_epilogue(acc_g, acc_u, b13_ptr + expert * stride_be + offs_n * stride_bn, b_up_off, col_ok, alpha, limit,
                         ACTIVATION, HAS_BIAS)

    # Store at the block's sorted rows (sentinel rows hold zeros, which GEMM2 reads).
    i_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_n[None, :] * stride_in
    if QUANT_OUT:
        # Per-tensor fp8 intermediate, quantised here instead of by its own launch: rounded to the
        # activation dtype first, as the two-step path stores it, then clamp(h / s) to e4m3.
        h = cast_rne(h, ACT_DTYPE, UPCAST).to(tl.float32)
        s = tl.full((BLOCK_SIZE_M,), 1.0, tl.float32) * tl.load(out_scale_ptr)
        quant_group(h, s, i_ptrs, (offs_m >= 0)[:, None] & col_ok[None, :], UPCAST)
    else:
        tl.store(i_ptrs, cast_rne(h, inter_ptr.dtype.element_ty, QUANT != 0 and UPCAST), mask=col_ok[None, :])


@triton.jit
def gemm2_weighted_sum_kernel(
    inter_ptr,  # (max_padded, I)
    w2_ptr,  # (E_local, H, I)
    w2_desc,  # USE_TMA: TMA descriptor of w2 as (E_local * H, I), block (BLOCK_SIZE_N, BLOCK_SIZE_K)
    ws_ptr,  # (M, H) fp32, zeroed: the sum over top-k, out
    topk_weights_ptr,  # (M*K,) router weights of the flat pairs
    sorted_ids_ptr,
    expert_ids_ptr,
    expert_map_ptr,  # MAPPED: as in GEMM1
    ntpp_ptr,
    a_scale_ptr,  # QUANT: (max_padded, G) fp32 scales of inter's sorted rows (stride 0 over rows: per tensor)
    w_scale_ptr,  # QUANT: scales of w2
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
    stride_wsm,
    stride_wsn,
    stride_asm,
    stride_asg,
    stride_bse,  # w2 scales, as stride_ws* in GEMM1
    stride_bsn,
    stride_bsk,
    wz_ptr,  # WQ_ZP: int4 zero points of w2, as in GEMM1
    stride_wze,
    stride_wzn,
    stride_wzk,
    b2_ptr,  # HAS_BIAS: (E_local, H) biases, added once (by the K split 0)
    stride_b2e,
    stride_b2n,
    TOPK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,  # w2's tiles through TMA
    QUANT: tl.constexpr = 0,  # as in GEMM1
    GROUP_N: tl.constexpr = 1,
    GROUP_K: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see pdl_wait)
    MAPPED: tl.constexpr = False,  # as in GEMM1
    WQ: tl.constexpr = 0,  # weight-only w2, as in GEMM1 (scales through w_scale_ptr / stride_bs*)
    WQ_GROUP: tl.constexpr = 1,
    WQ_ZP: tl.constexpr = False,
    WQ_PACK: tl.constexpr = 1,
    HAS_BIAS: tl.constexpr = False,  # add b2 before the router weight
    PAIR_STORE: tl.constexpr = False,  # ws_ptr is (M*K, H): store each pair's row (no K split)
    SWAP_AB: tl.constexpr = False,  # as in GEMM1
    TOKEN_ROWS: tl.constexpr = False,  # as in GEMM1 (never with PAIR_STORE)
    TOPK_PAD: tl.constexpr = 1,  # as in GEMM1
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
    if TOKEN_ROWS:
        expert = pid_m.to(tl.int64)
        offs_m, pair, row_ok, token, w_rows = token_rows(expert, sorted_ids_ptr, expert_map_ptr, topk_weights_ptr,
                                                         num_pairs, TOPK, TOPK_PAD, BLOCK_SIZE_M, MAPPED, True)
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:
            return
        pdl_wait(PDL)
        pdl_release(PDL)
    else:
        expert = block_expert(pid_m, ntpp_ptr, expert_ids_ptr, expert_map_ptr, BLOCK_SIZE_M, PDL, MAPPED)
        if expert < 0:  # unused padding block, or a remote expert (direct_align)
            return
        pdl_wait(PDL)
        pdl_release(PDL)
        # ... its rows (pairs, tokens), hidden columns, and this program's slice of the K dimension:
        # [k_lo, k_lo + k_per_split) within I.
        offs_m, pair, row_ok, token = tile_rows(pid_m * BLOCK_SIZE_M, sorted_ids_ptr, num_pairs, TOPK, BLOCK_SIZE_M)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < H
    k_lo = pid_k * k_per_split
    offs_k = k_lo + tl.arange(0, BLOCK_SIZE_K)

    # Pointers: A = inter's rows of the block (contiguous, sorted order; all rows of a used block
    # are written, sentinels as zeros); B (BK, BN) = w2[e, n, k]^T (TMA: its first row in the
    # (E_local * H, I) view); the scales of inter's rows and of w2's output channels n.
    a_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_k[None, :] * stride_ik
    b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + wq_offsets(k_lo, BLOCK_SIZE_K, WQ_PACK)[:, None] * stride_wk
    b_row = (expert * H + pid_n * BLOCK_SIZE_N).to(tl.int32)
    as_ptrs = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = scale_ptrs(w_scale_ptr, expert, stride_bse, stride_bsn, offs_n, QUANT, GROUP_N)

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
            b = weight_tile(b_ptrs, k_ok, k, k_hi, offs_n, col_ok, w_scale_ptr, stride_bse, stride_bsn, stride_bsk, wz_ptr,
                            stride_wze, stride_wzn, stride_wzk, expert, WQ, WQ_GROUP, WQ_ZP, EVEN_K, BLOCK_SIZE_K,
                            inter_ptr.dtype.element_ty, UPCAST)
        acc = scaled_mma(a, b, acc, k, as_ptrs, bs_ptrs, row_ok, col_ok, stride_asg, stride_bsk,
                         QUANT, GROUP_K, UPCAST, IEEE_DOT, SWAP_AB)
        a_ptrs += BLOCK_SIZE_K * stride_ik
        b_ptrs += (BLOCK_SIZE_K // WQ_PACK) * stride_wk
    acc = dequant(acc, as_ptrs, bs_ptrs, row_ok, col_ok, QUANT, SWAP_AB)

    # Epilogue: [+ b2 (the first K split only)], the router weight of each pair.
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(b2_ptr + expert * stride_b2e + offs_n * stride_b2n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if TOKEN_ROWS:
        w = w_rows
    else:
        w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * w[:, None]

    # Store (sentinel rows are masked off): the pair's own row, summed over top-k by the next
    # launch; or the sum over top-k here, as an fp32 atomic add into the pair's token row.
    if PAIR_STORE:
        o_ptrs = ws_ptr + pair[:, None].to(tl.int64) * stride_wsm + offs_n[None, :] * stride_wsn
        tl.store(o_ptrs, cast_rne(acc, ws_ptr.dtype.element_ty, UPCAST), mask=row_ok[:, None] & col_ok[None, :])
    else:
        o_ptrs = ws_ptr + token[:, None] * stride_wsm + offs_n[None, :] * stride_wsn
        tl.atomic_add(o_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")


@triton.jit
def topk_sum_kernel(x_ptr, y_ptr, row_ptr, w_ptr, H, TOP_K: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr,
                    BLOCK: tl.constexpr, EXACT: tl.constexpr):
    """One program per (token, column block): y[t, h] = sum_k w[t, k] * x[r(t, k), h] in fp32, cast to
    y's dtype (EXACT: rounded to nearest even also under the interpreter). r(t, k) = t * TOP_K + k, or
    row_ptr[t * TOP_K + k] (GATHER); w = 1 unless WEIGHTED (w_ptr: (M*K,) fp32)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOP_K):
        row = t * TOP_K + k
        if GATHER:
            row = tl.load(row_ptr + row).to(tl.int64)
        v = tl.load(x_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(w_ptr + t * TOP_K + k)
        acc += v
    tl.store(y_ptr + t * H + offs, cast_rne(acc, y_ptr.dtype.element_ty, EXACT), mask=ok)


def topk_sum(rows: torch.Tensor, out: torch.Tensor, topk: int, *, row_index: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """out (M, H) = the sum over K of each token's K rows of `rows` (R, H), in fp32 (both contiguous);
    returns out. The rows of token t are t*K .. t*K + K - 1 (R = M*K), or row_index[t*K + k] ((M*K,)
    int, any R); weights (M, K): each row times its router weight first."""
    m, h = out.shape
    assert rows.shape[1] == h and rows.is_contiguous() and out.is_contiguous()
    assert row_index is not None or rows.shape[0] == m * topk
    interpreter_compat()
    if m:
        w = _flat_weights(weights) if weights is not None else rows
        idx = row_index.reshape(-1).contiguous() if row_index is not None else rows
        topk_sum_kernel[(m, triton.cdiv(h, 1024))](rows, out, idx, w, h, TOP_K=topk, GATHER=row_index is not None,
                                                   WEIGHTED=weights is not None, BLOCK=1024,
                                                   EXACT=interpreting() and out.dtype == torch.bfloat16)
    return out


@triton.jit
def sorted_rows_kernel(x_ptr, xs_ptr, sorted_ids_ptr, ntpp_ptr, num_pairs, H, stride_xm, stride_xk, stride_sm,
                       stride_sk, TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                       ZERO_PAD: tl.constexpr):
    # Program (r, c): sorted rows r * ROWS .. of the used length, columns c * BLOCK_H ..; a row
    # holds its pair's token row of x, a sentinel row zeros (ZERO_PAD) or nothing. Rows past the
    # used length stay unset.
    row0 = tl.program_id(0) * ROWS
    if row0 >= tl.load(ntpp_ptr):
        return
    offs_m, pair, row_ok, token = tile_rows(row0, sorted_ids_ptr, num_pairs, TOPK, ROWS)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    v = tl.load(x_ptr + token[:, None] * stride_xm + offs_h[None, :] * stride_xk, mask=row_ok[:, None] & h_ok[None, :],
                other=0.0)
    store_ok = h_ok[None, :] if ZERO_PAD else row_ok[:, None] & h_ok[None, :]
    tl.store(xs_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_h[None, :] * stride_sk, v, mask=store_ok)


# ---------------------------------------------------------------------------------------------
# Launchers


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _scale_args(scale: torch.Tensor | None, w) -> tuple:
    """Kernel arguments of the scales: (a_scale, w_scale, a strides (2), w strides (3)); dummy
    pointers and zeros without quantisation (the QUANT=0 variant never reads them); weight-only
    schemes: the weight scales alone (no activation scale)."""
    if not isinstance(w, QuantWeight):
        return (w, w, 0, 0, 0, 0, 0)
    if w.scheme.weight_only:
        return (w.scale, w.scale, 0, 0, *w.scale_strides())
    return (scale, w.scale, scale.stride(0), scale.stride(1), *w.scale_strides())


def _map_arg(align: AlignResult) -> torch.Tensor:
    """The GEMMs' expert_map pointer: the map of a mapped direct alignment, else a dummy."""
    return align.expert_map if align.expert_map is not None else align.expert_ids


def _flat_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    """(M, K) router weights -> (M*K,) contiguous fp32, one per flat pair (the kernels' layout)."""
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    return weights


def sorted_rows(x: torch.Tensor, align: AlignResult, topk: int, out: torch.Tensor | None = None,
                zero_pad: bool = True) -> torch.Tensor:
    """x (M, H) -> (max_padded, H): row r = x[sorted_token_ids[r] // topk] for the used rows,
    zeros for sentinels (zero_pad; else left unset, for a consumer whose rows are independent and
    whose padding rows nobody reads); rows past num_tokens_post_padded are left unset (no kernel
    reads them). out: a (max_padded, H) tensor of x's dtype to write, any strides (DeepGEMM's
    MN-major scales); None: a new contiguous one. fp8 rows move as they are."""
    interpreter_compat()
    rows, h = align.sorted_token_ids.numel(), x.shape[1]
    xs = torch.empty((rows, h), dtype=x.dtype, device=x.device) if out is None else out
    assert xs.shape == (rows, h) and xs.dtype == x.dtype
    r = min(32, align.block_size_m)  # r divides every block
    bh = 256 if x.element_size() > 1 else 512  # 16 KB of bf16 / fp8 per program
    sorted_rows_kernel[(triton.cdiv(rows, r), triton.cdiv(h, bh))](
        x, xs, align.sorted_token_ids, align.num_tokens_post_padded, align.num_pairs, h, x.stride(0), x.stride(1),
        xs.stride(0), xs.stride(1), TOPK=topk, ROWS=r, BLOCK_H=bh, ZERO_PAD=zero_pad, num_warps=4)
    return xs


def launch_gemm1(
    x: torch.Tensor,
    w13,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    use_tma: bool = False,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    zero: torch.Tensor | None = None,
    wide: bool = False,
    out_scale: torch.Tensor | None = None,
    pdl: bool = False,
    sorted_a: bool = False,
    activation: Activation = SILU,
    b13: torch.Tensor | None = None,
    swap_ab: bool = False,
    k_groups: int = 1,
) -> torch.Tensor:
    """GEMM1 + activation-and-mul on aligned pairs -> inter (max_padded, I), sorted rows, in x's dtype.
    activation (moebench.activation) picks the epilogue's function and w13's gate/up layout
    (interleaved for swigluoai: the paired walk reads gate row 2j and up row 2j + 1 through its
    strides; it needs the paired walk without TMA, unquantised); b13 (E_local, 2I): biases added
    before the activation, or None.
    The flags are the resolved choices (`gemm1_walk`, `resolve_use_tma`, `resolve_pdl`):
    use_tma: weight tiles through TMA (the caller checks the device, `env.tma_ok`).
    wide: the wide walk (one tile of gate and up, one dot), else the paired walk.
    sorted_a: x's rows are first copied into sorted order (`sorted_rows`, one launch) and GEMM1
    reads its A tiles through TMA from the copy (needs use_tma and wide).
    pdl: launch with programmatic dependent launch (CUDA, Hopper+).
    zero: a contiguous fp32 tensor that the kernel also sets to zero (GEMM2's accumulator).
    swap_ab: the dots as w^T x^T into a transposed accumulator (`resolve_swap_ab`; fp8 only).
    k_groups: K steps per iteration of the paired walk (`resolve_k_groups`; H a multiple of k_groups x BLOCK_SIZE_K).
    out_scale: (1,) fp32 static scale: inter comes back as float8_e4m3fn, bit for bit what
    `quantize_rows(inter, per-tensor scheme, out_scale)` makes of the out_dtype intermediate.

    fp8: w13 a QuantWeight, x (M, H) float8_e4m3fn with a_scale (M, G) fp32 (any row stride, 0 for
    per tensor); inter is then in out_dtype (default bf16)."""
    m, h = x.shape
    n_inter = w13.shape[1] // 2
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    assert align.block_size_m == bm, "alignment block size differs from BLOCK_SIZE_M"
    quant = quant_meta(w13)
    interpreter_compat()
    upcast = interpreting() and x.dtype != torch.float32
    num_blocks = align.max_blocks
    bn1 = max(16, bn // 2)  # BLOCK_SIZE_N columns = half gate, half up
    act_dtype = (out_dtype or torch.bfloat16) if quant["QUANT"] else x.dtype
    inter = torch.empty((num_blocks * bm, n_inter), dtype=FP8_DTYPE if out_scale is not None else act_dtype,
                        device=x.device)
    wq = stored(w13)
    desc = wq
    if use_tma and wide:  # one (2, BN, BK) box: gate rows of slice 2e, up rows of slice 2e + 1
        desc = TensorDescriptor.from_tensor(wq.view(-1, n_inter, h), [2, bn1, bk])
    elif use_tma:
        desc = TensorDescriptor.from_tensor(wq.view(-1, h), [bn1, bk])
    x_desc = x
    if sorted_a:
        if not (use_tma and wide) or quant["QUANT"]:
            raise MoebenchError("sorted_a needs 16-bit inputs and the wide GEMM1 with TMA weight tiles (use_tma, wide)")
        x = sorted_rows(x, align, topk)
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    sc = _scale_args(a_scale, w13)
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.is_contiguous()
    # Where a gate row's up row is: I rows further, or (interleaved) the next row, gate rows two apart.
    il = activation.interleaved
    if k_groups > 1 and (wide or h % (k_groups * bk)):
        raise MoebenchError(f"GEMM1 takes {k_groups} K steps per iteration in its paired walk with H a multiple of "
                            f"{k_groups} x BLOCK_SIZE_K (H {h}, BLOCK_SIZE_K {bk})")
    if il and (use_tma or wide or sorted_a or quant["QUANT"]):
        raise MoebenchError("swigluoai's interleaved w13 runs GEMM1's paired walk without TMA, unquantised or "
                            "weight-only (TritonOptions gemm1_wide / use_tma off)")
    row = wq.stride(1)
    stride_wn, up_off = (2 * row, row) if il else (row, n_inter * row)
    if b13 is not None:
        assert b13.shape == (wq.shape[0], 2 * n_inter), "b13 must be (E_local, 2I)"
        bcol = b13.stride(1)
        bias_args = (b13, b13.stride(0), 2 * bcol if il else bcol, up_off, bcol if il else n_inter * bcol)
    else:
        bias_args = (wq, 0, 0, up_off, 0)
    grid1 = (num_blocks * triton.cdiv(n_inter, bn1),)
    silu_mul_gemm1_kernel[grid1](
        x, x_desc, wq, desc, inter, align.sorted_token_ids, align.expert_ids, _map_arg(align), align.num_tokens_post_padded,
        *sc[:2], inter if zero is None else zero, 0 if zero is None else zero.numel(),
        inter if out_scale is None else out_scale.to(device=x.device, dtype=torch.float32).reshape(1),
        align.num_pairs, n_inter, h, num_blocks,
        x.stride(0), x.stride(1), wq.stride(0), stride_wn, wq.stride(2), inter.stride(0), inter.stride(1),
        *sc[2:], *wq_zero_args(w13), *bias_args, float(activation.alpha), float(activation.limit),
        TOPK=topk, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn1, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"],
        EVEN_K=h % bk == 0, UPCAST=upcast, IEEE_DOT=x.dtype == torch.float32 or upcast, USE_TMA=use_tma,
        ZERO_OUT=zero is not None, WIDE=wide, QUANT_OUT=out_scale is not None, ACT_DTYPE=_TL_DTYPES[act_dtype],
        MAPPED=align.expert_map is not None, A_TMA=sorted_a, ACTIVATION=activation.kind, HAS_BIAS=b13 is not None,
        INTERLEAVED=il, SWAP_AB=swap_ab, K_GROUPS=k_groups, TOKEN_ROWS=align.token_rows,
        TOPK_PAD=triton.next_power_of_2(topk), num_warps=config["num_warps"],
        num_stages=config["num_stages"], **quant, **wq_meta(w13), **pdl_launch_args(pdl),
    )
    return inter


def launch_gemm2(
    inter: torch.Tensor,
    w2,
    topk_weights: torch.Tensor,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    split_k: int = 1,
    use_tma: bool = False,
    a_scale: torch.Tensor | None = None,
    ws: torch.Tensor | None = None,
    pdl: bool = False,
    b2: torch.Tensor | None = None,
    pair_store: bool = False,
    swap_ab: bool = False,
) -> torch.Tensor:
    """GEMM2 [+ b2 (E_local, H), before the router weight] + router weight on aligned pairs -> ws (M, H) fp32, the sum over top-k done by atomic
    adds (`ws` given = already zeroed, e.g. by GEMM1; else zeroed here). split_k: K splits (clamped
    to whole BLOCK_SIZE_K steps). use_tma: w2's tiles through TMA. pdl: launch with programmatic
    dependent launch (after a launch_gemm1 with pdl).
    pair_store: ws is (M*K, H) (any float dtype; given, or allocated in inter's 16-bit dtype,
    bf16 for fp8): each pair's weighted row is stored there, nothing summed (`topk_sum` does);
    the rows of pairs that are not aligned (remote experts) are not written. One K split only.
    swap_ab: as in `launch_gemm1`.

    fp8: w2 a QuantWeight, inter (max_padded, I) float8_e4m3fn with a_scale (max_padded, G)."""
    m, k = topk_weights.shape
    e_local, h, n_inter = w2.shape
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    quant = quant_meta(w2)
    interpreter_compat()
    upcast = interpreting() and inter.dtype != torch.float32
    num_blocks = align.max_blocks
    if pair_store:
        if ws is None:
            ws = torch.empty((m * k, h), dtype=torch.bfloat16 if quant["QUANT"] else inter.dtype, device=inter.device)
        assert ws.shape == (m * k, h) and split_k == 1, "pair_store: ws is (M*K, H), one K split"
    elif ws is None:
        ws = torch.zeros((m, h), dtype=torch.float32, device=inter.device)
    split_k = max(1, min(int(split_k), triton.cdiv(n_inter, bk)))
    k_per_split = triton.cdiv(triton.cdiv(n_inter, split_k), bk) * bk
    split_k = triton.cdiv(n_inter, k_per_split)
    weights = _flat_weights(topk_weights)
    wq = stored(w2)
    desc = wq
    if use_tma:
        desc = TensorDescriptor.from_tensor(wq.view(-1, n_inter), [bn, bk])
    sc = _scale_args(a_scale, w2)
    grid2 = (num_blocks * triton.cdiv(h, bn), split_k)
    gemm2_weighted_sum_kernel[grid2](
        inter, wq, desc, ws, weights, align.sorted_token_ids, align.expert_ids, _map_arg(align),
        align.num_tokens_post_padded, *sc[:2], align.num_pairs, h, n_inter, num_blocks, k_per_split,
        inter.stride(0), inter.stride(1), wq.stride(0), wq.stride(1), wq.stride(2), ws.stride(0), ws.stride(1),
        *sc[2:], *wq_zero_args(w2), *((b2, b2.stride(0), b2.stride(1)) if b2 is not None else (ws, 0, 0)),
        TOPK=topk, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"],
        EVEN_K=(n_inter % k_per_split == 0) and (k_per_split % bk == 0), UPCAST=upcast,
        IEEE_DOT=inter.dtype == torch.float32 or upcast, USE_TMA=use_tma, MAPPED=align.expert_map is not None,
        HAS_BIAS=b2 is not None, PAIR_STORE=pair_store, SWAP_AB=swap_ab, TOKEN_ROWS=align.token_rows,
        TOPK_PAD=triton.next_power_of_2(topk), num_warps=config["num_warps"], num_stages=config["num_stages"],
        **quant, **wq_meta(w2), **pdl_launch_args(pdl),
    )
    return ws


def fused_moe_gemms(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    split_k: int = 1,
    out: torch.Tensor | None = None,
    *,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    down_config: Mapping[str, Any] | None = None,
    num_experts: int | None = None,
    options: TritonOptions | None = None,
    activation: Activation = SILU,
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """The GEMM part on aligned pairs: x (M, H), w13 (E_local, 2I, H), w2 (E_local, H, I),
    topk_weights (M, K) -> out (M, H) in x's dtype, weighted and summed over top-k: GEMM1 (which
    zeroes GEMM2's fp32 accumulator), [the fp8 quantisation of the intermediate], GEMM2, a cast
    (none for an fp32 output, which is the accumulator itself).

    options (None: TritonOptions()) resolve to the code paths: TMA weight tiles (`resolve_use_tma`
    on GEMM1's config, where the device has TMA), GEMM1's walk and sorted_a (`gemm1_walk`; "auto"
    sizes pairs per expert as M * K / num_experts, None: E_local), PDL (`resolve_pdl`), GEMM2's
    sum over top-k (`resolve_pair_store`: per-pair rows and a `topk_sum` launch instead of the
    atomics, the cast and GEMM1's zeroing), the fp8 dots' operand order (`resolve_swap_ab`).
    down_config: GEMM2's own tile config (same BLOCK_SIZE_M as `config`; split_k is GEMM2's for
    it); its optional USE_TMA decides whether GEMM2 loads w2 through TMA, instead of GEMM1's
    choice. None: GEMM2 runs with `config`.

    fp8 (w13, w2 QuantWeights of one scheme): x float8_e4m3fn (M, H) with a_scale (M, G); out is
    in out_dtype (default bf16). The intermediate is quantised with the scheme before GEMM2 (by
    GEMM1 itself for per-tensor scales, with w2.input_scale), as moebench.quant describes.

    activation / bias: the epilogues' function (moebench.activation) and per-expert biases (b13
    before the activation, b2 before the router weight). swigluoai's interleaved w13 runs the
    paired GEMM1 walk without TMA (GEMM2 keeps its choice), unquantised."""
    options = options or TritonOptions()
    m, h = x.shape
    scheme = scheme_of(w13)
    if scheme is not None and scheme.weight_only:
        check_wq_config(config, scheme, "triton experts")
        if down_config is not None:
            check_wq_config(down_config, scheme, "triton experts (GEMM2)")
        if x.dtype != w13.act_dtype or a_scale is not None:
            raise MoebenchError(f"{scheme.name} triton experts take unquantised {w13.act_dtype} x (the dtype its "
                                f"weights were quantised for), got {x.dtype}")
        out_dtype = x.dtype
        use_tma = False
    elif scheme is not None:
        out_dtype = out_dtype or torch.bfloat16
        check_block_config(config, scheme, "triton experts", x.device)
        if down_config is not None:
            check_block_config(down_config, scheme, "triton experts (GEMM2)", x.device)
        if a_scale is None or x.dtype != FP8_DTYPE:
            raise MoebenchError("fp8 triton experts need x as float8_e4m3fn with its a_scale")
        if scheme.scales == "tensor" and w2.input_scale is None:
            raise MoebenchError("per-tensor fp8 needs w2.input_scale (moebench.quant.quantize_weights sets it)")
        use_tma = resolve_use_tma(options, config, x.dtype)
    else:
        out_dtype = x.dtype
        use_tma = resolve_use_tma(options, config, x.dtype)
    if out is None:
        out = alloc_output((m, h), out_dtype, x.device)
    if m == 0:
        return out
    use_tma = use_tma and tma_ok(stored(w13)) and tma_ok(stored(w2))
    rows_per_expert = m * topk / (num_experts or w13.shape[0])
    pair_store = resolve_pair_store(options, w2.shape[2], rows_per_expert, align.remote, split_k)
    if align.token_rows and pair_store:
        if options.pair_store is True:
            raise MoebenchError("pair_store stores one row per pair, which the token-rows layout does not have: "
                                "give token_rows=False or pair_store=False")
        pair_store = False
    if pair_store:
        # Each pair's row, summed by `topk_sum` into out; rows of remote pairs are never written.
        acc = (torch.zeros if align.remote else torch.empty)((m * topk, h), dtype=out_dtype, device=x.device)
    else:
        # GEMM2's fp32 accumulator, zeroed by GEMM1: an fp32 output is the accumulator itself (no cast).
        acc = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(
            (m, h), dtype=torch.float32, device=x.device)
    fp8 = scheme is not None and not scheme.weight_only
    fuse = fp8 and scheme.scales == "tensor"
    pdl = resolve_pdl(options, x.device, w2.shape[2])
    wide, sorted_a = gemm1_walk(options, config, x.dtype, scheme, use_tma, w2.shape[2], rows_per_expert)
    if align.token_rows and sorted_a:
        if options.sorted_a is True:
            raise MoebenchError("sorted_a copies x into sorted pair order, which the token-rows layout does not have: "
                                "give token_rows=False or sorted_a=False")
        sorted_a = False
    tma1 = use_tma
    if activation.interleaved:
        if scheme is not None and not scheme.weight_only:
            raise MoebenchError("triton experts: swigluoai's interleaved w13 runs unquantised or weight-only (not fp8)")
        wide = sorted_a = tma1 = False
    inter = launch_gemm1(x, w13, align, topk, config, tma1, a_scale, out_dtype, zero=None if pair_store else acc, wide=wide,
                         out_scale=w2.input_scale if fuse else None, pdl=pdl, sorted_a=sorted_a,
                         activation=activation, b13=None if bias is None else bias.b13,
                         swap_ab=resolve_swap_ab(options, config, scheme, tma1),
                         k_groups=resolve_k_groups(options, config, scheme, tma1, wide, x.shape[1], rows_per_expert))
    inter_scale = None
    if fuse:
        inter_scale = w2.input_scale.to(device=x.device, dtype=torch.float32).reshape(1, 1).expand(inter.shape[0], 1)
    elif fp8:
        # Only rows < num_tokens_post_padded are in use (read on the device), and of those only the
        # pairs' rows: GEMM2 masks the output rows of sentinels, whatever they hold. (The token-rows
        # layout has no sorted ids: there every row of a used block is quantised.)
        pair_rows = None if align.token_rows else (align.sorted_token_ids, align.num_pairs)
        inter, inter_scale = quantize_rows(inter, scheme, w2.input_scale, row_limit=align.num_tokens_post_padded,
                                           pair_rows=pair_rows)
    cfg2, tma2 = config, use_tma
    if down_config is not None:
        if down_config["BLOCK_SIZE_M"] != config["BLOCK_SIZE_M"]:
            raise MoebenchError(f"GEMM2's config has BLOCK_SIZE_M {down_config['BLOCK_SIZE_M']}, GEMM1's "
                                f"{config['BLOCK_SIZE_M']}: both GEMMs share one alignment")
        cfg2 = down_config
        if "USE_TMA" in down_config:
            tma2 = bool(down_config["USE_TMA"]) and not (scheme is not None and scheme.weight_only) and tma_ok(stored(w2))
    ws = launch_gemm2(inter, w2, topk_weights, align, topk, cfg2, split_k, tma2, inter_scale, ws=acc, pdl=pdl,
                      b2=None if bias is None else bias.b2, pair_store=pair_store,
                      swap_ab=resolve_swap_ab(options, cfg2, scheme, tma2))
    if pair_store:
        if out.is_contiguous():
            return topk_sum(ws, out, topk)
        out.copy_(topk_sum(ws, torch.empty_like(out, memory_format=torch.contiguous_format), topk))
    elif ws is not out:
        out.copy_(ws)
    return out
