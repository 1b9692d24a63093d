"""One MoE case on every rank of a multi-rank run: what the sweep calls inside each rank.

Every rank is handed the same full tensors (same seed); each rank takes its own part:

- TP path (a prepare/finalize that does not communicate: no-dpep, batched-local): every rank
  computes every token with its weight shard (ParallelLayout.shard_weights: 1/T of I for TP, its
  whole experts for EP without all2all), then the partial outputs are all-reduced. Needs dp == 1.
  This rank's output rows: all M tokens.
- DP path (a prepare/finalize that moves tokens: allgather-rs, all2all-ll, deepep-ll): every rank
  owns a contiguous slice of the M tokens (remainder to the first ranks, so a rank may own none)
  and its weight shard; the prepare/finalize moves the tokens. Output rows: that slice.

`run_rank_case` returns the output for this rank's rows (to compare with the reference of the same
rows) and, when asked, per-phase times measured between barriers: dispatch / experts / combine on
the DP path, experts / allreduce on the TP path, plus the whole layer without inner barriers.
Each sample is the slowest rank's time (max over ranks), so every rank gets the same figures.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from moebench.bench.timing import Timing, summarize
from moebench.errors import MoebenchError
from moebench.kernels.modular import FusedMoEKernel, PrepareAndFinalize
from moebench.layout import ParallelLayout, token_split
from moebench.runtime.distributed import RankContext, all_reduce, barrier


def communicates(pf: PrepareAndFinalize) -> bool:
    """True when the prepare/finalize moves tokens between ranks (DP path)."""
    return bool(getattr(type(pf), "communicates", False))


@dataclass
class RankInputs:
    """This rank's share of a case.

    x (M_r, H), topk_weights (M_r, K), topk_ids (M_r, K); w13 (E_local, 2I', H), w2 (E_local, H, I');
    expert_map (E,) or None; rows: [start, stop) of x in the full batch; all_reduce: TP path.
    """

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    expert_map: torch.Tensor | None
    num_experts: int
    rows: tuple[int, int]
    tokens_per_rank: list[int]
    pairs_per_rank: list[int]
    all_reduce: bool


def pairs_per_rank(topk_ids_full: torch.Tensor, layout: ParallelLayout, num_experts: int) -> list[int]:
    """(token, expert) pairs each rank's experts compute for the whole batch topk_ids_full (M, K):
    by expert owner with EP; every pair on every rank for TP (each rank holds a shard of all)."""
    ids = topk_ids_full.reshape(-1).long().cpu()
    ids = ids[ids >= 0]
    if not layout.enable_ep:
        return [int(ids.numel())] * layout.world_size
    owner = layout.expert_owner(num_experts)
    return [int(c) for c in torch.bincount(owner[ids], minlength=layout.ep_size).tolist()]


def rank_inputs(
    ctx: RankContext,
    pf: PrepareAndFinalize,
    x_full: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    num_experts: int,
    topk_weights_full: torch.Tensor,
    topk_ids_full: torch.Tensor,
    layout: ParallelLayout,
) -> RankInputs:
    """This rank's share of a case: x_full and topk_* (M, K) are identical on every rank; w13
    (E_local, 2I', H) and w2 (E_local, H, I') are already this rank's shard; see module doc."""
    if layout.world_size != ctx.world_size:
        raise MoebenchError(
            f"the layout has {layout.world_size} ranks (dp {layout.dp} x tp {layout.tp}) but the run has {ctx.world_size}"
        )
    m = x_full.shape[0]
    dev = ctx.device
    emap = layout.expert_map(ctx.rank, num_experts)
    if communicates(pf):
        if pf.needs_expert_parallel and not layout.enable_ep and ctx.world_size > 1:
            raise MoebenchError(f"prepare/finalize '{pf.name}' needs expert parallelism (--ep)")
        split = token_split(m, ctx.world_size)
        rows = split[ctx.rank]
        all_reduce = False
    else:
        if layout.dp > 1:
            raise MoebenchError(
                f"prepare/finalize '{pf.name}' keeps tokens where they are, so dp {layout.dp} > 1 needs a "
                f"token exchange: use allgather-rs or all2all-ll"
            )
        split = [(0, m)] * ctx.world_size
        rows = (0, m)
        all_reduce = ctx.world_size > 1
    lo, hi = rows
    return RankInputs(
        x=x_full[lo:hi].to(dev),
        topk_weights=topk_weights_full[lo:hi].to(dev),
        topk_ids=topk_ids_full[lo:hi].to(dev),
        w13=w13.to(dev),
        w2=w2.to(dev),
        expert_map=None if emap is None else emap.to(dev),
        num_experts=num_experts,
        rows=rows,
        tokens_per_rank=[b - a for a, b in split],
        pairs_per_rank=pairs_per_rank(topk_ids_full, layout, num_experts),
        all_reduce=all_reduce,
    )


