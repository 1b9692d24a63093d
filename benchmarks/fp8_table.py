"""fp8 vs bf16 table from `moebench sweep` result folders (benchmarks/device_fp8.sh).

    python -m benchmarks fp8_table RESULTS_DIR > fp8_table.md

One row per (shape, tokens): latency of each (precision, experts) variant, the fp8/bf16 ratio of
the `triton` experts, the roofline floors (bf16 bytes vs fp8 bytes, measured ceilings) and the
errors (kernel vs the scheme-emulating reference; fp8 vs the unquantised reference).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from benchmarks.bench_common import ok_rows


def load(root: Path) -> pd.DataFrame:
    df = ok_rows(root)
    df["variant"] = df.apply(lambda r: f"{r['dtype']}{(' ' + r['quant']) if r['quant'] else ''} {r['experts']}", axis=1)
    df["shape"] = df.apply(lambda r: f"{r.model} (E={r.num_experts}, K={r.topk}, H={r.hidden}, I={r.intermediate})", axis=1)
    return df


def table(df: pd.DataFrame) -> str:
    lat = df.pivot_table(index=["shape", "tokens"], columns="variant", values="latency_us", aggfunc="first")
    floor = df.pivot_table(index=["shape", "tokens"], columns="variant", values="floor_us", aggfunc="first")
    err = df.pivot_table(index=["shape", "tokens"], columns="variant", values="err_vs_unquantized", aggfunc="first")
    chk = df.groupby(["shape", "tokens"])["max_rel_err"].max()
    ok = df.groupby(["shape", "tokens"])["correct"].all()
    cols = list(lat.columns)
    base = "bf16 triton"
    fp8s = [c for c in cols if c.startswith("fp8") and c.endswith(" triton")]
    head = ["shape", "M"] + [f"{c} us" for c in cols]
    head += [f"{c} / bf16" for c in fp8s] + ["bf16 floor", "fp8 floor"] + [f"{c} err vs bf16 ref" for c in fp8s]
    head += ["max check err", "all correct"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, m), row in lat.iterrows():
        cells = [shape, str(m)] + [f"{row[c]:.1f}" if pd.notna(row[c]) else "-" for c in cols]
        for c in fp8s:
            cells.append(f"{row[c] / row[base]:.2f}" if base in cols and pd.notna(row[c]) and pd.notna(row[base]) else "-")
        fl = floor.loc[(shape, m)]
        cells.append(f"{fl[base]:.1f}" if base in fl and pd.notna(fl[base]) else "-")
        cells.append(f"{fl[fp8s[0]]:.1f}" if fp8s and pd.notna(fl[fp8s[0]]) else "-")
        e = err.loc[(shape, m)] if (shape, m) in err.index else None
        for c in fp8s:
            cells.append(f"{e[c]:.3f}" if e is not None and c in e and pd.notna(e[c]) else "-")
        cells += [f"{chk.loc[(shape, m)]:.1e}", str(bool(ok.loc[(shape, m)]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table of the sweep results under argv[0] (default ./results)."""
    argv = sys.argv[1:] if argv is None else argv
    print(table(load(Path(argv[0] if argv else "results"))))
    return 0
