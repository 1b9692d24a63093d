"""Prefill by a vendor grouped GEMM: DeepGEMM's two contiguous grouped GEMMs alone, on the rows of
the same routing, against the `triton` layer, the `deepgemm` layer (the adapter's glue included)
and, for bf16, torch's grouped GEMM; every time also over the compute floor (2 x pairs x 3 x H x I /
the matmul ceiling). The question it answers: can a layer built around the vendor GEMM come within
1.5x of the floor where the Triton layer does not, and how much of the `deepgemm` layer is glue.

    PYTHONPATH=. python -m benchmarks vendor_gemms [--shapes a,b] [--tokens 1024,4096] [--fp8-block]
        [--ceilings bf16=749.6,fp8=1336.2] [--warm] [--smoke]

The GEMM-alone rows use the adapter's psum layout (`moe_align_block_size` with DeepGEMM's 128-row
alignment as the block, `moebench.kernels.deepgemm.grouped_layout`) on the routed pairs, with activation values drawn at random (the
time does not depend on them); routing is done once, outside the timed region. Needs deep_gemm
(README, "Vendor libraries"); without it the DeepGEMM columns say why and the rest still runs.
"""

from __future__ import annotations

import argparse

import torch

import moebench
from moebench.errors import MoebenchError
from moebench.kernels import deepgemm as dgk
from moebench.kernels.token_layout import local_topk_ids
from moebench.kernels.triton.align import moe_align_block_size
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.quant import FP8_DTYPE

from benchmarks.bench_common import bench_shape, library_gemms, script_setup, seeded_inputs, shard_weights, timed_us, write_rows

DEFAULT_SHAPES = "mixtral-tp8,qwen3-30b-a3b,qwen3-235b-tp8,dsv3-tp8,mixtral,dsv3-ep8-local"
#: --smoke: H and I of one 128-column fp8 scale group, so every column runs
SMOKE = {"tiny": (16, 2, 128, 128, 16)}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> str:
    return f"{((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item():.1e}"


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--fp8-block", action="store_true", help="fp8_w8a8 weights with 128 x 128 block scales")
    ap.add_argument("--ceilings", default="bf16=749.6,fp8=1336.2", help="matmul ceilings, TFLOP/s")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm", action="store_true",
                    help="run every kernel once, unchecked and untimed (fills DeepGEMM's and Triton's caches)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    ceil = {k: float(v) for k, v in (p.split("=") for p in args.ceilings.split(","))}
    fp8 = args.fp8_block
    scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128)) if fp8 else None
    if args.smoke:
        args.shapes, args.tokens = ",".join(SMOKE), "8"
    out_dir, dev, head = script_setup((scheme.describe() if scheme else "bf16")
                                      + "; layers without routing, GEMMs alone (us); floor = compute floor")
    print("# " + head, flush=True)
    dg_reason = dgk.DeepGemmExperts.unavailable_reason(dev.type)
    dg = None
    if dg_reason is None:
        import deep_gemm as dg
    stem = ("vendor_gemms_fp8block" if fp8 else "vendor_gemms") + ("_warm" if args.warm else "")
    rows = []
    for shape in args.shapes.split(","):
        dims = SMOKE[shape] if shape in SMOKE else bench_shape(shape)
        e, k, h, inter, e_local = dims
        dt = torch.bfloat16
        w13, w2, emap = shard_weights(dims, scheme, dev)
        for m in [int(t) for t in args.tokens.split(",")]:
            x, logits = seeded_inputs(m, h, e, dt, dev)
            tw, ids = fused_topk_softmax(logits, k, renormalize=True)
            ids_local = local_topk_ids(ids, emap)
            pairs = int((ids_local >= 0).sum())
            floor_us = 2 * pairs * 3 * h * inter / (ceil["fp8" if fp8 else "bf16"] * 1e12) * 1e6
            row = dict(shape=shape, tokens=m, pairs=pairs, floor_us=round(floor_us, 1))
            ref = None if args.warm else moebench.reference_moe(x, w13, w2, tw, ids, emap)
            layers = {"triton": None, "deepgemm": dg_reason}
            for name, reason in layers.items():
                if reason is not None:
                    row[f"{name}_note"] = reason[:60]
                    continue
                kern = moebench.make_kernel(name, "no-dpep")

                def layer(kern=kern):
                    return kern.apply(x, w13, w2, tw, ids, expert_map=emap, num_experts=e)
                try:
                    out = layer()
                except MoebenchError as ex:
                    row[f"{name}_note"] = str(ex)[:60]
                    continue
                if args.warm:
                    continue
                row[f"{name}_err"] = _rel_err(out, ref)
                row[f"{name}_us"] = round(timed_us(layer, reps=args.reps, graph_calls=5), 1)
            gemms = {}
            if dg is not None:
                try:
                    dgk.check_shapes(w13, w2, scheme, "deepgemm")
                    gemms.update({f"dg_{n}": f for n, f in _dg_gemms(dg, ids_local, e_local, h, inter, w13, w2, fp8, dev).items()})
                except MoebenchError as ex:
                    row["dg_note"] = str(ex)[:60]
            if not fp8:
                lib = library_gemms(x, w13, w2, ids_local)
                if "grouped" in lib:
                    gemms["torch_grouped"] = lib["grouped"]
            for name, fn in gemms.items():
                fn()
                if args.warm:
                    continue
                row[f"{name}_us"] = round(timed_us(fn, reps=args.reps, graph_calls=5), 1)
            if "dg_gemm1_us" in row:
                row["dg_gemms_us"] = round(row["dg_gemm1_us"] + row["dg_gemm2_us"], 1)
            for name in ("triton", "deepgemm", "dg_gemms", "torch_grouped"):
                if f"{name}_us" in row and floor_us > 0:
                    row[f"{name}/floor"] = round(row[f"{name}_us"] / floor_us, 2)
            rows.append(row)
            write_rows(rows, out_dir, stem, head)
            ref = None
        w13 = w2 = None
    print((out_dir / f"{stem}.md").read_text())
    return 0
