"""Enumerate prepare/finalize x experts combinations for a shape and layout, check each against
the float64 reference, time it, and collect one ResultRow per (tokens, combination)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from moebench.bench import metrics
from moebench.bench.hardware import get_ceilings
from moebench.bench.timing import time_fn
from moebench.correctness import is_correct, relative_error
from moebench.errors import MoebenchError
from moebench.inputs import check_fits, dtype_name, make_tokens, rank_weights
from moebench.kernels.modular import poisoned_outputs
from moebench.kernels.reference import reference_moe
from moebench.kernels.registry import (
    check_combination,
    experts_names,
    get_experts_class,
    get_prepare_finalize_class,
    make_kernel,
    prepare_finalize_names,
)
from moebench.layout import ParallelLayout
from moebench.models import MoEShape
from moebench.quant import QuantScheme, precision_text
from moebench.results import ResultRow, RunStore
from moebench.routing import load_imbalance, make_routing

@dataclass
class SweepSpec:
    shape: MoEShape
    tokens: list[int]
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    experts: list[str] = field(default_factory=lambda: default_experts())
    prepare_finalize: list[str] = field(default_factory=lambda: prepare_finalize_names())
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    routing: str = "uniform"
    seed: int = 0
    check: bool = True
    warmup: int | None = None
    reps: int | None = None
    #: Distinct routings the timed calls cycle through (1 = the checked routing every call). With
    #: N > 1 every CUDA-graph replay runs N different routings, as vLLM's tuner does, so hot
    #: experts' weights do not stay in L2 from one call to the next.
    routings: int = 1
    #: False: `tokens` are per rank (a DP rank brings M tokens, M * world in all). True: `tokens`
    #: are the whole batch, split over the DP ranks (how tp-vs-ep compares equal work).
    tokens_are_global: bool = False
    #: fp8 scheme (weights and activations quantised; `dtype` is then the activation and output
    #: dtype); None = unquantised.
    quant: QuantScheme | None = None

    @property
    def dtype_label(self) -> str:
        """The `dtype` column: 'fp8_w8a8' for quantised runs, else 'bf16' / 'fp16' / 'fp32'."""
        return self.quant.name if self.quant is not None else dtype_name(self.dtype)

    @property
    def quant_label(self) -> str:
        """The `quant` column: 'per-tensor', 'per-token', 'block[128,128]' or ''."""
        return self.quant.scales_label if self.quant is not None else ""

    @property
    def precision(self) -> str:
        """'bf16', or 'fp8_w8a8 block[128,128] (bf16 activations)'."""
        return precision_text(dtype_name(self.dtype), self.quant)

    @property
    def act_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def batch_tokens(self, m: int, moves_tokens: bool) -> int:
        """Tokens of the whole batch for a case of `m` tokens."""
        if moves_tokens and not self.tokens_are_global:
            return m * self.layout.world_size
        return m

    def timing_kwargs(self) -> dict:
        if self.device == "cuda":
            return {"warmup": self.warmup or 3, "reps": self.reps or 50}
        return {"warmup": self.warmup if self.warmup is not None else 1, "reps": self.reps or 3}


def default_experts() -> list[str]:
    """Every experts backend that competes (the float64 reference only checks)."""
    return [n for n in experts_names() if n != "reference"]


def resolve_names(value: str, valid: list[str], kind: str, default: list[str]) -> list[str]:
    """'all' or a comma list -> names, each checked against the registry."""
    if value in ("all", "", None):
        return list(default)
    names = [v.strip() for v in value.split(",") if v.strip()]
    getter = get_experts_class if kind == "experts" else get_prepare_finalize_class
    for n in names:
        if n not in valid:
            getter(n)  # raises the "unknown ..., valid: ..." error with a suggestion
    return names


def plan(spec: SweepSpec) -> list[tuple[str, str, str | None]]:
    """(prepare_finalize, experts, skip reason or None) for every pair, in a stable order."""
    out = []
    for pf in spec.prepare_finalize:
        for ex in spec.experts:
            reason = check_combination(
                pf, ex, spec.device, spec.dtype, spec.layout.world_size, spec.layout.enable_ep, quant=spec.quant
            )
            if reason is None and spec.layout.dp > 1 and not get_prepare_finalize_class(pf).communicates:
                reason = (f"prepare/finalize '{pf}' keeps tokens where they are, so dp {spec.layout.dp} > 1 "
                          f"needs a token exchange: use allgather-rs or all2all-ll")
            out.append((pf, ex, reason))
    return out


def cases_to_run(spec: SweepSpec, store: RunStore | None = None, modeled: bool = False) -> int:
    """How many (tokens, pair) cases of `spec` will be measured: the pairs `plan` does not skip,
    less those whose rows `store` already holds (a resumed run). What a progress bar counts."""
    runnable = [(pf, ex) for pf, ex, reason in plan(spec) if reason is None]
    n = 0
    for m in spec.tokens:
        for pf, ex in runnable:
            row = base_row(spec, m, pf, ex)
            row.modeled = modeled
            n += store is None or not store.has(row.key())
    return n


def base_row(spec: SweepSpec, tokens: int, pf: str, ex: str) -> ResultRow:
    s, lay = spec.shape, spec.layout
    try:
        fmt = str(get_experts_class(ex).activation_format)
    except MoebenchError:
        fmt = "?"
    return ResultRow(
        model=s.name, num_experts=s.num_experts, topk=s.topk, hidden=s.hidden, intermediate=s.intermediate,
        tokens=tokens, tp=lay.tp, dp=lay.dp, ep=lay.ep_size, world_size=lay.world_size,
        prepare_finalize=pf, experts=ex, activation_format=fmt, dtype=spec.dtype_label,
        device=spec.device, routing=spec.routing, quant=spec.quant_label,
    )


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def run_sweep(
    spec: SweepSpec,
    store: RunStore,
    on_progress: Callable[[ResultRow], None] | None = None,
) -> list[ResultRow]:
    """Single-process sweep. Rows go to `store` as they are measured; rows already in the store
    (a resumed run) are skipped. Returns the rows of this sweep, in plan order."""
    if spec.layout.world_size > 1:
        raise MoebenchError("a multi-rank layout runs through run_multirank or run_simulated (CLI: --world-size / --simulate)")
    s = spec.shape
    pairs = plan(spec)
    runnable = [p for p in pairs if p[2] is None]
    rows: list[ResultRow] = []
    ceilings = get_ceilings(spec.device)
    qw13 = qw2 = unquantized = None
    if runnable:
        check_fits(s.num_experts, s.hidden, s.intermediate, max(spec.tokens, default=0), s.topk, spec.dtype, spec.device)
        # fp8: the kernels run on the quantised weights; the unquantised ones stay for err_vs_unquantized.
        (qw13, qw2), unquantized = rank_weights(spec, 0, keep_unquantized=spec.check)
    for m in spec.tokens:
        x = make_tokens(m, s.hidden, spec.dtype, spec.device, spec.seed + m)
        topk_weights, topk_ids = make_routing(spec.routing, m, s.num_experts, s.topk, seed=spec.seed + m, device=spec.device)
        imbalance = load_imbalance(topk_ids, s.num_experts)
        ref = ref_unq = None
        flops = metrics.layer_flops(m, s.topk, s.hidden, s.intermediate)
        nbytes = metrics.layer_bytes(topk_ids, s.num_experts, s.hidden, s.intermediate, spec.act_bytes, m, spec.quant)
        for pf, ex, reason in pairs:
            row = base_row(spec, m, pf, ex)
            row.imbalance = imbalance
            if store.has(row.key()):
                continue
            if reason is not None:
                row.status, row.reason = "skipped", reason
            else:
                if ref is None and spec.check:
                    ref = reference_moe(x, qw13, qw2, topk_weights, topk_ids)
                    if unquantized is not None:
                        ref_unq = reference_moe(x, *unquantized, topk_weights, topk_ids)
                _measure(spec, row, pf, ex, (x, qw13, qw2, topk_weights, topk_ids), ref, flops, nbytes, ceilings,
                         variants=routing_variants(spec, m, x, qw13, qw2), ref_unquantized=ref_unq)
            store.add(row)
            rows.append(row)
            if on_progress:
                on_progress(row)
    return rows


def routing_variants(spec: SweepSpec, m: int, x, w13, w2) -> list[tuple]:
    """Argument tuples with `spec.routings - 1` extra routings of the same distribution (the first
    routing, the checked one, is the caller's)."""
    s = spec.shape
    out = []
    for j in range(1, spec.routings):
        w, ids = make_routing(spec.routing, m, s.num_experts, s.topk, seed=spec.seed + m + 7919 * j, device=spec.device)
        out.append((x, w13, w2, w, ids))
    return out


def cycling(kernel, variants: list[tuple]) -> Callable[[], object]:
    """A call that applies `kernel` to the next argument tuple each time (captured into a CUDA
    graph, each captured call keeps its own routing)."""
    state = {"i": 0}

    def call():
        args = variants[state["i"] % len(variants)]
        state["i"] += 1
        return kernel.apply(*args)

    return call


def _measure(spec, row, pf, ex, args, ref, flops, nbytes, ceilings, variants: list[tuple] = (),
             ref_unquantized=None) -> None:
    """Check `pf + ex` on `args` against `ref`, then time it (cycling through `args` and
    `variants`, other routings of the same distribution); fills `row` in place. fp8 rows also
    get their error against `ref_unquantized` (the reference without quantisation)."""
    try:
        kernel = make_kernel(ex, pf)
        if spec.check:
            with poisoned_outputs():
                out = kernel.apply(*args)
            row.max_rel_err = relative_error(out, ref)
            row.correct = is_correct(row.max_rel_err, spec.dtype, spec.quant)
            if ref_unquantized is not None:
                row.err_vs_unquantized = relative_error(out, ref_unquantized)
        else:
            kernel.apply(*args)
        # Backends that pick a tile config say where it came from (tuned file or default heuristic).
        row.config_source = kernel.experts.last_config_source or ""
        if not kernel.experts.timed:
            row.reason = "correctness only (not timed)"
            return
        t = time_fn(cycling(kernel, [args, *variants]), spec.device, **spec.timing_kwargs())

    except MoebenchError as e:
        row.status, row.reason = "failed", str(e)
        return
    except Exception as e:  # any backend failure (compile error, out of resources, OOM) becomes a failed row
        if spec.device == "cuda":
            torch.cuda.synchronize()
        row.status, row.reason = "failed", one_line(e)
        return
    row.latency_us, row.p10_us, row.p90_us, row.timing_method = t.median_us, t.p10_us, t.p90_us, t.method
    if variants:
        row.timing_method += f", {1 + len(variants)} routings cycled"
        row.extra["routings"] = 1 + len(variants)
    fill_metrics(row, flops, nbytes, ceilings)


def fill_metrics(row: ResultRow, flops: float, nbytes: float, ceilings) -> None:
    m = metrics.metrics(row.latency_us, flops, nbytes, ceilings, dtype=row.dtype)
    row.tflops, row.gbps, row.roofline_frac = m["tflops"], m["gbps"], m.get("roofline_frac")
    row.floor_us = m.get("floor_us")
    row.ceilings_source = getattr(ceilings, "source", "") if ceilings is not None else "none"


def run_multirank(spec: SweepSpec, folder, world_size: int | None = None, ctx=None) -> int:
    """Real ranks: join the torchrun group `ctx`, or spawn `world_size` processes (gloo on CPU,
    NCCL with one GPU each). Rank 0 appends rows to `folder`; returns the rows it wrote."""
    from moebench.runtime.distributed import spawn
    from moebench.runtime.rank_sweep import sweep_on_rank

    if ctx is not None:
        return sweep_on_rank(ctx, spec, str(folder))
    return spawn(sweep_on_rank, world_size or spec.layout.world_size, spec.device, spec, str(folder))[0]


def run_simulated(spec: SweepSpec, store: RunStore, link, on_progress=None, experts_model=None) -> list[ResultRow]:
    """One device computes one rank's share; communication comes from the cost model (`link`);
    with `experts_model` (Ceilings), the experts time is that GPU's roofline floor instead."""
    from moebench.runtime.sim_sweep import run_simulated_sweep

    return run_simulated_sweep(spec, store, link, on_progress, experts_model)


def choose_mode(layout: ParallelLayout, device: str, simulate: bool = False, world_size: int | None = None,
                ctx=None) -> tuple[str, str | None]:
    """How a sweep of `layout` runs here: "single", "torchrun" (joined group `ctx`), "spawn"
    (--world-size real processes) or "simulate"; plus a notice for the user, or None.

    A multi-rank layout asked for without --world-size is simulated (one device computes one
    rank's share); --world-size larger than the visible GPUs on CUDA is an error."""
    if ctx is not None:
        if ctx.world_size != layout.world_size:
            raise MoebenchError(f"torchrun started {ctx.world_size} ranks but the layout needs {layout.world_size} "
                                f"(dp {layout.dp} x tp {layout.tp})")
        return "torchrun", None
    if layout.world_size == 1:
        note = "--simulate with a single rank changes nothing: running it for real" if simulate else None
        return "single", note
    if simulate:
        return "simulate", None
    if world_size is not None:
        have = torch.cuda.device_count() if device == "cuda" else world_size
        if have < world_size:
            raise MoebenchError(f"--world-size {world_size} needs {world_size} GPUs but {have} are visible; "
                                f"add --simulate to model the other ranks")
        return "spawn", None
    return "simulate", (f"{layout.describe()} asked for without --world-size: simulating it (one rank's share "
                        f"computed here, communication modeled); pass --world-size {layout.world_size} to run real ranks")


def run(spec: SweepSpec, store: RunStore, mode: str, link=None, ctx=None,
        on_progress: Callable[[ResultRow], None] | None = None) -> RunStore:
    """Run `spec` the way `choose_mode` decided; returns the store holding every row (for real
    ranks, re-read from the folder rank 0 appended to)."""
    if mode in ("spawn", "torchrun"):
        run_multirank(spec, store.folder, world_size=spec.layout.world_size, ctx=ctx)
        return RunStore(store.folder)
    if mode == "simulate":
        run_simulated(spec, store, link, on_progress=on_progress)
    else:
        run_sweep(spec, store, on_progress=on_progress)
    return store
