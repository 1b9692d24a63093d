"""Measured dispatch / combine beside the modeled ones, from two sets of `moebench sweep` folders.

    python -m benchmarks ep_model_table MEASURED_DIR --modeled MODELED_DIR > ep_model.md

MEASURED_DIR: sweeps over real ranks (e.g. the vendor job's EP2 runs with two ranks on one GPU):
their rows carry each phase timed between barriers (dispatch_us, experts_us, combine_us).
MODELED_DIR: the same points modeled (`sweep --simulate` or `compare tp-vs-ep` folders: the
communication priced from the model's published points, docs/comm-model.md). Rows are joined on
(prepare/finalize, dtype, quant, tokens per rank); each line gives the measured and modeled dispatch and combine and measured / modeled, and
per transport the smallest token count's combined time against the model's (its fixed cost) with a
flag where they differ by more than 25%. Both ranks on one GPU is not a real link: the measured
phases hold the kernels' fixed cost (launch, barrier, DeepEP's quantisation inside dispatch) and a
copy through one GPU's memory, not NVLink; the table says what it compares and nothing more.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from benchmarks.bench_common import ok_rows
from moebench.report import markdown

#: rows meet on the transport, the precision and the tokens each rank sends (the experts behind a
#: transport do not change what the model prices)
KEYS = ["prepare_finalize", "dtype", "quant", "rank_tokens"]
FIXED_FLAG = 0.25


def per_rank(df: pd.DataFrame) -> pd.DataFrame:
    """`rank_tokens` as the tokens of the first rank ("16,16" -> 16; a sweep's `tokens` are per rank
    already, a compare's are the whole batch), `tokens` where a row has none."""
    df = df.copy()
    first = df["rank_tokens"].astype(str).str.split(",").str[0] if "rank_tokens" in df else None
    df["rank_tokens"] = pd.to_numeric(first, errors="coerce") if first is not None else float("nan")
    df["rank_tokens"] = df["rank_tokens"].fillna(df["tokens"]).astype(int)
    return df


def joined(measured: pd.DataFrame, modeled: pd.DataFrame) -> pd.DataFrame:
    cols = KEYS + ["dispatch_us", "combine_us"]
    m = per_rank(measured)[[c for c in cols + ["experts", "device"] if c in measured or c == "rank_tokens"]].copy()
    s = per_rank(modeled)[cols].drop_duplicates(KEYS).copy()
    df = m.merge(s, on=KEYS, suffixes=("_measured", "_modeled"))
    for op in ("dispatch", "combine"):
        df[f"{op}_ratio"] = (df[f"{op}_us_measured"] / df[f"{op}_us_modeled"]).round(2)
    return df.sort_values(KEYS).reset_index(drop=True)


def fixed_costs(df: pd.DataFrame) -> pd.DataFrame:
    """Per (transport, dtype): the smallest token count's dispatch + combine, measured vs modeled."""
    rows = []
    for (pf, dtype, quant), g in df.groupby(["prepare_finalize", "dtype", "quant"], dropna=False):
        r = g.sort_values("rank_tokens").iloc[0]
        meas = r["dispatch_us_measured"] + r["combine_us_measured"]
        mod = r["dispatch_us_modeled"] + r["combine_us_modeled"]
        rows.append({"prepare_finalize": pf, "dtype": dtype, "quant": quant, "rank_tokens": int(r["rank_tokens"]),
                     "measured_us": round(meas, 1), "modeled_us": round(mod, 1), "measured_over_modeled":
                     round(meas / mod, 2), "beyond_25pct": abs(meas / mod - 1) > FIXED_FLAG})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("measured", type=Path)
    ap.add_argument("--modeled", type=Path, required=True)
    a = ap.parse_args(argv)
    meas, mod = ok_rows(a.measured), ok_rows(a.modeled)
    meas = meas[meas["dispatch_us"].notna()] if "dispatch_us" in meas else meas.iloc[0:0]
    mod = mod[mod["dispatch_us"].notna()] if "dispatch_us" in mod else mod.iloc[0:0]
    df = joined(meas, mod)
    if df.empty:
        print("error: no row of the measured folders has a modeled row of the same "
              "(prepare/finalize, experts, dtype, quant, tokens) with dispatch times", file=sys.stderr)
        return 2
    print("measured (rows' own phases) vs modeled (--simulate), us\n")
    print(markdown(df))
    print(f"\nfixed cost: the smallest count's dispatch + combine (flag: off by more than {FIXED_FLAG:.0%})\n")
    print(markdown(fixed_costs(df)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
