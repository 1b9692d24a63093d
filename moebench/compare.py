"""TP vs EP: run both layouts at each token count, break the time down, find the crossover.

TP{N}: no-dpep + a Standard experts backend on 1/N weight shards, then an all-reduce.
EP{N}: allgather-rs (Standard experts) and all2all-ll / deepep-ll (BatchedExperts experts) over N
ranks holding E/N experts each. Every layout is timed the simulated way (one rank's share computed
on this device, communication from the cost model) so the answer speaks of the target GPUs; on a
CPU machine the experts time is the target GPU's roofline floor (labelled), and a real gloo run of
both layouts checks correctness (within one node).

Past one node (N > gpus_per_node) TP stays inside a node: the TP layout is one TP{gpus_per_node}
replica per node ("TP8x4" for 32 ranks), each computing 1/nodes of the batch; EP spans all N ranks
(NVLink inside a node, RDMA between nodes). Each token count's answer carries the factor on the
modeled communication at which it would flip and whether the published transports' spread covers
the flip (moebench.comm.robustness).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from moebench.comm import robustness
from moebench.backends import check_named_experts_quant, get_prepare_finalize_class, prepare_finalize_names
from moebench.layout import ParallelLayout
from moebench.results import ResultRow, RunStore
from moebench.bench.hardware import Ceilings, datasheet_ceilings
from moebench.errors import MoebenchError
from moebench.comm.links import DEFAULT_TARGET_GPU, check_world, nvlink_domain
from moebench.comm.model import CommModel
from moebench.sweep import SweepSpec, check_ranks_fit, default_experts, run_multirank, run_simulated
from moebench.sweep.driver import simulation_link
from moebench.sweep.simulated import check_spec_for, experts_here


def layout_prepare_finalize(moves_tokens: bool) -> list[str]:
    """The prepare/finalize backends of one side of the comparison, from what each declares:
    those that move tokens between ranks (EP: each rank brings its own tokens), or those that keep
    them in place and run on many ranks (TP)."""
    out = []
    for name in prepare_finalize_names():
        cls = get_prepare_finalize_class(name)
        if cls.communicates == moves_tokens and (cls.max_world_size is None or cls.max_world_size > 1):
            out.append(name)
    return out


def modeled_experts(dtype, quant, activation, bias: bool, target: str) -> list[str]:
    """The experts a comparison considers when their time is the target GPU's floor: every backend
    would show the same floor, so one per activation format: the first (registry order) that runs
    this precision and layer on a GPU."""
    from moebench.backends import check_combination, experts_names, get_experts_class

    chosen: dict[str, str] = {}
    for name in experts_names():
        cls = get_experts_class(name)
        fmt = str(cls.activation_format)
        if not cls.timed or fmt in chosen:
            continue
        stand_in = next(pf for pf in prepare_finalize_names()
                        if str(get_prepare_finalize_class(pf).activation_format) == fmt
                        and not get_prepare_finalize_class(pf).communicates)
        if check_combination(stand_in, name, "cuda", dtype, 1, None, quant=quant, activation=activation, bias=bias,
                             comm_modeled=True, experts_modeled=target) is None:
            chosen[fmt] = name
    return list(chosen.values())


@dataclass
class CompareResult:
    """summary: one row per (tokens, layout) with the best correct pair and its breakdown;
    crossover: first token count where the winner differs from the winner at the smallest count;
    recommendation: one line with its reason; rows: every row behind the summary."""

    summary: pd.DataFrame
    crossover: int | None
    recommendation: str
    rows: list[ResultRow] = field(default_factory=list)


#: The largest TP group a comparison builds: past 8 ranks TP shards an expert's intermediate
#: size below what the GEMMs use well, and engines run TP8 replicas even inside a 72-GPU NVLink
#: domain (GB200 NVL72); EP is what spans it.
TP_MAX_RANKS = 8


def tp_replicas(world_size: int, gpus_per_node: int | None) -> int:
    """TP replicas of a comparison over `world_size` ranks: one TP group per node (at most
    TP_MAX_RANKS ranks, the largest that divides the world), 1 within one such group."""
    group = min(gpus_per_node or world_size, TP_MAX_RANKS, world_size)
    while world_size % group:
        group -= 1
    return world_size // group


def ep_group(world_size: int, num_experts: int | None) -> int:
    """Ranks of one EP group: all of them, or - where the model has fewer experts than ranks - the
    largest divisor of the world that gets every rank an expert (the rest are replicas)."""
    if num_experts is None or world_size <= num_experts:
        return world_size
    return max(d for d in range(1, num_experts + 1) if world_size % d == 0)


def replicas(name: str) -> int:
    """The replicas of a layout name: 'TP8x4' -> 4, 'EP32' -> 1."""
    return int(name.split("x")[1]) if "x" in name else 1


def layouts(world_size: int, gpus_per_node: int | None = None, num_experts: int | None = None) -> dict[str, ParallelLayout]:
    """TP{N} and EP{N}; past one node TP{gpus_per_node}x{nodes} (a TP replica per node); with fewer
    experts than ranks EP{g}x{N/g} (an EP group of g per replica, see ep_group)."""
    n = tp_replicas(world_size, gpus_per_node)
    tp_name = f"TP{world_size}" if n == 1 else f"TP{world_size // n}x{n}"
    g = ep_group(world_size, num_experts)
    ep_name = f"EP{world_size}" if g == world_size else f"EP{g}x{world_size // g}"
    return {tp_name: ParallelLayout(tp=world_size // n), ep_name: ParallelLayout(dp=g, enable_ep=g > 1)}


def layout_specs(base: SweepSpec, world_size: int, gpus_per_node: int | None = None) -> dict[str, SweepSpec]:
    """The TP and EP sweeps of `base` over `world_size` ranks (what run_compare simulates). Tokens
    are the whole batch: TP ranks all see it, EP ranks each bring 1/N of it; a layout of replicas
    (TP8x4 past one node, EP8x4 for 8 experts on 32 ranks) computes each replica's share of it."""
    specs = {}
    for name, lay in layouts(world_size, gpus_per_node, base.shape.num_experts).items():
        spec = replace(base, layout=lay, tokens_are_global=True,
                       prepare_finalize=layout_prepare_finalize(moves_tokens=not name.startswith("TP")))
        n = replicas(name)
        if n > 1:
            spec = replace(spec, tokens=sorted({math.ceil(m / n) for m in spec.tokens}))
        specs[name] = spec
    return specs


