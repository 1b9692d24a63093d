"""Triton experts on one GPU: whole layer, GEMM part, alignment, torch baseline, floors, reference.

    PYTHONPATH=. python -m benchmarks bench_triton [--tokens 1,16,...] [--shapes a,b] [--smoke]

For each shape of design.md ("Performance reference points", bench_common.VLLM_REF_US) and token
count, in one run:
  layer_us   routing (softmax top-k, renormalised) + moebench `triton` experts via the modular
             kernel (alignment included), CUDA-graph replay (moebench.bench.timing.time_cuda)
  gemm_us    the GEMM part alone (GEMM1+SiLU-mul, GEMM2+weight+top-k sum, cast), alignment outside
  align_us   the alignment the layer uses, alone: moe_align_block_size, or direct_align where
             moebench's default picks it (one token: no kernel; under EP the GEMMs map the ids)
  torch_us   routing + `torch` experts + no-dpep finalize (its host syncs forbid graph capture:
             CUDA events around eager calls)
  floor_us   max(bytes / read ceiling, flops / matmul ceiling); bytes = weights of the local experts
             hit + activations in and out; ceilings measured in this run (a tuned read-only Triton
             kernel or torch.sum, whichever is faster; a bf16 8192^3 matmul)
  ref_us     design.md's reference table (vLLM-style kernel, vLLM's H200 configs, GEMM part)
  size_read_tbps / layer_over_size_read  (decode points) the read probe over a buffer of the
             point's bytes, and the layer against the time that read takes: the floor's 4 GiB
             ceiling is not reached by a plain read of a few hundred MB either
  library_us the same two GEMMs per expert by torch's library kernels, best of grouped_mm (CUTLASS)
             and one cuBLAS mm per expert (bench_common.library_gemms), with x already in expert
             order and no activation, router weight or top-k sum: what the vendor GEMMs reach at
             these shapes, against the floor (library_over_floor) and ours (gemm_over_library)
--smoke runs tiny shapes
on CPU under the Triton interpreter to check the script itself (its times mean nothing).
Writes bench_triton.csv and bench_triton.md under $OUT (default ./bench-out), prints the table.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch
import triton

import moebench
from moebench.bench.hardware import read_gbps_candidates
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

from benchmarks.bench_common import ON_GPU, SMOKE_SHAPES, bench_shape, library_gemms, seeded_inputs, timed, vllm_ref_us

SHAPES = ("mixtral", "qwen3-30b-a3b", "dsv3-ep8-local", "dsv3-ep8")  # bench_common.BENCH_SHAPES names
TOKENS = [1, 16, 64, 256, 1024, 4096]


KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def read_ceiling() -> tuple[float, str]:
    """Best read bandwidth (bytes/s) of moebench's read-only kernels (Triton stream and tile walk,
    torch.sum) over a 4 GiB buffer (moebench.bench.hardware.read_gbps_candidates)."""
    if not ON_GPU:
        return 1e11, "cpu (smoke)"
    cands, notes = read_gbps_candidates(torch.device("cuda"), 4 * 2**30)
    for name, v in cands.items():
        print(f"# read {name}: {v:.0f} GB/s", flush=True)
    for note in notes:
        print(f"# read: {note}", flush=True)
    how, gbps = max(cands.items(), key=lambda kv: kv[1])
    return gbps * 1e9, how


def matmul_ceiling() -> float:
    if not ON_GPU:
        return 1e11
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = timed(lambda: torch.matmul(a, b, out=c), reps=20, graph_calls=5)
    return 2 * 8192**3 / (t.median_us * 1e-6)


def torch_routing(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax top-k, renormalised, in plain torch ops (5 launches)."""
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return w / w.sum(-1, keepdim=True), ids.to(torch.int32)


