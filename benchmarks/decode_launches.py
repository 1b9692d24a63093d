"""The `triton` layer's code paths for decode and prefill, A/B in one run: the layer (the sweep's
`triton` row behind `no-dpep`, routing given) with the defaults (`current`) against one
TritonOptions field changed, on the same routing, CUDA-graph replay. Each variant is a registered
sweep variant (the layer with its experts rebuilt from those options), checked against the float64
reference and timed by the sweep's measure step; each round is one run folder under $OUT/runs.

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
--rounds N times every variant N times, one sweep a round with the variants in a rotated order (median; `<name>_spread` =
max / min over the rounds): at prefill one pass in a fixed order measured the same code 5-12%
apart, as the clocks drift over a run (DEVELOPERS.md, GPU checks).
Writes decode_launches[_fp8].csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on
CPU under the Triton interpreter (checks the script; its times mean nothing). A variant a point
cannot take (`sorted` without TMA) is a failed row; the table says why (`<name>_note`).
"""

from __future__ import annotations

import argparse

import pandas as pd

import moebench
from moebench.kernels.triton.configs import heuristic_config
from moebench.kernels.tuned_files import TILE_KEYS
from moebench.kernels.triton.experts import select_config
from moebench.kernels.triton.options import TritonOptions, wants_direct_align
from moebench.sweep.variants import Case, Variant, register

from benchmarks.bench_common import SMOKE_SHAPES, bench_shape, run_shard, script_setup, write_table

DEFAULT_SHAPES = "mixtral,qwen3-30b-a3b,dsv3-ep8,qwen3-next-80b-a3b"
#: name: (GEMM2's split_k or None, the options); "current" is the layer's own row.
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


def _options_variant(name: str, split: int | None, opts: TritonOptions) -> Variant:
    """The layer with the `triton` experts rebuilt from `opts` (and GEMM2's split): "nodown" gives
    both GEMMs GEMM1's looked-up config, "heuristic" the default heuristic's (no file)."""

    def build(case: Case):
        x, w13, w2, _, ids, _, e = case.args
        m, k = x.shape[0], ids.shape[1]
        kw = dict(split_k=split, options=opts)
        if name == "nodown":  # both GEMMs with GEMM1's config from the lookup
            kw["config"] = dict(select_config(m, k, w13, w2, e, x.dtype)[0])
        if name == "heuristic":  # no file: the default over the global experts, as the lookup falls back
            kw["config"] = dict(heuristic_config(m, e, w2.shape[2], x.shape[1], k, x.dtype, quant=case.spec.quant))
            case.notes["heuristic_cfg"] = "/".join(str(kw["config"][c]) for c in TILE_KEYS)
        layer = case.rebuilt(**kw)
        return lambda: layer.apply(*case.args)

    return Variant(f"options-{name}", build, checked=True, about=f"the triton layer with {name}")


OPTION_VARIANTS = {name: register(_options_variant(name, *v)) for name, v in VARIANTS.items() if name != "current"}


def point_table(rows: pd.DataFrame, names: list[str], rounds: int, scheme) -> pd.DataFrame:
    """One line per (shape, tokens): each variant's median time over the rounds (`<name>_us`),
    their spread (max / min) with several rounds, its error against float64 (`<name>_err`), why a
    variant could not run (`<name>_note`), and the RATIOS."""
    rows = rows.drop_duplicates(["shape", "tokens", "variant", "round"]).copy()
    rows["name"] = rows["variant"].fillna("").map(lambda v: v.removeprefix("options-") or "current")
    rows["us"] = rows["experts_us"].where(rows["modeled"].astype(bool), rows["latency_us"])
    out = []
    for (shape, m), point in rows.groupby(["shape", "tokens"], sort=False):
        e, k, _, _, e_local = bench_shape(shape)
        row = dict(shape=shape, tokens=m, direct_rule=wants_direct_align(TritonOptions(), m, k, e, scheme, e_local < e))
        for name in names:
            got = point[point.name == name]
            ok = got[got.status == "ok"]
            if ok.empty:
                reason = got["reason"].iloc[0] if len(got) else "not run"
                row[f"{name}_note"] = f"n/a: {reason}"[:60]
                continue
            row[f"{name}_err"] = f"{ok['max_rel_err'].iloc[0]:.1e}"
            row[f"{name}_us"] = round(float(ok["us"].median()), 1)
            if rounds > 1:
                row[f"{name}_spread"] = round(float(ok["us"].max() / ok["us"].min()), 3)
            if name == "heuristic" and "x_heuristic_cfg" in ok:
                row["heuristic_cfg"] = ok["x_heuristic_cfg"].iloc[0]
        for a, b in RATIOS:
            if f"{a}_us" in row and f"{b}_us" in row:
                row[f"{a}/{b}"] = round(row[f"{a}_us"] / row[f"{b}_us"], 3)
        out.append(row)
    return pd.DataFrame(out)


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
    names = list(VARIANTS)
    if args.variants:
        keep = set(args.variants.split(",")) | {"current"}
        unknown = keep - set(VARIANTS)
        if unknown:
            ap.error(f"unknown variant(s) {', '.join(sorted(unknown))}; pick from {', '.join(VARIANTS)}")
        names = [n for n in names if n in keep]
    scheme = None
    if args.fp8 or args.fp8_block:
        scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128)) if args.fp8_block else \
            moebench.QuantScheme(scales="tensor")
    stem = "decode_launches_fp8block" if args.fp8_block else "decode_launches_fp8" if args.fp8 else "decode_launches"
    if args.smoke and args.shapes == DEFAULT_SHAPES:  # both smoke shapes unless some are named
        args.shapes = ",".join(SMOKE_SHAPES)
    out_dir, dev, head = script_setup((scheme.describe() if scheme else "bf16")
                                      + "; layer = triton experts behind no-dpep, routing given (us)")
    print("# " + head, flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = ["" if n == "current" else OPTION_VARIANTS[n].name for n in names]
    frames = []
    for shape in args.shapes.split(","):
        # each round one sweep of every variant, in an order rotated by one per round, so that a
        # drift of the clocks over the run (prefill layers heat the GPU) spreads over all of them
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            rows = run_shard(shape, tokens, out_dir / "runs", dev, [("triton", order)], quant=scheme, reps=args.reps)
            frames.append(rows.assign(shape=shape, round=r))
        write_table(point_table(pd.concat(frames, ignore_index=True), names, args.rounds, scheme), out_dir, stem, head)
    print((out_dir / f"{stem}.md").read_text())
    return 0
