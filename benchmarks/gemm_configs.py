"""Per-GEMM tile configs: how far is each GEMM of the `triton` layer from its own best config?

    PYTHONPATH=. python -m benchmarks gemm_configs [--points qwen3-30b-a3b:4096,...] [--gemms 1,2]
        [--budget-s 420] [--smoke]

The layer runs GEMM1 (w13, SiLU-mul) and GEMM2 (w2, router weight, top-k sum) with one tile
config, as vLLM's file format has it. Both GEMMs must share BLOCK_SIZE_M (the alignment's block
size), but nothing else: SGLang already loads a separate config for the down projection
(`..._down.json`). At each point this script takes the config the layer uses now (shipped tuned
file or default heuristic), aligns the pairs with its BLOCK_SIZE_M, and times each GEMM alone
(CUDA-graph replay) under that config and under candidates that keep BLOCK_SIZE_M and vary the
rest (--bm: another BLOCK_SIZE_M for the alignment and both GEMMs, e.g. 64-row GEMM2 tiles where
the layer's 128-row blocks are half full) (BLOCK_SIZE_N/K, warps, stages; for GEMM2 also its K split). Every
candidate's output is checked against the current config's before it counts.

Writes gemm_configs.csv (one row per candidate) and gemm_configs.md (per point and GEMM: current,
best, best/current) under $OUT (default ./bench-out). --smoke: tiny shapes on CPU under the
Triton interpreter (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import time

import pandas as pd
import torch

from moebench.kernels.triton.align import align_pairs
from moebench.kernels.triton.configs import TILE_KEYS
from moebench.kernels.triton.env import num_sms, tma_ok
from moebench.kernels.triton.experts import select_config
from moebench.kernels.triton.gemm import launch_gemm1, launch_gemm2
from moebench.kernels.triton.options import TritonOptions, gemm1_walk, layer_split_k, resolve_use_tma
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.report import markdown
from moebench.results import atomic_write_text

from benchmarks.bench_common import ON_GPU, SHAPES, script_setup, seeded_inputs, timed_us

# Largest layer/floor gaps of the 2026-11-29 kernel table first (PERF.md).
POINTS = ("qwen3-30b-a3b:4096,qwen3-30b-a3b:1024,dsv3-ep8-local:1024,mixtral:1024,dsv3-ep8-local:4096,"
          "mixtral:4096,qwen3-30b-a3b:1,dsv3-ep8-local:256,mixtral:256,qwen3-30b-a3b:256,dsv3-ep8:16,"
          "qwen3-30b-a3b:16,mixtral:16")
SMOKE = {"tiny": (16, 2, 64, 32, 16), "tiny-map": (32, 4, 64, 32, 8)}
SMEM = 220 * 1024  # bytes of shared memory a config's pipeline may use (H200: 227 KB per block)


def candidates(base: dict, gemm: int, smoke: bool) -> list[tuple[dict, int]]:
    """(config, GEMM2 split) candidates with base's BLOCK_SIZE_M and GROUP."""
    bm = base["BLOCK_SIZE_M"]
    if smoke:
        shapes = [(32, 32, 4, 2), (64, 32, 4, 2)]
        splits = (1, 2) if gemm == 2 else (1,)
    elif bm >= 64:  # compute-bound tiles: (BLOCK_N, warps) pairs x BLOCK_K x stages
        shapes = [(bn, bk, w, s) for (bn, w), bk, s in itertools.product(((128, 4), (128, 8), (256, 8)), (32, 64, 128), (3, 4, 5))]
        splits = (1,)
    else:  # memory-bound decode tiles: narrow N, long K, and GEMM2's K split
        shapes = [(bn, bk, 4, s) for bn, bk, s in itertools.product((32, 64, 128), (64, 128, 256), (3, 4, 5))]
        splits = (1, 2, 4) if gemm == 2 else (1,)
    out = []
    for (bn, bk, w, s), split in itertools.product(shapes, splits):
        if (bm * bk + bk * bn) * 2 * s > SMEM:
            continue
        cfg = dict(base, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_warps=w, num_stages=s)
        out.append((cfg, split))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=POINTS, help="shape:tokens,... (shapes: %s)" % ",".join(SHAPES))
    ap.add_argument("--gemms", default="2,1")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting new points after this many seconds")
    ap.add_argument("--bm", type=int, default=0,
                    help="BLOCK_SIZE_M of the alignment and both GEMMs instead of the layer's (0: the layer's)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.smoke:
        SHAPES.update(SMOKE)
        args.points = "tiny:4,tiny-map:16"
    out_dir, dev, head = script_setup("bf16; each GEMM alone, us")
    print("# " + head, flush=True)
    rows, summary = [], []
    weights: dict[str, tuple] = {}
    for point in args.points.split(","):
        if time.time() - t0 > args.budget_s:
            print(f"# budget reached, skipped {point} and after", flush=True)
            break
        shape, m = point.split(":")[0], int(point.split(":")[1])
        e, k, h, inter, e_local = SHAPES[shape]
        dt = torch.bfloat16
        if shape not in weights:
            weights.clear()
            if ON_GPU:
                torch.cuda.empty_cache()
            w13 = torch.randn(e_local, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5)
            w2 = torch.randn(e_local, h, inter, dtype=dt, device=dev).mul_(inter**-0.5)
            weights[shape] = (w13, w2)
        w13, w2 = weights[shape]
        emap = None
        if e_local < e:
            emap = torch.full((e,), -1, dtype=torch.int32, device=dev)
            emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=dev)
        x, logits = seeded_inputs(m, h, e, dt, dev)
        tw, ids = fused_topk_softmax(logits, k, renormalize=True)
        base = dict(select_config(m, k, w13, w2, e, dt)[0])  # the layer's own lookup
        if args.bm:
            base["BLOCK_SIZE_M"] = args.bm
        opts = TritonOptions()
        # the sorted layout (its used rows are read below), also where the layer takes token rows
        align = align_pairs(ids, base["BLOCK_SIZE_M"], e_local, emap, e, options=TritonOptions(token_rows=False))
        tma = resolve_use_tma(opts, base, dt) and tma_ok(w13) and tma_ok(w2)
        wide = gemm1_walk(opts, base, dt, None, False, inter, 0)[0]  # the wide walk from 64-row tiles (no sorted copy)
        split0 = layer_split_k(opts, m, k, e, e_local, h, inter, base, align.max_blocks, num_sms(dev))
        inter0 = launch_gemm1(x, w13, align, k, base, tma, wide=wide)
        # GEMM1's rows that hold a pair (padding rows and unused blocks are left unwritten)
        sorted_ids = align.sorted_token_ids[: inter0.shape[0]].long()
        used = (sorted_ids < align.num_pairs) & (torch.arange(inter0.shape[0], device=dev) < align.num_tokens_post_padded)

        def run(gemm: int, cfg: dict, split: int):
            if gemm == 1:
                return lambda: launch_gemm1(x, w13, align, k, cfg, tma, wide=wide)
            return lambda: launch_gemm2(inter0, w2, tw, align, k, cfg, split, tma)

        def timed(fn):
            return timed_us(fn, reps=15, graph_calls=3)

        for gemm in [int(s) for s in args.gemms.split(",")]:
            def result(fn):
                out = fn()
                return out[used].float() if gemm == 1 else out.float()

            want = result(run(gemm, base, split0))
            cur = timed(run(gemm, base, split0))
            best = (cur, "current", base, split0)
            n_ok = n_fail = 0
            for cfg, split in candidates(base, gemm, args.smoke):
                if cfg == base and split == split0:
                    continue
                label = "/".join(str(cfg[c]) for c in TILE_KEYS) + f" sk{split}"
                try:
                    got = result(run(gemm, cfg, split))
                    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                        raise RuntimeError("output differs from the current config's")
                    t = timed(run(gemm, cfg, split))
                    n_ok += 1
                except Exception as ex:  # noqa: BLE001 - out of resources etc.: recorded, not fatal
                    n_fail += 1
                    rows.append(dict(shape=shape, tokens=m, gemm=gemm, config=label, us=float("nan"),
                                     note=f"{type(ex).__name__}: {str(ex).splitlines()[0][:100]}"))
                    continue
                rows.append(dict(shape=shape, tokens=m, gemm=gemm, config=label, us=round(t, 2), note=""))
                if t < best[0]:
                    best = (t, label, cfg, split)
            cur_label = "/".join(str(base[c]) for c in TILE_KEYS) + f" sk{split0}"
            summary.append(dict(shape=shape, tokens=m, gemm=gemm, current=cur_label, current_us=round(cur, 2),
                                best=best[1], best_us=round(best[0], 2), best_over_current=round(best[0] / cur, 3),
                                candidates=n_ok, failed=n_fail, elapsed_s=round(time.time() - t0)))
            print(" ".join(f"{a}={b}" for a, b in summary[-1].items()), flush=True)
            atomic_write_text(out_dir / "gemm_configs.csv", pd.DataFrame(rows).to_csv(index=False))
            atomic_write_text(out_dir / "gemm_configs.md", head + "\n\n" + markdown(pd.DataFrame(summary)))
        inter0 = x = logits = None
    print((out_dir / "gemm_configs.md").read_text() if summary else "# nothing timed")
    return 0
