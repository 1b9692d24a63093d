"""The `triton` layer taken apart on one GPU, through the sweep: the layer, its GEMMs, its
alignment, routing, torch's library GEMMs and the `torch` experts, at the same points and routing.

    PYTHONPATH=. python -m benchmarks bench_triton [--tokens 1,16,...] [--shapes a,b] [--smoke]

Each shape (bench_common.BENCH_SHAPES: a model's rank share) runs as one sweep (moebench.sweep,
`no-dpep`): the `triton` experts with this module's registered variants, then the `torch` experts,
every row in one run folder under $OUT/runs (default ./bench-out), checked and timed by the sweep's
measure step. The variants, each a row with its name in the `variant` column:

  ""               the layer (the sweep's row): alignment, both GEMMs, SiLU-and-mul, top-k sum
  gemms            both GEMMs on alignment made outside the timed call (checked: the layer's output)
  gemm1, gemm2     each GEMM alone as the layer launches it (GEMM1's walk, GEMM2's K split)
  align            the alignment the layer takes (the direct one, or the alignment kernels)
  routing          softmax top-k, renormalised, in one Triton launch, on (M, E) router logits
  library-grouped  the same two GEMMs by torch.grouped_mm (CUTLASS on sm_90) on x already in
  library-mm       expert order / one torch.mm per hit expert (cuBLAS); no activation, router
                   weight or top-k sum: strictly less work than the layer (bench_common.library_gemms)

The table ($OUT/bench_triton.md and .csv, one line per shape and token count) puts each part
beside the layer, the layer against the sweep's floor (`floor_us`: max(bytes / read ceiling,
flops / matmul ceiling) of the ceilings the row names) and against design.md's reference
(bench_common.VLLM_REF_US). --smoke runs the tiny shapes on a CPU under the Triton interpreter
(checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from moebench.errors import MoebenchError
from moebench.kernels.triton.align import align_pairs
from moebench.kernels.triton.env import num_sms, tma_ok
from moebench.kernels.triton.experts import select_config
from moebench.kernels.triton.launch import fused_moe_gemms, launch_gemm1, launch_gemm2
from moebench.kernels.triton.options import (
    Gemm1Plan,
    Gemm2Plan,
    TritonOptions,
    gemm1_walk,
    layer_split_k,
    plan_layer,
    resolve_use_tma,
)
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.sweep.variants import Case, Variant, register

from benchmarks.bench_common import (LIBRARY_VARIANTS, SMOKE_SHAPES, run_shard, script_setup, seeded_inputs,
                                     vllm_ref_us, write_table)

SHAPES = ("mixtral", "qwen3-30b-a3b", "dsv3-ep8-local", "dsv3-ep8")  # bench_common.BENCH_SHAPES names
TOKENS = [1, 16, 64, 256, 1024, 4096]
PARTS = ("gemms", "gemm1", "gemm2", "align", "routing", *LIBRARY_VARIANTS)


class LayerParts:
    """What the parts of one case share, as the `triton` layer decides it: GEMM1's config and
    where it came from, the alignment, GEMM2's K split and GEMM1's walk (TMA, wide, sorted A)."""

    def __init__(self, case: Case):
        x, w13, w2, self.tw, self.ids, self.emap, self.e = case.args
        if not isinstance(w13, torch.Tensor):
            raise MoebenchError("the layer's parts are timed for 16-bit weights only")
        self.x, self.w13, self.w2, self.k = x, w13, w2, self.ids.shape[1]
        m, e_local, inter = x.shape[0], w13.shape[0], w2.shape[2]
        self.cfg, source = select_config(m, self.k, w13, w2, self.e, x.dtype)
        self.options = TritonOptions()
        self.align = self.aligned()
        self.split = layer_split_k(self.options, m, self.k, self.e, e_local, x.shape[1], inter, self.cfg,
                                   self.align.max_blocks, num_sms(x.device))
        self.tma = resolve_use_tma(self.options, self.cfg, x.dtype) and tma_ok(w13) and tma_ok(w2)
        wide, sorted_a = gemm1_walk(self.options, self.cfg, x.dtype, None, self.tma, inter, m * self.k / self.e)
        self.plan1 = Gemm1Plan(use_tma=self.tma, wide=wide, sorted_a=sorted_a)
        case.notes.update(config="/".join(str(self.cfg[c]) for c in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K",
                                                                     "GROUP_SIZE_M", "num_warps", "num_stages")),
                          config_file=source, split_k=self.split, tma=self.tma, sorted_a=sorted_a,
                          align_kind="direct" if self.align.direct else "kernels")

    def aligned(self):
        return align_pairs(self.ids, self.cfg["BLOCK_SIZE_M"], self.w13.shape[0], self.emap, self.e)

    def gemms(self):
        plan = plan_layer(self.options, self.x, self.w13, self.w2, self.align, self.k, self.cfg, split_k=self.split)
        return fused_moe_gemms(self.x, self.w13, self.w2, self.tw, self.align, self.k, plan)

    def gemm1(self):
        return launch_gemm1(self.x, self.w13, self.align, self.k, self.cfg, self.plan1)

    def gemm2(self):
        inter = self.gemm1()  # made once, outside the timed call
        plan2 = Gemm2Plan(use_tma=self.tma, split_k=self.split)
        return lambda: launch_gemm2(inter, self.w2, self.tw, self.align, self.k, self.cfg, plan2)


def _routing(case: Case):
    x, e, k = case.args[0], case.args[6], case.args[4].shape[1]
    _, logits = seeded_inputs(x.shape[0], x.shape[1], e, x.dtype, x.device)
    return lambda: fused_topk_softmax(logits, k, renormalize=True)


for _variant in (
    Variant("gemms", lambda case: LayerParts(case).gemms, checked=True,
            about="both GEMMs, alignment made outside the timed call"),
    Variant("gemm1", lambda case: LayerParts(case).gemm1, about="GEMM1 + SiLU-and-mul as the layer launches it"),
    Variant("gemm2", lambda case: LayerParts(case).gemm2(), about="GEMM2 + router weight + top-k sum"),
    Variant("align", lambda case: LayerParts(case).aligned, about="the alignment the layer takes"),
    Variant("routing", _routing, about="softmax top-k, renormalised, one Triton launch"),
):
    register(_variant)


def parts_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (shape, tokens): the layer, each part's time (us), the `torch` experts, the
    floor and the ratios the PERF.md tables quote."""
    # a simulated shard's rows come once per modeled all-reduce, on one measurement of its experts
    ok = rows[rows.status == "ok"].drop_duplicates(["shape", "tokens", "experts", "variant"]).copy()
    ok["us"] = ok["experts_us"].where(ok["modeled"].astype(bool), ok["latency_us"])
    ok["part"] = ok["variant"].fillna("").where(ok["experts"] == "triton", "torch")
    ok["part"] = ok["part"].replace("", "layer")
    wide = ok.pivot_table(index=["shape", "tokens"], columns="part", values="us", aggfunc="first")
    layer = ok[ok.part == "layer"].set_index(["shape", "tokens"])
    gemms = ok[ok.part == "gemms"].set_index(["shape", "tokens"])
    out = pd.DataFrame(index=wide.index)
    for part in ("layer", *PARTS, "torch"):
        if part in wide:
            out[f"{part}_us"] = wide[part].round(1)
    out["floor_us"] = layer["floor_us"].round(1)
    out["layer_over_floor"] = (out["layer_us"] / out["floor_us"]).round(3)
    if "gemms_us" in out:
        out["gemms_over_floor"] = (out["gemms_us"] / out["floor_us"]).round(3)
        lib = out[[c for c in ("library-grouped_us", "library-mm_us") if c in out]].min(axis=1)
        out["gemms_over_library"] = (out["gemms_us"] / lib).round(3)
    if "torch_us" in out:
        out["torch_over_layer"] = (out["torch_us"] / out["layer_us"]).round(2)
    out["max_rel_err"] = layer["max_rel_err"].map(lambda v: f"{v:.1e}")
    out["gemms_err"] = gemms["max_rel_err"].map(lambda v: f"{v:.1e}") if len(gemms) else ""
    for name in ("config", "config_file", "split_k", "tma", "sorted_a", "align_kind"):
        col = gemms.get(f"x_{name}")
        out[name] = col if col is not None else ""
    # in the order the shapes ran (pivot_table sorts its index)
    order = list(dict.fromkeys(zip(ok["shape"], ok["tokens"])))
    out = out.reindex(pd.MultiIndex.from_tuples(order, names=["shape", "tokens"])).reset_index()
    # the smoke shapes stand in for Mixtral's reference row
    out["ref_us"] = [vllm_ref_us("mixtral" if s in SMOKE_SHAPES else s, t) for s, t in zip(out["shape"], out["tokens"])]
    out["layer_over_ref"] = (out["layer_us"] / out["ref_us"]).round(3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter): checks the script")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = list(SMOKE_SHAPES) if args.smoke else args.shapes.split(",")
    out_dir, dev, head = script_setup("bf16; layer = the `triton` experts' layer, routing given (us)")
    print("# " + head, flush=True)
    frames = []
    for shape in shapes:
        rows = run_shard(shape, tokens, out_dir / "runs", dev, [("triton", ["", *PARTS]), ("torch", [""])])
        frames.append(rows.assign(shape=shape))
        table = parts_table(pd.concat(frames, ignore_index=True))
        write_table(table, out_dir, "bench_triton", head)
    print((out_dir / "bench_triton.md").read_text())
    return 0
