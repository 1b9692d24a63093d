"""Where one (prepare/finalize, experts) case spends its time: torch.profiler's table, or plain
calls for an outside profiler such as Nsight Compute.

    PYTHONPATH=. python -m benchmarks profile_case --shape qwen3-30b-a3b --tokens 1 \
        --experts batched-triton --prepare-finalize batched-local
    ncu --clock-control none -k regex:gemm --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python -m benchmarks profile_case --shape dsv3-tp8 --tokens 64 --fp8-block --plain --calls 3

--shape: a bench shape (bench_common.BENCH_SHAPES: whole models and the TP / EP shards of the tables,
routing over the global experts through an expert map where fewer are local). --fp8-block:
fp8_w8a8 weights with 128 x 128 block scales. --plain: no torch.profiler, just --calls calls after
the warm-up (each call launches the same kernels, so `--launch-skip` counts whole calls).
--option NAME=VALUE (repeatable): a TritonOptions field for the triton experts (true, false, auto, or
a number), e.g. --option token_rows=false to see the alignment kernels where the token-rows layout
is the default. --smoke: a tiny shape on CPU under the Triton interpreter (checks the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import moebench
from moebench.errors import MoebenchError
from moebench.kernels.triton.options import TritonOptions
from moebench.kernels.triton.routing import fused_topk_softmax

from benchmarks.bench_common import bench_shape, script_setup, seeded_inputs, shard_weights


def parse_options(pairs: list[str]) -> TritonOptions:
    """TritonOptions from NAME=VALUE strings: true / false / auto, an int, a float, else the string."""
    names = {f.name for f in dataclasses.fields(TritonOptions)}
    kw: dict = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in names:
            raise MoebenchError(f"--option {pair!r}: give NAME=VALUE with NAME one of {', '.join(sorted(names))}")
        low = raw.lower()
        if low in ("true", "false"):
            kw[name] = low == "true"
            continue
        try:
            kw[name] = int(raw)
        except ValueError:
            try:
                kw[name] = float(raw)
            except ValueError:
                kw[name] = raw
    return TritonOptions(**kw)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", "--model", dest="shape", default="qwen3-30b-a3b", help="a bench_common.BENCH_SHAPES name")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--experts", default="triton")
    ap.add_argument("--prepare-finalize", default="no-dpep")
    ap.add_argument("--fp8-block", action="store_true", help="fp8_w8a8 weights with 128 x 128 block scales")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--plain", action="store_true", help="no torch.profiler: the calls alone, for an outside profiler")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a TritonOptions field of the triton experts (repeatable)")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.shape = "tiny"
    try:
        options = parse_options(a.option)
        dims = bench_shape(a.shape)
    except MoebenchError as ex:
        print(f"error: {ex}", file=sys.stderr)
        sys.exit(2)
    _, dev, head = script_setup("profile_case")
    e, k, h, _, _ = dims
    scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128)) if a.fp8_block else None
    w13, w2, emap = shard_weights(dims, scheme, dev)
    x, logits = seeded_inputs(a.tokens, h, e, torch.bfloat16, dev)
    w, ids = fused_topk_softmax(logits, k, renormalize=True)
    kern = moebench.make_kernel(a.experts, a.prepare_finalize, experts_kwargs=dict(options=options) if a.option else None)

    def call():
        return kern.apply(x, w13, w2, w, ids, expert_map=emap, num_experts=e)

    for _ in range(3):
        call()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    what = (f"{a.shape} M={a.tokens} {a.prepare_finalize}+{a.experts} {scheme.describe() if scheme else 'bf16'}"
            + "".join(f" {o}" for o in a.option))
    if a.plain:
        for _ in range(a.calls):
            call()
        sync()
        print(f"# {head}\n{what}: {a.calls} calls", flush=True)
        return
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.calls):
            call()
        sync()
    sort = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(f"# {head}\n{what}, {a.calls} calls")
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
