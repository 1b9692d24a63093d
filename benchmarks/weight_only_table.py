"""Weight-only (int8_w8a16 / int4_w4a16 / mxfp4) vs bf16 table from `moebench sweep` result
folders (benchmarks/device_weight_only.sh).

    python -m benchmarks weight_only_table RESULTS_DIR > weight_only.md

One row per (shape, quantised variant, tokens): the bf16 layer's latency and the quantised one's
(the same experts backend, `triton` unless --experts says otherwise), their ratio, both roofline
floors (the bf16 weights' bytes vs the packed bytes and scales, measured ceilings), the fraction of
its floor the quantised layer reaches, its error against the reference of the dequantised weights
(the kernel's own) and against the unquantised layer (the scheme's), and where each tile config
came from (a bf16 tuned file does not serve the quantised layer: vLLM's names keep them apart).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from benchmarks.bench_common import ok_rows

WEIGHT_ONLY = ("int8_w8a16", "int4_w4a16", "mxfp4")


def load(root: Path, experts: str) -> pd.DataFrame:
    df = ok_rows(root)
    df = df[df.experts == experts].copy()
    df["variant"] = df.apply(lambda r: f"{r['dtype']}{(' ' + r['quant']) if r['quant'] else ''}", axis=1)
    df["shape"] = df.apply(lambda r: f"{r.model} (E={r.num_experts}, K={r.topk}, H={r.hidden}, I={r.intermediate})",
                           axis=1)
    return df


def _f(v, fmt: str) -> str:
    return format(v, fmt) if pd.notna(v) else "-"


def table(df: pd.DataFrame) -> str:
    head = ["shape", "variant", "M", "bf16 us", "quantised us", "quantised / bf16", "bf16 floor us",
            "packed floor us", "quantised roofline", "err vs dequantised ref", "err vs bf16 layer", "correct",
            "config (bf16 / quantised)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, sdf in df.groupby("shape", sort=False):
        base = sdf[sdf.dtype.isin(["bf16"])].set_index("tokens")
        for variant, q in sdf[sdf.dtype.isin(WEIGHT_ONLY)].groupby("variant", sort=False):
            for _, r in q.sort_values("tokens").iterrows():
                b = base.loc[r.tokens] if r.tokens in base.index else None
                if isinstance(b, pd.DataFrame):
                    b = b.iloc[0]
                b_lat = b.latency_us if b is not None else float("nan")
                cfg = f"{_src(b.config_source) if b is not None else '-'} / {_src(r.config_source)}"
                cells = [shape, variant, str(int(r.tokens)), _f(b_lat, ".1f"), _f(r.latency_us, ".1f"),
                         _f(r.latency_us / b_lat if b is not None else float("nan"), ".2f"),
                         _f(b.floor_us if b is not None else float("nan"), ".1f"), _f(r.floor_us, ".1f"),
                         _f(r.roofline_frac, ".2f"), _f(r.max_rel_err, ".1e"), _f(r.err_vs_unquantized, ".3f"),
                         str(bool(r.correct)), cfg]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _src(source) -> str:
    """'tuned' for a tuned file's entry, 'heuristic' for the default."""
    if not isinstance(source, str) or not source:
        return "-"
    return "heuristic" if source.startswith("default") else "tuned"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default="results", help="folder holding the sweep run folders")
    ap.add_argument("--experts", default="triton", help="experts backend whose rows are compared [triton]")
    a = ap.parse_args(argv)
    print(table(load(Path(a.results), a.experts)))
    return 0
