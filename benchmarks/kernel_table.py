"""A table of moebench's measured experts times, as `moebench.bench.kernel_tables` reads it.

    python -m benchmarks kernel_table RUN... --out FILE.csv
    python -m benchmarks kernel_table --vllm-kernel CSV... --gpu "NVIDIA H200" --date D --revision R --out FILE.csv

From sweep run folders (the `kernel_times` device job's): one line per measured ok row of the
`triton` / `batched-triton` experts: a single-process row's latency, a simulated EP row's measured
experts time (the busiest rank's share: its pairs over its local experts); the GPU, date and
revision from each folder's metadata. From vllm_kernel's tables (PERF.md's raw files in
docs/perf/): the `triton_us` column of each shard (benchmarks/bench_common.py's shapes), with the
GPU, date and revision given. Lines are sorted; the file is written by an atomic rename.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from moebench.bench.kernel_tables import COLUMNS, precision_key
from moebench.fileio import atomic_write_text

#: vllm_kernel's precision names -> moebench's (its fp8 rows are 128x128 block scales)
VLLM_KERNEL_PRECISION = {"bf16": "bf16", "fp8": "fp8_w8a8 block[128,128]"}


def from_vllm_kernel(path: Path, gpu: str, date: str, revision: str) -> pd.DataFrame:
    from benchmarks.bench_common import bench_shape

    df = pd.read_csv(path)
    df = df[df.get("wrong", "-").astype(str).isin(["-", "nan", "False", ""]) & df.triton_us.notna()]
    out = []
    for r in df.itertuples():
        _, topk, hidden, inter, e_local = bench_shape(r.shape)
        out.append(dict(gpu=gpu, experts=e_local, topk=topk, hidden=hidden, intermediate=inter,
                        precision=VLLM_KERNEL_PRECISION[r.precision], tokens=int(r.tokens),
                        rows_per_expert=int(r.tokens) * topk / e_local, experts_us=float(r.triton_us), date=date,
                        revision=revision, source=f"{path.name}: {r.shape}"))
    return pd.DataFrame(out, columns=COLUMNS)


def from_runs(folders: list[Path]) -> pd.DataFrame:
    out = []
    for folder in folders:
        meta = json.loads((folder / "metadata.json").read_text()) if (folder / "metadata.json").is_file() else {}
        gpu = (meta.get("device_summary") or {}).get("name") or meta.get("gpu") or ""
        date = str(meta.get("created", meta.get("started", "")))[:10]
        revision = str(meta.get("git_revision", meta.get("revision", "")))
        rows = pd.read_csv(folder / "results.csv")
        rows = rows[(rows.status == "ok") & rows.experts.isin(["triton", "batched-triton"]) & (rows.device == "cuda")]
        for r in rows.itertuples():
            ep = int(r.ep)
            if bool(r.modeled) and ep > 1:  # a simulated EP row: its busiest rank's measured experts on its pairs
                pairs = [int(p) for p in str(getattr(r, "x_pairs_per_rank", "") or "").split(",") if p]
                if not pairs or pd.isna(r.experts_us):
                    continue
                e_local, inter = int(r.num_experts) // ep, int(r.intermediate)
                rpe, us = max(pairs) / e_local, float(r.experts_us)
            elif bool(r.modeled):  # a simulated TP row: rank 0's 1/tp shard on every token, measured
                if pd.isna(r.experts_us):
                    continue
                e_local, inter = int(r.num_experts), int(r.intermediate) // int(r.world_size)
                rpe, us = int(r.tokens) * int(r.topk) / e_local, float(r.experts_us)
            else:
                e_local = int(r.num_experts) // max(ep, 1)
                inter = int(r.intermediate) // (int(r.tp) if ep == 1 else 1)
                rpe, us = int(r.tokens) * int(r.topk) / e_local, float(r.latency_us)
            out.append(dict(gpu=gpu, experts=e_local, topk=int(r.topk), hidden=int(r.hidden), intermediate=inter,
                            precision=precision_key(r.dtype, "" if pd.isna(r.quant) else str(r.quant)),
                            tokens=int(r.tokens), rows_per_expert=rpe, experts_us=us, date=date, revision=revision,
                            source=f"{folder.name}"))
    # a simulated TP row comes once per modeled all-reduce, each with the same measured experts time
    return pd.DataFrame(out, columns=COLUMNS).drop_duplicates(ignore_index=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks kernel_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path, help="sweep run folders (results.csv + metadata.json)")
    ap.add_argument("--vllm-kernel", nargs="*", type=Path, default=[], help="vllm_kernel table CSVs (docs/perf/)")
    ap.add_argument("--gpu", default="NVIDIA H200", help="the GPU of --vllm-kernel tables")
    ap.add_argument("--date", default="", help="the date of --vllm-kernel tables")
    ap.add_argument("--revision", default="", help="the git revision of --vllm-kernel tables")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    frames = [from_vllm_kernel(p, a.gpu, a.date, a.revision) for p in a.vllm_kernel]
    if a.runs:
        frames.append(from_runs(a.runs))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    if df.empty:
        print("no measured triton / batched-triton rows in what was given")
        return 2
    df = df.sort_values(["gpu", "precision", "experts", "hidden", "intermediate", "topk", "tokens"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, df.to_csv(index=False, float_format="%.6g"))
    print(f"wrote {a.out}: {len(df)} lines, {df.groupby(['gpu', 'experts', 'hidden', 'intermediate', 'precision']).ngroups} shards")
    return 0
