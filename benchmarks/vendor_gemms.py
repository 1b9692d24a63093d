"""Prefill by a vendor grouped GEMM: DeepGEMM's two contiguous grouped GEMMs alone, on the rows of
the same routing, against the `triton` layer, the `deepgemm` layer (the adapter's glue included)
and, for bf16, torch's grouped GEMM; every time also over the sweep's floor (at these token counts
the compute floor, 2 x pairs x 3 x H x I / the matmul ceiling). The question it answers: can a layer
built around the vendor GEMM come within 1.5x of the floor where the Triton layer does not, and how
much of the `deepgemm` layer is glue.

    PYTHONPATH=. python -m benchmarks vendor_gemms [--shapes a,b] [--tokens 1024,4096] [--fp8-block]
        [--warm] [--smoke]

Each shape is one sweep (moebench.sweep, `no-dpep`, a run folder under $OUT/runs): the `triton`
layer; the `deepgemm` layer with its GEMMs alone as registered variants (`dg-gemm1`, `dg-gemm2`),
on the adapter's psum layout (`moe_align_block_size` with DeepGEMM's 128-row alignment as the
block, `moebench.kernels.deepgemm.grouped_layout`) of the routed pairs, with activation values drawn
at random (the time does not depend on them); for bf16 `library-grouped` (bench_common). Routing is
given, outside the timed region. Needs deep_gemm (README, "Vendor libraries"); without it the
DeepGEMM rows are skipped by the sweep with the reason, and the table's `deepgemm_note` says it.
--warm runs every call once, unchecked (fills DeepGEMM's and Triton's caches).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

import moebench
from moebench.kernels import deepgemm as dgk
from moebench.kernels.token_layout import local_topk_ids
from moebench.kernels.triton.align import moe_align_block_size
from moebench.quant import FP8_DTYPE
from moebench.sweep.variants import Case, Variant, register

from benchmarks.bench_common import run_shard, script_setup, write_table

DEFAULT_SHAPES = "mixtral-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-tp8,mixtral,dsv3-ep8-local"
#: --smoke: H and I of one 128-column fp8 scale group, so every column runs
SMOKE = {"tiny": (16, 2, 128, 128, 16)}


def _dg_gemms(dg, ids_local, e: int, h: int, inter: int, w13, w2, fp8: bool, dev) -> dict:
    """DeepGEMM's GEMM1 and GEMM2 alone on the contiguous (psum) layout of these pairs."""
    align = moe_align_block_size(ids_local, dg.get_mk_alignment_for_contiguous_layout(), e)
    group_end = dgk.grouped_layout(align, ids_local, e)
    rows = align.sorted_token_ids.numel()
    m, k = ids_local.shape
    expected_m = max(1, -(-m * k // e))
    kw = {"use_psum_layout": True, "expected_m_for_psum_layout": expected_m}
    a = torch.randn(rows, h, device=dev).to(torch.bfloat16)
    act = torch.randn(rows, inter, device=dev).to(torch.bfloat16)
    gate_up = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=dev)
    y = torch.empty(rows, h, dtype=torch.bfloat16, device=dev)
    if fp8:
        a, act = a.to(FP8_DTYPE), act.to(FP8_DTYPE)
        sa, sact = dgk.empty_mn_major((rows, h // 128), dev), dgk.empty_mn_major((rows, inter // 128), dev)
        sa.fill_(1.0)
        sact.fill_(1.0)
        b13, b2 = (w13.q, w13.scale.contiguous()), (w2.q, w2.scale.contiguous())
        return {"gemm1": lambda: dg.m_grouped_fp8_gemm_nt_contiguous((a, sa), b13, gate_up, group_end, **kw),
                "gemm2": lambda: dg.m_grouped_fp8_gemm_nt_contiguous((act, sact), b2, y, group_end, **kw)}
    return {"gemm1": lambda: dg.m_grouped_bf16_gemm_nt_contiguous(a, w13, gate_up, group_end, **kw),
            "gemm2": lambda: dg.m_grouped_bf16_gemm_nt_contiguous(act, w2, y, group_end, **kw)}


def _dg_variant(which: str):
    def build(case: Case):
        import deep_gemm as dg

        x, w13, w2, _, ids, emap, _ = case.args
        dgk.check_shapes(w13, w2, case.spec.quant, "deepgemm")
        e_local, h, inter = w2.shape
        calls = _dg_gemms(dg, local_topk_ids(ids, emap), e_local, h, inter, w13, w2, case.spec.quant is not None,
                          x.device)
        return calls[which]
    return build


DG_VARIANTS = tuple(register(Variant(f"dg-{g}", _dg_variant(g), about=f"DeepGEMM's {g} alone, contiguous layout")).name
                    for g in ("gemm1", "gemm2"))


def vendor_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (shape, tokens): each layer's and GEMM's time, error, and over the floor; a
    column that did not run says why (`<name>_note`)."""
    rows = rows.copy()
    rows["name"] = rows["variant"].fillna("").str.replace("-", "_")
    rows["name"] = rows["name"].where(rows["name"] != "", rows["experts"]).replace("library_grouped", "torch_grouped")
    out = []
    for (shape, m), point in rows.groupby(["shape", "tokens"], sort=False):
        layer = point[(point.experts == "triton") & (point.name == "triton")]
        row = dict(shape=shape, tokens=m, floor_us=round(float(layer["floor_us"].iloc[0]), 1) if len(layer) else "")
        for _, r in point.iterrows():
            if r.status != "ok":
                row[f"{r['name']}_note"] = str(r.reason)[:60]
                continue
            if r.max_rel_err == r.max_rel_err and r.max_rel_err is not None:
                row[f"{r['name']}_err"] = f"{r.max_rel_err:.1e}"
            row[f"{r['name']}_us"] = round(float(r.latency_us), 1)
        if "dg_gemm1_us" in row and "dg_gemm2_us" in row:
            row["dg_gemms_us"] = round(row["dg_gemm1_us"] + row["dg_gemm2_us"], 1)
        for name in ("triton", "deepgemm", "dg_gemms", "torch_grouped"):
            if f"{name}_us" in row and row["floor_us"]:
                row[f"{name}/floor"] = round(row[f"{name}_us"] / row["floor_us"], 2)
        out.append(row)
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--fp8-block", action="store_true", help="fp8_w8a8 weights with 128 x 128 block scales")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm", action="store_true",
                    help="run every call once, unchecked (fills DeepGEMM's and Triton's caches)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    fp8 = args.fp8_block
    scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128)) if fp8 else None
    if args.smoke:
        args.shapes, args.tokens = ",".join(SMOKE), "8"
    out_dir, dev, head = script_setup((scheme.describe() if scheme else "bf16")
                                      + "; layers without routing, GEMMs alone (us); floor = the sweep's")
    print("# " + head, flush=True)
    stem = ("vendor_gemms_fp8block" if fp8 else "vendor_gemms") + ("_warm" if args.warm else "")
    experts = [("triton", [""] if fp8 else ["", "library-grouped"]), ("deepgemm", ["", *DG_VARIANTS])]
    frames = []
    for shape in args.shapes.split(","):
        rows = run_shard(shape, [int(t) for t in args.tokens.split(",")], out_dir / "runs", dev, experts, quant=scheme,
                         reps=1 if args.warm else args.reps, check=not args.warm, shapes=SMOKE)
        frames.append(rows.assign(shape=shape))
        write_table(vendor_table(pd.concat(frames, ignore_index=True)), out_dir, stem, head)
    print((out_dir / f"{stem}.md").read_text())
    return 0
