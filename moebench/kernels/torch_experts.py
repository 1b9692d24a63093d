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

#: grouped_mm needs every stride to be a multiple of 16 bytes: H and I are padded to this many
#: elements (zeros, which change no result) when a shape is not aligned; real model shapes are.
_ALIGN = 8


def _pad_to(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _aligned_operands(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
    """Zero-pad H and I to multiples of _ALIGN: x (R, H'), w13 (E, 2I', H'), w2 (E, H', I')."""
    e, two_i, h = w13.shape
    i = two_i // 2
    hp, ip = _pad_to(h), _pad_to(i)
    if (hp, ip) == (h, i):
        return x, w13, w2
    x_p = torch.nn.functional.pad(x, (0, hp - h))
    w13_p = w13.new_zeros((e, 2 * ip, hp))
    w13_p[:, :i, :h] = w13[:, :i]
    w13_p[:, ip : ip + i, :h] = w13[:, i:]
    w2_p = w2.new_zeros((e, hp, ip))
    w2_p[:, :h, :i] = w2
    return x_p, w13_p, w2_p


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
        xs, w13, w2 = _aligned_operands(xs, w13, w2)
        offs = s.offsets.to(torch.int32)
        # grouped_mm: rows [offs[g-1], offs[g]) of xs times group g; rows past offs[-1] undefined.
        gate_up = _grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # (M*K, 2I)
        act = silu_and_mul(gate_up)
        ys = _grouped_mm(act, w2.transpose(1, 2), offs=offs)[:, :h]  # (M*K, H)
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
