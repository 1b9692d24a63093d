"""`batched-local`: the BatchedExperts layout without communication (one process). Scatters each
(token, k) pair into (E_local, M, H) and gathers back with the router weights on finalize, so
BatchedExperts backends can run and be checked on a single rank; each half one Triton launch where
Triton runs (moebench.kernels.triton.batched_layout)."""

from __future__ import annotations

import torch

from moebench.kernels.act_quant import maybe_quantize
from moebench.kernels.modular import (
    ActivationFormat,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
)
from moebench.kernels.token_layout import batched_slots, local_topk_ids
from moebench.kernels.triton.batched_layout import TopKWeightAndReduceBatchedTriton, batched_rows


class BatchedLocalPrepareAndFinalize(PrepareAndFinalize):
    name = "batched-local"
    activation_format = ActivationFormat.BATCHED
    max_world_size = 1
    communication = ()

    def default_weight_and_reduce(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceBatchedTriton()

    def prepare(self, x, topk_weights, topk_ids, num_experts, num_local_experts, expert_map, quant=None) -> PrepareResult:
        num_local = num_local_experts
        max_tokens = max(x.shape[0], 1)  # an expert receives each token at most once
        local = local_topk_ids(topk_ids, expert_map)
        slot_map, counts = batched_slots(local, num_local, max_tokens)
        q, scale = maybe_quantize(x, quant)
        a = batched_rows(q, slot_map, num_local, max_tokens)
        a_scale = None if scale is None else batched_rows(scale.contiguous(), slot_map, num_local, max_tokens)
        return PrepareResult(
            a=a, topk_ids=None, topk_weights=None, expert_num_tokens=counts,
            expert_map=expert_map, num_experts=num_experts, handle=slot_map, a_scale=a_scale, quant=quant.scheme if quant else None,
            num_tokens=x.shape[0], topk=topk_ids.shape[1],
        )

    def finalize(self, out, prep, topk_weights, weight_and_reduce) -> torch.Tensor:
        return weight_and_reduce.apply(out, topk_weights, prep.handle)
