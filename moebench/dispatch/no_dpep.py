"""`no-dpep`: no communication. Tokens stay where they are (Standard format); the TP path
all-reduces after finalize when tp > 1 (done by the runtime, not here)."""

from __future__ import annotations

import torch

from moebench.kernels.act_quant import maybe_quantize
from moebench.kernels.modular import (
    ActivationFormat,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
)


class NoDPEPPrepareAndFinalize(PrepareAndFinalize):
    name = "no-dpep"
    activation_format = ActivationFormat.STANDARD
    # the TP path: every engine's default (tokens replicated, an all-reduce after the experts)
    engine_flags = {"vllm": "", "sglang": "", "trt-llm": ""}

    def default_weight_and_reduce(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceContiguous()

    def prepare(self, x, topk_weights, topk_ids, num_experts, num_local_experts, expert_map, quant=None) -> PrepareResult:
        a, a_scale = maybe_quantize(x, quant)
        return PrepareResult(
            a=a, topk_ids=topk_ids, topk_weights=topk_weights, expert_num_tokens=None,
            expert_map=expert_map, num_experts=num_experts, a_scale=a_scale, quant=quant.scheme if quant else None,
        )

    def finalize(self, out, prep, topk_weights, weight_and_reduce) -> torch.Tensor:
        return weight_and_reduce.apply(out, topk_weights, None)
