"""Parallel layout of the MoE layer: which rank holds which weights, and how tokens travel.

Rules (as vLLM's FusedMoEParallelConfig):
- world = dp * tp ranks.
- Without expert parallelism the MoE layer is tensor-parallel over all world ranks:
  moe_tp = world, every rank holds all E experts, w13 column-sharded (its slice of gate and its
  slice of up), w2 row-sharded; partial outputs are all-reduced.
- With expert parallelism ep = world and moe_tp = 1: each rank holds E/ep whole experts (linear
  placement, the remainder to the first ranks) and an expert_map (E,) global -> local id or -1.
- use_all2all = dp > 1 and expert parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.errors import MoebenchError


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    dp: int = 1
    enable_ep: bool = False
    #: with expert parallelism, ranks sharing each expert's intermediate size (TensorRT-LLM's
    #: moe_tp_size under --ep_size): ep = world / expert_tp. Simulated runs only.
    expert_tp: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.expert_tp, int) or self.expert_tp < 1 or self.world_size % self.expert_tp \
                or (self.expert_tp > 1 and not self.enable_ep):
            raise MoebenchError(f"expert TP {self.expert_tp!r} must divide the world {self.world_size} under EP")
        for name in ("tp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise MoebenchError(f"--{name} must be a positive integer, got {v!r}")

    # -- construction from CLI numbers ----------------------------------------------------------
    @classmethod
    def from_args(cls, tp: int | None, dp: int | None, ep: int | None, world_size: int | None = None) -> "ParallelLayout":
        """Build from --tp/--dp/--ep/--world-size, explaining which numbers disagree.

        --ep N: expert parallelism over N ranks; N must equal dp * tp (given --ep alone, dp = N / tp).
        --tp N alone: tensor-parallel MoE over N ranks.
        """
        for name, v in (("tp", tp), ("dp", dp), ("ep", ep), ("world-size", world_size)):
            if v is not None and v < 1:
                raise MoebenchError(f"--{name} must be a positive integer, got {v}")
        tp_ = tp or 1
        if ep is not None:
            if dp is None:
                if ep % tp_:
                    raise MoebenchError(f"--ep {ep} is not a multiple of --tp {tp_}: ep must equal dp * tp")
                dp = ep // tp_
            if dp * tp_ != ep:
                raise MoebenchError(f"--ep {ep} must equal --dp {dp} x --tp {tp_} = {dp * tp_}")
            layout = cls(tp=tp_, dp=dp, enable_ep=ep > 1)
        else:
            layout = cls(tp=tp_, dp=dp or 1, enable_ep=False)
        if world_size is not None and world_size != layout.world_size:
            raise MoebenchError(
                f"--world-size {world_size} does not match the layout: dp {layout.dp} x tp {layout.tp} "
                f"= {layout.world_size} ranks"
            )
        return layout

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def ep_size(self) -> int:
        return self.world_size // self.expert_tp if self.enable_ep else 1

    @property
    def moe_tp_size(self) -> int:
        return self.expert_tp if self.enable_ep else self.world_size

    @property
    def use_all2all(self) -> bool:
        return self.dp > 1 and self.enable_ep

    def describe(self) -> str:
        if self.enable_ep:
            inner = f", experts TP{self.expert_tp}" if self.expert_tp > 1 else ""
            return f"EP{self.ep_size} (dp {self.dp} x tp {self.tp}{inner})"
        if self.world_size == 1:
            return "single rank"
        return f"TP{self.moe_tp_size}" + (f" (dp {self.dp} x tp {self.tp})" if self.dp > 1 else "")

    def validate_shape(self, num_experts: int, intermediate: int) -> None:
        """Raise MoebenchError when the shape cannot be split this way."""
        if self.enable_ep and self.ep_size > num_experts:
            raise MoebenchError(
                f"ep {self.ep_size} is larger than the number of experts {num_experts}: "
                f"every EP rank needs at least one expert; use --ep <= {num_experts}"
            )
        t = self.moe_tp_size
        if intermediate % t:
            raise MoebenchError(
                f"tp {t} does not divide the intermediate size {intermediate}: pick a tp that divides it"
            )

    # -- expert placement -----------------------------------------------------------------------
    def local_experts(self, rank: int, num_experts: int) -> range:
        """Global ids of the experts on `rank` (linear placement, remainder to the first ranks)."""
        p = self.ep_size
        base, rem = divmod(num_experts, p)
        start = rank * base + min(rank, rem)
        return range(start, start + base + (1 if rank < rem else 0))

    def expert_owner(self, num_experts: int) -> torch.Tensor:
        """(E,) int64: the rank that owns each global expert."""
        owner = torch.empty(num_experts, dtype=torch.int64)
        for r in range(self.ep_size):
            owner[list(self.local_experts(r, num_experts))] = r
        return owner

    def expert_map(self, rank: int, num_experts: int) -> torch.Tensor | None:
        """(E,) int32: global expert id -> local id on `rank`, -1 when remote. None without EP."""
        if not self.enable_ep:
            return None
        m = torch.full((num_experts,), -1, dtype=torch.int32)
        local = self.local_experts(rank, num_experts)
        m[local.start : local.stop] = torch.arange(len(local), dtype=torch.int32)
        return m

    # -- weight shards --------------------------------------------------------------------------
    def intermediate_per_rank(self, intermediate: int) -> int:
        return intermediate // self.moe_tp_size

    def shard_weights(self, w13: torch.Tensor, w2: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full w13 (E, 2I, H), w2 (E, H, I) -> this rank's (E_local, 2I', H), (E_local, H, I').

        TP: w13 keeps rows [r*I', (r+1)*I') of gate and the same rows of up; w2 keeps columns
        [r*I', (r+1)*I'). EP: whole experts of this rank.
        """
        e, two_i, _ = w13.shape
        if self.expert_tp > 1:
            raise MoebenchError("experts split by expert and within each expert run simulated only (--simulate)")
        if self.enable_ep:
            local = self.local_experts(rank, e)
            return w13[local.start : local.stop].contiguous(), w2[local.start : local.stop].contiguous()
        t = self.moe_tp_size
        if t == 1:
            return w13, w2
        if not isinstance(w13, torch.Tensor):
            raise MoebenchError("TP shards of quantised weights are quantised per shard: build them with "
                                "moebench.inputs.make_weights(..., tp_rank=r, tp_size=t, quant=scheme)")
        inter = two_i // 2
        ip = inter // t
        lo, hi = rank * ip, (rank + 1) * ip
        w13_r = torch.cat([w13[:, lo:hi], w13[:, inter + lo : inter + hi]], dim=1).contiguous()
        w2_r = w2[:, :, lo:hi].contiguous()
        return w13_r, w2_r


def token_split(num_tokens: int, world: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) token ranges of each rank; the remainder goes to the first ranks."""
    base, rem = divmod(num_tokens, world)
    out, start = [], 0
    for r in range(world):
        n = base + (1 if r < rem else 0)
        out.append((start, start + n))
        start += n
    return out
