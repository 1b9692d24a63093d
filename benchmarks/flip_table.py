"""The flip factor per token count of compare tp-vs-ep run folders, as one Markdown table.

    python -m benchmarks flip_table results/<run>/ [more run folders]

Per comparison and token count: the winner (or "too close"), both layouts' latency and modeled
communication, comm_flip_factor (the factor on both layouts' modeled communication at which the
winner flips; inf = never) and comm_flip_gbps (the bandwidth of the deciding layout's
communication at the flip), then the recommendation line.
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


def table(folder: Path) -> str:
    s = pd.read_csv(folder / "compare.csv")
    meta = json.loads((folder / "metadata.json").read_text()) if (folder / "metadata.json").is_file() else {}
    name = f"{meta.get('shape', {}).get('name', folder.name)}, {meta.get('world_size', '?')} ranks"
    lines = [f"### {name}", "", "| tokens | answer | latency us (layouts) | comm us (layouts) | communication | flip factor "
             "| flip GB/s |", "|---|---|---|---|---|---|---|"]
    for t, g in s.groupby("tokens"):
        g = g.sort_values("latency_us")
        w = g.iloc[0]
        answer = "too close" if bool(w.get("too_close", False)) and len(g) > 1 else w.layout
        f = w.comm_flip_factor
        ftxt = "never" if f == math.inf else ("-" if pd.isna(f) else f"{f:.2f} ({w.comm_flip_by})")
        gb = "-" if pd.isna(w.comm_flip_gbps) else f"{w.comm_flip_gbps:.3g}"
        lat = ", ".join(f"{r.layout} {r.latency_us:.0f}" for _, r in g.iterrows())
        comm = ", ".join(f"{r.layout} {r.comm_us:.0f}" for _, r in g.iterrows())
        how = ", ".join(f"{r.layout} {_transport(r)}" for _, r in g.iterrows())
        lines.append(f"| {t} | {answer} | {lat} | {comm} | {how} | {ftxt} | {gb} |")
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
