"""Alignment above the one-launch limit, A/B in one run (issue 3): `scan` (a (local expert, chunk)
grid, each program scanning its chunk for its expert) against `sort` (per-chunk histograms, then
each chunk sorted by expert and scattered) over chunk sizes, and `auto` (the rule the layer uses,
TritonOptions' align_method "auto"), on the layer's routing and BLOCK_SIZE_M, CUDA-graph replay.
Every result is checked against the torch alignment first.

    PYTHONPATH=. python -m benchmarks align_methods [--tokens 256,1024,4096,16384] [--chunks 256,512,1024,2048] [--smoke]

Writes align_methods.csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on CPU under
the Triton interpreter (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch

from moebench.kernels.triton.align import moe_align_block_size, moe_align_block_size_torch
from moebench.kernels.triton.experts import select_config
from moebench.kernels.triton.options import TritonOptions
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.report import markdown
from moebench.results import atomic_write_text

from benchmarks.bench_common import SHAPES, script_setup, timed_us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,4096,16384")
    ap.add_argument("--chunks", default="256,512,1024,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    out_dir, dev, header = script_setup("alignment: scan vs sort")
    print(header)
    shapes = {n: SHAPES[n] for n in a.shapes.split(",")}
    tokens = [int(t) for t in a.tokens.split(",")]
    chunks = [int(c) for c in a.chunks.split(",")]
    if a.smoke:
        shapes = {"smoke": (12, 4, 64, 32, 12), "smoke-map": (24, 4, 64, 32, 12)}
        tokens, chunks = [300], [64, 256]
    rows = []
    for name, (e, k, h, inter, e_local) in shapes.items():
        emap = None
        if e_local < e:
            emap = torch.full((e,), -1, dtype=torch.int32, device=dev)
            emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=dev)
        # Shape-only weights on the device (expanded views, no memory) for the config lookup.
        w13 = torch.empty(1, dtype=torch.bfloat16, device=dev).expand(e_local, 2 * inter, h)
        w2 = torch.empty(1, dtype=torch.bfloat16, device=dev).expand(e_local, h, inter)
        for m in tokens:
            if m * k <= TritonOptions().one_launch_max_pairs:
                continue  # the one-launch kernel's range: neither method runs there
            g = torch.Generator(device=dev).manual_seed(m)
            _, ids = fused_topk_softmax(torch.randn(m, e, device=dev, generator=g), k)
            bm = select_config(m, k, w13, w2, e, torch.bfloat16)[0]["BLOCK_SIZE_M"]
            want = moe_align_block_size_torch(ids, bm, e_local, emap)
            variants = [("scan", None), ("auto", None)] + [("sort", c) for c in chunks]
            row = dict(shape=name, tokens=m, pairs=m * k, block_m=bm)
            for method, chunk in variants:
                label = f"sort{chunk}" if chunk else method

                def run(opts=TritonOptions(align_method=method), chunk=chunk):
                    return moe_align_block_size(ids, bm, e_local, emap, options=opts, chunk=chunk)

                got = run()
                same = all(torch.equal(getattr(got, f), getattr(want, f))
                           for f in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"))
                if not same:
                    print(f"{name} {m} {label}: MISMATCH with the torch alignment", file=sys.stderr)
                    return 1
                row[f"{label}_us"] = round(timed_us(run, reps=30, graph_calls=10), 2)
            best = min((c for c in row if c.startswith("sort")), key=lambda c: row[c])
            row["best_sort"] = best[:-3]
            row["best_sort/scan"] = round(row[best] / row["scan_us"], 3)
            row["auto/best"] = round(row["auto_us"] / min(row["scan_us"], row[best]), 3)
            rows.append(row)
            print(row, flush=True)
    df = pd.DataFrame(rows)
    atomic_write_text(out_dir / "align_methods.csv", df.to_csv(index=False))
    atomic_write_text(out_dir / "align_methods.md", header + "\n\n" + markdown(df) + "\n")
    print(markdown(df))
    return 0
