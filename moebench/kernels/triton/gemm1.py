"""GEMM1 of the sorted-token fused MoE layer: x's rows times w13's gate and up rows, the activation.

On pairs aligned by moebench.kernels.triton.align (BLOCK_SIZE_M pairs of one expert per block),
one program per (block, intermediate tile) computes act(x w_gate [+ b_gate]) * (x w_up [+ b_up])
(SiLU by default, any moebench.activation) into inter (max_padded, I), rows in sorted order. Two
kernels, one per walk over K:

    gemm1_paired_kernel   a gate tile and an up tile of BLOCK_SIZE_N columns each, two dots per K
                          step (K_GROUPS steps per iteration); weight tiles by pointers or TMA; the
                          only walk for swigluoai's interleaved w13
    gemm1_wide_kernel     gate and up as one (BK, 2 BN) tile, one dot per K step; through TMA one
                          (2, BN, BK) box of w13 viewed as (2 E_local, I, H), and (A_TMA) the A
                          tiles from x copied into sorted order (`sorted_rows_kernel`)

Both zero GEMM2's fp32 accumulator on the way (`zero_fill`: no memset launch, so every token's row
is written, also when all its experts are remote) and share the epilogue (`gate_up_epilogue`,
`store_inter`: the layer's dtype, or per-tensor fp8 quantised here). Arguments that travel
together come as groups (common.Rows, common.Scales, common.GateUp, ZeroFill, Fp8Out); the
launcher is moebench.kernels.triton.launch.launch_gemm1.

Accumulation is fp32; fp32 inputs use IEEE dots (no tf32); under the Triton interpreter 16-bit and
fp8 operands are upcast to fp32 before `tl.dot` (UPCAST) and bf16 stores round to nearest even
explicitly. fp8 (w8a8): tensor/token scales multiply the accumulator in the epilogue, block scales
each K step's dot (`common.scaled_mma`); SWAP_AB computes w^T x^T into a transposed accumulator.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from moebench.kernels.triton.common import (
    acc_zeros,
    block_expert,
    cast_rne,
    dequant,
    gate_up_epilogue,
    gate_up_rows,
    grouped_tile,
    pdl_release,
    pdl_wait,
    scale_ptrs,
    scaled_mma,
    tile_rows,
    token_rows,
)
from moebench.kernels.triton.quant import quant_group
from moebench.kernels.triton.wquant import weight_tile, wq_offsets


class ZeroFill(NamedTuple):
    """An fp32 buffer of zero_numel elements GEMM1's programs set to zero (GEMM2's atomic accumulator),
    when ZERO_OUT."""

    zero_ptr: Any
    zero_numel: Any
    ZERO_OUT: Any


class Fp8Out(NamedTuple):
    """QUANT_OUT: GEMM1 stores the intermediate as per-tensor fp8 with the static scale at
    out_scale_ptr ((1,) fp32), rounded to ACT_DTYPE (the layer's dtype) first, as the two-step path
    stores it."""

    out_scale_ptr: Any
    QUANT_OUT: Any
    ACT_DTYPE: Any


@triton.jit
def zero_fill(pid, zero):
    """Programs pid = 0.. of the grid zero `zero` (ZeroFill) 1024 elements at a time, in a
    grid-stride loop."""
    if zero.ZERO_OUT:
        offs_z = tl.arange(0, 1024)
        for z in range(pid * 1024, zero.zero_numel, tl.num_programs(0) * 1024):
            tl.store(zero.zero_ptr + z + offs_z, tl.zeros((1024,), tl.float32), mask=z + offs_z < zero.zero_numel)


@triton.jit
def store_inter(h, inter_ptr, offs_m, offs_n, col_ok, stride_im, stride_in, fp8_out, QUANT: tl.constexpr,
                UPCAST: tl.constexpr):
    """Store the (BM, BN) intermediate tile h at the block's sorted rows offs_m (sentinel rows hold
    zeros, which GEMM2 reads): in inter's dtype, or (fp8_out.QUANT_OUT) clamp(h / s) to e4m3 after the
    rounding to the activation dtype."""
    i_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_n[None, :] * stride_in
    if fp8_out.QUANT_OUT:
        h = cast_rne(h, fp8_out.ACT_DTYPE, UPCAST).to(tl.float32)
        s = tl.full((offs_m.shape[0],), 1.0, tl.float32) * tl.load(fp8_out.out_scale_ptr)
        quant_group(h, s, i_ptrs, (offs_m >= 0)[:, None] & col_ok[None, :], UPCAST)
    else:
        tl.store(i_ptrs, cast_rne(h, inter_ptr.dtype.element_ty, QUANT != 0 and UPCAST), mask=col_ok[None, :])


@triton.jit
def gemm1_paired_kernel(
    x_ptr,  # (M, H)
    w13_ptr,  # (E_local, 2I, H)
    w13_desc,  # USE_TMA: TMA descriptor of w13 as (E_local * 2I, H), block (BLOCK_SIZE_N, BLOCK_SIZE_K)
    inter_ptr,  # (max_padded, I) out, rows in sorted order
    rows,  # common.Rows: the alignment
    a_scale_ptr,  # QUANT: (M, G) fp32 dequantisation scales of x's rows (stride 0 over rows: per tensor)
    w_scale_ptr,  # QUANT / WQ: scales of w13
    zero,  # ZeroFill
    fp8_out,  # Fp8Out
    num_pairs,
    N_INTER,  # I
    H,
    num_blocks_m,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,  # from one gate row to the next (two rows when interleaved)
    stride_wk,
    stride_im,
    stride_in,
    sc,  # common.Scales of a_scale and w13
    gu,  # common.GateUp
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,  # intermediate columns per program (gate and up each)
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: 16-bit / fp8 operands -> fp32 before tl.dot
    IEEE_DOT: tl.constexpr,  # fp32 operands: full-precision dot, no tf32
    USE_TMA: tl.constexpr,  # weight tiles through the tensor-memory accelerator (Hopper+)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see pdl_wait)
    SWAP_AB: tl.constexpr = False,  # accumulate (BN, BM) = w^T x^T (common.mma), transposed back after the K loop
    K_GROUPS: tl.constexpr = 1,  # K steps per loop iteration (H a multiple of K_GROUPS x BLOCK_SIZE_K)
):
    # Program id -> (block of sorted pairs, intermediate tile), grouped for L2 reuse of weights.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N_INTER, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_SIZE_M)
    # Everything here reads the routing or alignment just before: wait for it (PDL), then let
    # GEMM2 launch while this kernel runs.
    pdl_wait(PDL)
    pdl_release(PDL)
    # Before the early exit, so that every program takes part.
    zero_fill(pid, zero)

    # Tile: the block's expert (none past the used length, the padding of the worst-case grid, nor
    # for a remote expert of a direct alignment: nothing to do), its rows (the pairs; token =
    # pair // K; sentinel rows load zeros) and the intermediate columns n0 ..
    # Token rows (decode, M <= BLOCK_SIZE_M): block = local expert pid_m, row t = token t, in use
    # where the token routes to it; a block without such a token has nothing to do.
    if rows.TOKEN_ROWS:
        expert = pid_m.to(tl.int64)
        offs_m, pair, row_ok, token, _ = token_rows(expert, rows.sorted_ids_ptr, rows.expert_map_ptr,
                                                    rows.sorted_ids_ptr, num_pairs, rows.TOPK, rows.TOPK_PAD,
                                                    BLOCK_SIZE_M, rows.MAPPED, False)
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:
            return
    else:
        expert = block_expert(pid_m, rows.ntpp_ptr, rows.expert_ids_ptr, rows.expert_map_ptr, BLOCK_SIZE_M, False,
                              rows.MAPPED)
        if expert < 0:
            return
        offs_m, pair, row_ok, token = tile_rows(pid_m * BLOCK_SIZE_M, rows.sorted_ids_ptr, num_pairs, rows.TOPK,
                                                BLOCK_SIZE_M)
    n0 = pid_n * BLOCK_SIZE_N
    offs_n = n0 + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N_INTER
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    # Pointers: A (BM, BK) = x's rows of the pairs' tokens, and their fp8 scales; B: two (BK, BN)
    # tiles, gate rows n0.. and their up rows (up_off further: I rows, or the next row when
    # interleaved, where stride_wn steps two rows) of w13[expert], and their scales. TMA: the gate
    # tile's first row in the (E_local * 2I, H) view; rows past I (the last tile) read the
    # neighbouring rows or zeros, their columns are masked at the store.
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    as_ptrs = a_scale_ptr + token * sc.stride_asm
    g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + wq_offsets(0, BLOCK_SIZE_K, sc.WQ_PACK)[:, None] * stride_wk
    u_ptrs = g_ptrs + gu.up_off
    g_row = (expert * 2 * N_INTER + n0).to(tl.int32)
    g_rows, u_rows = gate_up_rows(offs_n, N_INTER, gu.INTERLEAVED)
    gs_ptrs = scale_ptrs(w_scale_ptr, expert, g_rows, sc)
    us_ptrs = scale_ptrs(w_scale_ptr, expert, u_rows, sc)

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
                g = weight_tile(g_ptrs, k_ok, k0, H, g_rows, col_ok, w_scale_ptr, sc, expert, EVEN_K, BLOCK_SIZE_K,
                                x_ptr.dtype.element_ty, UPCAST)
                u = weight_tile(u_ptrs, k_ok, k0, H, u_rows, col_ok, w_scale_ptr, sc, expert, EVEN_K, BLOCK_SIZE_K,
                                x_ptr.dtype.element_ty, UPCAST)
            acc_g = scaled_mma(a, g, acc_g, k0, as_ptrs, gs_ptrs, row_ok, col_ok, sc, UPCAST, IEEE_DOT, SWAP_AB)
            acc_u = scaled_mma(a, u, acc_u, k0, as_ptrs, us_ptrs, row_ok, col_ok, sc, UPCAST, IEEE_DOT, SWAP_AB)
            a_ptrs += BLOCK_SIZE_K * stride_xk
            g_ptrs += (BLOCK_SIZE_K // sc.WQ_PACK) * stride_wk
            u_ptrs += (BLOCK_SIZE_K // sc.WQ_PACK) * stride_wk
    acc_g = dequant(acc_g, as_ptrs, gs_ptrs, row_ok, col_ok, sc.QUANT, SWAP_AB)
    acc_u = dequant(acc_u, as_ptrs, us_ptrs, row_ok, col_ok, sc.QUANT, SWAP_AB)

    # Epilogue: [+ b13], the activation (SiLU(gate) * up by default), the store.
    h = gate_up_epilogue(acc_g, acc_u, expert, offs_n, col_ok, gu)
    store_inter(h, inter_ptr, offs_m, offs_n, col_ok, stride_im, stride_in, fp8_out, sc.QUANT, UPCAST)


@triton.jit
def gemm1_wide_kernel(
    x_ptr,  # (M, H)
    x_desc,  # A_TMA: TMA descriptor of x's rows in sorted order (max_padded, H), block (BLOCK_SIZE_M, BLOCK_SIZE_K)
    w13_ptr,  # (E_local, 2I, H)
    w13_desc,  # USE_TMA: TMA descriptor of w13 as (2 E_local, I, H), block (2, BLOCK_SIZE_N, BLOCK_SIZE_K):
    #            a gate tile and its up tile
    inter_ptr,  # (max_padded, I) out, rows in sorted order
    rows,  # common.Rows: the alignment
    a_scale_ptr,  # QUANT: (M, G) fp32 dequantisation scales of x's rows (stride 0 over rows: per tensor)
    w_scale_ptr,  # QUANT / WQ: scales of w13
    zero,  # ZeroFill
    fp8_out,  # Fp8Out
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
    sc,  # common.Scales of a_scale and w13
    gu,  # common.GateUp (never interleaved here)
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,  # intermediate columns per program (gate and up each)
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    PDL: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False,
    A_TMA: tl.constexpr = False,  # with USE_TMA: A tiles from x_desc (x gathered into sorted order)
):
    # Program id -> (block, intermediate tile), PDL and GEMM2's accumulator as in the paired walk.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N_INTER, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_SIZE_M)
    pdl_wait(PDL)
    pdl_release(PDL)
    zero_fill(pid, zero)

    # Tile: the block's expert, its rows and the intermediate columns n0 .., as in the paired walk.
    if rows.TOKEN_ROWS:
        expert = pid_m.to(tl.int64)
        offs_m, pair, row_ok, token, _ = token_rows(expert, rows.sorted_ids_ptr, rows.expert_map_ptr,
                                                    rows.sorted_ids_ptr, num_pairs, rows.TOPK, rows.TOPK_PAD,
                                                    BLOCK_SIZE_M, rows.MAPPED, False)
        if tl.max(row_ok.to(tl.int32), axis=0) == 0:
            return
    else:
        expert = block_expert(pid_m, rows.ntpp_ptr, rows.expert_ids_ptr, rows.expert_map_ptr, BLOCK_SIZE_M, False,
                              rows.MAPPED)
        if expert < 0:
            return
        offs_m, pair, row_ok, token = tile_rows(pid_m * BLOCK_SIZE_M, rows.sorted_ids_ptr, num_pairs, rows.TOPK,
                                                BLOCK_SIZE_M)
    row0 = pid_m * BLOCK_SIZE_M
    n0 = pid_n * BLOCK_SIZE_N
    offs_n = n0 + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N_INTER
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    # Pointers: A (BM, BK) = x's rows of the pairs' tokens, and their fp8 scales; B (BK, 2 BN):
    # columns 0..BN-1 are gate rows n0.. of w13[expert], BN..2BN-1 the same up rows I further;
    # each column's fp8 scale follows its row. TMA: the gate rows are in slice 2e of the
    # (2 E_local, I, H) view, the up rows in slice 2e + 1 (rows past I read zeros).
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    as_ptrs = a_scale_ptr + token * sc.stride_asm
    offs_w = tl.arange(0, 2 * BLOCK_SIZE_N)
    n_w = n0 + offs_w % BLOCK_SIZE_N
    wcol_ok = n_w < N_INTER
    rows_w = n_w + (offs_w // BLOCK_SIZE_N) * N_INTER
    w_ptrs = w13_ptr + expert * stride_we + rows_w[None, :] * stride_wn + wq_offsets(0, BLOCK_SIZE_K, sc.WQ_PACK)[:, None] * stride_wk
    ws_ptrs = scale_ptrs(w_scale_ptr, expert, rows_w, sc)
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
            w = weight_tile(w_ptrs, k_ok, k * BLOCK_SIZE_K, H, rows_w, wcol_ok, w_scale_ptr, sc, expert, EVEN_K,
                            BLOCK_SIZE_K, x_ptr.dtype.element_ty, UPCAST)
        acc = scaled_mma(a, w, acc, k * BLOCK_SIZE_K, as_ptrs, ws_ptrs, row_ok, wcol_ok, sc, UPCAST, IEEE_DOT, SWAP_AB)
        a_ptrs += BLOCK_SIZE_K * stride_xk
        w_ptrs += (BLOCK_SIZE_K // sc.WQ_PACK) * stride_wk
    acc = dequant(acc, as_ptrs, ws_ptrs, row_ok, wcol_ok, sc.QUANT, SWAP_AB)
    # (BM, 2 BN) -> (BM, 2, BN) -> (BM, BN, 2) -> gate, up
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N)), (0, 2, 1)))

    # Epilogue: [+ b13], the activation, the store.
    h = gate_up_epilogue(acc_g, acc_u, expert, offs_n, col_ok, gu)
    store_inter(h, inter_ptr, offs_m, offs_n, col_ok, stride_im, stride_in, fp8_out, sc.QUANT, UPCAST)


@triton.jit
def sorted_rows_kernel(x_ptr, xs_ptr, sorted_ids_ptr, ntpp_ptr, num_pairs, H, stride_xm, stride_xk, stride_sm,
                       stride_sk, TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                       ZERO_PAD: tl.constexpr):
    # x's rows copied into sorted order (the wide walk's A_TMA source, and the vendor GEMMs' input).
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
