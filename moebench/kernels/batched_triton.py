"""`batched-triton` experts (BatchedExperts format): the layout DeepEP low-latency produces.

Input a (E_local, T, H) with expert_num_tokens (E_local,): rows [0, count[e]) of expert e are
valid. Two kernels, grid (tiles, E_local): each program reads its expert's count and returns at
once when its row tile starts past it, so empty experts and empty tiles cost one load.

    GEMM1  a[e] @ w13[e]^T with gate and up tiles in the same K loop, SiLU(gate) * up -> inter
           (E_local, T, I)
    GEMM2  inter[e] @ w2[e]^T -> out (E_local, T, H), unweighted, in a's dtype

Rows past each expert's count are not written (the prepare/finalize reads only valid slots);
weighting and the sum over top-k are delegated to the prepare/finalize.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    PrepareResult,
    TopKWeightAndReduceDelegate,
    alloc_output,
)
from moebench.kernels.moe_align import interpreter_compat, interpreting, triton_unavailable_reason
from moebench.kernels.registry import register_experts
from moebench.kernels.triton_common import grouped_tile, mma
from moebench.tuning.configs import TileConfig, default_config, validate_tile_config


@triton.jit
def _batched_silu_mul_gemm1_kernel(
    a_ptr,  # (E_local, T, H)
    w13_ptr,  # (E_local, 2I, H)
    inter_ptr,  # (E_local, T, I) out
    num_tokens_ptr,  # (E_local,) valid rows per expert
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
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,  # intermediate columns per program (gate and up each)
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    # Axis 1 = expert; axis 0 -> (row tile, intermediate tile), grouped for L2 reuse.
    expert = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(T, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N_INTER, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)

    # Skip tiles past this expert's valid rows.
    count = tl.load(num_tokens_ptr + expert)
    if pid_m * BLOCK_SIZE_M >= count:
        return

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    row_ok = offs_m < count
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N_INTER
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    a_ptrs = a_ptr + expert * stride_ae + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N_INTER * stride_wn

    acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_SIZE_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < H - k * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_g = mma(a, g, acc_g, UPCAST, IEEE_DOT)
        acc_u = mma(a, u, acc_u, UPCAST, IEEE_DOT)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        g_ptrs += BLOCK_SIZE_K * stride_wk
        u_ptrs += BLOCK_SIZE_K * stride_wk

    # Epilogue: SiLU(gate) * up for the valid rows.
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    i_ptrs = inter_ptr + expert * stride_ie + offs_m[:, None] * stride_im + offs_n[None, :] * stride_in
    tl.store(i_ptrs, h.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _batched_gemm2_kernel(
    inter_ptr,  # (E_local, T, I)
    w2_ptr,  # (E_local, H, I)
    out_ptr,  # (E_local, T, H) out
    num_tokens_ptr,
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
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    expert = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(T, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(H, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M)

    count = tl.load(num_tokens_ptr + expert)
    if pid_m * BLOCK_SIZE_M >= count:
        return

    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    row_ok = offs_m < count
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    a_ptrs = inter_ptr + expert * stride_ie + offs_m[:, None] * stride_im + offs_k[None, :] * stride_ik
    b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(N_INTER, BLOCK_SIZE_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < N_INTER - k * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = mma(a, b, acc, UPCAST, IEEE_DOT)
        a_ptrs += BLOCK_SIZE_K * stride_ik
        b_ptrs += BLOCK_SIZE_K * stride_wk

    o_ptrs = out_ptr + expert * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def batched_default_config(max_tokens: int, n_inter: int, hidden: int, dtype: torch.dtype) -> TileConfig:
    """The Standard kernel's default heuristic with tokens per expert = max_tokens (an upper
    bound: the real counts are only known on the device), BLOCK_SIZE_M capped at 64."""
    cfg = default_config(max_tokens, 1, n_inter, hidden, 1, dtype)
    if cfg["BLOCK_SIZE_M"] > 64:
        cfg = TileConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
        if dtype == torch.float32:
            cfg["BLOCK_SIZE_K"], cfg["num_stages"] = 32, 3
    return cfg


def batched_moe(
    a: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: Mapping[str, int],
) -> torch.Tensor:
    """a (E_local, T, H), expert_num_tokens (E_local,) int, w13 (E_local, 2I, H), w2 (E_local, H, I)
    -> (E_local, T, H) unweighted in a's dtype (rows past each count unwritten)."""
    e_local, t, h = a.shape
    n_inter = w2.shape[2]
    out = alloc_output((e_local, t, h), a.dtype, a.device)
    if e_local == 0 or t == 0:
        return out
    interp = interpreting()
    if interp:
        interpreter_compat()
    upcast = interp and a.dtype != torch.float32
    ieee = a.dtype == torch.float32 or upcast
    bm, bn, bk, g = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"], config["GROUP_SIZE_M"]
    meta = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    counts = expert_num_tokens.to(device=a.device, dtype=torch.int32)

    bn1 = max(16, bn // 2)
    inter = torch.empty((e_local, t, n_inter), dtype=a.dtype, device=a.device)
    grid1 = (triton.cdiv(t, bm) * triton.cdiv(n_inter, bn1), e_local)
    _batched_silu_mul_gemm1_kernel[grid1](
        a, w13, inter, counts, t, n_inter, h,
        a.stride(0), a.stride(1), a.stride(2), w13.stride(0), w13.stride(1), w13.stride(2),
        inter.stride(0), inter.stride(1), inter.stride(2),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn1, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g,
        EVEN_K=h % bk == 0, UPCAST=upcast, IEEE_DOT=ieee, **meta,
    )
    grid2 = (triton.cdiv(t, bm) * triton.cdiv(h, bn), e_local)
    _batched_gemm2_kernel[grid2](
        inter, w2, out, counts, t, h, n_inter,
        inter.stride(0), inter.stride(1), inter.stride(2), w2.stride(0), w2.stride(1), w2.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g,
        EVEN_K=n_inter % bk == 0, UPCAST=upcast, IEEE_DOT=ieee, **meta,
    )
    return out


@register_experts
class BatchedTritonExperts(Experts):
    """BatchedExperts: (E_local, T, H) -> (E_local, T, H) unweighted; weights applied by the P/F.

    config: a TileConfig used for every call (else `batched_default_config`).
    """

    name = "batched-triton"
    activation_format = ActivationFormat.BATCHED

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return triton_unavailable_reason(device)

    def __init__(self, config: Mapping[str, int] | None = None):
        self.config = validate_tile_config(dict(config), "BatchedTritonExperts config") if config is not None else None

    def weight_and_reduce(self):
        return TopKWeightAndReduceDelegate()

    def config_for(self, t: int, n_inter: int, hidden: int, dtype: torch.dtype) -> dict[str, Any]:
        if self.config is not None:
            return dict(self.config)
        return dict(batched_default_config(t, n_inter, hidden, dtype))

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        a = prep.a
        cfg = self.config_for(a.shape[1], w2.shape[2], a.shape[2], a.dtype)
        return batched_moe(a, prep.expert_num_tokens, w13, w2, cfg)
