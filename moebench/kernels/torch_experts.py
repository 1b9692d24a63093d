"""Torch experts: the peer baseline.

`torch` (Standard): tokens sorted by expert, two grouped GEMMs (torch.nn.functional.grouped_mm or
torch._grouped_mm) with SiLU-and-mul between; output (M, K, H) unweighted.
`batched-torch` (BatchedExperts): two batched matmuls over (E_local, T, H).
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

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@register_experts
class TorchExperts(Experts):
    """Standard: grouped GEMM on expert-sorted tokens. Returns (M, K, H), remote pairs zero."""

    name = "torch"
    activation_format = ActivationFormat.STANDARD

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if _grouped_mm is None:
            return f"torch {torch.__version__} has neither nn.functional.grouped_mm nor _grouped_mm"
        return None

    def weight_and_reduce(self):
        return TopKWeightAndReduceContiguous()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        x, ids = prep.a, prep.topk_ids
        m, k = ids.shape
        h = x.shape[-1]
        local = local_topk_ids(ids, prep.expert_map)
        s = sort_by_expert(local, w13.shape[0])
        xs = x.index_select(0, s.order // k)  # (M*K, H): pairs in expert order, remote ones last
        offs = s.offsets.to(torch.int32)
        # grouped_mm: rows [offs[g-1], offs[g]) of xs times group g; rows past offs[-1] undefined.
        gate_up = _grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # (M*K, 2I)
        act = silu_and_mul(gate_up)
        ys = _grouped_mm(act, w2.transpose(1, 2), offs=offs)  # (M*K, H)
        valid = (torch.arange(m * k, device=x.device) < offs[-1:].long()).unsqueeze(-1) if m * k else None
        out = alloc_output((m * k, h), x.dtype, x.device)
        if m * k:
            out.index_copy_(0, s.order, torch.where(valid, ys, torch.zeros((), dtype=ys.dtype, device=ys.device)))
        return out.view(m, k, h)


@register_experts
class BatchedTorchExperts(Experts):
    """BatchedExperts: bmm over (E_local, T, H). Returns (E_local, T, H) unweighted; rows past
    expert_num_tokens are not meaningful (the finalize only reads valid slots)."""

    name = "batched-torch"
    activation_format = ActivationFormat.BATCHED

    def weight_and_reduce(self):
        return TopKWeightAndReduceDelegate()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        a = prep.a  # (E_local, T, H)
        gate_up = torch.bmm(a, w13.transpose(1, 2))  # (E_local, T, 2I)
        out = alloc_output(a.shape, a.dtype, a.device)
        torch.bmm(silu_and_mul(gate_up), w2.transpose(1, 2), out=out)
        return out
