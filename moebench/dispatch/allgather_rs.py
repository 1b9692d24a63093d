"""`allgather-rs`: all-gather tokens over the DP ranks, run the local experts on every gathered
token, reduce-scatter the partial outputs back (Standard format).

    prepare:  x (M_r, H), topk_* (M_r, K) on each rank r
              -> all-gather (padded to max_r M_r)  -> a (sum_r M_r, H), topk_* (sum_r M_r, K)
    experts:  this rank's experts only (expert_map; remote experts contribute zero), or this
              rank's TP shard of every expert (no expert_map) -- either way a partial output
    finalize: weight-and-reduce over k (the experts' choice, resolved by `resolve`) -> (sum M_r, H)
              -> reduce-scatter (sum over ranks, padded to max M_r) -> (M_r, H)

Ranks may hold different numbers of tokens, zero included: counts are all-gathered first and
every rank pads to the largest count. The counts exchange syncs with the host (not CUDA-graph
capturable). Without torch.distributed (one process) it degenerates to `no-dpep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moebench.comm import CommOp
from moebench.kernels.act_quant import maybe_quantize
from moebench.kernels.modular import (
    ActivationFormat,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
)
from moebench.quant import pack_rows, unpack_rows
from moebench.runtime.distributed import all_gather_single, group_rank_world, reduce_scatter_single


@dataclass
class AllGatherHandle:
    """counts: tokens per rank (host ints); rank / world in the group; pad = max(counts, 1)."""

    counts: list[int]
    rank: int
    world: int
    pad: int


class AllGatherReduceScatterPrepareAndFinalize(PrepareAndFinalize):
    name = "allgather-rs"
    activation_format = ActivationFormat.STANDARD
    min_world_size = 2  # with one rank it is no-dpep; sweeps list it as skipped there
    needs_expert_parallel = True
    #: moves tokens between ranks (the rank-case runner gives each rank its own token slice)
    communicates = True
    engine_flags = {"vllm": "--all2all-backend allgather_reducescatter", "sglang": ""}
    #: all-gather of the tokens with their routing (int64 id + fp32 weight per slot), then
    #: reduce-scatter of the partial outputs
    communication = (
        CommOp("all-gather", ("nccl-all-gather",), "tensor", "activations", topk_extra=12),
        CommOp("reduce-scatter", ("nccl-reduce-scatter",), "tensor", "outputs"),
    )

    def __init__(self, group: Any = None):
        """group: a torch.distributed ProcessGroup over the DP ranks, None = the default group."""
        self.group = group

    def default_weight_and_reduce(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceContiguous()

    def _gather(self, t: torch.Tensor, h: AllGatherHandle) -> torch.Tensor:
        """t (M_r, ...) on every rank -> (sum_r M_r, ...) in rank order."""
        padded = t.new_zeros((h.pad,) + tuple(t.shape[1:]))
        padded[: t.shape[0]] = t
        out = t.new_empty((h.world * h.pad,) + tuple(t.shape[1:]))
        all_gather_single(out, padded, self.group)
        out = out.view(h.world, h.pad, *t.shape[1:])
        return torch.cat([out[r, : h.counts[r]] for r in range(h.world)], dim=0)

    def prepare(self, x, topk_weights, topk_ids, num_experts, num_local_experts, expert_map, quant=None) -> PrepareResult:
        """x (M_r, H), topk_weights (M_r, K) float32, topk_ids (M_r, K) -> a (sum M_r, H) etc.
        With `quant`, x is quantised first and fp8 rows with their scales are gathered."""
        rank, world = group_rank_world(self.group)
        q, a_scale = maybe_quantize(x, quant)
        if world == 1:
            handle = AllGatherHandle([x.shape[0]], 0, 1, max(x.shape[0], 1))
            return PrepareResult(
                a=q, topk_ids=topk_ids, topk_weights=topk_weights, expert_num_tokens=None,
                expert_map=expert_map, num_experts=num_experts, handle=handle, a_scale=a_scale, quant=quant.scheme if quant else None,
            )
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts_t = torch.empty(world, dtype=torch.int64, device=x.device)
        all_gather_single(counts_t, count, self.group)
        counts = [int(c) for c in counts_t.tolist()]
        h = AllGatherHandle(counts=counts, rank=rank, world=world, pad=max(max(counts), 1))
        if quant is None:
            a = self._gather(x, h)
        else:  # one byte row per token: fp8 payload then its scales
            a, a_scale = unpack_rows(self._gather(pack_rows(q, a_scale), h), x.shape[-1])
        w = self._gather(topk_weights, h)
        ids = self._gather(topk_ids, h)
        return PrepareResult(
            a=a, topk_ids=ids, topk_weights=w, expert_num_tokens=None,
            expert_map=expert_map, num_experts=num_experts, handle=h, a_scale=a_scale, quant=quant.scheme if quant else None,
        )

    def finalize(self, out, prep, topk_weights, weight_and_reduce) -> torch.Tensor:
        """out: the experts' output for the gathered tokens ((sum M_r, K, H) or (sum M_r, H)).
        topk_weights: this rank's (M_r, K); the gathered weights in `prep` are the ones used.
        Returns (M_r, H): the sum over ranks of every rank's partial output for these tokens."""
        h: AllGatherHandle = prep.handle
        partial = weight_and_reduce.apply(out, prep.topk_weights, None)  # (sum M_r, H)
        if h.world == 1:
            return partial
        hidden = partial.shape[-1]
        send = partial.new_zeros((h.world, h.pad, hidden))
        start = 0
        for r, c in enumerate(h.counts):
            send[r, :c] = partial[start : start + c]
            start += c
        recv = partial.new_empty((h.pad, hidden))
        reduce_scatter_single(recv, send.view(h.world * h.pad, hidden), self.group)
        return recv[: h.counts[h.rank]]
