"""Token counts between a tuned file's keys, in one run: the entry the lookup picks (the nearest
key, as vLLM reads the files) against the neighbouring key's entry and the default heuristic.

    PYTHONPATH=. python -m benchmarks between_keys [--points mixtral:512,...] [--smoke]

moebench's shipped H200 files hold 6 token counts (1, 16, 64, 256, 1024, 4096), vLLM's tuner 18.
Between two keys the lookup takes the nearer one, whose tile may be sized for 2-4x fewer or more
pairs per expert than the layer has. Each point: `fused_moe` (alignment + both GEMMs) with each
candidate config, checked against the first, CUDA-graph replay, timed --rounds times in
alternating order (median; `*_spread`: max / min of the rounds). Writes between_keys.csv / .md
under $OUT (default ./bench-out). --smoke: a tiny shape on CPU under the Triton interpreter with a
made-up file (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse

import torch

from moebench.kernels.triton.configs import TILE_KEYS, default_config, device_name, find_config_file, load_config_file, nearest_entry
from moebench.kernels.triton.experts import fused_moe
from moebench.kernels.triton.routing import fused_topk_softmax

from benchmarks.bench_common import ON_GPU, SHAPES, script_setup, timed_us, write_rows

POINTS = ("dsv3-ep8:32,dsv3-ep8:128,dsv3-ep8:512,dsv3-ep8:2048,mixtral:32,mixtral:128,mixtral:512,mixtral:2048,"
          "qwen3-30b-a3b:32,qwen3-30b-a3b:128,qwen3-30b-a3b:512,qwen3-30b-a3b:2048")
SMOKE = {"tiny": (16, 2, 64, 32, 16)}


def _text(cfg: dict) -> str:
    return "/".join(str(cfg[k]) for k in TILE_KEYS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--rounds", type=int, default=4, help="timings per candidate, alternating the order")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        SHAPES.update(SMOKE)
        args.points = "tiny:6"
    out_dir, dev, head = script_setup("bf16; fused_moe (alignment + GEMMs), us")
    print("# " + head, flush=True)
    dt = torch.bfloat16
    rows, weights = [], {}
    for point in args.points.split(","):
        shape, m = point.split(":")[0], int(point.split(":")[1])
        e, k, h, inter, e_local = SHAPES[shape]
        if shape not in weights:
            weights.clear()
            if ON_GPU:
                torch.cuda.empty_cache()
            weights[shape] = (torch.randn(e_local, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5),
                              torch.randn(e_local, h, inter, dtype=dt, device=dev).mul_(inter**-0.5))
        w13, w2 = weights[shape]
        emap = None
        if e_local < e:
            emap = torch.full((e,), -1, dtype=torch.int32, device=dev)
            emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=dev)
        path = find_config_file(e_local, inter, "cpu" if args.smoke else device_name(dev), dt)
        table = load_config_file(path) if path is not None else {}
        if args.smoke:  # a made-up two-key file
            table = {1: default_config(1, e, inter, h, k, dt), 16: default_config(16, e, inter, h, k, dt)}
        cands = {"heuristic": dict(default_config(m, e, inter, h, k, dt))}
        if table:
            near, cfg = nearest_entry(table, m)
            cands["nearest"] = dict(cfg)
            lower = max((t for t in table if t <= m), default=None)
            upper = min((t for t in table if t >= m), default=None)
            other = upper if near == lower else lower
            if other is not None and other != near:
                cands["other"] = dict(table[other])
        g = torch.Generator(device=dev).manual_seed(m)
        x = torch.randn(m, h, dtype=dt, device=dev, generator=g)
        tw, ids = fused_topk_softmax(torch.randn(m, e, device=dev, generator=g), k, renormalize=True)
        row = dict(shape=shape, tokens=m, pairs_per_local_expert=round(m * k / e, 1))
        want = None
        fns = {}
        for name, cfg in cands.items():
            fns[name] = lambda cfg=cfg: fused_moe(x, w13, w2, tw, ids, emap, e, cfg)  # noqa: E731
            out = fns[name]().float()
            if want is None:
                want = out
            elif not torch.allclose(out, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                raise SystemExit(f"{point}: {name} differs from {next(iter(cands))}")
            row[name] = _text(cfg)
        # candidates timed in order, then in reverse (ABBA), --rounds times; the median per candidate
        times = {name: [] for name in cands}
        for r in range(args.rounds):
            for name in (list(cands) if r % 2 == 0 else list(reversed(cands))):
                times[name].append(timed_us(fns[name], reps=20, graph_calls=3))
        for name in cands:
            row[f"{name}_us"] = round(float(torch.tensor(times[name]).median()), 1)
            row[f"{name}_spread"] = round(max(times[name]) / min(times[name]), 3)
        if table:
            row["key"] = near
            row["other_key"] = other
        best = min(row[f"{n}_us"] for n in cands)
        for n in cands:
            row[f"{n}/best"] = round(row[f"{n}_us"] / best, 3)
        rows.append(row)
        write_rows(rows, out_dir, "between_keys", head)
    return 0
