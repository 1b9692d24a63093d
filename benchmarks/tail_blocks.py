"""Half-height tail blocks for prefill (issue 3), A/B in one run: the `triton` layer (routing +
experts) with `moe_align_block_size(tail=False)` and `tail=True` (moebench.kernels.triton_moe.
DEFAULT_TAIL_BLOCKS), on the same routings, CUDA-graph replay, each checked against the float64
reference first.

    PYTHONPATH=. python benchmarks/tail_blocks.py [--tokens 256,1024,4096] [--routings 2] [--smoke]

Why: at 128-row tiles every expert's last block is padded to 128 rows, and the GEMMs multiply the
padding too. At ~256 pairs per expert (Mixtral / DeepSeek-V3 EP8 1024 tokens, Qwen3-30B 4096)
about half the experts pad ~120 rows: ~25% more rows than pairs. With tail blocks a remainder of at
most 64 rows goes into a 64-row block of a second layout (GEMM1 and GEMM2 launched once more each).
Predicted: -8 to -12% of the layer at those points, ~0 at 4096 tokens of Mixtral (1024 pairs per
expert: ~6% padding), a small loss where few experts have a short remainder (two launches more).
Columns: rows_off / rows_on = rows the GEMMs multiply (pairs + padding) without and with tails.
Writes tail_blocks.csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on CPU under
the Triton interpreter (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch
import triton

import moebench
from moebench.bench.timing import time_cpu, time_cuda
from moebench.kernels.moe_align import moe_align_block_size
from moebench.kernels.triton_moe import fused_moe, fused_topk_softmax, select_config
from moebench.report import _markdown
from moebench.results import atomic_write_text
from moebench.tuning.configs import default_config

ON_GPU = torch.cuda.is_available()
# name: (E global, topk, H, I, E local, tuned file fits the routing); see bench_triton.HEURISTIC_ONLY
SHAPES = {"mixtral": (8, 2, 4096, 14336, 8, True), "qwen3-30b-a3b": (128, 8, 2048, 768, 128, True),
          "dsv3-ep8-local": (32, 8, 7168, 2048, 32, False), "dsv3-ep8": (256, 8, 7168, 2048, 32, True)}
SMOKE = {"tiny": (8, 2, 64, 32, 8, False), "tiny-map": (16, 4, 64, 32, 8, False)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--routings", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        SHAPES.update(SMOKE)
        args.shapes, args.tokens, args.routings = ",".join(SMOKE), "40", 1
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if ON_GPU else "cpu")
    head = (f"{torch.cuda.get_device_name() if ON_GPU else 'cpu (smoke: times mean nothing)'}, torch "
            f"{torch.__version__}, triton {triton.__version__}, bf16; layer = routing + triton experts (us)")
    print("# " + head, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, inter, e_local, tuned_fits = SHAPES[shape]
        dt = torch.bfloat16
        w13 = torch.randn(e_local, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5)
        w2 = torch.randn(e_local, h, inter, dtype=dt, device=dev).mul_(inter**-0.5)
        emap = None
        if e_local < e:
            emap = torch.full((e,), -1, dtype=torch.int32, device=dev)
            emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=dev)
        for m in [int(t) for t in args.tokens.split(",")]:
            cfg, src = select_config(m, k, w13, w2, e, dt)
            if not tuned_fits or args.smoke:
                cfg, src = default_config(m, e, inter, h, k, dt), "default heuristic"
            if args.smoke:
                cfg = dict(cfg, BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
            row = dict(shape=shape, tokens=m, config="/".join(str(v) for v in cfg.values()), source=src)
            ratios, times = [], {"off": [], "on": []}
            for r in range(args.routings):
                g = torch.Generator(device=dev).manual_seed(1000 * r + m)
                x = torch.randn(m, h, dtype=dt, device=dev, generator=g)
                logits = torch.randn(m, e, device=dev, generator=g)
                tw, ids = fused_topk_softmax(logits, k)
                ref = moebench.reference_moe(x, w13, w2, tw, ids, emap)
                t = {}
                for name in ("off", "on", "on2", "off2"):  # ABBA: drift cancels in the ratio
                    tail = name.startswith("on")

                    def layer(tail=tail):
                        w_, i_ = fused_topk_softmax(logits, k)
                        return fused_moe(x, w13, w2, w_, i_, emap, e, cfg, tail=tail)

                    out = layer()
                    err = ((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
                    if err > 2e-2:
                        raise RuntimeError(f"{shape} M={m} tail={tail}: error {err:.2e} against the reference")
                    row[f"err_{'on' if tail else 'off'}"] = f"{err:.1e}"
                    tm = time_cuda(layer, reps=20, graph_calls=3) if ON_GPU else time_cpu(layer, warmup=0, reps=1)
                    t[name] = tm.median_us
                times["off"] += [t["off"], t["off2"]]
                times["on"] += [t["on"], t["on2"]]
                ratios.append((t["on"] + t["on2"]) / (t["off"] + t["off2"]))
                if r == 0:  # rows multiplied, from the layouts of this routing
                    a0 = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], e_local, emap)
                    a1 = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], e_local, emap, tail=True)
                    local = ids.long() if emap is None else emap.long()[ids.long()]
                    row.update(pairs=int((local >= 0).sum()), rows_off=int(a0.num_tokens_post_padded.item()),
                               rows_on=int(a1.num_tokens_post_padded.item() + a1.tail.num_tokens_post_padded.item()))
            row.update(off_us=round(statistics.median(times["off"]), 1), on_us=round(statistics.median(times["on"]), 1),
                       on_over_off=round(statistics.median(ratios), 3),
                       per_routing=" ".join(f"{v:.3f}" for v in ratios))
            rows.append(row)
            print(" ".join(f"{a}={b}" for a, b in row.items()), flush=True)
            df = pd.DataFrame(rows)
            atomic_write_text(out_dir / "tail_blocks.csv", df.to_csv(index=False))
            atomic_write_text(out_dir / "tail_blocks.md", head + "\n\n" + _markdown(df))
        w13 = w2 = None
    print((out_dir / "tail_blocks.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
