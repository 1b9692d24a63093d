"""A sweep over real ranks: every rank of a spawned or torchrun run executes `sweep_on_rank` with
the same spec; rank 0 writes the rows.

Inputs per case (identical on every rank, from the seed): for a prepare/finalize that keeps tokens
in place (no-dpep: the TP path) the full batch is the M tokens every rank holds; for one that moves
tokens (the DP path) it is M tokens per rank, M * world in all, each rank owning its slice.
Each rank generates only its own weight shard. The float64 reference of the full batch is the sum
over ranks of each rank's reference on its own shard (TP: partial sums over I; EP: each rank's
experts), so no rank ever holds all the weights.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from moebench.bench import metrics
from moebench.bench.hardware import get_ceilings
from moebench.cases import base_row, fill_metrics, one_line, plan
from moebench.correctness import is_correct, relative_error
from moebench.errors import MoebenchError
from moebench.inputs import check_fits, make_tokens, rank_weights
from moebench.kernels.modular import poisoned_outputs
from moebench.kernels.reference import reference_moe
from moebench.kernels.registry import get_prepare_finalize_class, make_kernel
from moebench.results import RunStore
from moebench.routing import load_imbalance, make_routing
from moebench.runtime.distributed import RankContext, is_main
from moebench.runtime.rank_case import rank_inputs, run_inputs


def prepare_finalize_kwargs(name: str, ctx: RankContext, layout, max_tokens_per_rank: int) -> dict[str, Any]:
    """The constructor arguments a prepare/finalize takes, from what the run knows."""
    cls = get_prepare_finalize_class(name)
    have = {"group": ctx.group if ctx.distributed else None, "layout": layout,
            "max_tokens_per_rank": max(1, max_tokens_per_rank)}
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in have.items() if k in params}


def _all_reduce(t: torch.Tensor, ctx: RankContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if ctx.distributed and ctx.world_size > 1:
        dist.all_reduce(t, op=op, group=ctx.group)
    return t


def sweep_on_rank(ctx: RankContext, spec, folder: str, show_progress: bool = True) -> int:
    """Run the sweep's cases on this rank; rank 0 appends rows to the run folder. Returns the
    number of rows written (rank 0) or 0."""
    main = is_main(ctx)
    s, lay = spec.shape, spec.layout
    spec.device = ctx.device.type
    store = RunStore(folder, write=main)
    done = [sorted(store._keys)] if main else [None]
    if ctx.distributed and ctx.world_size > 1:
        dist.broadcast_object_list(done, src=0, group=ctx.group)
    done_keys = set(map(tuple, done[0]))
    pairs = plan(spec)
    ceilings = get_ceilings(spec.device) if main else None
    e_local = len(lay.local_experts(ctx.rank, s.num_experts)) if lay.enable_ep else s.num_experts
    i_local = lay.intermediate_per_rank(s.intermediate)
    check_fits(e_local, s.hidden, i_local, spec.batch_tokens(max(spec.tokens), True), s.topk, spec.dtype, spec.device)
    (w13, w2), unquantized = rank_weights(spec, ctx.rank, keep_unquantized=spec.check)
    emap = lay.expert_map(ctx.rank, s.num_experts)
    el = spec.act_bytes
    # The bar counts and names only the cases that run (not skipped pairs, not resumed rows).
    todo = sum(reason is None and base_row(spec, m, pf, ex).key() not in done_keys
               for m in spec.tokens for pf, ex, reason in pairs)
    progress = _RankProgress(todo, main and show_progress)
    written = 0
    for m in spec.tokens:
        for pf, ex, reason in pairs:
            row = base_row(spec, m, pf, ex)
            if row.key() in done_keys:
                continue
            if reason is None:
                _run_case(ctx, spec, row, pf, ex, m, w13, w2, emap, ceilings, el, fill_metrics, one_line, unquantized)
            else:
                row.status, row.reason = "skipped", reason
            if main:
                store.add(row)
                written += 1
            if reason is None:
                progress.advance(row)
    progress.close()
    return written


def _run_case(ctx, spec, row, pf, ex, m, w13, w2, emap, ceilings, el, fill_metrics, one_line, unquantized=None) -> None:
    s, lay = spec.shape, spec.layout
    moves_tokens = get_prepare_finalize_class(pf).communicates
    m_full = spec.batch_tokens(m, moves_tokens)
    dev = ctx.device
    x_full = make_tokens(m_full, s.hidden, spec.dtype, spec.device, spec.seed + m)
    wts, ids = make_routing(spec.routing, m_full, s.num_experts, s.topk, seed=spec.seed + m, device=spec.device)
    row.imbalance = load_imbalance(ids, s.num_experts)
    try:
        kernel = make_kernel(ex, pf, prepare_finalize_kwargs=prepare_finalize_kwargs(pf, ctx, lay, m))
        inp = rank_inputs(ctx, kernel.prepare_finalize, x_full, w13, w2, s.num_experts, wts, ids, lay)
        with poisoned_outputs(spec.check):
            out = run_inputs(ctx, kernel, inp).out
        timed = run_inputs(ctx, kernel, inp, time_phases=True, warmup=spec.timing_kwargs()["warmup"],
                           reps=spec.timing_kwargs()["reps"])
    except MoebenchError as e:  # raised the same way on every rank (inputs are identical)
        row.status, row.reason = "failed", str(e)
        return
    except Exception as e:  # any backend failure (compile error, out of resources, OOM) becomes a failed row
        # A backend that fails to build or launch fails on every rank alike; a failure on one rank
        # only leaves its peers in a collective, which times out and ends the run with its message.
        row.status, row.reason = "failed", one_line(e)
        return
    if spec.check:
        lo, hi = inp.rows
        refs = [(w13, w2)] + ([unquantized] if unquantized is not None else [])
        errs = []
        for r13, r2 in refs:  # the kernels' weights; then (fp8) the unquantised ones
            ref = reference_moe(x_full.to(dev), r13, r2, wts.to(dev), ids.to(dev), None if emap is None else emap.to(dev))
            ref = _all_reduce(ref, ctx)  # TP: partial sums of the shards
            err = torch.tensor([relative_error(out, ref[lo:hi]) if hi > lo else 0.0], dtype=torch.float64, device=dev)
            errs.append(float(_all_reduce(err, ctx, dist.ReduceOp.MAX).item()))
        row.max_rel_err = errs[0]
        row.correct = is_correct(row.max_rel_err, spec.dtype, spec.quant)
        if len(errs) > 1:
            row.err_vs_unquantized = errs[1]
    ph = timed.phases
    total = ph["total"]
    row.latency_us, row.p10_us, row.p90_us, row.timing_method = total.median_us, total.p10_us, total.p90_us, total.method
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
    nbytes = metrics.layer_bytes(ids, s.num_experts, s.hidden, s.intermediate, el, m_full, spec.quant) / lay.world_size
    if ceilings is not None:
        fill_metrics(row, flops, nbytes, ceilings)
    if moves_tokens:
        set_comm_gbps(row, ids, s.hidden, el, lay.world_size, spec.quant)


def set_comm_gbps(row, ids_full: torch.Tensor, hidden: int, el: int, world: int, quant=None) -> None:
    """Dispatch / combine GB/s per rank, counting bytes per (token, expert) pair as DeepEP does
    (fp8 dispatch: payload + scales + header; combine sends the activation dtype)."""
    per_rank = {
        "dispatch": metrics.dispatch_bytes(ids_full, hidden, fp8=quant is not None and not quant.weight_only, dtype_bytes=el) / world,
        "combine": metrics.dispatch_bytes(ids_full, hidden, dtype_bytes=el) / world,
    }
    for name in ("dispatch", "combine"):
        us = getattr(row, f"{name}_us")
        row.extra[f"{name}_gbps"] = per_rank[name] / (us * 1e3) if us else None


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
