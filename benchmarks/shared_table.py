"""Shared experts and activations table from `moebench sweep` result folders
(benchmarks/device_shared_experts.sh).

    python -m benchmarks shared_table RESULTS_DIR > shared_experts.md

One row per (shape, layout, precision, experts backend, tokens): the time of the layer without
shared experts, with them fused (extra experts) and separate (a dense MLP), each one's ratio to
the layer without them and to its own memory / compute floor; then one row per (shape,
precision, tokens) of each activation (silu, swigluoai with biases, ...) and its ratio to silu.
Simulated rows (--simulate --tp N) use the measured experts time of the rank (the communication
is modeled, and the same for every variant); others the layer latency.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from benchmarks.bench_common import ok_rows


def load(root: Path) -> pd.DataFrame:
    df = ok_rows(root)
    for col, default in (("activation", "silu"), ("expert_bias", False), ("shared_experts", "none")):
        df[col] = df[col].fillna(default) if col in df else default
    df["t_us"] = df["experts_us"].where(df["modeled"].astype(bool), df["latency_us"]) if "experts_us" in df else df["latency_us"]
    df["precision"] = df["dtype"].astype(str) + df["quant"].map(lambda q: f" {q}" if q else "")
    df["layout"] = df.apply(lambda r: f"TP{r.tp}" if r.tp > 1 else (f"EP{r.ep}" if r.ep > 1 else "1 GPU"), axis=1)
    df["fn"] = df.apply(lambda r: r.activation + ("+bias" if str(r.expert_bias) in ("True", "true", "1") else ""), axis=1)
    return df


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None or pd.isna(v) else format(v, spec)


def shared_table(df: pd.DataFrame) -> str:
    keys = ["model", "layout", "precision", "experts", "fn", "tokens"]
    sub = df[df.model.isin(df[df.shared_experts != "none"].model.unique())]
    if sub.empty:
        return "(no rows with shared experts)"
    t = sub.pivot_table(index=keys, columns="shared_experts", values="t_us", aggfunc="first")
    fl = sub.pivot_table(index=keys, columns="shared_experts", values="floor_us", aggfunc="first")
    ok = sub.groupby(keys)["correct"].all()
    modes = [m for m in ("none", "fused", "separate") if m in t.columns]
    head = ["model", "layout", "precision", "experts", "activation", "M"] + [f"{m} us" for m in modes]
    head += [f"{m} / none" for m in modes if m != "none"] + [f"{m} / floor" for m in modes] + ["faster", "correct"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for idx, row in t.iterrows():
        cells = [str(v) for v in idx] + [_fmt(row.get(m)) for m in modes]
        for m in modes:
            if m != "none":
                cells.append(_fmt(row.get(m) / row.get("none") if "none" in modes else None, ".2f"))
        for m in modes:
            f = fl.loc[idx].get(m)
            cells.append(_fmt(row.get(m) / f if f else None, ".2f"))
        pair = {m: row.get(m) for m in ("fused", "separate") if m in modes and pd.notna(row.get(m))}
        cells.append(min(pair, key=pair.get) if len(pair) == 2 else "-")
        cells.append(str(bool(ok.loc[idx])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def activation_table(df: pd.DataFrame) -> str:
    sub = df[df.shared_experts == "none"]
    sub = sub[sub.model.isin(sub[sub.fn != "silu"].model.unique())]
    if sub.empty:
        return "(no rows with another activation)"
    keys = ["model", "layout", "precision", "experts", "tokens"]
    t = sub.pivot_table(index=keys, columns="fn", values="t_us", aggfunc="first")
    fl = sub.pivot_table(index=keys, columns="fn", values="floor_us", aggfunc="first")
    fns = sorted(t.columns, key=lambda f: (f != "silu", f))
    head = ["model", "layout", "precision", "experts", "M"] + [f"{f} us" for f in fns]
    head += [f"{f} / silu" for f in fns if f != "silu"] + [f"{f} / floor" for f in fns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for idx, row in t.iterrows():
        cells = [str(v) for v in idx] + [_fmt(row.get(f)) for f in fns]
        cells += [_fmt(row.get(f) / row.get("silu") if "silu" in fns else None, ".2f") for f in fns if f != "silu"]
        cells += [_fmt(row.get(f) / fl.loc[idx].get(f) if fl.loc[idx].get(f) else None, ".2f") for f in fns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print both tables of the sweep results under argv[0] (default ./results)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    df = load(Path(argv[0] if argv else "results"))
    print("## Shared experts: fused vs separate vs none\n")
    print(shared_table(df))
    print("\n## Activations\n")
    print(activation_table(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