@dataclass
class ComparePlan:
    """How a comparison runs here, decided before its folder exists. spec: the base spec (its
    experts chosen: one per activation format where their time is modeled); link: the
    communication model and why that link; experts_model: the target GPU's datasheet ceilings where
    the experts time is its floor (None: measured here, on `measured_on`); check_ranks: correctness
    is also checked on real gloo ranks of both layouts."""

    spec: SweepSpec
    gpus_per_node: int
    link: CommModel
    link_why: str
    experts_model: Ceilings | None
    measured_on: str | None
    check_ranks: bool


def plan_compare(spec: SweepSpec, world_size: int, *, experts_given: bool, target_gpu: str | None,
                 device_name: str | None, link_name: str | None = None, link_gbps: float | None = None,
                 gpus_per_node: int | None = None, rdma_name: str = "rdma-400g") -> ComparePlan:
    """Plan a comparison of `spec` over `world_size` ranks, and refuse (MoebenchError) what cannot
    run: a world the nodes do not divide, a shape a layout cannot shard, a target GPU without a
    datasheet, real-rank checks that do not fit this machine. On a CPU the experts time is the
    target GPU's floor (default DEFAULT_TARGET_GPU); on a GPU it is measured unless `target_gpu`."""
    shape, device = spec.shape, spec.device
    gpu = target_gpu or (DEFAULT_TARGET_GPU if device == "cpu" else None)
    if gpus_per_node is None:
        gpus_per_node = nvlink_domain(gpu or device_name)
    check_world(world_size, gpus_per_node)
    for lay in layouts(world_size, gpus_per_node, shape.num_experts).values():
        lay.validate_shape(shape.num_experts, shape.intermediate)
    experts_model = None
    if gpu is not None:
        experts_model = datasheet_ceilings(gpu)
        if experts_model is None:
            raise MoebenchError(f"no datasheet profile for GPU '{gpu}'; try H200, H100, A100, B200, GB200, MI300X")
        if not experts_given:  # every backend shows the same floor: one per activation format
            spec = replace(spec, experts=modeled_experts(spec.dtype, spec.quant, spec.activation, spec.bias, gpu))
    if experts_given:
        check_named_experts_quant(spec.experts, spec.quant)
    measured_on = gpu or device_name
    # a measurement of this machine's links stands in only when its GPUs are the target
    link, why = simulation_link(device, device_name, link_name, link_gbps, gpus_per_node, rdma_name,
                                device_name if device == "cuda" and target_gpu is None else measured_on,
                                requested_gpu=target_gpu)
    check_ranks = (device == "cpu" and spec.check and world_size <= gpus_per_node and spec.shared != "fused"
                   and shape.num_experts >= world_size)
    if check_ranks:  # all ranks of each layout at once on this host: refuse before anything is written
        for sp in layout_specs(spec, world_size, gpus_per_node).values():
            check_ranks_fit(check_spec_for(sp) if experts_model is not None else sp, world_size,
                            "the real-rank check of compare tp-vs-ep does not fit this machine: use --no-check (the "
                            "simulated check still runs), a smaller shape or fewer --tokens")
    return ComparePlan(spec, gpus_per_node, link, why, experts_model, measured_on, check_ranks)


