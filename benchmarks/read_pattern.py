"""Does pairing gate and up rows cost HBM bandwidth? (issue 3: Mixtral M=16 streams w13 at ~4.3 TB/s
in moebench's GEMM1, vLLM's unfused GEMM1 at ~4.8.)

    PYTHONPATH=. python -m benchmarks read_pattern [--experts 8 --inter 14336 --hidden 4096]

Reads every expert's w13 (E, 2I, H) bf16 once with the tile walk of the two GEMM1 layouts and no
MMA: `paired` (moebench: a program takes BLOCK_N/2 gate rows n.. and the same up rows I+n..) and
`contiguous` (vLLM: a program takes BLOCK_N consecutive rows of 2I), for a few (BLOCK_N, BLOCK_K,
stages, warps), CUDA-graph timed (moebench.bench.timing.time_cuda). Prints GB/s per variant; the
gap between the best of each walk is what the layout costs.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from moebench.bench.timing import time_cuda


@triton.jit
def _stream_w13(w_ptr, out_ptr, N_INTER, H, stride_e, stride_n, PAIRED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    # program (expert, column tile); sums the tile so the loads cannot be dropped
    e = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    if PAIRED:  # BLOCK_N / 2 gate rows and the same up rows, I apart
        rows = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        g = w_ptr + e * stride_e + rows[:, None] * stride_n + offs_k[None, :]
        u = g + N_INTER * stride_n
        acc = tl.zeros((BLOCK_N // 2, BLOCK_K), tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            acc += tl.load(g + k * BLOCK_K).to(tl.float32) + tl.load(u + k * BLOCK_K).to(tl.float32)
    else:  # BLOCK_N consecutive rows of the stacked (2I, H) matrix
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        p = w_ptr + e * stride_e + rows[:, None] * stride_n + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            acc += tl.load(p + k * BLOCK_K).to(tl.float32)
    tl.store(out_ptr + e * tl.num_programs(0) + pid, tl.sum(acc))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--hidden", type=int, default=4096)
    a = ap.parse_args(argv)
    e, i, h = a.experts, a.inter, a.hidden
    w = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    print(f"w13 ({e}, {2 * i}, {h}) bf16: {nbytes / 1e9:.2f} GB, {torch.cuda.get_device_name()}")
    best: dict[str, float] = {}
    for paired in (True, False):
        for bn, bk, stages, warps in ((64, 256, 3, 4), (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 3, 8), (32, 256, 4, 4)):
            grid = ((2 * i) // bn, e)
            out = torch.empty(grid[0] * e, device="cuda")

            def run():
                _stream_w13[grid](w, out, i, h, w.stride(0), w.stride(1), PAIRED=paired, BLOCK_N=bn, BLOCK_K=bk,
                                  num_stages=stages, num_warps=warps)

            t = time_cuda(run, warmup=3, reps=30)
            gbps = nbytes / (t.median_us * 1e-6) / 1e9
            name = "paired" if paired else "contiguous"
            best[name] = max(best.get(name, 0.0), gbps)
            print(f"{name:10s} BLOCK_N={bn:3d} BLOCK_K={bk:3d} stages={stages} warps={warps}: "
                  f"{t.median_us:8.1f} us  {gbps:7.0f} GB/s")
    print("best: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in best.items()))
    return 0
