"""Where the DeepGEMM pairs spend their time: DeepGEMM's two grouped GEMMs against the glue around
them, per launch, beside the layer as the sweep times it.

    PYTHONPATH=. python -m benchmarks deepgemm_breakdown --shapes dsv3-tp8,dsv3-ep8 \
        --tokens 16,64,256,1024,4096 [--bf16] [--calls 10]

For each shape, token count and pair (`no-dpep+deepgemm`, `batched-local+batched-deepgemm`):
  - the layer as the sweep times it (CUDA-graph replays, `bench_common.timed`);
  - torch.profiler over --calls eager calls: every kernel's device time per call, each given to the
    adapter step (`moebench.kernels.deepgemm.STAGES`: the GEMMs, the alignment, gather, activation
    with requantisation, weighted top-k sum, the masked layout's pack / unpack) whose profiler
    range launched it; kernels outside every step (the prepare's quantisation, the finalize) are
    `other`;
  - the glue's unavoidable bytes (the layer input read, once; GEMM1's output read and the fp8 or
    bf16 intermediate written; GEMM2's rows read and the output written) over the measured read
    ceiling: the least time any glue around DeepGEMM's two GEMMs can take;
  - target: the layer within 1.10x of (GEMMs + that least glue time). Where the profiler records
    no launch of DeepGEMM's GEMMs (its JIT kernels on Hopper with torch 2.11), their time is the
    layer's minus the glue's (`gemms_from`), an upper bound, and the target reads: the glue beyond
    its least time is at most a tenth of the layer.
Writes deepgemm_breakdown.csv (one row per point and pair), deepgemm_kernels.csv (one row per
kernel) and deepgemm_breakdown.md to $OUT.

    PYTHONPATH=. python -m benchmarks deepgemm_breakdown --padding --gpu H100   # any machine, no GEMM

--padding: what DeepGEMM's row alignment costs at each point, from the routing alone (modeled, with
the --gpu datasheet's peaks): the rows its contiguous layout computes (every local expert's rows
rounded up to 128) and its masked layout (rounded up to 64, its smallest BLOCK_M) against the pairs,
the compute those rows take at the fp8 (bf16 with --bf16) peak, and the experts' weights read at the
HBM peak: where the padded compute passes the weight read, the alignment, not the bytes, sets
DeepGEMM's time, and a kernel that computes the pairs alone can be faster. Writes
deepgemm_padding.csv / .md. --smoke: a tiny shape on the CPU with the torch stand-in
for deep_gemm (`deepgemm_standin`), the glue under the Triton interpreter: checks the script, times
nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

import pandas as pd
import torch

import moebench
from benchmarks.bench_common import ON_GPU, bench_shape, script_setup, seeded_inputs, shard_weights, timed, write_table
from moebench.errors import MoebenchError
from moebench.kernels.deepgemm import GEMM_STAGES, STAGES
from moebench.kernels.triton.routing import fused_topk_softmax

#: (prepare/finalize, experts, experts' arguments, label): the pairs and the glue variants timed
PAIRS = (("no-dpep", "deepgemm", {}, "no-dpep+deepgemm"),
         ("batched-local", "batched-deepgemm", {}, "batched-local+batched-deepgemm"))
TARGET = 1.10
#: a kernel of torch's own (elementwise, index, cub): never one of DeepGEMM's GEMMs
TORCH_KERNEL = re.compile(r"\bat(_cuda_detail)?::")


def glue_bytes(m: int, topk: int, h: int, inter: int, fp8: bool) -> int:
    """Bytes the glue must move at least: x read once, GEMM1's (pairs, 2I) bf16 output read and the
    intermediate (pairs, I) written (fp8 with 1x128 fp32 scales, or bf16), GEMM2's (pairs, H) bf16
    rows read and the (M, H) bf16 output written."""
    pairs = m * topk
    act = pairs * inter * (1 + 4 / 128) if fp8 else pairs * inter * 2
    return int(m * h * 2 + pairs * 2 * inter * 2 + act + pairs * h * 2 + m * h * 2)


def padding_rows(ids: torch.Tensor, e_local: int, align: int) -> tuple[int, int]:
    """(local experts hit, rows a layout aligning each expert's rows to `align` computes) for
    routing `ids` (M, K) over global experts, the first `e_local` of them local."""
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat[flat < e_local], minlength=e_local)
    return int((counts > 0).sum()), int(((counts + align - 1) // align * align).sum())


def padding_table(a, tokens: list[int], dims_of: dict, gpu: str) -> pd.DataFrame:
    from moebench.bench.hardware import datasheet_ceilings

    c = datasheet_ceilings(gpu)
    if c is None:
        raise MoebenchError(f"--gpu {gpu}: no datasheet profile (e.g. H100, H200, B200)")
    fp8 = not a.bf16
    tflops = c.matmul_tflops["fp8" if fp8 else "bf16"]
    rows = []
    for shape, (e, k, h, inter, e_local) in dims_of.items():
        for m in tokens:
            g = torch.Generator().manual_seed(m)
            logits = torch.randn(m, e, generator=g)
            ids = torch.softmax(logits, -1).topk(k, -1).indices
            pairs = int((ids < e_local).sum())
            hit, contiguous = padding_rows(ids, e_local, 128)
            _, masked = padding_rows(ids, e_local, 64)
            flops_per_row = 2 * 3 * h * inter
            read_us = hit * 3 * h * inter * (1 if fp8 else 2) / (c.mem_read_gbps * 1e3)
            rows.append({"shape": shape, "tokens": m, "pairs": pairs, "experts_hit": hit,
                         "contiguous_rows": contiguous, "masked_rows": masked,
                         "padding_x": round(contiguous / max(1, pairs), 1),
                         "padded_compute_us": round(contiguous * flops_per_row / (tflops * 1e6), 1),
                         "masked_compute_us": round(masked * flops_per_row / (tflops * 1e6), 1),
                         "pairs_compute_us": round(pairs * flops_per_row / (tflops * 1e6), 1),
                         "weights_read_us": round(read_us, 1)})
    df = pd.DataFrame(rows)
    df["alignment_bound"] = df["padded_compute_us"] > df["weights_read_us"]
    return df


def _step_of(event, parents: dict) -> str | None:
    """The adapter step (`deepgemm:<step>` range) an event runs under, or None."""
    node = event
    while node is not None:
        if node.name.startswith("deepgemm:"):
            return node.name.split(":", 1)[1]
        node = parents.get(id(node))
    return None


def profile_steps(call, calls: int, on_gpu: bool) -> tuple[dict[str, float], list[dict]]:
    """torch.profiler over `calls` calls: {step: us per call} (device time on a GPU, CPU time
    otherwise) and one dict per kernel (name, step, launches and us per call)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            call()
        if on_gpu:
            torch.cuda.synchronize()
    events = prof.events()
    parents = {}
    for ev in events:
        for child in ev.cpu_children:
            parents[id(child)] = ev
    steps: dict[str, float] = defaultdict(float)
    kernels: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    if on_gpu:
        for ev in events:
            for k in ev.kernels:
                step = _step_of(ev, parents) or "other"
                steps[step] += k.duration / calls
                rec = kernels[(k.name, step)]
                rec[0] += 1
                rec[1] += k.duration / calls
    else:  # no kernels on a CPU: the ranges' own CPU time stands in (the smoke checks the attribution)
        for ev in events:
            if ev.name.startswith("deepgemm:"):
                steps[ev.name.split(":", 1)[1]] += ev.cpu_time_total / calls
    rows = [{"kernel": name[:120], "step": step, "launches_per_call": n / calls, "us_per_call": round(us, 2)}
            for (name, step), (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    return dict(steps), rows


def split_time(layer_us: float, steps: dict[str, float], kernels: list[dict], on_gpu: bool) -> tuple[float, float, bool]:
    """(GEMMs us, glue us, whether the profiler saw a GEMM launch) of one point. The profiler records
    no launch of DeepGEMM's JIT kernels (H100, torch 2.11, deep_gemm 2.5: only torch's kernels appear
    in the GEMM steps): their time is then the layer's minus the glue's, an upper bound (the gaps
    between launches are in it)."""
    glue_us = sum(v for s, v in steps.items() if s not in GEMM_STAGES)
    seen = not on_gpu or any(k["step"] in GEMM_STAGES and not TORCH_KERNEL.search(k["kernel"]) for k in kernels)
    if seen:
        return sum(steps.get(s, 0.0) for s in GEMM_STAGES), glue_us, True
    return max(layer_us - glue_us, 0.0), glue_us, False


def read_ceiling_gbps(dev: torch.device) -> float | None:
    """The measured read ceiling of this GPU (moebench env --calibrate's, measured now if missing)."""
    if dev.type != "cuda":
        return None
    from moebench.bench.hardware import get_ceilings

    c = get_ceilings(dev, calibrate_if_missing=True)
    return c.mem_read_gbps if c is not None else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3-tp8,dsv3-ep8", help="bench_common.BENCH_SHAPES names")
    ap.add_argument("--tokens", default="16,64,256,1024,4096")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights (default: fp8 with 128x128 block scales)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=30, help="graph replays of the layer's timing")
    ap.add_argument("--padding", action="store_true", help="the alignment's cost from the routing alone (modeled)")
    ap.add_argument("--gpu", default="H100", help="datasheet for --padding")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
        shapes = ["tiny"] if a.smoke else a.shapes.split(",")
        dims_of = {s: bench_shape(s) for s in shapes}
    except (ValueError, MoebenchError) as ex:
        print(f"error: {ex}", file=sys.stderr)
        sys.exit(2)
    if a.padding:
        out_dir = script_setup("deepgemm_breakdown --padding")[0]
        try:
            df = padding_table(a, tokens, dims_of, a.gpu)
        except MoebenchError as ex:
            print(f"error: {ex}", file=sys.stderr)
            sys.exit(2)
        write_table(df, out_dir, "deepgemm_padding",
                    f"# modeled from the routing and the {a.gpu} datasheet ({'fp8' if not a.bf16 else 'bf16'} peak, "
                    "HBM peak): DeepGEMM's row alignment (contiguous: 128 rows per expert; masked: 64) vs the pairs")
        return None
    if not a.smoke:
        return run(a, tokens, dims_of)
    from benchmarks.deepgemm_standin import fake_deep_gemm

    held = sys.modules.get("deep_gemm")
    sys.modules["deep_gemm"] = fake_deep_gemm()
    try:  # the stand-in only for this run: the process may go on (tests run cases in-process)
        return run(a, tokens[:2], {"tiny": (8, 2, 128, 128, 8)})
    finally:
        if held is None:
            sys.modules.pop("deep_gemm", None)
        else:
            sys.modules["deep_gemm"] = held


def run(a, tokens: list[int], dims_of: dict) -> None:
    out_dir, dev, head = script_setup("deepgemm_breakdown")
    on_gpu = dev.type == "cuda"
    fp8 = not a.bf16
    scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128)) if fp8 else None
    read_gbps = read_ceiling_gbps(dev)
    rows, kernel_rows = [], []
    for shape, dims in dims_of.items():
        e, k, h, inter, _ = dims
        w13, w2, emap = shard_weights(dims, scheme, dev)
        for m in tokens:
            x, logits = seeded_inputs(m, h, e, torch.bfloat16, dev)
            w, ids = fused_topk_softmax(logits, k, renormalize=True)
            for pf, ex, kw, label in PAIRS:
                kern = moebench.make_kernel(ex, pf, experts_kwargs=kw or None)

                def call(kern=kern):
                    return kern.apply(x, w13, w2, w, ids, expert_map=emap, num_experts=e)

                for _ in range(1 if a.smoke else 3):
                    call()
                layer_us = timed(call, reps=a.reps).median_us
                steps, kern_list = profile_steps(call, 1 if a.smoke else a.calls, on_gpu)
                gemm_us, glue_us, seen = split_time(layer_us, steps, kern_list, on_gpu)
                floor_glue = glue_bytes(m, k, h, inter, fp8) / (read_gbps * 1e3) if read_gbps else None
                bound = gemm_us + floor_glue if floor_glue is not None else None
                row = {"shape": shape, "tokens": m, "pair": label, "dtype": "fp8-block" if fp8 else "bf16",
                       "layer_us": round(layer_us, 1), "kernels_us": round(glue_us + (gemm_us if seen else 0.0), 1),
                       "gemms_us": round(gemm_us, 1), "gemms_from": "profiler" if seen else "layer - glue",
                       "glue_us": round(glue_us, 1)}
                for s in STAGES[ex] + ("other",):
                    row[f"{s}_us"] = None if s in GEMM_STAGES and not seen else round(steps.get(s, 0.0), 1)
                row["glue_floor_us"] = round(floor_glue, 1) if floor_glue is not None else None
                row["layer_over_bound"] = round(layer_us / bound, 3) if bound else None
                row["target_met"] = (layer_us <= TARGET * bound) if bound else None
                rows.append(row)
                for kr in kern_list:
                    kernel_rows.append({"shape": shape, "tokens": m, "pair": label, **kr})
                print(f"{shape} M={m} {label}: layer {layer_us:.1f} us, GEMMs {gemm_us:.1f}, glue {glue_us:.1f}"
                      + (f", least glue {floor_glue:.1f}, layer / (GEMMs + least glue) {layer_us / bound:.3f}"
                         if bound else ""), flush=True)
    df = pd.DataFrame(rows)
    pd.DataFrame(kernel_rows).to_csv(out_dir / "deepgemm_kernels.csv", index=False)
    note = (f"# {head}\n{'fp8 block 128x128' if fp8 else 'bf16'}; layer: CUDA-graph replays; steps: torch.profiler "
            f"device time per call over {1 if a.smoke else a.calls} eager calls (gemms_from 'layer - glue': the "
            "profiler saw no GEMM launch, their time is the layer's minus the glue's, an upper bound); glue_floor_us: the glue's least bytes over the read "
            f"ceiling ({read_gbps} GB/s); target: layer <= {TARGET} x (gemms + glue floor)")
    write_table(df, out_dir, "deepgemm_breakdown", note)


if __name__ == "__main__":
    main()
