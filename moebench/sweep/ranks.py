"""A sweep over real ranks: every rank of a spawned or torchrun run executes `sweep_on_rank` with
the same spec; rank 0 writes the rows.

Inputs per case (identical on every rank, from the seed): for a prepare/finalize that keeps tokens
in place (no-dpep: the TP path) the full batch is the M tokens every rank holds; for one that moves
tokens (the DP path) it is M tokens per rank, M * world in all, each rank owning its slice.
Each rank generates only its own weight shard. The float64 reference of the full batch is the sum
over ranks of each rank's reference on its own shard (TP: partial sums over I; EP: each rank's
experts), so no rank ever holds all the weights.

Ranks sharing a GPU (more ranks than GPUs: a gloo group, `RankContext.ranks_per_gpu` > 1) run the
same cases, checked the same way; their rows carry device `cuda-shared` (a setting of its own,
so a report never ranks them against rows of one GPU per rank), `x_ranks_per_gpu`, and for
measured rows a reason that says so.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist

from moebench.bench import metrics
from moebench.bench.hardware import get_ceilings
from moebench.correctness import relative_error
from moebench.inputs import check_fits
from moebench.kernels.layer import MoELayer
from moebench.backends import make_kernel
from moebench.results import RunStore
from moebench.routing import load_imbalance
from moebench.runtime.distributed import RankContext, all_reduce, is_main
from moebench.runtime.rank_case import rank_inputs, run_inputs
from moebench.sweep.cases import CaseRunner, base_row, batch_inputs, run_cases
from moebench.sweep.layer import fill_metrics, layer_reference, rank_layer, set_comm_gbps, shared_gate
from moebench.sweep.measure import measure


def prepare_finalize_kwargs(cls: type, ctx: RankContext, layout, max_tokens_per_rank: int,
                            buffer_tokens: int | None = None) -> dict[str, Any]:
    """The constructor arguments the prepare/finalize class `cls` takes, from what the run knows
    (buffer_tokens: the run's largest token count, for buffers a process sets up once)."""
    have = {"group": ctx.group if ctx.distributed else None, "layout": layout,
            "max_tokens_per_rank": max(1, max_tokens_per_rank),
            "buffer_tokens": max(1, buffer_tokens or max_tokens_per_rank)}
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in have.items() if k in params}


