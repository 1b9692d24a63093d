"""DeepGEMM experts (optional; Hopper, bf16): `deepgemm` (Standard, grouped GEMM on the contiguous
layout) and `batched-deepgemm` (BatchedExperts, masked grouped GEMM).

DeepGEMM's bf16 grouped GEMMs ("nt": B is (G, N, K), i.e. our weights as stored):
  m_grouped_bf16_gemm_nt_contiguous(a (R, K), b (G, N, K), d (R, N), m_indices (R,) int32)
      rows of one group are contiguous and each group's run is padded to the M alignment
      (get_mk_alignment_for_contiguous_layout()); padding rows carry group index -1.
  m_grouped_bf16_gemm_nt_masked(a (G, T, K), b (G, N, K), d (G, T, N), masked_m (G,), expected_m)
deep_gemm is imported lazily; nothing else in moebench needs it.
"""

from __future__ import annotations

import torch

from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    PrepareResult,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    alloc_output,
)
from moebench.kernels.reference import silu_and_mul
from moebench.kernels.registry import register_experts
from moebench.kernels.token_layout import local_topk_ids, sort_by_expert


def _deep_gemm_reason(device: str) -> str | None:
    if device != "cuda":
        return "DeepGEMM needs a CUDA GPU"
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        return "deep_gemm is not installed (pip install from github.com/deepseek-ai/DeepGEMM)"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return "DeepGEMM needs Hopper (sm_90) or newer"
    return None


class _DeepGemmBackend(Experts):
    """What both DeepGEMM backends declare: bf16, CUDA (Hopper), deep_gemm importable."""

    supported_dtypes = (torch.bfloat16,)
    supported_devices = ("cuda",)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return _deep_gemm_reason(device)


@register_experts
class DeepGemmExperts(_DeepGemmBackend):
    """Standard: pairs sorted by expert into DeepGEMM's padded contiguous layout. Returns (M, K, H)."""

    name = "deepgemm"
    activation_format = ActivationFormat.STANDARD
    def weight_and_reduce(self):
        return TopKWeightAndReduceContiguous()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        import deep_gemm

        x, ids = prep.a, prep.topk_ids
        m, k = ids.shape
        e, h = w13.shape[0], x.shape[-1]
        align = deep_gemm.get_mk_alignment_for_contiguous_layout()
        local = local_topk_ids(ids, prep.expert_map)
        s = sort_by_expert(local, e)
        # Padded row of each pair: expert e's run starts at the sum of the aligned counts before it.
        padded = (s.counts + align - 1) // align * align
        starts = torch.cumsum(padded, 0) - padded
        rows = m * k + e * align  # static worst case
        flat = local.reshape(-1)
        dest = torch.where(flat >= 0, starts[flat.clamp(min=0)] + s.pos, torch.full_like(flat, rows))
        m_indices = torch.full((rows + 1,), -1, dtype=torch.int32, device=x.device)
        m_indices.index_copy_(0, dest, flat.to(torch.int32).clamp(min=-1))
        a = torch.zeros((rows + 1, h), dtype=x.dtype, device=x.device)
        a.index_copy_(0, dest, x.repeat_interleave(k, dim=0))
        m_indices, a = m_indices[:rows].contiguous(), a[:rows].contiguous()
        gate_up = torch.empty((rows, w13.shape[1]), dtype=x.dtype, device=x.device)
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, w13, gate_up, m_indices)
        act = silu_and_mul(gate_up).contiguous()
        y = torch.empty((rows, h), dtype=x.dtype, device=x.device)
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(act, w2, y, m_indices)
        out = alloc_output((m * k, h), x.dtype, x.device)
        valid = (flat >= 0).unsqueeze(-1)
        out.copy_(torch.where(valid, y[dest.clamp(max=rows - 1)], torch.zeros((), dtype=x.dtype, device=x.device)))
        return out.view(m, k, h)


@register_experts
class BatchedDeepGemmExperts(_DeepGemmBackend):
    """BatchedExperts: masked grouped GEMM over (E_local, T, H). Returns (E_local, T, H) unweighted."""

    name = "batched-deepgemm"
    activation_format = ActivationFormat.BATCHED
    def weight_and_reduce(self):
        return TopKWeightAndReduceDelegate()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        import deep_gemm

        a, counts = prep.a, prep.expert_num_tokens
        e, t, h = a.shape
        expected_m = max(1, t // 2)  # a hint for DeepGEMM's config choice, not a bound
        gate_up = torch.empty((e, t, w13.shape[1]), dtype=a.dtype, device=a.device)
        deep_gemm.m_grouped_bf16_gemm_nt_masked(a.contiguous(), w13, gate_up, counts, expected_m)
        act = silu_and_mul(gate_up).contiguous()
        out = alloc_output((e, t, h), a.dtype, a.device)
        deep_gemm.m_grouped_bf16_gemm_nt_masked(act, w2, out, counts, expected_m)
        return out