def routing(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing in one Triton launch (moebench.kernels.triton.routing.fused_topk_softmax)."""
    return fused_topk_softmax(logits, k, renormalize=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter): checks the script")
    args = ap.parse_args(argv)
    t_start = time.time()
    out_dir = os.environ.get("OUT", "bench-out")
    os.makedirs(out_dir, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.smoke:
        args.shapes = ",".join(SMOKE_SHAPES)
    dev = torch.device("cuda" if ON_GPU else "cpu")
    gpu = torch.cuda.get_device_name() if ON_GPU else "cpu (smoke run: times are not kernel performance)"
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rbw, rhow = read_ceiling()
    mm = matmul_ceiling()
    print(f"# read ceiling {rbw / 1e12:.2f} TB/s ({rhow}); bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []
    csv_path = os.path.join(out_dir, "bench_triton.csv")
    torch_kernel = moebench.make_kernel("torch", "no-dpep")
    for shape in args.shapes.split(","):
        e, k, h, inter, e_local = bench_shape(shape)
        use_map = e_local < e
        dtype = torch.bfloat16
        w13 = torch.randn(e_local, 2 * inter, h, dtype=dtype, device=dev).mul_(h**-0.5)
        w2 = torch.randn(e_local, h, inter, dtype=dtype, device=dev).mul_(inter**-0.5)
        emap = None
        if use_map:
            emap = torch.full((e,), -1, dtype=torch.int32, device=dev)
            emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=dev)
        for ti_, m in enumerate(tokens):
            x, logits = seeded_inputs(m, h, e, dtype, dev)
            tw, ids = routing(logits, k)
            # dsv3-ep8-local reads the E=32,N=2048 file (tuned routing over 256 experts) by its tuned
            # routing: M tokens here are its 8M-token entries (configs.file_tokens)
            cfg, src = select_config(m, k, w13, w2, e, dtype)
            kernel = moebench.make_kernel("triton", "no-dpep", experts_kwargs=dict(config=cfg))
            # correctness first
            out = kernel.apply(x, w13, w2, tw, ids, expert_map=emap, num_experts=e)
            ref = moebench.reference_moe(x, w13, w2, tw, ids, emap)
            err = ((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            del ref
            local = ids.long() if emap is None else emap.long()[ids.long()]
            hit = torch.unique(local[local >= 0]).numel()
            pairs = int((local >= 0).sum())
            def aligned(bm=cfg["BLOCK_SIZE_M"], ids=ids):  # the alignment the layer uses
                return align_pairs(ids, bm, e_local, emap, e)

            align = aligned()
            opts = TritonOptions()
            split = layer_split_k(opts, m, k, e, e_local, h, inter, cfg, align.max_blocks, num_sms(dev))

            def layer():
                w_, i_ = routing(logits, k)
                return kernel.apply(x, w13, w2, w_, i_, expert_map=emap, num_experts=e)

            def gemm(c=cfg, a=align, s=split, tma="auto"):
                return fused_moe_gemms(x, w13, w2, tw, a, k, plan_layer(TritonOptions(use_tma=tma), x, w13, w2, a, k, c,
                                                                        split_k=s))

            tma0 = resolve_use_tma(opts, cfg, dtype) and tma_ok(w13) and tma_ok(w2)

            def torch_layer():
                w_, i_ = routing(logits, k)
                return torch_kernel.apply(x, w13, w2, w_, i_, expert_map=emap, num_experts=e)

            t_layer = timed(layer, reps=30, graph_calls=5)
            t_gemm = timed(gemm, reps=30, graph_calls=5)
            # GEMM1 as the layer runs it: x through TMA from a sorted copy where the sorted_a rule picks
            # it (the copy included), else the wide walk at >= 64-row tiles (wide_gemm1 "auto")
            wide0, s_a = gemm1_walk(opts, cfg, dtype, None, tma0, inter, m * k / e)
            plan1 = Gemm1Plan(use_tma=tma0, wide=wide0, sorted_a=s_a)
            inter0 = launch_gemm1(x, w13, align, k, cfg, plan1)
            t_g1 = timed(lambda: launch_gemm1(x, w13, align, k, cfg, plan1), reps=20, graph_calls=5)
            t_g2 = timed(lambda: launch_gemm2(inter0, w2, tw, align, k, cfg, Gemm2Plan(use_tma=tma0, split_k=split)),
                         reps=20, graph_calls=5)
            inter0 = None
            t_align = timed(aligned, reps=30, graph_calls=10)
            t_route = timed(lambda: routing(logits, k), reps=30, graph_calls=10)
            t_troute = timed(lambda: torch_routing(logits, k), reps=30, graph_calls=10)
            try:
                t_torch = timed(torch_layer, reps=10, use_graph=False).median_us
                torch_err = ""
            except Exception as ex:  # noqa: BLE001 - report, do not hide
                t_torch, torch_err = float("nan"), f"{type(ex).__name__}: {str(ex)[:80]}"
            # The same GEMMs by torch's library kernels (bench_common.library_gemms): what cuBLAS /
            # CUTLASS reach at these per-expert shapes, with the gather, activation and sum left out.
            lib = {}
            for name, fn in library_gemms(x, w13, w2, local).items():
                try:
                    lib[name] = timed(fn, reps=20, graph_calls=5).median_us
                except Exception as ex:  # noqa: BLE001 - report, do not hide
                    print(f"  library {name}: {type(ex).__name__}: {str(ex)[:160]}", file=sys.stderr)
            lib_how, t_lib = min(lib.items(), key=lambda kv: kv[1]) if lib else ("-", float("nan"))
            nbytes = hit * 3 * h * inter * 2 + 2 * m * h * 2
            flops = 2 * pairs * 3 * h * inter
            mem_floor = nbytes / rbw * 1e6
            cmp_floor = flops / mm * 1e6
            # No local expert hit (an EP shard at one token): the layer reads no weights and its
            # time is launches, not a roofline: no floor (nan), not the activations' few ns.
            floor = max(mem_floor, cmp_floor) if hit else float("nan")
            # A plain read of this point's weight bytes in one launch (the read-ceiling probe over a
            # buffer of that size): below ~1 GB it runs below the 4 GiB ceiling (PERF.md).
            size_read = float("nan")
            if ON_GPU and hit and m <= 256:
                size_read = max(read_gbps_candidates(dev, nbytes)[0].values()) * 1e9
            # the smoke shapes stand in for Mixtral's reference row
            ref_us = vllm_ref_us("mixtral" if shape in SMOKE_SHAPES else shape, m)
            row = dict(
                shape=shape, tokens=m, E=e, E_local=e_local, topk=k, hidden=h, intermediate=inter,
                max_rel_err=f"{err:.2e}", layer_us=round(t_layer.median_us, 1), layer_method=t_layer.method,
                layer_p10=round(t_layer.p10_us, 1), layer_p90=round(t_layer.p90_us, 1),
                gemm_us=round(t_gemm.median_us, 1), gemm_method=t_gemm.method, gemm1_us=round(t_g1.median_us, 1),
                gemm2_us=round(t_g2.median_us, 1), align_us=round(t_align.median_us, 1), align_kind="direct" if align.direct else "kernels",
                routing_us=round(t_route.median_us, 1), torch_routing_us=round(t_troute.median_us, 1), torch_us=round(t_torch, 1), torch_err=torch_err,
                experts_hit=hit, local_pairs=pairs, mem_floor_us=round(mem_floor, 1), compute_floor_us=round(cmp_floor, 1),
                floor_us=round(floor, 1), layer_over_floor=round(t_layer.median_us / floor, 3),
                size_read_tbps=round(size_read / 1e12, 3), layer_over_size_read=round(t_layer.median_us / (nbytes / size_read * 1e6), 3),
                gemm_over_floor=round(t_gemm.median_us / floor, 3), ref_us=ref_us,
                layer_over_ref=round(t_layer.median_us / ref_us, 3), gemm_over_ref=round(t_gemm.median_us / ref_us, 3),
                torch_over_layer=round(t_torch / t_layer.median_us, 2),
                library_us=round(t_lib, 1), library_how=lib_how, library_grouped_us=round(lib.get("grouped", float("nan")), 1),
                library_mm_us=round(lib.get("mm", float("nan")), 1), library_over_floor=round(t_lib / floor, 3),
                gemm_over_library=round(t_gemm.median_us / t_lib, 3),
                config="/".join(str(cfg[kk]) for kk in KEYS), split_k=split, tma=tma0, sorted_a=s_a, config_source=src,
            )
            rows.append(row)
            print(
                f"{shape:16s} M={m:5d} err={err:.1e} layer={t_layer.median_us:8.1f} ({t_layer.method}) gemm={t_gemm.median_us:8.1f} ({t_gemm.method}) "
                f"align={t_align.median_us:5.1f} torch={t_torch:8.1f} floor={floor:7.1f} ref={ref_us} "
                f"g1={t_g1.median_us:.1f} g2={t_g2.median_us:.1f} cfg={row['config']} sk={split}"
                f" [{time.time() - t_start:.0f}s]",
                flush=True,
            )
            _write_csv(csv_path, rows)
            out = x = logits = None  # free before the next token count
        w13 = w2 = None  # free this shape's weights before the next shape's
        torch.cuda.empty_cache()
    md = table_markdown(rows, gpu, rbw, rhow, mm)
    with open(os.path.join(out_dir, "bench_triton.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def _write_csv(path: str, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def table_markdown(rows, gpu, rbw, rhow, mm) -> str:
    lines = [
        f"GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}; read ceiling "
        f"{rbw / 1e12:.2f} TB/s ({rhow}), bf16 matmul {mm / 1e12:.0f} TFLOP/s (this run).",
        "",
        "| shape | M | layer us | gemm us (gemm1 + gemm2) | align us | routing us (torch ops) | torch us | floor us | layer/floor (layer/same-size read) | library gemms us (how): /floor, gemm/library | gemm/ref | layer/ref | config (M/N/K/G/w/s) sk | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f" ({r['layer_over_size_read']})" if r["layer_over_size_read"] == r["layer_over_size_read"] else ""
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['layer_us']} | {r['gemm_us']} ({r['gemm1_us']} + {r['gemm2_us']}) | {r['align_us']}{' (direct)' if r['align_kind'] == 'direct' else ''} | {r['routing_us']} ({r['torch_routing_us']}) | "
            f"{r['torch_us']} | {r['floor_us']} | {r['layer_over_floor']}{size} | {r['library_us']} ({r['library_how']}): {r['library_over_floor']}, {r['gemm_over_library']} | {r['gemm_over_ref']} | {r['layer_over_ref']} | "
            f"{r['config']} sk{r['split_k']}{' tma' if r['tma'] else ''}{' sorted-a' if r['sorted_a'] else ''} | {r['max_rel_err']} |"
        )
    return "\n".join(lines) + "\n"