def _all_reduce(t: torch.Tensor, ctx: RankContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if ctx.distributed and ctx.world_size > 1:
        all_reduce(t, ctx.group, op)
    return t


#: the `device` of rows timed with several ranks on one GPU
SHARED_GPU_DEVICE = "cuda-shared"


def shared_gpu_reason(ranks_per_gpu: int) -> str:
    return (f"{ranks_per_gpu} ranks shared each GPU (gloo group): not a time of one GPU per rank, "
            f"never ranked against one")


class SharedGpuRows:
    """The run folder (a RunStore) of ranks sharing a GPU: every row it takes is marked (device
    SHARED_GPU_DEVICE, extra ranks_per_gpu, measured rows' reason, TP's all-reduce "gloo", which it
    is), and its keys read as the cases they came from (device cuda, all-reduce "nccl"), so a
    resumed run skips them."""

    def __init__(self, store: RunStore, ranks_per_gpu: int):
        self.store = store
        self.ranks_per_gpu = ranks_per_gpu

    def __getattr__(self, name):
        return getattr(self.store, name)

    def keys(self) -> set[tuple]:
        return {(dataclasses.replace(r, device="cuda", allreduce="nccl" if r.allreduce == "gloo" else r.allreduce)
                 if r.device == SHARED_GPU_DEVICE else r).key() for r in self.store.rows}

    def has(self, row_key: tuple) -> bool:
        return row_key in self.keys()

    def add(self, row) -> None:
        mark_shared_gpu(row, self.ranks_per_gpu)
        self.store.add(row)


def mark_shared_gpu(row, ranks_per_gpu: int) -> None:
    row.device = SHARED_GPU_DEVICE
    row.extra["ranks_per_gpu"] = ranks_per_gpu
    if row.allreduce == "nccl":  # the group of ranks sharing a GPU is gloo's
        row.allreduce = "gloo"
    if row.status == "ok":
        row.reason = "; ".join(x for x in (row.reason, shared_gpu_reason(ranks_per_gpu)) if x)


def sweep_on_rank(ctx: RankContext, spec, folder: str, show_progress: bool = True) -> int:
    """Run the sweep's cases on this rank; rank 0 appends rows to the run folder. Returns the
    number of rows written (rank 0) or 0."""
    spec.device = ctx.device.type
    main = is_main(ctx)
    runner = RankRunner(ctx, show_progress)
    store = RunStore(folder, write=main)
    if ctx.shares_gpu:
        store = SharedGpuRows(store, ctx.ranks_per_gpu)
    rows = run_cases(spec, store, runner, on_progress=runner.advance)
    return len(rows) if main else 0


class RankRunner(CaseRunner):
    """Every rank runs the same cases on its own shard, in step (the collectives inside a case
    need every rank); rank 0 writes the rows and shows the progress."""

    def __init__(self, ctx: RankContext, show_progress: bool = True):
        self.ctx = ctx
        self.writes = is_main(ctx)
        self.show_progress = show_progress
        self.progress: _RankProgress | None = None  # made in start, once the cases to run are known

    def done_keys(self, store: RunStore) -> set[tuple]:
        """Rank 0's resumed rows, known to every rank (all skip the same cases)."""
        done = [sorted(store.keys())] if self.writes else [None]
        if self.ctx.distributed and self.ctx.world_size > 1:
            dist.broadcast_object_list(done, src=0, group=self.ctx.group)
        self.done = set(map(tuple, done[0]))
        return self.done

    def start(self, spec, runnable: list[tuple[str, str]]) -> None:
        ctx, s, lay = self.ctx, spec.shape, spec.layout
        self.spec = spec
        self.ceilings = get_ceilings(spec.device) if self.writes else None
        e_local = len(lay.local_experts(ctx.rank, s.num_experts)) if lay.enable_ep else s.num_experts
        check_fits(e_local, s.hidden, lay.intermediate_per_rank(s.intermediate),
                   spec.batch_tokens(max(spec.tokens), True), s.topk, spec.dtype, spec.device)
        # The rank's whole layer (biases, separate shared MLP) as the simulated runner makes it: the
        # shared MLP replicated where tokens move (each EP rank serves its own), sharded over I where
        # they stay (TP: the all-reduce sums it)
        moves = lay.enable_ep and lay.dp > 1
        experts = lay.local_experts(ctx.rank, s.num_experts) if lay.enable_ep else range(s.num_experts)
        tp_rank, tp_size = (0, 1) if lay.enable_ep else (ctx.rank, lay.moe_tp_size)
        self.lw = rank_layer(spec, experts, tp_rank=tp_rank, tp_size=tp_size,
                             shared_shard=(0, 1) if moves else (ctx.rank, lay.world_size))
        self.w13, self.w2 = self.lw.w13, self.lw.w2
        self.emap = lay.expert_map(ctx.rank, s.num_experts)
        # The bar counts and names only the cases that run (not skipped pairs, not resumed rows).
        todo = sum(base_row(spec, m, pf, ex).key() not in self.done for m in spec.tokens for pf, ex in runnable)
        self.progress = _RankProgress(todo, self.writes and self.show_progress)

    def advance(self, row) -> None:
        self.progress.advance(row)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def inputs(self, m: int, pf: str):
        return batch_inputs(self.spec, m, pf)

    def run_case(self, row, m: int, pf: str, ex: str, inputs) -> None:
        ctx, spec = self.ctx, self.spec
        s, lay = spec.shape, spec.layout
        moves_tokens = spec.pf_classes[pf].communicates
        m_full, x_full, wts, ids = inputs
        dev = ctx.device
        row.imbalance = load_imbalance(ids, s.num_experts)
        # A backend that fails to build or launch fails on every rank alike (inputs are identical);
        # a failure on one rank only leaves its peers in a collective, which times out and ends
        # the run with its message.
        kernel = make_kernel(spec.experts_classes[ex], spec.pf_classes[pf],
                             prepare_finalize_kwargs=prepare_finalize_kwargs(spec.pf_classes[pf], ctx, lay, m, max(spec.tokens)))
        inp = rank_inputs(ctx, kernel.prepare_finalize, x_full, self.w13, self.w2, s.num_experts, wts, ids, lay)
        lo, hi = inp.rows
        gate = shared_gate(spec, x_full, m)
        lw = self.lw
        kernel = MoELayer(kernel, spec.activation, lw.bias, lw.shared_w13, lw.shared_w2,
                          None if gate is None else gate[lo:hi].to(dev))
        emap = None if self.emap is None else self.emap.to(dev)
        own = slice(lo, hi)

        def reference(rl):
            # each rank's reference is its partial sum (its experts or shards, its own tokens' shared
            # MLP where tokens move); summed over ranks it is the whole layer
            g = None if gate is None else gate.to(dev)
            args = (x_full.to(dev), rl.w13, rl.w2, wts.to(dev), ids.to(dev), emap, s.num_experts)
            return _all_reduce(layer_reference(rl, args, spec.activation, g, own if moves_tokens else None), ctx)[own]

        def worst_error(out, ref) -> float:
            err = torch.tensor([relative_error(out, ref) if hi > lo else 0.0], dtype=torch.float64, device=dev)
            return float(_all_reduce(err, ctx, dist.ReduceOp.MAX).item())

        timing = spec.timing_kwargs()
        outcome = measure(
            lambda: run_inputs(ctx, kernel, inp).out,
            lambda: run_inputs(ctx, kernel, inp, time_phases=True, **timing),
            dtype=spec.dtype, quant=spec.quant, error=worst_error,
            reference=(lambda: reference(lw)) if spec.check else None,
            unquantized_reference=(lambda: reference(lw.unquantized))
            if spec.check and lw.unquantized is not None else None)
        outcome.fill(row)
        timed = outcome.timing
        ph = timed.phases
        total = ph["total"]
        row.latency_us, row.p10_us, row.p90_us, row.timing_method = (total.median_us, total.p10_us, total.p90_us,
                                                                     total.method)
        for name in ("dispatch", "experts", "combine", "allreduce"):
            if name in ph:
                setattr(row, f"{name}_us", ph[name].median_us)
        row.rank_tokens = ",".join(map(str, inp.tokens_per_rank))
        row.rank_imbalance = timed.load_imbalance
        # this rank's tile config source (every rank looks up the same token count: M' or M_r x world)
        row.config_source = kernel.experts.last_config_source or ""
        row.extra["pairs_per_rank"] = ",".join(map(str, inp.pairs_per_rank))
        # Per-rank averages of the whole layer's work.
        flops = metrics.layer_flops(m_full, s.topk, s.hidden, s.intermediate) / lay.world_size
        nbytes = metrics.layer_bytes(ids, s.num_experts, s.hidden, s.intermediate, spec.act_bytes, m_full,
                                     spec.quant) / lay.world_size
        if self.ceilings is not None:
            fill_metrics(row, flops, nbytes, self.ceilings)
        if moves_tokens:
            set_comm_gbps(row, ids, lay, s.num_experts, s.hidden, spec.act_bytes, spec.quant)


class _RankProgress:
    """A rich progress bar on rank 0 of a multi-rank run (the parent cannot see the rows live)."""

    def __init__(self, total: int, enabled: bool):
        from rich.console import Console

        self.prog = None
        console = Console()
        if enabled and console.is_terminal:  # a log (stdout not a terminal) gets no bar
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
            self.prog.start()
            self.task = self.prog.add_task("sweep", total=total)

    def advance(self, row) -> None:
        if self.prog is not None:
            self.prog.update(self.task, advance=1, description=f"M={row.tokens} {row.prepare_finalize}+{row.experts}")

    def close(self) -> None:
        if self.prog is not None:
            self.prog.stop()
