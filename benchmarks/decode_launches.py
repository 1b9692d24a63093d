"""Launch trimming for decode (issues 3, 8), A/B in one run: the `triton` layer (routing + experts via
the modular kernel) with the alignment kernels or `direct_align`, and with GEMM2's accumulator
zeroed by a memset or by GEMM1 (moebench.kernels.triton_moe.DEFAULT_DIRECT_ALIGN /
DEFAULT_ZERO_IN_GEMM1), on the same routing, CUDA-graph replay.

    PYTHONPATH=. python benchmarks/decode_launches.py [--tokens 1,2,4,16,64] [--shapes a,b] [--fp8] [--smoke]
        [--variants a,b] [--rounds N] [--reps N]

Measured (PERF.md section 3; both are defaults now): at one token the two alignment launches and
the memset go, GEMM work unchanged: Qwen3-30B-A3B M=1 40.0 -> 33.5 us.
--fp8: per-tensor fp8_w8a8 weights, adding GEMM1's fused quantisation of the intermediate
(DEFAULT_FUSE_FP8_INTER). `align1` adds the one-launch alignment (moe_align.DEFAULT_ONE_LAUNCH,
up to 1024 pairs; measured 0.96-1.005 of the layer from 2 tokens on, where the alignment runs;
default since the fifth session). `sk2` / `sk4`: the current defaults with GEMM2 split 2 / 4
ways over K (columns `sk2/current`, `sk4/current`; measured a loss: 1.05 at Qwen3-30B M=1, up
to 1.5 at DeepSeek-V3 EP8). `nopdl`: the current defaults without programmatic dependent launch
(triton_moe.DEFAULT_PDL; column `current/nopdl`); `pdl`: PDL forced on, also where "auto" leaves
it off (`pdl/nopdl`). (Two PDL variants measured in the sixth session are gone from the kernels:
GEMM2 prefetching its w2 rows into L2 before waiting, and GEMM1 releasing GEMM2 only after its
epilogue; PERF.md section 3.) `nodown`: GEMM2 with GEMM1's config even where a `_down.json` file
is found (triton_moe.DEFAULT_DOWN_FILES; `current/nodown`; point $MOEBENCH_CONFIG_DIR at the files).
`noearly`: routing and alignment outside the PDL chain (triton_moe.DEFAULT_PDL_EARLY;
`current/noearly`); `memset`: also the alignment's used length zeroed by a memset launch first
(moe_align.DEFAULT_SKIP_MEMSET; `noearly/memset`, `current/memset`: the seventh session's two
launch changes). `gather`: a direct alignment with an expert_map (DeepSeek-V3 EP8, one token)
mapping its ids by a torch gather before GEMM1 instead of in the GEMMs (moe_align.DEFAULT_MAP_IN_GEMM;
`current/gather`). `half`: half-height tiles for blocks whose pairs fit in their first half
(triton_moe.DEFAULT_HALF_BLOCKS, off: measured -4% at Qwen3 1024 / 4096 tokens, +4% / +10% at
Mixtral / dsv3-local 1024; `half/current`, at 128-row tiles). `nosorted` / `sorted`: GEMM1's A
tiles gathered by pointer loads / always through TMA from x copied into sorted order
(triton_moe.DEFAULT_SORTED_A, "auto" = >= 512 pairs per expert (256 where I >= 4096) at >= 64-row
tiles; `current/nosorted`, `sorted/nosorted`; `sorted` is n/a where the tile has no TMA). `widetma`:
the wide GEMM1 with its weight tile through TMA (triton_moe.DEFAULT_WIDE_TMA; with the sorted_a
rule as it is), `wt_sorted` / `wt_nosorted` the same with sorted_a forced on / off, `wt_all` with
the wide walk at every tile size (TMA from 32-row tiles); `wave`:
GEMM2's K split by the wave rule (triton_moe.DEFAULT_WAVE_SPLIT); `new`: both, `new_nosorted`:
both without sorted_a; `tma2a`: GEMM2's A tiles through TMA (triton_moe.DEFAULT_TMA_GEMM2_A); each
against `current`. (A seventh-session variant, GEMM2 casting each finished (token, hidden tile) into the output in
its epilogue instead of a cast launch, measured a loss and is gone; PERF.md section 3.) `again`: the current defaults timed a second
time, last (`again/current`: the point's noise). --variants picks which run (default: all).
--rounds N times every variant N times, interleaved in a rotated order (median; `<name>_spread` =
max / min over the rounds): at prefill one pass in a fixed order measured the same code 5-12%
apart (eleventh session), as the clocks drift over a run.
Writes decode_launches[_fp8].csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on CPU under the Triton interpreter (checks the script; its
times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import torch

import moebench
from moebench.errors import MoebenchError
from moebench.kernels import moe_align, triton_moe
from moebench.kernels.triton_moe import fused_topk_softmax

from bench_common import HEURISTIC_ONLY, SHAPES, layer_config, script_setup, seeded_inputs, timed_us, write_rows

DEFAULT_SHAPES = "mixtral,qwen3-30b-a3b,dsv3-ep8,qwen3-next-80b-a3b"
SMOKE = {"tiny": (16, 2, 64, 32, 16), "tiny-map": (32, 4, 64, 32, 8)}
# The switches of moebench.kernels.triton_moe each variant sets; "baseline" is the path before any
# of them (two alignment kernels, a memset, GEMM1, GEMM2, [quantisation launch]).
SWITCHES = ((triton_moe, "DEFAULT_DIRECT_ALIGN"), (triton_moe, "DEFAULT_ZERO_IN_GEMM1"),
            (triton_moe, "DEFAULT_FUSE_FP8_INTER"), (moe_align, "DEFAULT_ONE_LAUNCH"))
VARIANTS = {"baseline": (False, False, False, False), "direct": ("auto", False, False, False),
            "zero": (False, True, False, False), "both": ("auto", True, False, False),
            "align1": ("auto", True, False, True)}
FP8_VARIANTS = {"fuse": (False, False, True, False), "all": ("auto", True, True, True)}
# The current defaults with GEMM2's split over K given (choose_split_k keeps >= 4 K steps per
# split, so it never splits Qwen3's I = 768 at BLOCK_SIZE_K 128) and/or triton_moe attributes
# overridden, against `current` (the defaults as they are): name: (split_k or None, {attribute: value}).
CURRENT_VARIANTS = {"current": (None, {}), "sk2": (2, {}), "sk4": (4, {}), "nopdl": (None, {"DEFAULT_PDL": False}),
                  "pdl": (None, {"DEFAULT_PDL": True}), "nodown": (None, {"DEFAULT_DOWN_FILES": False}),
                  "noearly": (None, {"DEFAULT_PDL_EARLY": False}),
                  "memset": (None, {"DEFAULT_PDL_EARLY": False, "moe_align.DEFAULT_SKIP_MEMSET": False}),
                  "gather": (None, {"moe_align.DEFAULT_MAP_IN_GEMM": False}),
                  "half": (None, {"DEFAULT_HALF_BLOCKS": True}),
                  "nosorted": (None, {"DEFAULT_SORTED_A": False}), "sorted": (None, {"DEFAULT_SORTED_A": True}),
                  "widetma": (None, {"DEFAULT_WIDE_TMA": True}),
                  "wt_sorted": (None, {"DEFAULT_WIDE_TMA": True, "DEFAULT_SORTED_A": True}),
                  "wt_nosorted": (None, {"DEFAULT_WIDE_TMA": True, "DEFAULT_SORTED_A": False}),
                  "wt_all": (None, {"DEFAULT_WIDE_TMA": True, "DEFAULT_WIDE_GEMM1": True}),
                  "wave": (None, {"DEFAULT_WAVE_SPLIT": True}),
                  "new": (None, {"DEFAULT_WIDE_TMA": True, "DEFAULT_WAVE_SPLIT": True}),
                  "new_nosorted": (None, {"DEFAULT_WIDE_TMA": True, "DEFAULT_WAVE_SPLIT": True, "DEFAULT_SORTED_A": False}),
                  "tma2a": (None, {"DEFAULT_TMA_GEMM2_A": True}),
                  "again": (None, {})}


@contextlib.contextmanager
def switched(values: tuple, overrides: dict):
    """SWITCHES set to `values` and the CURRENT_VARIANTS `overrides` applied, restored on exit."""
    saved = tuple(getattr(mod, n) for mod, n in SWITCHES)
    kept = {a: getattr(*owner(a)) for a in overrides}
    try:
        for (mod, n), v in zip(SWITCHES, values):
            setattr(mod, n, v)
        for a, v in overrides.items():
            setattr(*owner(a), v)
        yield
    finally:
        for (mod, n), v in zip(SWITCHES, saved):
            setattr(mod, n, v)
        for a, v in kept.items():
            setattr(*owner(a), v)


def owner(attr: str) -> tuple:
    """(module, name) of a CURRENT_VARIANTS override: "moe_align.NAME" is moe_align's, else triton_moe's."""
    return (moe_align, attr.split(".", 1)[1]) if attr.startswith("moe_align.") else (triton_moe, attr)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,16,64")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--fp8", action="store_true", help="fp8_w8a8 per-tensor weights (adds the fused-quantisation variants)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default="", help="comma-separated subset of the variants (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="time the variants this many times, interleaved (median)")
    ap.add_argument("--reps", type=int, default=30, help="graph replays per timing")
    args = ap.parse_args()
    variants = dict(VARIANTS, **(FP8_VARIANTS if args.fp8 else {}))
    splits = dict(CURRENT_VARIANTS)
    if args.variants:
        keep = set(args.variants.split(",")) | {"current"}
        variants = {n: v for n, v in variants.items() if n in keep}
        splits = {n: v for n, v in splits.items() if n in keep}
    saved = tuple(getattr(mod, n) for mod, n in SWITCHES)
    stem = "decode_launches_fp8" if args.fp8 else "decode_launches"
    if args.smoke:
        SHAPES.update(SMOKE)
        args.shapes = ",".join(SMOKE)
    out_dir, dev, head = script_setup(("fp8_w8a8 per-tensor" if args.fp8 else "bf16")
                                      + "; layer = routing + triton experts (us)")
    print("# " + head, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, inter, e_local = SHAPES[shape]
        dt = torch.bfloat16
        w13 = torch.randn(e_local, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5)
        w2 = torch.randn(e_local, h, inter, dtype=dt, device=dev).mul_(inter**-0.5)
        if args.fp8:
            w13, w2 = moebench.quantize_weights(w13, w2, moebench.QuantScheme(scales="tensor"), act_dtype=dt)
        emap = None
        if e_local < e:
            emap = torch.full((e,), -1, dtype=torch.int32, device=dev)
            emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=dev)
        for m in [int(t) for t in args.tokens.split(",")]:
            x, logits = seeded_inputs(m, h, e, dt, dev)
            # the tile config bench_triton.py times (the default heuristic for HEURISTIC_ONLY shapes)
            cfg_kw = {} if args.fp8 or shape not in HEURISTIC_ONLY else dict(
                config=layer_config(shape, m, w13, w2, e, k, dt))
            kernel = moebench.make_kernel("triton", "no-dpep", experts_kwargs=cfg_kw)

            def layer(kern=kernel):
                tw, ids = fused_topk_softmax(logits, k, renormalize=True)
                return kern.apply(x, w13, w2, tw, ids, expert_map=emap, num_experts=e)

            row = dict(shape=shape, tokens=m, direct_rule=triton_moe.use_direct_align(m, k, e))
            ref = None
            runs = {}  # name: (callable, switch values, attribute overrides), for the variants this point can take
            for name, values in {**variants, **splits}.items():
                overrides = {}
                if name in splits:  # the defaults as they are, GEMM2's split given
                    values = saved
                    split, overrides = splits[name]
                    kern = moebench.make_kernel("triton", "no-dpep", experts_kwargs=dict(split_k=split, **cfg_kw)) \
                        if split else kernel
                    run = lambda kern=kern: layer(kern)  # noqa: E731
                else:
                    run = layer
                try:
                    with switched(values, overrides):
                        out = run()
                except MoebenchError as ex:  # a forced option this point cannot take (`sorted` without TMA)
                    row[f"{name}_note"] = f"n/a: {ex}"[:60]
                    continue
                if ref is None:
                    tw, ids = fused_topk_softmax(logits, k, renormalize=True)
                    ref = moebench.reference_moe(x, w13, w2, tw, ids, emap)
                row[f"{name}_err"] = f"{((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item():.1e}"
                runs[name] = (run, values, overrides)
            # Timing: --rounds rounds over the variants, each round in a rotated order, so that a drift
            # of the clocks over the run (prefill layers heat the GPU) spreads over all of them; a
            # variant's time is the median of its rounds' medians.
            times = {name: [] for name in runs}
            names = list(runs)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    run, values, overrides = runs[name]
                    with switched(values, overrides):
                        times[name].append(timed_us(run, reps=args.reps, graph_calls=5))
            for name, ts in times.items():
                row[f"{name}_us"] = round(statistics.median(ts), 1)
                if args.rounds > 1:
                    row[f"{name}_spread"] = round(max(ts) / min(ts), 3)

            def ratio(a, b):
                if f"{a}_us" in row and f"{b}_us" in row:
                    row[f"{a}/{b}"] = round(row[f"{a}_us"] / row[f"{b}_us"], 3)

            for name in variants:
                if name != "baseline":
                    ratio(name, "baseline")
            ratio("align1", "both")  # against the path it would replace (direct alignment + zeroing in GEMM1)
            ratio("sk2", "current")
            ratio("sk4", "current")
            for name in ("current", "pdl"):
                ratio(name, "nopdl")
            ratio("current", "nodown")
            ratio("current", "noearly")
            ratio("noearly", "memset")
            ratio("current", "memset")
            ratio("current", "gather")
            ratio("half", "current")
            ratio("current", "nosorted")
            ratio("sorted", "nosorted")
            for name in ("widetma", "wt_sorted", "wt_nosorted", "wt_all", "wave", "new", "new_nosorted"):
                ratio(name, "current")
            ratio("wt_sorted", "wt_nosorted")
            ratio("new", "new_nosorted")
            ratio("tma2a", "current")
            ratio("again", "current")  # the same code timed twice: this point's noise
            rows.append(row)
            write_rows(rows, out_dir, f"{stem}", head)
        w13 = w2 = None  # free this shape's weights before the next shape's
    print((out_dir / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
