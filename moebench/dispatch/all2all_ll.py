"""`all2all-ll`: moebench's own low-latency dispatch/combine in the DeepEP low-latency layout,
over `torch.distributed.all_to_all_single` (gloo on CPU, NCCL on GPU). BatchedExperts format.

Dispatch (per (token, expert) pair, like DeepEP LL: a token that picks two experts of one rank
travels twice):
    1. owner[topk_ids] gives each pair's destination rank; pairs are sorted by destination.
    2. split sizes are exchanged (all_to_all_single of one count per rank), then the pairs' rows
       and their local expert ids travel with uneven splits.
    3. the receiver scatters them into a (E_local, max_tokens_per_rank * world, H) buffer, packed
       per expert (the first expert_num_tokens[e] rows of expert e are valid).
Combine: each received pair's output row goes back along the reverse path; on the source rank the
rows are put back in (token, k) order and the router weights are applied and summed over k there
(`default_weight_and_reduce` = contiguous weight-and-reduce after the return trip).

Expert placement is linear (ParallelLayout.local_experts with ep = world). The counts exchange
syncs with the host, so this path is not CUDA-graph capturable (DeepEP's kernels are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moebench.errors import MoebenchError, UnsupportedError
from moebench.comm import CommOp
from moebench.kernels.act_quant import maybe_quantize
from moebench.kernels.modular import (
    ActivationFormat,
    PrepareAndFinalize,
    PrepareResult,
    TopKWeightAndReduce,
    TopKWeightAndReduceBatched,
    TopKWeightAndReduceContiguous,
)
from moebench.kernels.token_layout import batched_slots
from moebench.kernels.triton.batched_layout import batched_rows
from moebench.quant import pack_rows, unpack_rows
from moebench.layout import ParallelLayout
from moebench.runtime.distributed import all_to_all_single, group_rank_world


@dataclass
class All2AllHandle:
    """State between dispatch and combine.

    order:       (M*K,) int64 flat (token * K + k) index of each sent pair, sorted by destination
    send_counts: pairs sent to each rank (host ints, world)
    recv_counts: pairs received from each rank (host ints, world)
    recv_slots:  (R,) int64 flat row (e * T + t) of each received pair in the batched buffer
    num_tokens, topk: M and K of the source side
    """

    order: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    recv_slots: torch.Tensor
    num_tokens: int
    topk: int


class AllToAllLLPrepareAndFinalize(PrepareAndFinalize):
    name = "all2all-ll"
    activation_format = ActivationFormat.BATCHED
    min_world_size = 1
    needs_expert_parallel = True
    #: moves tokens between ranks (the rank-case runner gives each rank its own token slice)
    communicates = True
    #: dispatch: counts, then the pairs' rows, then their local expert ids (int64): three
    #: all_to_all_single calls; combine: the rows back in one
    communication = (
        CommOp("dispatch", ("nccl-all-to-all",), "pair", "activations", calls=3, row_extra=8),
        CommOp("combine", ("nccl-all-to-all",), "pair", "outputs"),
    )

    def __init__(self, group: Any = None, max_tokens_per_rank: int = 256, layout: ParallelLayout | None = None):
        """group: ProcessGroup over the EP ranks (None = default group).
        max_tokens_per_rank: static bound on tokens any rank dispatches per call, as DeepEP's
        num_max_dispatch_tokens_per_rank; the receive buffer is (E_local, max * world, H).
        layout: where experts live; None = linear placement over the group's ranks."""
        if max_tokens_per_rank < 1:
            raise MoebenchError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
        self.group = group
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.layout = layout
        self._owner_cache: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def default_weight_and_reduce(self) -> TopKWeightAndReduce:
        # Combine returns each pair's unweighted row to its source rank as (M, K, H); the router
        # weights are applied and summed over k there.
        return TopKWeightAndReduceContiguous()

    def _placement(self, num_experts: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """owner (E,) int64 rank of each expert; first (world,) int64 first global expert of each rank."""
        key = (num_experts, world, str(device))
        if key not in self._owner_cache:
            layout = self.layout or ParallelLayout(dp=world, enable_ep=world > 1)
            if layout.ep_size != world:
                raise MoebenchError(
                    f"all2all-ll: the layout has {layout.ep_size} EP ranks but the group has {world}"
                )
            owner = layout.expert_owner(num_experts)
            first = torch.tensor([layout.local_experts(r, num_experts).start for r in range(world)], dtype=torch.int64)
            self._owner_cache[key] = (owner.to(device), first.to(device))
        return self._owner_cache[key]

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def prepare(self, x, topk_weights, topk_ids, num_experts, num_local_experts, expert_map, quant=None) -> PrepareResult:
        """x (M, H), topk_ids (M, K) global ids -> a (E_local, max_tokens_per_rank * world, H),
        expert_num_tokens (E_local,) int32. With `quant`, x is quantised before dispatch and each
        message is one byte row, fp8 payload then scales (as DeepEP-LL sends fp8); a is then fp8
        with a_scale (E_local, T, G)."""
        rank, world = group_rank_world(self.group)
        m, k = topk_ids.shape
        hidden = x.shape[-1]
        if m > self.max_tokens_per_rank:
            raise MoebenchError(
                f"all2all-ll: rank {rank} dispatches {m} tokens but max_tokens_per_rank is "
                f"{self.max_tokens_per_rank}; raise max_tokens_per_rank to at least {m}"
            )
        owner, first = self._placement(num_experts, world, x.device)
        n_local = int((owner == rank).sum())
        if n_local != num_local_experts:
            raise MoebenchError(
                f"all2all-ll: rank {rank} owns {n_local} of {num_experts} experts under linear placement "
                f"but was given weights for {num_local_experts}"
            )
        ids = topk_ids.reshape(-1).long()
        dest = owner[ids]  # (M*K,)
        order = torch.argsort(dest, stable=True)
        send_counts_t = torch.bincount(dest, minlength=world)
        q, scale = maybe_quantize(x, quant)
        rows_in = q if quant is None else pack_rows(q, scale)  # (M, H) or (M, H + 4G) uint8
        send_x = rows_in.index_select(0, order // k) if m else rows_in.new_empty((0, rows_in.shape[-1]))
        send_local = ids[order] - first[dest[order]]  # local expert id on the destination rank

        if world == 1:
            recv_counts = [m * k]
            send_counts = recv_counts
            recv_x, recv_local = send_x, send_local
        else:
            recv_counts_t = torch.empty_like(send_counts_t)
            self._a2a(recv_counts_t, send_counts_t, [1] * world, [1] * world)
            send_counts = [int(c) for c in send_counts_t.tolist()]
            recv_counts = [int(c) for c in recv_counts_t.tolist()]
            n_recv = sum(recv_counts)
            recv_x = send_x.new_empty((n_recv, send_x.shape[-1]))
            self._a2a(recv_x, send_x.contiguous(), recv_counts, send_counts)
            recv_local = torch.empty(n_recv, dtype=torch.int64, device=x.device)
            self._a2a(recv_local, send_local.contiguous(), recv_counts, send_counts)

        cap = self.max_tokens_per_rank * world  # one expert gets a token at most once per source rank
        slot_map, expert_num_tokens = batched_slots(recv_local.view(-1, 1), num_local_experts, cap)
        a_scale = None
        if quant is not None:
            recv_x, recv_scale = unpack_rows(recv_x, hidden)
            a_scale = batched_rows(recv_scale, slot_map, num_local_experts, cap)
        a = batched_rows(recv_x, slot_map, num_local_experts, cap)
        handle = All2AllHandle(
            order=order, send_counts=send_counts, recv_counts=recv_counts,
            recv_slots=slot_map.view(-1), num_tokens=m, topk=k,
        )
        return PrepareResult(
            a=a, topk_ids=None, topk_weights=None, expert_num_tokens=expert_num_tokens,
            expert_map=expert_map, num_experts=num_experts, handle=handle, a_scale=a_scale, quant=quant.scheme if quant else None,
            num_tokens=m * world, topk=k,
        )

    def finalize(self, out, prep, topk_weights, weight_and_reduce) -> torch.Tensor:
        """out (E_local, T, H) unweighted expert outputs -> combine -> (M, H) weighted sum over k."""
        h: All2AllHandle = prep.handle
        e_local, cap, hidden = out.shape
        rows = out.reshape(e_local * cap, hidden).index_select(0, h.recv_slots)  # (R, H) received order
        if len(h.send_counts) == 1:  # one rank: nothing travels
            back = rows
        else:
            back = rows.new_empty((sum(h.send_counts), hidden))
            self._a2a(back, rows.contiguous(), h.send_counts, h.recv_counts)
        pairs = back.new_empty((h.num_tokens * h.topk, hidden))
        pairs[h.order] = back
        pairs = pairs.view(h.num_tokens, h.topk, hidden)
        if isinstance(weight_and_reduce, TopKWeightAndReduceContiguous):
            return weight_and_reduce.apply(pairs, topk_weights, None)
        if isinstance(weight_and_reduce, TopKWeightAndReduceBatched):
            slot_map = torch.arange(h.num_tokens * h.topk, device=pairs.device).view(h.num_tokens, h.topk)
            return weight_and_reduce.apply(pairs.view(1, -1, hidden), topk_weights, slot_map)
        raise UnsupportedError(
            f"all2all-ll combines unweighted per-expert rows; experts asking for "
            f"'{weight_and_reduce.name}' weight-and-reduce cannot be used with it"
        )
