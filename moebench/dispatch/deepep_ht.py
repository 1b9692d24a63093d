"""`deepep-ht`: adapter over DeepEP's normal (high-throughput) kernels, the prefill path
(`deep_ep.Buffer.get_dispatch_layout`, `dispatch`, `combine`). Standard format:

    dispatch: x (M, H), topk_ids (M, K), topk_weights (M, K) -> the tokens this rank receives,
              once per token however many of its experts the token picked: a (R, H) with their
              routing in local expert ids (-1 where the expert lives on another rank)
    experts:  this rank's experts on those R tokens, weighted and summed over the local k
    combine:  each received token's partial output back to its source rank, summed there -> (M, H)

A token travels once per rank it has experts on (DeepEP's normal kernels deduplicate per rank;
past one node once per node over RDMA, then over NVLink inside it), which is what its declared
communication prices. fp8: with block scales of bk = 128 the tokens travel as fp8 with their
1x128 scales, as DeepEP's dispatch takes them (x given as a (fp8, scales) pair).

Optional: deep_ep is imported lazily. Needs CUDA, at least 2 ranks (they may share one GPU: see
deepep_ll) and E divisible by the ranks. One buffer per process and group, reused by every case.
Where it cannot run, simulated runs still price it (modeled), which is how `compare tp-vs-ep`
considers it on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moebench.comm import CommOp
from moebench.dispatch.deepep_ll import deep_ep_unavailable_reason, shared_buffer
from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels.act_quant import maybe_quantize
from moebench.kernels.modular import (
    ActivationFormat,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
    TopKWeightAndReduceContiguous,
)
from moebench.runtime.distributed import group_rank_world

#: DeepEP's buffers for the normal kernels: its README's sizing (NVLink buffer of 1 GB; RDMA only
#: past one node of 8)
NVL_BUFFER_BYTES = 1 << 30
RDMA_BUFFER_BYTES = 1 << 30
NVL_PEERS = 8


@dataclass
class DeepEPHTHandle:
    deep_ep_handle: Any
    num_tokens: int


class DeepEPHTPrepareAndFinalize(PrepareAndFinalize):
    name = "deepep-ht"
    activation_format = ActivationFormat.STANDARD
    supported_devices = ("cuda",)
    min_world_size = 2
    needs_expert_parallel = True
    communicates = True
    engine_flags = {"vllm": "--all2all-backend deepep_high_throughput",
                    "sglang": "--moe-a2a-backend deepep --deepep-mode normal"}
    overlaps = True
    #: one row per (token, remote rank) each way, with the token's routing on the way out
    #: (int64 id + fp32 weight per slot)
    communication = (
        CommOp("dispatch", ("deepep-ht",), "rank", "activations", topk_extra=12),
        CommOp("combine", ("deepep-ht",), "rank", "outputs"),
    )
    supported_quant = ("block",)

    @classmethod
    def unavailable_reason(cls, device: str, world_size: int) -> str | None:
        return deep_ep_unavailable_reason(device)

    def __init__(self, group: Any = None):
        self.group = group
        self._buffer = None

    def default_weight_and_reduce(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceContiguous()

    def _get_buffer(self, world: int):
        if self._buffer is None:
            reason = deep_ep_unavailable_reason("cuda")
            if reason is not None:
                raise UnsupportedError(f"deepep-ht is unusable: {reason}")
            import torch.distributed as dist
            from deep_ep import Buffer  # lazy: optional dependency

            group = self.group if self.group is not None else dist.group.WORLD
            rdma = RDMA_BUFFER_BYTES if world > NVL_PEERS else 0
            self._buffer = shared_buffer("normal", group, lambda k: k == (NVL_BUFFER_BYTES, rdma),
                                         lambda: ((NVL_BUFFER_BYTES, rdma), Buffer(group, NVL_BUFFER_BYTES, rdma)))
        return self._buffer

    def prepare(self, x, topk_weights, topk_ids, num_experts, num_local_experts, expert_map, quant=None) -> PrepareResult:
        rank, world = group_rank_world(self.group)
        if num_experts % world or num_local_experts != num_experts // world:
            raise UnsupportedError(f"deepep-ht places E / world experts per rank: {num_experts} experts over {world} "
                                   f"ranks, this rank holds {num_local_experts}")
        if quant is not None and (quant.scheme.scales != "block" or quant.scheme.group_k != 128):
            raise UnsupportedError(f"deepep-ht carries fp8 with 1x128 scales: needs block scales with bk = 128, "
                                   f"got {quant.scheme.describe()}")
        buf = self._get_buffer(world)
        ids = topk_ids.to(torch.int64).contiguous()
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(ids, num_experts)
        q, a_scale = maybe_quantize(x, quant)
        payload = q if a_scale is None else (q, a_scale.to(torch.float32).contiguous())
        recv, recv_ids, recv_w, _counts, handle, _ = buf.dispatch(
            payload, topk_idx=ids, topk_weights=topk_weights.to(torch.float32), num_tokens_per_rank=n_rank,
            num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
        recv_scale = None
        if isinstance(recv, tuple):
            recv, recv_scale = recv
        # local ids -> global ids through this rank's expert_map; slots of other ranks' experts
        # point at an expert of the next rank with weight 0 (the map sends it to -1)
        other = ((rank + 1) % world) * num_local_experts
        gid = torch.where(recv_ids >= 0, recv_ids + rank * num_local_experts, torch.full_like(recv_ids, other))
        w = torch.where(recv_ids >= 0, recv_w, torch.zeros_like(recv_w))
        if expert_map is None:
            raise MoebenchError("deepep-ht needs the rank's expert_map (expert parallelism)")
        return PrepareResult(
            a=recv, topk_ids=gid, topk_weights=w, expert_num_tokens=None, expert_map=expert_map,
            num_experts=num_experts, handle=DeepEPHTHandle(handle, x.shape[0]), a_scale=recv_scale,
            quant=quant.scheme if quant else None,
        )

    def finalize(self, out, prep, topk_weights, weight_and_reduce) -> torch.Tensor:
        """out: the experts' output for the received tokens -> (M, H): each received token's
        weighted sum over its local experts, summed over ranks by DeepEP's combine."""
        partial = weight_and_reduce.apply(out, prep.topk_weights, None)
        _, world = group_rank_world(self.group)
        combined, _, _ = self._get_buffer(world).combine(partial.contiguous(), prep.handle.deep_ep_handle)
        return combined
