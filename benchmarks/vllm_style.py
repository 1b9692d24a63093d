"""moebench's `triton` experts against a vLLM-style kernel with vLLM's shipped H200 configs, in one
run on the same routings (issues 3 and 5: design.md's reference table, re-measured here).

    PYTHONPATH=. python -m benchmarks vllm_style [--tokens 1,16,...] [--routings 4] [--smoke]

The vLLM-style GEMM part is the `vllm-triton` experts (moebench.kernels.vllm_triton: vLLM's
fused-MoE kernel structure): one sorted-token grouped GEMM kernel used twice, with
  GEMM1   rows of x gathered by pair // topk, a program walks BLOCK_SIZE_N *consecutive* rows of
          w13 (E, 2I, H), output (M*topk, 2I) written at the pair's row
  act     SiLU(gate) * up as its own launch -> (M*topk, I)
  GEMM2   rows of the activation by pair, times the router weight -> (M*topk, H)
  sum     over top-k (its own launch) -> (M, H)
on vLLM's alignment (`vllm_align`, the sorted path), with the tile configs of vLLM's `E=8,N=14336` and `E=128,N=768` H200 files (benchmarks/
vllm_h200_configs.json: the six fields as lists in KEYS order; nearest token key, as vLLM looks them up). moebench's `triton` GEMM part
(fused SiLU-mul epilogue, paired gate/up walk, atomic top-k sum) is timed with its shipped tuned
file and with vLLM's config, so kernel and config effects separate (`ours`, `ours_vcfg`: the default
code path, so GEMM1 is the wide walk where TritonOptions().wide_gemm1 "auto" says so); at vLLM's
config also with the paired gate/up walk (`wide_gemm1=False`) with and without TMA, and with the
wide GEMM1 (gate and up as one tile, one dot: `wide_gemm1=True`).

Per (shape, tokens) several routings (seeds) are timed, each CUDA-graph replayed, alignment outside
the timed region (as design.md's "GEMM part"); the table gives the median over routings of each
variant, the median of the per-routing ratios, the experts hit per routing and each GEMM1 alone.
Writes vllm_style.csv / vllm_style.md under $OUT (default ./bench-out). --smoke: tiny shapes on
CPU under the Triton interpreter, checking the script (its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import pandas as pd
import torch
import triton

import moebench
from moebench.bench.timing import time_cpu, time_cuda
from moebench.kernels.triton.align import moe_align_block_size
from moebench.kernels.triton.env import num_sms
from moebench.kernels.triton.experts import select_config
from moebench.kernels.triton.gemm import fused_moe_gemms, launch_gemm1
from moebench.kernels.triton.options import TritonOptions, layer_split_k, resolve_use_tma
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.kernels.vllm_triton import vllm_align, vllm_gemm1, vllm_gemms
from moebench.report import markdown
from moebench.results import atomic_write_text

ON_GPU = torch.cuda.is_available()
# name: (E, topk, H, I, vLLM config file key)
SHAPES = {"mixtral": (8, 2, 4096, 14336, "E=8,N=14336"), "qwen3-30b-a3b": (128, 8, 2048, 768, "E=128,N=768")}
SMOKE_SHAPES = {"tiny": (8, 2, 64, 96, "E=8,N=14336")}
REF = {"mixtral": [191, 583, 673, 791, 1682, 5684], "qwen3-30b-a3b": [37, 209, 302, 332, 409, 906]}
TOKENS = [1, 16, 64, 256, 1024, 4096]
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def vllm_style_gemm1(x, w13, blocks, topk, cfg) -> torch.Tensor:
    """The vllm-triton experts' GEMM1 alone: x (M, H), w13 (E, 2I, H) -> (M*topk, 2I), rows by pair."""
    return vllm_gemm1(x, w13, blocks, topk, cfg)


def vllm_style_moe(x, w13, w2, topk_weights, blocks, topk, cfg) -> torch.Tensor:
    """The vllm-triton experts after the alignment (4 launches: GEMM1, SiLU-and-mul, GEMM2, top-k
    sum) -> (M, H) in x's dtype; blocks from `vllm_align`."""
    return vllm_gemms(x, w13, w2, topk_weights, blocks, topk, cfg)


