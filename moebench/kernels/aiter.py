"""AITER experts (optional; ROCm only): `aiter` (Standard), AMD's fused MoE
`aiter.fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)`, which weights and sums itself.
aiter is imported lazily; nothing else in moebench needs it."""

from __future__ import annotations

import torch

from moebench.activation import SILU
from moebench.errors import UnsupportedError
from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    PrepareResult,
    TopKWeightAndReduceNoOp,
)
from moebench.quant import scheme_of


class AiterExperts(Experts):
    name = "aiter"
    activation_format = ActivationFormat.STANDARD
    supported_dtypes = (torch.bfloat16, torch.float16)
    supported_devices = ("cuda",)  # ROCm devices are "cuda" in torch
    gpu_vendors = ("amd",)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if getattr(torch.version, "hip", None) is None:
            return "AITER needs ROCm (an AMD GPU build of torch)"
        try:
            import aiter  # noqa: F401
        except ImportError:
            return "aiter is not installed (github.com/ROCm/aiter)"
        return None

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor, *, activation=SILU, bias=None) -> torch.Tensor:
        self.check_activation(activation, bias, scheme_of(w13))
        from aiter.fused_moe import fused_moe

        if prep.expert_map is not None:
            raise UnsupportedError("the aiter adapter does not take an expert_map (EP); use it with all experts local")
        return fused_moe(prep.a, w13, w2, prep.topk_weights, prep.topk_ids)