def run_compare(base: SweepSpec, world_size: int, store: RunStore, link, experts_model=None,
                check_ranks: bool = False, on_progress=None, gpus_per_node: int | None = None) -> CompareResult:
    """Run TP and EP layouts of `base` (shape, tokens, dtype, routing...) over `world_size` ranks.

    link: a comm.model.CommModel (or a comm.links.LinkProfile); gpus_per_node: node size (default:
    the model's). check_ranks: also run both layouts on real gloo/NCCL ranks for correctness (their
    rows have modeled = false and CPU times; the answer uses the simulated rows only); only within
    one node."""
    gpn = gpus_per_node if gpus_per_node is not None else getattr(link, "gpus_per_node", None)
    specs = layout_specs(base, world_size, gpn)
    n = max(replicas(name) for name in specs)
    for spec in specs.values():
        run_simulated(spec, store, link, on_progress=on_progress, experts_model=experts_model)
    if check_ranks and n == 1:
        for spec in specs.values():
            # with the experts time modeled, the ranks check what this machine runs (check_spec_for)
            checked = spec
            if experts_model is not None:
                checked = check_spec_for(spec)
                names = [experts_here(ex, checked)[0] for ex in spec.experts]
                checked = replace(checked, experts=list(dict.fromkeys(n for n in names if n)))
            run_multirank(replace(checked, reps=1, warmup=0), store.folder, world_size=world_size)
        store = RunStore(store.folder)
    return summarize(store.rows, world_size, gpus_per_node=gpn, tokens=list(base.tokens))


def _layout_name(r: ResultRow, world_size: int | None = None) -> str:
    if r.ep > 1:
        return f"EP{r.ep}" if world_size is None or world_size <= r.world_size else f"EP{r.ep}x{world_size // r.world_size}"
    if world_size is not None and world_size > r.world_size:
        return f"TP{r.world_size}x{world_size // r.world_size}"
    return f"TP{r.world_size}"


def summarize(rows: list[ResultRow], world_size: int, gpus_per_node: int | None = None,
              tokens: list[int] | None = None) -> CompareResult:
    """Best correct simulated pair per (tokens, layout), the winner, crossover and recommendation.

    The rows of a layout of replicas (TP past one node; EP with fewer experts than ranks) are per
    replica: the summary row of a batch of M tokens is that layout's row of ceil(M / replicas)
    tokens (`tokens`: the batch sizes asked for; default: the rows' own)."""
    checked: dict[tuple, bool] = {}
    for r in rows:
        if not r.modeled and r.status == "ok" and r.correct is not None:
            key = (r.tokens, _layout_name(r, world_size), r.prepare_finalize)  # any experts that ran here
            checked[key] = checked.get(key, True) and bool(r.correct)
    best: dict[tuple[int, str], ResultRow] = {}
    for r in rows:
        if not (r.modeled and r.status == "ok" and r.latency_us is not None and r.correct is not False):
            continue
        k = (r.tokens, _layout_name(r, world_size))
        if k not in best or r.latency_us < best[k].latency_us:
            best[k] = r
    per_replica = {k: v for k, v in best.items() if replicas(k[1]) > 1}
    if per_replica:  # replica rows were run at ceil(M / n) tokens: file them under the batch size M
        best = {k: v for k, v in best.items() if replicas(k[1]) == 1}
        batch = tokens if tokens is not None else sorted({t for t, _ in best})
        for m in batch:
            for (t, name), r in per_replica.items():
                if t == math.ceil(m / replicas(name)):
                    best[(m, name)] = r
    recs = []
    for (tokens, lname), r in sorted(best.items()):
        comm = sum(v or 0.0 for v in (r.dispatch_us, r.combine_us, r.allreduce_us))
        other = r.latency_us - comm - (r.experts_us or 0.0)  # what the parts leave out
        recs.append({
            "tokens": tokens, "layout": lname, "prepare_finalize": r.prepare_finalize, "experts": r.experts,
            "allreduce": r.allreduce or "", "transports": r.extra.get("comm_transports", ""),
            "not_run_here": r.extra.get("comm_not_run", ""),
            "latency_us": r.latency_us, "dispatch_us": r.dispatch_us, "experts_us": r.experts_us,
            "combine_us": r.combine_us, "allreduce_us": r.allreduce_us, "comm_us": comm, "other_us": other,
            "floor_us": r.floor_us, "imbalance": r.imbalance, "rank_imbalance": r.rank_imbalance,
            "checked_on_ranks": checked.get((tokens, lname, r.prepare_finalize)),
            "timing": r.timing_method,
        })
    df = pd.DataFrame(recs)
    if df.empty:
        why = Counter(r.reason.split(";")[0] for r in rows if r.status != "ok" or r.correct is False)
        top = f": {why.most_common(1)[0][0]} ({why.most_common(1)[0][1]} of {len(rows)} rows)" if why else ""
        return CompareResult(df, None, f"no layout could be priced{top}", rows)
    df["replicas"] = [replicas(lname) for lname in df.layout]
    robustness.add_columns(df, best)
    winners = df.loc[df.groupby("tokens").latency_us.idxmin()].set_index("tokens")
    df["winner"] = df.apply(lambda x: winners.loc[x.tokens, "layout"] == x.layout, axis=1)
    # A winner inside the published transports' band is no winner: the answer skips those counts.
    decisive = winners[~winners.too_close.astype(bool)]
    crossover = None
    order = list(decisive.index)
    for t in order[1:]:
        if decisive.loc[t, "layout"] != decisive.loc[order[0], "layout"]:
            crossover = int(t)
            break
    if decisive.empty:
        rec = (f"{robustness.TOO_CLOSE} at every token count ({order_text(winners.index)}): the layouts' bands "
               f"between the fastest and the slowest published transport for this link overlap")
    else:
        scope = "every token count where the answer is clear" if len(decisive) < len(winners) else None
        rec = _recommend(df, decisive, crossover, world_size, scope) + robustness.close_line(df)
    return CompareResult(df, crossover, rec, rows)


