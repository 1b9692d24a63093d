"""`deepep-ll`: adapter over DeepEP's low-latency kernels (`deep_ep.Buffer.low_latency_dispatch`
and `low_latency_combine`). BatchedExperts format, same layout as `all2all-ll`:

    dispatch: x (M, H) bf16, topk_ids (M, K) int64 -> recv_x (E_local, max_tokens_per_rank * world, H)
              bf16 packed per expert, recv_count (E_local,) int32
    combine:  expert outputs (E_local, max_tokens_per_rank * world, H) bf16 -> (M, H), weighted by
              topk_weights and summed over k inside DeepEP's combine kernel

Optional: deep_ep is imported lazily, only when the backend is used. Needs CUDA, bf16
activations, E divisible by the number of ranks (DeepEP places expert e on rank e // E_local) and
at most max_tokens_per_rank tokens per rank. With torch.distributed up, the buffer spans `group`:
one rank per GPU (NCCL group), or several ranks sharing a GPU (a gloo group: DeepEP uses the group
only to exchange its buffers' handles; `sweep --world-size 2 --device cuda` on one GPU), which
DeepEP's intranode kernels take as peers over CUDA IPC. A process without torch.distributed is
refused: DeepEP 1.2.1 stops a one-rank buffer ("Unsupported ranks"). fp8: with block scales of bk = 128
(`--dtype fp8_w8a8 --block-shape N,128`) the dispatch quantises (DeepEP's use_fp8: 1x128 groups,
fp32 scales) and the batched experts get fp8 rows with their scales, as from `all2all-ll`.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from moebench.comm import CommOp
from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels.modular import (
    ActivationFormat,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
)
from moebench.runtime.distributed import group_rank_world

_IMPORT_ERROR: list[str | None] = []  # cached: [None] when deep_ep imports, [reason] otherwise


def _deep_ep_import_error() -> str | None:
    if not _IMPORT_ERROR:
        if importlib.util.find_spec("deep_ep") is None:
            _IMPORT_ERROR.append("deep_ep is not installed (moebench vendor install deepep)")
        else:
            try:
                from moebench.vendor import preload_libraries

                preload_libraries("deep_ep")
                importlib.import_module("deep_ep")
                _IMPORT_ERROR.append(None)
            except Exception as e:  # noqa: BLE001 - a broken install (missing CUDA libs, ...) is a reason
                _IMPORT_ERROR.append(f"deep_ep does not import: {type(e).__name__}: {e}")
    return _IMPORT_ERROR[0]


def deep_ep_unavailable_reason(device: str) -> str | None:
    """Why DeepEP's kernels cannot run here (not installed or not importable, no CUDA GPU), or None.
    One GPU is enough: ranks beyond the GPUs share them (the sweep marks their rows)."""
    reason = _deep_ep_import_error()
    if reason is not None:
        return reason
    if device != "cuda" or not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "deep_ep needs CUDA"
    return None


class TopKWeightAndReduceInCombine(TopKWeightAndReduce):
    """The router weights are applied and summed over k inside DeepEP's combine kernel."""

    name = "in-combine"

    def apply(self, out, topk_weights, slot_map):
        raise RuntimeError("deepep-ll weights and reduces inside low_latency_combine; nothing to apply here")


@dataclass
class DeepEPHandle:
    deep_ep_handle: Any
    topk_ids: torch.Tensor  # (M, K) int64, as dispatched


#: DeepEP buffers of this process, shared by every adapter object over the same group: a buffer
#: (NVSHMEM in low-latency mode) is set up once per process and reused, as DeepEP advises, never
#: torn down and set up again between the cases of a sweep. (kind, group id) -> (size key, Buffer)
_BUFFERS: dict[tuple, tuple[tuple, Any]] = {}


def shared_buffer(kind: str, group: Any, fits: Any, make: Any):
    """The process's DeepEP buffer of `kind` over `group`: the cached one where `fits(its key)`,
    else `make()` -> (key, Buffer), cached."""
    slot = (kind, id(group))
    held = _BUFFERS.get(slot)
    if held is None or not fits(held[0]):
        _BUFFERS[slot] = make()
    return _BUFFERS[slot][1]


