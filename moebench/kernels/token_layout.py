"""Index bookkeeping shared by backends: global -> local expert ids, sorting (token, k) pairs by
expert, and slots in the batched (E_local, T, H) layout. All on the device, no host sync, so the
callers stay CUDA-graph capturable."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def local_topk_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """topk_ids (M, K) global ids -> (M, K) int64 local ids, -1 where the expert is remote."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    return expert_map.to(ids.device).long()[ids]


@dataclass
class ExpertSort:
    """(token, k) pairs ordered by local expert; remote pairs (id -1) sort last.

    order:  (M*K,) int64 flat (token * K + k) index of each sorted pair
    counts: (E_local,) int64 pairs per local expert
    offsets:(E_local,) int64 end of each expert's run in the sorted order (cumsum of counts)
    pos:    (M*K,) int64 for each flat pair, its index inside its expert's run (garbage if remote)
    """

    order: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    pos: torch.Tensor


def sort_by_expert(local_ids: torch.Tensor, num_local: int) -> ExpertSort:
    """local_ids (M, K) with -1 for remote -> ExpertSort."""
    flat = local_ids.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_local))
    order = torch.argsort(key, stable=True)
    # scatter_add into a fixed-size buffer: unlike bincount it needs no host sync (graph-capturable)
    counts_all = torch.zeros(num_local + 1, dtype=torch.int64, device=flat.device)
    counts_all.scatter_add_(0, key, torch.ones_like(key))
    counts = counts_all[:num_local]
    starts = torch.cumsum(counts_all, 0) - counts_all
    pos_sorted = torch.arange(flat.numel(), device=flat.device) - starts[key[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    return ExpertSort(order=order, counts=counts, offsets=torch.cumsum(counts, 0), pos=pos)


def batched_slots(local_ids: torch.Tensor, num_local: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the batched layout (E_local, max_tokens, H).

    Returns slot_map (M, K) int64 = e * max_tokens + position, -1 for remote pairs, and
    expert_num_tokens (E_local,) int32.
    """
    s = sort_by_expert(local_ids, num_local)
    flat = local_ids.reshape(-1)
    slot = torch.where(flat >= 0, flat * max_tokens + s.pos, torch.full_like(flat, -1))
    return slot.reshape(local_ids.shape), s.counts.to(torch.int32)


def scatter_to_batched(
    x: torch.Tensor, slot_map: torch.Tensor, num_local: int, max_tokens: int
) -> torch.Tensor:
    """x (M, H) and slot_map (M, K) -> (E_local, max_tokens, H); rows past each count are garbage.
    Any dtype: fp8 rows move as bytes (index_copy has no fp8 kernel on every device)."""
    if x.element_size() == 1 and x.dtype != torch.uint8:
        return scatter_to_batched(x.view(torch.uint8), slot_map, num_local, max_tokens).view(x.dtype)
    m, k = slot_map.shape
    h = x.shape[-1]
    rows = num_local * max_tokens
    buf = torch.empty((rows + 1, h), dtype=x.dtype, device=x.device)  # last row: sink for remote pairs
    dest = torch.where(slot_map >= 0, slot_map, torch.full_like(slot_map, rows)).reshape(-1)
    buf.index_copy_(0, dest, x.repeat_interleave(k, dim=0))
    return buf[:rows].view(num_local, max_tokens, h)
