"""The batched Triton GEMMs (BatchedExperts format, the layout DeepEP low-latency produces).

Input a (E_local, T, H) with expert_num_tokens (E_local,): rows [0, count[e]) of expert e are
valid. Two kernels, grid (tiles, E_local): each program reads its expert's count and returns at
once when its row tile starts past it, so empty experts and empty tiles cost one load.

    GEMM1  a[e] @ w13[e]^T with gate and up tiles in the same K loop [+ b13], the activation
           (SiLU(gate) * up by default; moebench.activation) -> inter (E_local, T, I)
    GEMM2  inter[e] @ w2[e]^T [+ b2] -> out (E_local, T, H), unweighted, in a's dtype (fp8: the layer's)

Rows past each expert's count are not written (the prepare/finalize reads only valid slots);
weighting and the sum over top-k are delegated to the prepare/finalize
(moebench.kernels.triton.experts.BatchedTritonExperts).

fp8_w8a8 (QuantWeight weights): a is float8_e4m3fn with a_scale (E_local, T, G), as the
triton experts take it (see moebench.kernels.triton.launch): scales in the epilogue (tensor/token)
or per K step (block); the intermediate is stored in the layer's dtype, quantised with the scheme
(moebench.kernels.triton.quant, rows past each count skipped), and the output is in the layer's dtype.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from moebench.activation import SILU, Activation
from moebench.errors import MoebenchError
from moebench.kernels.modular import ExpertBias, alloc_output
from moebench.kernels.triton.common import (
    bias_arg,
    cast_rne,
    dequant,
    gate_up_args,
    gate_up_epilogue,
    gate_up_rows,
    grouped_tile,
    scale_ptrs,
    scaled_mma,
)
from moebench.kernels.triton.configs import default_config
from moebench.kernels.tuned_files import TileConfig
from moebench.kernels.triton.env import interpreter_compat, interpreting
from moebench.kernels.triton.options import TritonOptions
from moebench.kernels.triton.quant import check_block_config, gemm_scales, quantize_rows
from moebench.kernels.triton.wquant import check_wq_config, weight_tile, wq_offsets
from moebench.quant import FP8_DTYPE, QuantWeight, scheme_of


@triton.jit
def expert_tile(T, N, num_tokens_ptr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                GROUP_SIZE_M: tl.constexpr):
    """This program's (expert, row tile, column tile over N, the expert's valid rows): axis 1 is
    the expert, axis 0 its (row, column) tiles, grouped for L2 reuse of the weight tiles."""
    expert = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(T, BLOCK_SIZE_M), tl.cdiv(N, BLOCK_SIZE_N), GROUP_SIZE_M)
    return expert, pid_m, pid_n, tl.load(num_tokens_ptr + expert)


@triton.jit
def batched_silu_mul_gemm1_kernel(
    a_ptr,  # (E_local, T, H)
    w13_ptr,  # (E_local, 2I, H)
    inter_ptr,  # (E_local, T, I) out
    num_tokens_ptr,  # (E_local,) valid rows per expert
    a_scale_ptr,  # QUANT: (E_local, T, G) fp32 scales of a's rows
    w_scale_ptr,  # QUANT / WQ: scales of w13
    T,
    N_INTER,
    H,
    stride_ae,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ie,
    stride_im,
    stride_in,
    stride_ase,  # a_scale's expert stride (its row and group strides are sc's)
    sc,  # common.Scales of a_scale and w13
    gu,  # common.GateUp: where up rows are, b13, the activation (as in the sorted-token GEMM1)
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,  # intermediate columns per program (gate and up each)
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    # Program -> (expert, row tile, intermediate tile); skip tiles past the expert's valid rows.
    expert, pid_m, pid_n, count = expert_tile(T, N_INTER, num_tokens_ptr, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= count:
        return

    # Tile: the expert's rows (valid below its count) and intermediate columns.
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    row_ok = offs_m < count
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N_INTER
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    # Pointers: A = the expert's rows, B = gate rows n.. and their up rows (up_off further: I rows,
    # or the next row when interleaved, where stride_wn steps two rows) of w13[e], their scales.
    a_ptrs = a_ptr + expert * stride_ae + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    as_ptrs = a_scale_ptr + expert * stride_ase + offs_m * sc.stride_asm
    g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + wq_offsets(0, BLOCK_SIZE_K, sc.WQ_PACK)[:, None] * stride_wk
    u_ptrs = g_ptrs + gu.up_off
    g_rows, u_rows = gate_up_rows(offs_n, N_INTER, gu.INTERLEAVED)
    gs_ptrs = scale_ptrs(w_scale_ptr, expert, g_rows, sc)
    us_ptrs = scale_ptrs(w_scale_ptr, expert, u_rows, sc)

    # K loop: two (BM, BN) dots per step, one A tile for both.
    acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_SIZE_K)):
        k_ok = offs_k < H - k * BLOCK_SIZE_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = weight_tile(g_ptrs, k_ok, k * BLOCK_SIZE_K, H, g_rows, col_ok, w_scale_ptr, sc, expert, EVEN_K,
                        BLOCK_SIZE_K, a_ptr.dtype.element_ty, UPCAST)
        u = weight_tile(u_ptrs, k_ok, k * BLOCK_SIZE_K, H, u_rows, col_ok, w_scale_ptr, sc, expert, EVEN_K,
                        BLOCK_SIZE_K, a_ptr.dtype.element_ty, UPCAST)
        acc_g = scaled_mma(a, g, acc_g, k * BLOCK_SIZE_K, as_ptrs, gs_ptrs, row_ok, col_ok, sc, UPCAST, IEEE_DOT)
        acc_u = scaled_mma(a, u, acc_u, k * BLOCK_SIZE_K, as_ptrs, us_ptrs, row_ok, col_ok, sc, UPCAST, IEEE_DOT)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        g_ptrs += (BLOCK_SIZE_K // sc.WQ_PACK) * stride_wk
        u_ptrs += (BLOCK_SIZE_K // sc.WQ_PACK) * stride_wk
    acc_g = dequant(acc_g, as_ptrs, gs_ptrs, row_ok, col_ok, sc.QUANT)
    acc_u = dequant(acc_u, as_ptrs, us_ptrs, row_ok, col_ok, sc.QUANT)

    # Epilogue: [+ b13], the activation (SiLU(gate) * up by default); store the valid rows.
    h = gate_up_epilogue(acc_g, acc_u, expert, offs_n, col_ok, gu)
    i_ptrs = inter_ptr + expert * stride_ie + offs_m[:, None] * stride_im + offs_n[None, :] * stride_in
    h = cast_rne(h, inter_ptr.dtype.element_ty, sc.QUANT != 0 and UPCAST)
    tl.store(i_ptrs, h, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def batched_gemm2_kernel(
    inter_ptr,  # (E_local, T, I)
    w2_ptr,  # (E_local, H, I)
    out_ptr,  # (E_local, T, H) out
    num_tokens_ptr,
    a_scale_ptr,  # QUANT: (E_local, T, G) fp32 scales of inter's rows
    w_scale_ptr,  # QUANT / WQ: scales of w2
    T,
    H,
    N_INTER,
    stride_ie,
    stride_im,
    stride_ik,
    stride_we,
    stride_wn,
    stride_wk,
    stride_oe,
    stride_om,
    stride_on,
    stride_ase,
    sc,  # common.Scales of a_scale and w2, as in GEMM1
    b2,  # common.Bias: (E_local, H) biases
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    # Program -> (expert, row tile, hidden tile), as in GEMM1.
    expert, pid_m, pid_n, count = expert_tile(T, H, num_tokens_ptr, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= count:
        return

    # Tile: the expert's valid rows and hidden columns.
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    row_ok = offs_m < count
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    # Pointers: A = inter's rows of the expert, B (BK, BN) = w2[e, n, k]^T, and their scales.
    a_ptrs = inter_ptr + expert * stride_ie + offs_m[:, None] * stride_im + offs_k[None, :] * stride_ik
    b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + wq_offsets(0, BLOCK_SIZE_K, sc.WQ_PACK)[:, None] * stride_wk
    as_ptrs = a_scale_ptr + expert * stride_ase + offs_m * sc.stride_asm
    bs_ptrs = scale_ptrs(w_scale_ptr, expert, offs_n, sc)

    # K loop.
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(N_INTER, BLOCK_SIZE_K)):
        k_ok = offs_k < N_INTER - k * BLOCK_SIZE_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = weight_tile(b_ptrs, k_ok, k * BLOCK_SIZE_K, N_INTER, offs_n, col_ok, w_scale_ptr, sc, expert, EVEN_K,
                        BLOCK_SIZE_K, inter_ptr.dtype.element_ty, UPCAST)
        acc = scaled_mma(a, b, acc, k * BLOCK_SIZE_K, as_ptrs, bs_ptrs, row_ok, col_ok, sc, UPCAST, IEEE_DOT)
        a_ptrs += BLOCK_SIZE_K * stride_ik
        b_ptrs += (BLOCK_SIZE_K // sc.WQ_PACK) * stride_wk

    acc = dequant(acc, as_ptrs, bs_ptrs, row_ok, col_ok, sc.QUANT)

    # Epilogue: [+ b2]; store the valid rows, unweighted.
    if b2.HAS_BIAS:
        acc += tl.load(b2.b2_ptr + expert * b2.stride_b2e + offs_n * b2.stride_b2n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + expert * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    acc = cast_rne(acc, out_ptr.dtype.element_ty, sc.QUANT != 0 and UPCAST)
    tl.store(o_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])


def batched_default_config(rows: int, n_inter: int, hidden: int, dtype: torch.dtype,
                           options: TritonOptions | None = None) -> TileConfig:
    """The Standard kernel's default heuristic with tokens per expert = rows (the routed pairs per
    local expert when the P/F says how many tokens it routed, else the buffer's rows: an upper
    bound), with 64-row tiles instead of 128-row ones up to options.batched_wide_rows rows
    (PERF.md, batched-triton's configs)."""
    cfg = default_config(rows, 1, n_inter, hidden, 1, dtype)
    if cfg["BLOCK_SIZE_M"] > 64 and rows <= (options or TritonOptions()).batched_wide_rows:
        cfg = TileConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
        if dtype == torch.float32:
            cfg["BLOCK_SIZE_K"], cfg["num_stages"] = 32, 3
    return cfg


def mean_rows(t: int, tokens: int | None, topk: int | None, num_experts: int | None) -> int:
    """Rows per local expert the batched heuristic sizes tiles for: the mean routed pairs per
    expert, tokens x topk / num_experts (at most the buffer's t), or t when the load is unknown."""
    if tokens is None or not topk or not num_experts:
        return t
    return max(1, min(t, -(-tokens * topk // num_experts)))


def batched_moe(
    a: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    w13,
    w2,
    config: Mapping[str, int],
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    activation: Activation = SILU,
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """a (E_local, T, H), expert_num_tokens (E_local,) int, w13 (E_local, 2I, H), w2 (E_local, H, I)
    -> (E_local, T, H) unweighted in a's dtype (rows past each count unwritten).
    activation: the GEMM1 epilogue's function and w13's gate/up layout (moebench.activation;
    swigluoai's interleaved w13 unquantised or weight-only); bias: b13 before the activation, b2 added to
    each row of GEMM2's output (before the P/F's router weight), or None.

    fp8 (w13, w2 QuantWeights of one scheme): a float8_e4m3fn with a_scale (E_local, T, G) fp32
    (or a unquantised: quantised here with the scheme, w13.input_scale for per tensor); output
    and the stored intermediate in out_dtype (default: bf16 for fp8 a, else a's dtype); the
    intermediate is quantised with the scheme (w2.input_scale for per tensor) before GEMM2."""
    e_local, t, h = a.shape
    n_inter = w2.shape[2]
    scheme = scheme_of(w13)
    if scheme_of(w2) != scheme:
        raise MoebenchError("w13 and w2 must be quantised with the same scheme (or both not at all)")
    counts = expert_num_tokens.to(device=a.device, dtype=torch.int32)
    if scheme is not None and scheme.weight_only:
        check_wq_config(config, scheme, "batched-triton experts")
        if a.dtype != w13.act_dtype or a_scale is not None:
            raise MoebenchError(f"{scheme.name} batched-triton experts take unquantised {w13.act_dtype} activations "
                                f"(the dtype its weights were quantised for), got {a.dtype}")
        out_dtype = a.dtype
    elif scheme is not None:
        check_block_config(config, scheme, "batched-triton experts", a.device)
        if scheme.scales == "tensor" and w2.input_scale is None:
            raise MoebenchError("per-tensor fp8 needs w2.input_scale (moebench.quant.quantize_weights sets it)")
        if a.dtype == FP8_DTYPE:
            if a_scale is None:
                raise MoebenchError("fp8 activations need their a_scale (E_local, T, G) float32")
            out_dtype = out_dtype or torch.bfloat16
        else:
            if scheme.scales == "tensor" and w13.input_scale is None:
                raise MoebenchError("per-tensor fp8 of batched activations needs w13.input_scale")
            out_dtype = out_dtype or a.dtype
            a, a_scale = quantize_rows(a, scheme, w13.input_scale, batch_counts=counts)
    else:
        out_dtype = a.dtype
    out = alloc_output((e_local, t, h), out_dtype, a.device)
    if e_local == 0 or t == 0:
        return out
    interpreter_compat()
    upcast = interpreting() and a.dtype != torch.float32
    ieee = a.dtype == torch.float32 or upcast
    bm, bn, bk, g = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"], config["GROUP_SIZE_M"]
    meta = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    w13q, w2q = (w13.q, w2.q) if scheme is not None else (w13, w2)

    bn1 = max(16, bn // 2)
    inter = torch.empty((e_local, t, n_inter), dtype=out_dtype, device=a.device)
    if activation.interleaved and scheme is not None and not scheme.weight_only:
        raise MoebenchError("batched-triton experts: swigluoai's interleaved w13 runs unquantised or weight-only "
                            "(not fp8)")
    stride_wn, gu = gate_up_args(w13q, n_inter, activation, None if bias is None else bias.b13)
    ptrs, sc = gemm_scales(w13, a_scale, (1, 2))
    grid1 = (triton.cdiv(t, bm) * triton.cdiv(n_inter, bn1), e_local)
    batched_silu_mul_gemm1_kernel[grid1](
        a, w13q, inter, counts, *ptrs, t, n_inter, h,
        a.stride(0), a.stride(1), a.stride(2), w13q.stride(0), stride_wn, w13q.stride(2),
        inter.stride(0), inter.stride(1), inter.stride(2), _expert_stride(a_scale, w13), sc, gu,
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn1, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g,
        EVEN_K=h % bk == 0, UPCAST=upcast, IEEE_DOT=ieee, **meta,
    )
    inter_scale = None
    if scheme is not None and not scheme.weight_only:
        # Rows past each expert's count are skipped (counts read on the device).
        inter, inter_scale = quantize_rows(inter, scheme, w2.input_scale, batch_counts=counts)
    ptrs, sc = gemm_scales(w2, inter_scale, (1, 2))
    grid2 = (triton.cdiv(t, bm) * triton.cdiv(h, bn), e_local)
    batched_gemm2_kernel[grid2](
        inter, w2q, out, counts, *ptrs, t, h, n_inter,
        inter.stride(0), inter.stride(1), inter.stride(2), w2q.stride(0), w2q.stride(1), w2q.stride(2),
        out.stride(0), out.stride(1), out.stride(2), _expert_stride(inter_scale, w2), sc,
        bias_arg(None if bias is None else bias.b2, w2q),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g,
        EVEN_K=n_inter % bk == 0, UPCAST=upcast, IEEE_DOT=ieee, **meta,
    )
    return out


def _expert_stride(a_scale: torch.Tensor | None, w) -> int:
    """The expert stride of a batched GEMM's activation scales (E_local, T, G): fp8 (w8a8) only, else 0."""
    if isinstance(w, QuantWeight) and not w.scheme.weight_only:
        return a_scale.stride(0)
    return 0