def dispatch_tokens_for(tokens: int, world: int) -> int:
    """The smallest n >= tokens with world * n a multiple of 4 (DeepEP low-latency's constraint)."""
    step = 4 // math.gcd(world, 4)
    return -(-max(1, tokens) // step) * step


#: tokens per rank one low-latency call carries in a deployment: vLLM's VLLM_MOE_DP_CHUNK_SIZE
#: default (vllm/envs.py); larger batches are dispatched in chunks of it
DP_CHUNK = 256


class DeepEPLLPrepareAndFinalize(PrepareAndFinalize):
    name = "deepep-ll"
    activation_format = ActivationFormat.BATCHED
    supported_devices = ("cuda",)
    min_world_size = 2
    needs_expert_parallel = True
    #: moves tokens between ranks (the rank-case runner gives each rank its own token slice)
    communicates = True
    engine_flags = {"vllm": "--all2all-backend deepep_low_latency",
                    "sglang": "--moe-a2a-backend deepep --deepep-mode low_latency"}
    overlaps = True
    #: one row per (token, expert) pair each way: fp8 with 1x128 scales out where the layer is fp8
    #: (use_fp8), the activation dtype back; a buffer of DP_CHUNK tokens per rank per call
    communication = (
        CommOp("dispatch", ("deepep-ll",), "pair", "activations", chunk=DP_CHUNK),
        CommOp("combine", ("deepep-ll",), "pair", "outputs", chunk=DP_CHUNK),
    )
    #: DeepEP-LL quantises inside its dispatch (use_fp8): per-token 1x128 groups, i.e. the
    #: activation side of block scales with bk = 128.
    supported_quant = ("block",)

    @classmethod
    def unavailable_reason(cls, device: str, world_size: int) -> str | None:
        return deep_ep_unavailable_reason(device)

    def __init__(self, group: Any = None, max_tokens_per_rank: int = 128, buffer_tokens: int | None = None):
        """group: ProcessGroup over the EP ranks (None = the default group).
        max_tokens_per_rank: DeepEP's num_max_dispatch_tokens_per_rank (same on every rank).
        buffer_tokens: the tokens per rank the process's buffer is sized for (>= max_tokens_per_rank;
        a sweep passes its largest count so that one buffer serves every case)."""
        if max_tokens_per_rank < 1:
            raise MoebenchError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
        self.group = group
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.buffer_tokens = max(self.max_tokens_per_rank, int(buffer_tokens or 0))
        self._buffer = None
        self._buffer_key: tuple[int, int, int] | None = None

    def default_weight_and_reduce(self) -> TopKWeightAndReduce:
        return TopKWeightAndReduceInCombine()

    def dispatch_tokens(self, world: int) -> int:
        """DeepEP's num_max_dispatch_tokens_per_rank for `world` ranks: max_tokens_per_rank rounded
        up to the next count whose world multiple is a multiple of 4 (DeepEP's low-latency kernels
        copy the per-rank slots 4 at a time and assert it), as a deployment's fixed chunk is."""
        return dispatch_tokens_for(self.max_tokens_per_rank, world)

    def _get_buffer(self, hidden: int, num_experts: int, world: int):
        key = (hidden, num_experts, world)
        if self._buffer is None or self._buffer_key != key:
            reason = _deep_ep_import_error() or (None if torch.cuda.is_available() else "deep_ep needs CUDA")
            if reason is not None:
                raise UnsupportedError(f"deepep-ll is unusable: {reason}")
            import torch.distributed as dist
            from deep_ep import Buffer  # lazy: optional dependency

            if not (dist.is_available() and dist.is_initialized()) or world < 2:
                raise UnsupportedError("deepep-ll needs a process group of >= 2 ranks (DeepEP stops a one-rank "
                                       "buffer); two ranks may share one GPU (sweep --world-size 2)")
            group = self.group if self.group is not None else dist.group.WORLD
            need = Buffer.get_low_latency_rdma_size_hint(self.dispatch_tokens(world), hidden, world, num_experts)
            qps = max(1, num_experts // world)

            def make():
                size = Buffer.get_low_latency_rdma_size_hint(dispatch_tokens_for(self.buffer_tokens, world), hidden,
                                                             world, num_experts)
                return (size, qps), Buffer(group, num_nvl_bytes=0, num_rdma_bytes=max(size, need), low_latency_mode=True,
                                           num_qps_per_rank=qps)

            self._buffer = shared_buffer("low-latency", group, lambda k: k[0] >= need and k[1] == qps, make)
            self._buffer_key = key
        return self._buffer

    def prepare(self, x, topk_weights, topk_ids, num_experts, num_local_experts, expert_map, quant=None) -> PrepareResult:
        """x (M, H) bf16, topk_ids (M, K) -> a (E_local, dispatch_tokens(world) * world, H) bf16,
        expert_num_tokens (E_local,) int32. With block `quant` (bk = 128), DeepEP quantises in
        its dispatch (use_fp8): a fp8, a_scale (E_local, T, H / 128) float32."""
        rank, world = group_rank_world(self.group)
        if x.dtype != torch.bfloat16:
            raise UnsupportedError(f"deepep-ll dispatches bf16 activations, got {x.dtype}")
        use_fp8 = quant is not None
        if use_fp8 and (quant.scheme.scales != "block" or quant.scheme.group_k != 128 or x.shape[-1] % 128):
            raise UnsupportedError(
                f"deepep-ll quantises in 1x128 groups: needs block scales with bk = 128 and hidden % 128 == 0, "
                f"got {quant.scheme.describe()} with hidden {x.shape[-1]}"
            )
        if num_experts % world:
            raise UnsupportedError(
                f"deepep-ll places E / world experts per rank: {num_experts} experts do not split over {world} ranks"
            )
        if num_local_experts != num_experts // world:
            raise MoebenchError(
                f"deepep-ll: rank {rank} holds {num_local_experts} experts, DeepEP expects {num_experts // world}"
            )
        if x.shape[0] > self.max_tokens_per_rank:
            raise MoebenchError(
                f"deepep-ll: rank {rank} dispatches {x.shape[0]} tokens but max_tokens_per_rank is "
                f"{self.max_tokens_per_rank}; raise it to at least {x.shape[0]}"
            )
        buf = self._get_buffer(x.shape[-1], num_experts, world)
        ids = topk_ids.to(torch.int64).contiguous()
        recv_x, recv_count, handle, _event, _hook = buf.low_latency_dispatch(
            x.contiguous(), ids, self.dispatch_tokens(world), num_experts,
            use_fp8=use_fp8, async_finish=False, return_recv_hook=False,
        )
        a_scale = None
        if use_fp8:  # DeepEP returns (fp8 rows, fp32 scales (E_local, T, H / 128))
            recv_x, a_scale = recv_x
        return PrepareResult(
            a=recv_x, topk_ids=None, topk_weights=None, expert_num_tokens=recv_count,
            expert_map=expert_map, num_experts=num_experts, handle=DeepEPHandle(handle, ids),
            a_scale=a_scale, quant=quant.scheme if quant else None, num_tokens=x.shape[0] * world,
            topk=topk_ids.shape[1],
        )

    def finalize(self, out, prep, topk_weights, weight_and_reduce) -> torch.Tensor:
        """out (E_local, max_tokens_per_rank * world, H) bf16 -> (M, H) bf16."""
        if not isinstance(weight_and_reduce, TopKWeightAndReduceInCombine):
            raise UnsupportedError(
                f"deepep-ll weights inside its combine; experts asking for '{weight_and_reduce.name}' "
                f"weight-and-reduce cannot be paired with it"
            )
        h: DeepEPHandle = prep.handle
        _, world = group_rank_world(self.group)
        buf = self._get_buffer(out.shape[-1], prep.num_experts, world)
        combined, _event, _hook = buf.low_latency_combine(
            out.contiguous(), h.topk_ids, topk_weights.to(torch.float32).contiguous(), h.deep_ep_handle,
            async_finish=False, return_recv_hook=False,
        )
        return combined
