"""The share of the work one rank gets in a simulated multi-rank run (the busiest EP rank's
tokens and experts). The links and the time of the communication are moebench.comm's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.layout import ParallelLayout



@dataclass
class RankShare:
    """One EP rank's work under a routing.

    rank: the rank; pairs_per_rank: (P,) int64 (token, expert) pairs each rank receives;
    token_index: (M_s,) int64 global ids of the tokens with at least one expert on `rank`;
    topk_ids / topk_weights: (M_s, K) their routing (global ids; pairs elsewhere are remote);
    expert_map: (E,) int32 for `rank`; imbalance: max / mean of pairs_per_rank.
    """

    rank: int
    pairs_per_rank: torch.Tensor
    token_index: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor | None
    expert_map: torch.Tensor | None
    imbalance: float

    @property
    def pairs(self) -> int:
        return int(self.pairs_per_rank[self.rank])


def rank_share(
    topk_ids: torch.Tensor,
    layout: ParallelLayout,
    num_experts: int,
    rank: int,
    topk_weights: torch.Tensor | None = None,
) -> RankShare:
    """The share of `rank`: tokens of the whole batch topk_ids (M, K) that it receives."""
    owner = layout.expert_owner(num_experts).to(topk_ids.device)
    world = layout.ep_size
    dest = owner[topk_ids.long()]  # (M, K)
    per_rank = torch.bincount(dest.reshape(-1).cpu(), minlength=world)
    hit = (dest == rank).any(dim=1)
    idx = torch.nonzero(hit, as_tuple=True)[0]
    mean = float(per_rank.float().mean()) if world else 0.0
    return RankShare(
        rank=rank,
        pairs_per_rank=per_rank,
        token_index=idx,
        topk_ids=topk_ids[idx],
        topk_weights=None if topk_weights is None else topk_weights[idx],
        expert_map=layout.expert_map(rank, num_experts),
        imbalance=float(per_rank.max()) / mean if mean else 1.0,
    )


def busiest_rank_share(
    topk_ids: torch.Tensor, layout: ParallelLayout, num_experts: int, topk_weights: torch.Tensor | None = None
) -> RankShare:
    """The EP rank that receives the most (token, expert) pairs (lowest rank on ties) and its share."""
    owner = layout.expert_owner(num_experts)
    per_rank = torch.bincount(owner[topk_ids.reshape(-1).long().cpu()], minlength=layout.ep_size)
    rank = int(torch.argmax(per_rank))  # first maximum
    return rank_share(topk_ids, layout, num_experts, rank, topk_weights)
