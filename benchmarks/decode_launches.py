"""The `triton` layer's code paths for decode and prefill, A/B in one run: the layer (routing +
experts via the modular kernel) with the defaults (`current`) against one TritonOptions field
changed, on the same routing, CUDA-graph replay.

    PYTHONPATH=. python -m benchmarks decode_launches [--tokens 1,2,4,16,64] [--shapes a,b] [--fp8] [--smoke]
        [--variants a,b] [--rounds N] [--reps N]

Variants (each a TritonOptions, a split or a config; column `current/<name>` or `<name>/current`):
`nodirect`: the alignment kernels also where the direct alignment is the default (`direct_rule`;
direct_align=False); `direct`: one block per pair at every point (direct_align=True; `direct/current`); `twolaunch`: the two-launch alignment also up to 1024 pairs
(one_launch_max_pairs=0); `notokenrows`: the alignment kernels also where the token-rows layout is the
default (token_rows=False; `current/notokenrows`); `tokenrows`: the token-rows layout at every point up to
BLOCK_SIZE_M tokens where the direct alignment is not taken, however many experts stay idle
(token_rows_max_idle=inf; `tokenrows/current`); `sk1` / `sk2` / `sk4`: GEMM2 split 1 / 2 / 4 ways over K instead of the
split rule's choice (`sk1` = no wave split; PERF.md measured `sk2` / `sk4` a loss at
decode); `nopdl`: without programmatic dependent launch (pdl=False), `pdl`: PDL forced on, also where
"auto" leaves it off (`pdl/nopdl`); `nodown`: GEMM2 with GEMM1's config even where a `_down.json`
file is found (the looked-up GEMM1 config given explicitly; point $MOEBENCH_CONFIG_DIR at the
files); `nosorted` / `sorted`: GEMM1's A tiles gathered by pointer loads / always through TMA from
x copied into sorted order (sorted_a False / True; `sorted` is n/a where the tile has no TMA);
`wide`: the wide GEMM1 at every tile size (wide_gemm1=True); `pairstore` / `atomic`: GEMM2
stores each pair's row and `topk_sum` adds them / the fp32 atomic sum over top-k (pair_store True
/ False); `tma`: weight tiles through TMA at every
tile and for fp8 too (use_tma=True; `tma/current`); `swapab` / `noswap`: the fp8 GEMMs as w^T x^T
into a transposed accumulator at every tile / at none (swap_ab True / False; `current/noswap`,
`swapab/noswap`; the same as current for 16-bit weights); `kg1`: GEMM1's fp8 block K loop one scale
group per iteration at every tile (fp8_k_groups=1; `current/kg1`); `kg2`: two groups per iteration
wherever the walk can take them, any tile size or H (fp8_k_groups=2; `kg2/current`; n/a elsewhere); `heuristic`: the layer without tuned
files, both GEMMs with the default heuristic's config (`configs.heuristic_config`, given explicitly;
column `heuristic_cfg`; `heuristic/current` = default / tuned where a file exists); `again`: the current defaults timed a
second time, last (`again/current`: the point's noise). --fp8: per-tensor fp8_w8a8 weights (GEMM1
quantises the intermediate itself); --fp8-block: fp8_w8a8 with 128 x 128 block scales. --variants picks which run (default: all).
--rounds N times every variant N times, interleaved in a rotated order (median; `<name>_spread` =
max / min over the rounds): at prefill one pass in a fixed order measured the same code 5-12%
apart, as the clocks drift over a run (DEVELOPERS.md, GPU checks).
Writes decode_launches[_fp8].csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on
CPU under the Triton interpreter (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import moebench
from moebench.errors import MoebenchError
from moebench.kernels.triton.configs import TILE_KEYS, heuristic_config
from moebench.kernels.triton.experts import select_config
from moebench.kernels.triton.options import TritonOptions, wants_direct_align
from moebench.kernels.triton.routing import fused_topk_softmax

from benchmarks.bench_common import (SMOKE_SHAPES, bench_shape, script_setup, seeded_inputs, shard_weights,
                                     timed_us, write_rows)

DEFAULT_SHAPES = "mixtral,qwen3-30b-a3b,dsv3-ep8,qwen3-next-80b-a3b"
#: name: (GEMM2's split_k or None, the options); "nodown" also gives GEMM1's looked-up config.
VARIANTS = {"current": (None, TritonOptions()), "nodirect": (None, TritonOptions(direct_align=False)),
            "direct": (None, TritonOptions(direct_align=True)),
            "notokenrows": (None, TritonOptions(token_rows=False)),
            "tokenrows": (None, TritonOptions(token_rows_max_idle=float("inf"), token_rows_max_idle_share=1.0,
                                              token_rows_quant_max_idle=float("inf"))),
            "twolaunch": (None, TritonOptions(one_launch_max_pairs=0)), "sk1": (1, TritonOptions()),
            "sk2": (2, TritonOptions()), "sk4": (4, TritonOptions()), "nopdl": (None, TritonOptions(pdl=False)),
            "pdl": (None, TritonOptions(pdl=True)), "nodown": (None, TritonOptions()),
            "nosorted": (None, TritonOptions(sorted_a=False)), "sorted": (None, TritonOptions(sorted_a=True)),
            "wide": (None, TritonOptions(wide_gemm1=True)), "pairstore": (None, TritonOptions(pair_store=True)),
            "atomic": (None, TritonOptions(pair_store=False)),
            "tma": (None, TritonOptions(use_tma=True)), "swapab": (None, TritonOptions(swap_ab=True)),
            "noswap": (None, TritonOptions(swap_ab=False)), "kg1": (None, TritonOptions(fp8_k_groups=1)),
            "kg2": (None, TritonOptions(fp8_k_groups=2)),
            "heuristic": (None, TritonOptions()),
            "again": (None, TritonOptions())}
#: (a, b) pairs whose ratio a/b each row gets
RATIOS = (("current", "nodirect"), ("direct", "current"), ("current", "notokenrows"), ("tokenrows", "current"), ("current", "twolaunch"), ("current", "sk1"), ("sk2", "current"), ("sk4", "current"),
          ("current", "nopdl"), ("pdl", "nopdl"), ("current", "nodown"), ("current", "nosorted"), ("sorted", "nosorted"),
          ("wide", "current"), ("pairstore", "atomic"), ("current", "atomic"), ("tma", "current"), ("current", "noswap"),
          ("swapab", "noswap"), ("current", "kg1"), ("kg2", "current"), ("heuristic", "current"), ("again", "current"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,16,64")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--fp8", action="store_true", help="fp8_w8a8 per-tensor weights")
    ap.add_argument("--fp8-block", action="store_true", help="fp8_w8a8 weights with 128 x 128 block scales")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="time the variants this many times, interleaved (median)")
    ap.add_argument("--reps", type=int, default=30, help="graph replays per timing")
    args = ap.parse_args(argv)
    variants = dict(VARIANTS)
    if args.variants:
        keep = set(args.variants.split(",")) | {"current"}
        variants = {n: v for n, v in variants.items() if n in keep}
    scheme = None
    if args.fp8 or args.fp8_block:
        scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128)) if args.fp8_block else \
            moebench.QuantScheme(scales="tensor")
    stem = "decode_launches_fp8block" if args.fp8_block else "decode_launches_fp8" if args.fp8 else "decode_launches"
    if args.smoke:
        if args.shapes == DEFAULT_SHAPES:  # both smoke shapes unless some are named
            args.shapes = ",".join(SMOKE_SHAPES)
    out_dir, dev, head = script_setup((scheme.describe() if scheme else "bf16")
                                      + "; layer = routing + triton experts (us)")
    print("# " + head, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, inter, e_local = bench_shape(shape)
        dt = torch.bfloat16
        w13, w2, emap = shard_weights(bench_shape(shape), scheme, dev)
        for m in [int(t) for t in args.tokens.split(",")]:
            x, logits = seeded_inputs(m, h, e, dt, dev)

            def layer(kern):
                tw, ids = fused_topk_softmax(logits, k, renormalize=True)
                return kern.apply(x, w13, w2, tw, ids, expert_map=emap, num_experts=e)

            row = dict(shape=shape, tokens=m,
                       direct_rule=wants_direct_align(TritonOptions(), m, k, e, scheme, emap is not None))
            ref = None
            runs = {}  # name: the layer of each variant this point can take
            for name, (split, opts) in variants.items():
                kw = dict(split_k=split, options=opts)
                if name == "nodown":  # both GEMMs with GEMM1's config from the lookup
                    kw["config"] = dict(select_config(m, k, w13, w2, e, dt)[0])
                if name == "heuristic":  # no file: the default over the global experts, as the lookup falls back
                    kw["config"] = dict(heuristic_config(m, e, inter, h, k, dt, quant=scheme))
                    row["heuristic_cfg"] = "/".join(str(kw["config"][c]) for c in TILE_KEYS)
                kern = moebench.make_kernel("triton", "no-dpep", experts_kwargs=kw)
                try:
                    out = layer(kern)
                except MoebenchError as ex:  # a forced option this point cannot take (`sorted` without TMA)
                    row[f"{name}_note"] = f"n/a: {ex}"[:60]
                    continue
                if ref is None:
                    tw, ids = fused_topk_softmax(logits, k, renormalize=True)
                    ref = moebench.reference_moe(x, w13, w2, tw, ids, emap)
                row[f"{name}_err"] = f"{((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item():.1e}"
                runs[name] = lambda kern=kern: layer(kern)
            # Timing: --rounds rounds over the variants, each round in a rotated order, so that a drift
            # of the clocks over the run (prefill layers heat the GPU) spreads over all of them; a
            # variant's time is the median of its rounds' medians.
            times = {name: [] for name in runs}
            names = list(runs)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(timed_us(runs[name], reps=args.reps, graph_calls=5))
            for name, ts in times.items():
                row[f"{name}_us"] = round(statistics.median(ts), 1)
                if args.rounds > 1:
                    row[f"{name}_spread"] = round(max(ts) / min(ts), 3)
            for a, b in RATIOS:
                if f"{a}_us" in row and f"{b}_us" in row:
                    row[f"{a}/{b}"] = round(row[f"{a}_us"] / row[f"{b}_us"], 3)
            rows.append(row)
            write_rows(rows, out_dir, f"{stem}", head)
        w13 = w2 = None  # free this shape's weights before the next shape's
    print((out_dir / f"{stem}.md").read_text())
    return 0