def order_text(tokens) -> str:
    t = list(tokens)
    return f"{t[0]}..{t[-1]}" if len(t) > 1 else str(t[0])


def _recommend(df: pd.DataFrame, winners: pd.DataFrame, crossover: int | None, n: int, scope: str | None = None) -> str:
    def at(t: int, layout: str):
        sel = df[(df.tokens == t) & (df.layout == layout)]
        return None if sel.empty else sel.iloc[0]

    tokens = list(winners.index)
    names = sorted(set(df.layout))

    def other_of(w: str) -> str:
        return next((x for x in names if x != w), f"EP{n}" if w.startswith("TP") else f"TP{n}")

    def robust(t: int) -> str:
        c = robustness.clause(df, t)
        return f"; at {t} tokens it holds {c}" if c else ""

    if crossover is None:
        w = winners.iloc[-1].layout
        t = tokens[-1]
        other = other_of(w)
        a, b = at(t, w), at(t, other)
        if b is None:
            return f"{w} is the only layout that ran correctly (tokens {tokens[0]}..{tokens[-1]})"
        return (f"{w} wins at {scope or 'every token count measured'} ({tokens[0]}..{tokens[-1]}): at {t} tokens "
                f"{a.latency_us:.0f} us vs {b.latency_us:.0f} us for {other}, {_why(a, b)}{robust(t)}")
    w = winners.loc[crossover].layout
    other = winners.loc[tokens[0]].layout
    a, b = at(crossover, w), at(crossover, other)
    line = (f"{w} wins from {crossover} tokens ({other} below): at {crossover} tokens {a.latency_us:.0f} us vs "
            f"{b.latency_us:.0f} us, {_why(a, b)}{robust(crossover)}")
    later = [t for t in tokens if t > crossover and winners.loc[t].layout != w]
    if later:  # the answer flips back: say where, so nobody reads one crossover as the whole story
        t = later[0]
        c, d = at(t, other), at(t, w)
        line += (f"; {other} wins again from {t} tokens ({c.latency_us:.0f} vs {d.latency_us:.0f} us), "
                 f"{_why(c, d)}")
    return line


def _why(win, lose) -> str:
    """The reason in the terms users weigh: the experts GEMM per rank against the communication."""
    a, b = win.experts_us, lose.experts_us
    comm = f"communication costs {win.comm_us:.0f} vs {lose.comm_us:.0f} us"
    if a and b / a > 1.05:
        return f"the experts GEMM takes {b / a:.1f}x less per rank ({a:.0f} vs {b:.0f} us) while {comm}"
    if a and b / a < 0.95:
        return f"{comm}, which outweighs its experts GEMM being {a / b:.1f}x slower per rank ({a:.0f} vs {b:.0f} us)"
    return f"the experts GEMM costs about the same per rank ({a:.0f} vs {b:.0f} us), so communication decides: {comm}"


def write_summary(result: CompareResult, folder: Path) -> list[Path]:
    """compare.csv and compare.md (with the recommendation) in the run folder."""
    from moebench.report import export_frame, markdown
    from moebench.results import atomic_write_text

    csv = folder / "compare.csv"
    export_frame(result.summary, csv, "csv")
    md = folder / "compare.md"
    text = (f"**{result.recommendation}**\n\ncrossover: {result.crossover if result.crossover is not None else 'none'}"
            f"\n\n{markdown(result.summary)}")
    atomic_write_text(md, text)
    return [csv, md]


__all__ = ["CompareResult", "layout_specs", "run_compare", "summarize", "layouts", "write_summary", "default_experts"]
