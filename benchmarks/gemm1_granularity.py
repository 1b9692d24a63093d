"""GEMM1's weight-streaming rate at decode against the number of experts hit, in one run (issue 3:
why a decode layer that hits few experts sits further from the memory floor than one that hits
many).

    PYTHONPATH=. python -m benchmarks gemm1_granularity [--smoke]

At 16 tokens, DeepSeek-V3's EP8 shard (about 9-13 of 32 local experts hit) streams its GEMM1
weights at ~84% of the read ceiling, the same shard with all 32 experts hit at ~100%, with the same
16-row tile config. If the gap is the grid's granularity (few programs per SM, a ragged last
wave), the rate rises with the experts hit and with the programs per expert (narrower N tiles);
if it is a fixed cost per launch, it rises with the bytes alone, as a plain read of as many bytes
does (`read_tbps`: moebench's read-ceiling probe over a buffer of the point's size). Each point: GEMM1 alone
(`launch_gemm1`) on `pairs` pairs for each of `hit` experts (topk 1, one row block per expert),
CUDA-graph replay; rate = the hit experts' w13 bytes / time. Writes gemm1_granularity.csv / .md
under $OUT (default ./bench-out). --smoke: a tiny shape on CPU under the Triton interpreter (checks
the script; its times mean nothing).
"""

from __future__ import annotations

import argparse

import torch

from moebench.bench.hardware import read_gbps_candidates
from moebench.kernels.triton.align import moe_align_block_size
from moebench.kernels.triton.gemm import launch_gemm1

from benchmarks.bench_common import ON_GPU, script_setup, timed_us, write_rows

# name: (E_local, H, I, pairs per hit expert, experts hit to try)
CASES = {"dsv3-expert": (32, 7168, 2048, 4, (4, 9, 13, 18, 26, 32)),
         "mixtral-expert": (8, 4096, 14336, 1, (1, 2, 4, 8))}
SMOKE = {"tiny": (4, 64, 32, 2, (1, 4))}
# 16-row tiles as the decode heuristic picks them, with 2x / 0.5x the programs per expert (BLOCK_SIZE_N)
CONFIGS = {"n64": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=4, num_stages=3),
           "n32": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=4, num_stages=3),
           "n128": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    cases = SMOKE if args.smoke else CASES
    out_dir, dev, head = script_setup("bf16; GEMM1 alone at decode, us and TB/s of w13")
    print("# " + head, flush=True)
    dt = torch.bfloat16
    rows = []
    for name, (e_local, h, inter, pairs, hits) in cases.items():
        w13 = torch.randn(e_local, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5)
        expert_bytes = 2 * inter * h * w13.element_size()
        for hit in hits:
            ids = torch.arange(hit, dtype=torch.int32, device=dev).repeat_interleave(pairs).reshape(-1, 1)
            x = torch.randn(ids.shape[0], h, dtype=dt, device=dev)
            row = dict(case=name, experts_hit=hit, pairs=ids.shape[0], mbytes=round(hit * expert_bytes / 1e6, 1))
            if ON_GPU:  # the same number of bytes read by the ceiling probe, for comparison
                row["read_tbps"] = round(max(read_gbps_candidates(dev, hit * expert_bytes)[0].values()) / 1e3, 3)
            for cname, cfg in CONFIGS.items():
                if args.smoke:
                    cfg = dict(cfg, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
                align = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], e_local)
                fn = lambda align=align, cfg=cfg: launch_gemm1(x, w13, align, 1, cfg)  # noqa: E731
                us = timed_us(fn, reps=20, graph_calls=3)
                row[f"{cname}_us"] = round(us, 1)
                row[f"{cname}_tbps"] = round(hit * expert_bytes / us / 1e6, 3)
                row[f"{cname}_programs"] = hit * -(-inter // (cfg["BLOCK_SIZE_N"] // 2))
            rows.append(row)
            write_rows(rows, out_dir, "gemm1_granularity", head)
        w13 = None
        if ON_GPU:
            torch.cuda.empty_cache()
    return 0
