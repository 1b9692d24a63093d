"""Profile one (prepare/finalize, experts) case with torch.profiler: where does the time go?

    PYTHONPATH=. python -m benchmarks profile_case --model qwen3-30b-a3b --tokens 1 \
        --experts batched-triton --prepare-finalize batched-local
"""

from __future__ import annotations

import argparse

import torch

import moebench
from moebench.inputs import make_tokens, make_weights
from moebench.models import get_model
from moebench.routing import make_routing


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--experts", default="batched-triton")
    ap.add_argument("--prepare-finalize", default="batched-local")
    ap.add_argument("--calls", type=int, default=5)
    a = ap.parse_args(argv)
    s = get_model(a.model)
    dev, dt = "cuda", torch.bfloat16
    w13, w2 = make_weights(range(s.num_experts), s.hidden, s.intermediate, dt, dev, 0)
    x = make_tokens(a.tokens, s.hidden, dt, dev, 1)
    w, ids = make_routing("uniform", a.tokens, s.num_experts, s.topk, seed=1, device=dev)
    k = moebench.make_kernel(a.experts, a.prepare_finalize)
    for _ in range(3):
        k.apply(x, w13, w2, w, ids)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.calls):
            k.apply(x, w13, w2, w, ids)
        torch.cuda.synchronize()
    print(f"{a.model} M={a.tokens} {a.prepare_finalize}+{a.experts}, {a.calls} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
