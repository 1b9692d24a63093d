"""The answer per token count of compare tp-vs-ep run folders, as one Markdown table.

    python -m benchmarks flip_table results/<run>/ [more run folders]

Per comparison and token count: the winner among the layouts that fit and that an engine runs (or
"too close"), its latency, the overlap it runs with and the sequences it holds; the runner-up with
its latency; the one-sided flip factors (how many times faster than modeled the runner-up's own
communication must run to win; how many times slower the winner's may run); the layouts that do
not fit; then the recommendation line.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd


def _transport(r) -> str:
    """How a summary row communicates: its prepare/finalize, and TP's all-reduce where it names one."""
    ar = r.get("allreduce") if hasattr(r, "get") else None
    return f"{r.prepare_finalize} ({ar} AR)" if isinstance(ar, str) and ar else str(r.prepare_finalize)


def _f(v) -> str:
    return "never" if v == math.inf else ("-" if pd.isna(v) else f"{v:.2f}")


def _name(r) -> str:
    return f"{r.layout} {r.prepare_finalize}" if str(r.get("kind", "")) == "dp-ep" else f"{r.layout} ({_transport(r)})"


def table(folder: Path) -> str:
    s = pd.read_csv(folder / "compare.csv")
    meta = json.loads((folder / "metadata.json").read_text()) if (folder / "metadata.json").is_file() else {}
    name = f"{meta.get('shape', {}).get('name', folder.name)}, {meta.get('world_size', '?')} ranks"
    lines = [f"### {name}", "", "| tokens | answer | us | overlap | holds | runner-up | us | flip x runner-up "
             "| flip x answer | no fit |", "|---|---|---|---|---|---|---|---|---|---|"]
    elig = s[s.eligible] if "eligible" in s.columns else s
    for t, g in elig.groupby("tokens"):
        g = g.sort_values("latency_us")
        w = g.iloc[0]
        r = g.iloc[1] if len(g) > 1 else None
        answer = f"too close ({_name(w)})" if bool(w.get("too_close", False)) and r is not None else _name(w)
        held = "-" if pd.isna(w.get("sequences", float("nan"))) else str(int(w.sequences))
        nofit = sorted(set(s[(s.tokens == t) & (s.get("fits", True) == False)].layout)) if "fits" in s.columns else []  # noqa: E712
        ru = "-" if r is None else _name(r)
        ru_us = "-" if r is None else f"{r.latency_us:.0f}"
        rf = "-" if r is None else _f(r.comm_flip_factor) + (f" ({r.comm_flip_by})" if isinstance(r.comm_flip_by, str)
                                                             and r.comm_flip_by else "")
        lines.append(f"| {t} | {answer} | {w.latency_us:.0f} | {w.get('overlap', 'none')} | {held} | {ru} | {ru_us} | "
                     f"{rf} | {_f(w.comm_flip_factor)} | {', '.join(nofit) or '-'} |")
    md = folder / "compare.md"
    if md.is_file():
        lines += ["", md.read_text().split("\n\n")[0]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    folders = [Path(a) for a in argv if (Path(a) / "compare.csv").is_file()]
    if not folders:
        print("no compare run folders (with compare.csv) given", file=sys.stderr)
        return 2
    for f in folders:
        print(table(f))
    return 0