# ---------------------------------------------------------------------------------------------
# Timing


class PhaseTimer:
    """Times whole-layer runs and their phases: a barrier before each run (`run()`), then a mark
    at the end of each phase on this rank (CUDA events; wall clock on a CPU) and none between
    them, so a run's phases add up to its time on that rank.

    `summarise` (a collective: every rank calls it) takes per run the rank that took longest (the
    run's latency is its time) and returns "total" over the runs and, per phase, that rank's time:
    the medians are those of the median run, so the phases add up to the total they break down.
    """

    def __init__(self, ctx: RankContext, enabled: bool = True):
        self.ctx = ctx
        self.enabled = enabled
        self.runs: list[tuple[dict[str, float], float]] = []
        self._marks: list[tuple[str, object]] | None = None
        self.cuda = ctx.device.type == "cuda"

    @property
    def method(self) -> str:
        return "cuda-events" if self.cuda else "cpu-wallclock"

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _us(self, a, b) -> float:
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6

    @contextmanager
    def run(self) -> Iterator[None]:
        """One timed run of the whole layer (its phases marked inside by `phase`)."""
        if not self.enabled:
            yield
            return
        barrier(self.ctx)
        self._marks = [("", self._mark())]
        yield
        end = self._mark()
        if self.cuda:
            end.synchronize()
        phases, prev = {}, self._marks[0][1]
        for name, m in self._marks[1:]:  # a phase entered twice (the shared MLP: "experts") adds up
            phases[name] = phases.get(name, 0.0) + self._us(prev, m)
            prev = m
        self.runs.append((phases, self._us(self._marks[0][1], end)))
        self._marks = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield
        if self._marks is not None:
            self._marks.append((name, self._mark()))

    def summarise(self) -> dict[str, Timing]:
        """{phase: Timing, "total": Timing} over the runs, each run's slowest rank. Collective."""
        if not self.runs:
            return {}
        names = list(self.runs[0][0])
        t = torch.tensor([[ph[n] for n in names] + [total] for ph, total in self.runs], dtype=torch.float64)
        if self.ctx.distributed and self.ctx.world_size > 1:
            dev = self.ctx.device if self.ctx.backend == "nccl" else torch.device("cpu")
            parts = [torch.empty_like(t, device=dev) for _ in range(self.ctx.world_size)]
            dist.all_gather(parts, t.to(dev), group=self.ctx.group)
            ranks = torch.stack([p.cpu() for p in parts])  # (world, runs, phases + 1)
            slowest = ranks[:, :, -1].argmax(dim=0)  # per run, the rank that took longest
            t = ranks[slowest, torch.arange(t.shape[0])]
        order = sorted(range(t.shape[0]), key=lambda i: float(t[i, -1]))
        mid = order[(len(order) - 1) // 2]  # the median run (an actual run: its parts add up)
        out = {}
        for j, n in enumerate(names + ["total"]):
            col = t[:, j].tolist()
            q = summarize(col, self.method)
            out[n] = Timing(col[mid], q.p10_us, q.p90_us, q.reps, q.method)
        return out


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class RankCaseResult:
    """out (M_r, H): this rank's output rows; rows: [start, stop) in the full batch;
    tokens_per_rank: M_r of every rank (DP path) or M everywhere (TP path);
    pairs_per_rank: (token, expert) pairs each rank's experts compute (the expert load);
    phases: {phase: Timing} of the runs' slowest rank, with "total" the whole layer (PhaseTimer)."""

    out: torch.Tensor
    rows: tuple[int, int]
    tokens_per_rank: list[int]
    pairs_per_rank: list[int]
    phases: dict[str, Timing] = field(default_factory=dict)

    @property
    def token_imbalance(self) -> float:
        """max / mean of the tokens each rank starts with (1.0 = even)."""
        return _imbalance(self.tokens_per_rank)

    @property
    def load_imbalance(self) -> float:
        """max / mean of the (token, expert) pairs each rank computes (1.0 = even)."""
        return _imbalance(self.pairs_per_rank)


def _imbalance(n: list[int]) -> float:
    mean = sum(n) / len(n) if n else 0.0
    return max(n) / mean if mean else 1.0


def _layer(kernel: FusedMoEKernel, inp: RankInputs, ctx: RankContext, timer: PhaseTimer) -> torch.Tensor:
    """The kernel's apply with its phases under `timer` (FusedMoEKernel.apply's hook); on the TP
    path, where nothing is dispatched, the whole apply is "experts", then the all-reduce."""
    args = (inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, inp.expert_map, inp.num_experts)
    if inp.all_reduce:
        with timer.phase("experts"):
            y = kernel.apply(*args)
        with timer.phase("allreduce"):
            y = _all_reduce(y.contiguous(), ctx)
        return y
    return kernel.apply(*args, phases=timer)


def _all_reduce(y: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    if not (ctx.distributed and ctx.world_size > 1):
        return y
    if ctx.backend == "gloo" and y.dtype in (torch.float16, torch.bfloat16):
        # gloo's half-precision sums are not dependable across versions: sum in fp32
        return all_reduce(y.float(), ctx.group).to(y.dtype)
    return all_reduce(y, ctx.group)


def run_rank_case(
    ctx: RankContext,
    kernel: FusedMoEKernel,
    x_full: torch.Tensor,
    w13_full: torch.Tensor,
    w2_full: torch.Tensor,
    topk_weights_full: torch.Tensor,
    topk_ids_full: torch.Tensor,
    layout: ParallelLayout,
    *,
    time_phases: bool = False,
    warmup: int = 1,
    reps: int = 5,
) -> RankCaseResult:
    """Run one case on this rank (every rank of the run must call it with the same arguments).

    x_full (M, H), w13_full (E, 2I, H), w2_full (E, H, I), topk_* (M, K): identical on all ranks.
    The kernel's prepare/finalize must use the run's group. Returns this rank's output rows
    (compare with reference rows `result.rows` of the full batch); with time_phases, also
    `warmup` untimed and `reps` timed runs: "total" (the whole layer, after a barrier) and the
    phases of the same runs (PhaseTimer). All timing is collective; the figures are the same on
    every rank.
    """
    layout.validate_shape(w13_full.shape[0], w2_full.shape[-1])
    w13, w2 = layout.shard_weights(w13_full, w2_full, ctx.rank)
    inp = rank_inputs(ctx, kernel.prepare_finalize, x_full, w13, w2, w13_full.shape[0], topk_weights_full,
                      topk_ids_full, layout)
    return run_inputs(ctx, kernel, inp, time_phases=time_phases, warmup=warmup, reps=reps)


def run_inputs(
    ctx: RankContext, kernel: FusedMoEKernel, inp: RankInputs, *, time_phases: bool = False, warmup: int = 1,
    reps: int = 5,
) -> RankCaseResult:
    """`run_rank_case` on inputs already sliced and sharded for this rank (see `rank_inputs`)."""
    off = PhaseTimer(ctx, enabled=False)
    out = _layer(kernel, inp, ctx, off)
    result = RankCaseResult(
        out=out, rows=inp.rows, tokens_per_rank=inp.tokens_per_rank, pairs_per_rank=inp.pairs_per_rank
    )
    if not time_phases:
        return result
    for _ in range(warmup):
        _layer(kernel, inp, ctx, off)
    timer = PhaseTimer(ctx)
    for _ in range(reps):
        with timer.run():
            _layer(kernel, inp, ctx, timer)
    result.phases = timer.summarise()
    return result
