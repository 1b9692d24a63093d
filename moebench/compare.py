"""TP vs EP: run both layouts at each token count, break the time down, find the crossover.

TP{N}: no-dpep + a Standard experts backend on 1/N weight shards, then an all-reduce.
EP{N}: allgather-rs (Standard experts) and all2all-ll / deepep-ll (BatchedExperts experts) over N
ranks holding E/N experts each. Every layout is timed the simulated way (one rank's share computed
on this device, communication from the cost model) so the answer speaks of the target GPUs; on a
CPU machine the experts time is the target GPU's roofline floor (labelled), and a real gloo run of
both layouts checks correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from moebench.layout import ParallelLayout
from moebench.results import ResultRow, RunStore
from moebench.sweep import SweepSpec, default_experts, run_multirank, run_simulated

EP_PREPARE_FINALIZE = ["allgather-rs", "all2all-ll", "deepep-ll"]


@dataclass
class CompareResult:
    """summary: one row per (tokens, layout) with the best correct pair and its breakdown;
    crossover: first token count where the winner differs from the winner at the smallest count;
    recommendation: one line with its reason; rows: every row behind the summary."""

    summary: pd.DataFrame
    crossover: int | None
    recommendation: str
    rows: list[ResultRow] = field(default_factory=list)


def layouts(world_size: int) -> dict[str, ParallelLayout]:
    return {f"TP{world_size}": ParallelLayout(tp=world_size),
            f"EP{world_size}": ParallelLayout(dp=world_size, enable_ep=world_size > 1)}


def layout_specs(base: SweepSpec, world_size: int) -> dict[str, SweepSpec]:
    """The TP and EP sweeps of `base` over `world_size` ranks (what run_compare simulates)."""
    return {  # tokens are the whole batch: TP ranks all see it, EP ranks each bring 1/N of it
        name: replace(base, layout=l, tokens_are_global=True,
                      prepare_finalize=["no-dpep"] if name.startswith("TP") else EP_PREPARE_FINALIZE)
        for name, l in layouts(world_size).items()
    }


def run_compare(base: SweepSpec, world_size: int, store: RunStore, link, experts_model=None,
                check_ranks: bool = False, on_progress=None) -> CompareResult:
    """Run TP and EP layouts of `base` (shape, tokens, dtype, routing...) over `world_size` ranks.

    check_ranks: also run both layouts on real gloo/NCCL ranks for correctness (their rows have
    modeled = false and CPU times; the answer uses the simulated rows only)."""
    specs = layout_specs(base, world_size)
    for spec in specs.values():
        run_simulated(spec, store, link, on_progress=on_progress, experts_model=experts_model)
    if check_ranks:
        for spec in specs.values():
            run_multirank(replace(spec, reps=1, warmup=0), store.folder, world_size=world_size)
        store = RunStore(store.folder)
    return summarize(store.rows, world_size)


def _layout_name(r: ResultRow) -> str:
    return f"EP{r.ep}" if r.ep > 1 else f"TP{r.world_size}"


def summarize(rows: list[ResultRow], world_size: int) -> CompareResult:
    """Best correct simulated pair per (tokens, layout), the winner, crossover and recommendation."""
    checked: dict[tuple, bool] = {}
    for r in rows:
        if not r.modeled and r.status == "ok" and r.correct is not None:
            key = (r.tokens, _layout_name(r), r.prepare_finalize, r.experts)
            checked[key] = checked.get(key, True) and bool(r.correct)
    best: dict[tuple[int, str], ResultRow] = {}
    for r in rows:
        if not (r.modeled and r.status == "ok" and r.latency_us is not None and r.correct is not False):
            continue
        k = (r.tokens, _layout_name(r))
        if k not in best or r.latency_us < best[k].latency_us:
            best[k] = r
    recs = []
    for (tokens, lname), r in sorted(best.items()):
        comm = sum(v or 0.0 for v in (r.dispatch_us, r.combine_us, r.allreduce_us))
        other = r.latency_us - comm - (r.experts_us or 0.0)  # what the parts leave out
        recs.append({
            "tokens": tokens, "layout": lname, "prepare_finalize": r.prepare_finalize, "experts": r.experts,
            "latency_us": r.latency_us, "dispatch_us": r.dispatch_us, "experts_us": r.experts_us,
            "combine_us": r.combine_us, "allreduce_us": r.allreduce_us, "comm_us": comm, "other_us": other,
            "floor_us": r.floor_us, "imbalance": r.imbalance, "rank_imbalance": r.rank_imbalance,
            "checked_on_ranks": checked.get((tokens, lname, r.prepare_finalize, r.experts)),
            "timing": r.timing_method,
        })
    df = pd.DataFrame(recs)
    if df.empty:
        return CompareResult(df, None, "no layout produced a correct result; see the rows for reasons", rows)
    winners = df.loc[df.groupby("tokens").latency_us.idxmin()].set_index("tokens")
    df["winner"] = df.apply(lambda x: winners.loc[x.tokens, "layout"] == x.layout, axis=1)
    crossover = None
    order = list(winners.index)
    for t in order[1:]:
        if winners.loc[t, "layout"] != winners.loc[order[0], "layout"]:
            crossover = int(t)
            break
    return CompareResult(df, crossover, _recommend(df, winners, crossover, world_size), rows)


def _recommend(df: pd.DataFrame, winners: pd.DataFrame, crossover: int | None, n: int) -> str:
    def at(t: int, layout: str):
        sel = df[(df.tokens == t) & (df.layout == layout)]
        return None if sel.empty else sel.iloc[0]

    tokens = list(winners.index)
    if crossover is None:
        w = winners.iloc[-1].layout
        t = tokens[-1]
        other = f"EP{n}" if w.startswith("TP") else f"TP{n}"
        a, b = at(t, w), at(t, other)
        if b is None:
            return f"{w} is the only layout that ran correctly (tokens {tokens[0]}..{tokens[-1]})"
        return (f"{w} wins at every token count measured ({tokens[0]}..{tokens[-1]}): at {t} tokens "
                f"{a.latency_us:.0f} us vs {b.latency_us:.0f} us for {other}, {_why(a, b)}")
    w = winners.loc[crossover].layout
    other = winners.loc[tokens[0]].layout
    a, b = at(crossover, w), at(crossover, other)
    line = (f"{w} wins from {crossover} tokens ({other} below): at {crossover} tokens {a.latency_us:.0f} us vs "
            f"{b.latency_us:.0f} us, {_why(a, b)}")
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
    from moebench.report import _markdown, export_frame
    from moebench.results import atomic_write_text

    csv = folder / "compare.csv"
    export_frame(result.summary, csv, "csv")
    md = folder / "compare.md"
    text = (f"**{result.recommendation}**\n\ncrossover: {result.crossover if result.crossover is not None else 'none'}"
            f"\n\n{_markdown(result.summary)}")
    atomic_write_text(md, text)
    return [csv, md]


__all__ = ["CompareResult", "layout_specs", "run_compare", "summarize", "layouts", "write_summary", "default_experts"]