def vllm_config(table: dict[str, dict], m: int) -> dict[str, int]:
    """vLLM's lookup: the entry whose token key is nearest to m."""
    key = min(table, key=lambda k: abs(int(k) - m))
    return table[key]


def _time(fn, reps=30):
    if ON_GPU:
        return time_cuda(fn, reps=reps, graph_calls=5).median_us
    return time_cpu(fn, warmup=1, reps=1).median_us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--routings", type=int, default=4, help="routings (seeds) per point")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        SHAPES.update(SMOKE_SHAPES)
        REF["tiny"] = REF["mixtral"]
        args.shapes, args.routings = "tiny", min(args.routings, 2)
    out_dir = os.environ.get("OUT", "bench-out")
    os.makedirs(out_dir, exist_ok=True)
    tables = json.loads((Path(__file__).parent / "vllm_h200_configs.json").read_text())
    dev = torch.device("cuda" if ON_GPU else "cpu")
    gpu = torch.cuda.get_device_name() if ON_GPU else "cpu (smoke: times mean nothing)"
    head = f"GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}, bf16, {args.routings} routings per point"
    print("# " + head, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, inter, key = SHAPES[shape]
        table = {t: dict(zip(KEYS, c)) for t, c in tables[key].items()}
        dt = torch.bfloat16
        w13 = torch.randn(e, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5)
        w2 = torch.randn(e, h, inter, dtype=dt, device=dev).mul_(inter**-0.5)
        for m in [int(t) for t in args.tokens.split(",")]:
            vcfg = vllm_config(table, m)
            ocfg, src = select_config(m, k, w13, w2, e, dt)
            per = {name: [] for name in ("vllm", "ours", "ours_vcfg", "ours_vcfg_paired", "ours_vcfg_notma", "ours_vcfg_wide", "vllm_g1",
                                         "ours_g1", "ours_vcfg_g1", "ours_vcfg_g1_notma", "ours_vcfg_g1_wide")}
            hits, errs = [], []
            for r in range(args.routings):
                g = torch.Generator(device=dev).manual_seed(1000 * r + m)
                x = torch.randn(m, h, dtype=dt, device=dev, generator=g)
                tw, ids = fused_topk_softmax(torch.randn(m, e, device=dev, generator=g), k, renormalize=True)
                hits.append(int(torch.unique(ids).numel()))
                va = vllm_align(ids, vcfg["BLOCK_SIZE_M"], e, None, per_pair=False)
                va_ours = moe_align_block_size(ids, vcfg["BLOCK_SIZE_M"], e)  # moebench's kernels at vLLM's config
                oa = moe_align_block_size(ids, ocfg["BLOCK_SIZE_M"], e)
                opts = TritonOptions()
                split = layer_split_k(opts, m, k, e, e, h, inter, ocfg, oa.max_blocks, num_sms(dev))  # as the layer splits
                otma = resolve_use_tma(opts, ocfg, dt)
                vtma = resolve_use_tma(opts, vcfg, dt)
                paired, notma = TritonOptions(wide_gemm1=False), TritonOptions(use_tma=False, wide_gemm1=False)
                wide = TritonOptions(wide_gemm1=True)
                if r == 0:  # correctness of the vLLM-style path, against the float64 reference
                    ref = moebench.reference_moe(x, w13, w2, tw, ids, None)
                    got = vllm_style_moe(x, w13, w2, tw, va, k, vcfg)
                    errs.append(((got.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item())
                    del ref, got
                per["vllm"].append(_time(lambda: vllm_style_moe(x, w13, w2, tw, va, k, vcfg)))
                per["ours"].append(_time(lambda: fused_moe_gemms(x, w13, w2, tw, oa, k, ocfg, split)))
                per["ours_vcfg"].append(_time(lambda: fused_moe_gemms(x, w13, w2, tw, va_ours, k, vcfg, 1)))
                # GEMM1 variants of moebench's kernel at vLLM's config: the paired walk with TMA weight
                # loads as the default says and without TMA, and the wide single-dot walk
                per["ours_vcfg_paired"].append(_time(lambda: fused_moe_gemms(x, w13, w2, tw, va_ours, k, vcfg, 1, options=paired)))
                per["ours_vcfg_notma"].append(_time(lambda: fused_moe_gemms(x, w13, w2, tw, va_ours, k, vcfg, 1, options=notma)))
                per["ours_vcfg_wide"].append(_time(lambda: fused_moe_gemms(x, w13, w2, tw, va_ours, k, vcfg, 1, options=wide)))
                per["vllm_g1"].append(_time(lambda: vllm_style_gemm1(x, w13, va, k, vcfg), reps=20))
                per["ours_g1"].append(_time(lambda: launch_gemm1(x, w13, oa, k, ocfg, otma), reps=20))
                per["ours_vcfg_g1"].append(_time(lambda: launch_gemm1(x, w13, va_ours, k, vcfg, vtma), reps=20))
                per["ours_vcfg_g1_notma"].append(_time(lambda: launch_gemm1(x, w13, va_ours, k, vcfg, False), reps=20))
                per["ours_vcfg_g1_wide"].append(_time(lambda: launch_gemm1(x, w13, va_ours, k, vcfg, False, wide=True), reps=20))
                if r == 0:  # the wide walk gives the paired walk's result
                    got = fused_moe_gemms(x, w13, w2, tw, va_ours, k, vcfg, 1, options=wide)
                    ref = fused_moe_gemms(x, w13, w2, tw, va_ours, k, vcfg, 1, options=paired)
                    errs.append(((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item())
            med = {n: statistics.median(v) for n, v in per.items()}
            ratio = statistics.median(o / v for o, v in zip(per["ours"], per["vllm"]))
            ratio_v = statistics.median(o / v for o, v in zip(per["ours_vcfg"], per["vllm"]))
            ref_us = REF[shape][TOKENS.index(m)] if m in TOKENS else float("nan")
            row = dict(
                shape=shape, tokens=m, experts_hit="/".join(map(str, hits)), vllm_us=round(med["vllm"], 1),
                ours_us=round(med["ours"], 1), ours_over_vllm=round(ratio, 3), ours_vcfg_us=round(med["ours_vcfg"], 1),
                ours_vcfg_over_vllm=round(ratio_v, 3), ours_vcfg_paired_us=round(med["ours_vcfg_paired"], 1),
                ours_vcfg_notma_us=round(med["ours_vcfg_notma"], 1),
                ours_vcfg_wide_us=round(med["ours_vcfg_wide"], 1),
                wide_over_paired=round(statistics.median(a / b for a, b in zip(per["ours_vcfg_wide"], per["ours_vcfg_paired"])), 3),
                vllm_g1_us=round(med["vllm_g1"], 1), ours_g1_us=round(med["ours_g1"], 1),
                ours_vcfg_g1_us=round(med["ours_vcfg_g1"], 1), ours_vcfg_g1_notma_us=round(med["ours_vcfg_g1_notma"], 1),
                ours_vcfg_g1_wide_us=round(med["ours_vcfg_g1_wide"], 1), design_ref_us=ref_us,
                ours_over_design_ref=round(med["ours"] / ref_us, 3), vllm_config="/".join(str(vcfg[x]) for x in KEYS),
                ours_config="/".join(str(ocfg[x]) for x in KEYS) + f" sk{split}" + (" tma" if otma else ""),
                ours_config_source=src, vllm_style_err=f"{errs[0]:.2e}", wide_vs_paired_err=f"{errs[1]:.2e}",
                per_routing_vllm=" ".join(f"{t:.1f}" for t in per["vllm"]), per_routing_ours=" ".join(f"{t:.1f}" for t in per["ours"]),
            )
            rows.append(row)
            print(" ".join(f"{a}={b}" for a, b in row.items()), flush=True)
            _write(out_dir, head, rows)
        w13 = w2 = None  # free this shape's weights before the next shape's
        if ON_GPU:
            torch.cuda.empty_cache()
    print(open(os.path.join(out_dir, "vllm_style.md")).read())
    return 0


def _write(out_dir: str, head: str, rows: list[dict]) -> None:
    """csv and markdown, rewritten after every point (atomic renames)."""
    df = pd.DataFrame(rows)
    atomic_write_text(Path(out_dir) / "vllm_style.csv", df.to_csv(index=False))
    table = markdown(df.drop(columns=["per_routing_vllm", "per_routing_ours"]))
    atomic_write_text(Path(out_dir) / "vllm_style.md", head + "\n\n" + table)
