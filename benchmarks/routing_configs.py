"""Launch shape of the routing kernel (issue 3), A/B in one run: `fused_topk_softmax` (softmax
top-k + renormalise in one Triton launch) with ROWS tokens per program and num_warps, against the
current rule (`moebench.kernels.triton.routing.topk_softmax_launch`), per (experts, topk, tokens), CUDA-graph replay of
10 back-to-back calls. Every variant is checked to give the rule's ids (and its weights to rounding) first.

    PYTHONPATH=. python -m benchmarks routing_configs [--tokens 1,16,256,4096] [--smoke]

Why: an earlier run (2026-11-29) measured the routing at 6.0 us for Qwen3-30B (128 experts)
and 7.9 us for DeepSeek-V3 (256) at one token, against 1.8 us for Mixtral (8): a sixth of the
Qwen3 M=1 layer (33.4 us). Writes routing_configs.csv / .md under $OUT (default ./bench-out).
--smoke: tiny shapes on CPU under the Triton interpreter (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse

import torch

from moebench.bench.timing import time_cpu, time_cuda
from moebench.kernels.triton.routing import fused_topk_softmax, topk_softmax_launch

from benchmarks.bench_common import script_setup, write_rows

ON_GPU = torch.cuda.is_available()
# name: (experts routed over, topk)
SHAPES = {"mixtral": (8, 2), "dsv3-ep8-local": (32, 8), "qwen3-30b-a3b": (128, 8), "deepseek-v3": (256, 8),
          "qwen3-next-80b-a3b": (512, 10)}
SMOKE = {"tiny": (16, 2), "tiny-wide": (128, 8)}
VARIANTS = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (4, 4), (8, 4), (16, 4), (16, 8))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        SHAPES.update(SMOKE)
        args.shapes = ",".join(SMOKE)
        args.tokens = "1,5"
    out_dir, dev, head = script_setup("fused_topk_softmax us per call (ROWS/warps)")
    print("# " + head, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        e, k = SHAPES[shape]
        for m in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator(device=dev).manual_seed(m)
            logits = torch.randn(m, e, device=dev, generator=g, dtype=torch.bfloat16)
            ref_w, ref_i = fused_topk_softmax(logits, k)
            rule = topk_softmax_launch(m, e)
            row = dict(shape=shape, experts=e, topk=k, tokens=m, rule=f"{rule[0]}/{rule[1]}")
            for r, w in VARIANTS:
                fn = lambda r=r, w=w: fused_topk_softmax(logits, k, rows=r, num_warps=w)  # noqa: E731
                got_w, got_i = fn()
                # same winners; weights to rounding (the sums' reduction order follows the layout)
                if not (torch.equal(got_i, ref_i) and torch.allclose(got_w, ref_w, rtol=1e-5, atol=1e-7)):
                    raise RuntimeError(f"{shape} M={m} rows={r} warps={w}: result differs from the rule's")
                t = time_cuda(fn, reps=30, graph_calls=10) if ON_GPU else time_cpu(fn, warmup=0, reps=1)
                row[f"{r}/{w}"] = round(t.median_us, 2)
            rule_us = row.get(row["rule"])
            best = min((v for v in row if "/" in v and v != "rule"), key=lambda v: row[v])
            row.update(best=best, best_us=row[best], rule_us=rule_us,
                       best_over_rule=round(row[best] / rule_us, 3) if rule_us else None)
            rows.append(row)
            write_rows(rows, out_dir, "routing_configs", head)
    print((out_dir / "routing_configs.md").read_text())
    return 0
