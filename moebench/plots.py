"""Plots (matplotlib, headless): TP-vs-EP comparison and latency-vs-tokens of result rows."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from moebench.results import atomic_write_bytes  # noqa: E402


def check_plot_file(path: Path, option: str = "--plot") -> Path:
    """Before any work: `path` names a .png file that can be written (the figures are PNGs; another
    name would hold a PNG under a misleading suffix). A one-line MoebenchError otherwise."""
    from moebench.errors import MoebenchError
    from moebench.results import check_output_file

    if Path(path).suffix.lower() != ".png":
        raise MoebenchError(f"{option} '{path}': the figure is a PNG; give a file name ending in .png")
    return check_output_file(path, option)


def _save(fig, path: Path) -> Path:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


def compare_plot(summary: pd.DataFrame, crossover: int | None, title: str, path: Path) -> Path:
    """Three panels from a compare summary (tokens, layout, latency/dispatch/experts/combine/allreduce,
    floor_us): latency vs tokens with the crossover marked (and, where the summary has
    latency_lo_us / latency_hi_us, each layout's band between the fastest and the slowest published
    transport); stacked breakdown; experts vs floor."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for layout, g in summary.groupby("layout"):
        g = g.sort_values("tokens")
        line = ax.plot(g.tokens, g.latency_us, marker="o", label=f"{layout} ({', '.join(sorted(set(g.prepare_finalize)))})")
        if {"latency_lo_us", "latency_hi_us"} <= set(g.columns) and g.latency_lo_us.notna().any():
            # the modeled rows under the fastest and the slowest published transport for this link
            ax.fill_between(g.tokens.astype(float), g.latency_lo_us.astype(float), g.latency_hi_us.astype(float),
                            color=line[0].get_color(), alpha=0.18, label=f"{layout}: published transports")
    # Every token count where the winning layout changes (the first is `crossover`).
    flips = []
    if "winner" in summary.columns:
        winners = summary[summary.winner.astype(bool)].sort_values("tokens")
        if "too_close" in winners.columns:  # a winner inside the published transports' band is no winner
            close = sorted(set(winners[winners.too_close.astype(bool)].tokens))
            for i, t in enumerate(close):
                ax.axvline(t, color="grey", alpha=0.25, linewidth=8,
                           label="too close to call on modeled communication" if i == 0 else None)
            winners = winners[~winners.too_close.astype(bool)]
        prev = None
        for t, layout in zip(winners.tokens, winners.layout):
            if prev is not None and layout != prev:
                flips.append((int(t), layout))
            prev = layout
    elif crossover is not None:
        flips = [(crossover, "")]
    for i, (t, layout) in enumerate(flips):
        ax.axvline(t, color="red", linestyle="--" if i == 0 else ":",
                   label=f"{layout or 'winner'} from {t} tokens" if layout else f"crossover: {t} tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch tokens (all ranks)")
    ax.set_ylabel("layer latency (us)")
    ax.set_title("latency vs tokens")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    tokens = sorted(summary.tokens.unique())
    lays = sorted(summary.layout.unique())
    width = 0.8 / max(len(lays), 1)
    parts = [("dispatch_us", "dispatch"), ("experts_us", "experts"), ("combine_us", "combine"), ("allreduce_us", "all-reduce")]
    colors = {"dispatch_us": "#4c72b0", "experts_us": "#55a868", "combine_us": "#c44e52", "allreduce_us": "#8172b2"}
    for j, layout in enumerate(lays):
        g = summary[summary.layout == layout].set_index("tokens")
        xs = [i + j * width for i in range(len(tokens))]
        bottom = [0.0] * len(tokens)
        for col, label in parts:
            vals = [float(g.loc[t, col]) if t in g.index and pd.notna(g.loc[t, col]) else 0.0 for t in tokens]
            if any(vals):
                ax.bar(xs, vals, width, bottom=bottom, color=colors[col], edgecolor="white",
                       label=label if j == 0 or col == "allreduce_us" else None, hatch="//" if j % 2 else None)
                bottom = [b + v for b, v in zip(bottom, vals)]
        for x, b in zip(xs, bottom):
            ax.text(x, b, layout, ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks([i + width * (len(lays) - 1) / 2 for i in range(len(tokens))])
    ax.set_xticklabels([str(t) for t in tokens])
    ax.set_xlabel("batch tokens (all ranks)")
    ax.set_ylabel("us")
    ax.set_title("breakdown (best pair per layout)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)

    ax = axes[2]
    for layout, g in summary.groupby("layout"):
        g = g.sort_values("tokens")
        line = ax.plot(g.tokens, g.experts_us, marker="o", label=f"{layout} experts (achieved)")
        if g.floor_us.notna().any():
            ax.plot(g.tokens, g.floor_us, linestyle=":", color=line[0].get_color(), label=f"{layout} floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch tokens (all ranks)")
    ax.set_ylabel("experts GEMM per rank (us)")
    ax.set_title("roofline: achieved vs floor")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path)


def latency_plot(df: pd.DataFrame, title: str, path: Path) -> Path:
    """Latency vs tokens, one line per series (full setting: shape, layout, link, routing,
    precision, device, modeled, pair; named by what differs), correct ok rows only (never a
    check-only row)."""
    from moebench.report import label_series

    fig, ax = plt.subplots(figsize=(8, 5))
    checks = (df["check_only"].fillna(False).astype(bool) if "check_only" in df.columns
              else pd.Series(False, index=df.index))
    ok = df[(df.status == "ok") & (df.correct == True) & df.latency_us.notna() & ~checks].copy()  # noqa: E712
    if not ok.empty:
        lab = label_series(ok)
        ok["_label"] = [" ".join(str(v) for v in rec) for rec in lab.labels[lab.row_keys + ["series"]].itertuples(index=False)]
        ok["_modeled"] = ok.modeled.astype(bool)
    for label, g in (ok.groupby("_label", sort=True) if not ok.empty else []):
        g = g.groupby("tokens", as_index=False).agg(latency_us=("latency_us", "min"), modeled=("_modeled", "any"))
        style = "--" if g.modeled.any() else "-"
        ax.plot(g.tokens.clip(lower=0.5), g.latency_us, style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("latency (us)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return _save(fig, path)
