"""Probe: the quantize_rows calls of one fp8 block layer call, each timed alone (CUDA graph)."""
from __future__ import annotations
import sys
import torch
import moebench
import moebench.kernels.triton.gemm as G
import moebench.kernels.triton.experts as X
import moebench.kernels.triton.quant as Q
import moebench.kernels.act_quant as AQ
from moebench.kernels.triton.routing import fused_topk_softmax
from benchmarks.bench_common import SHAPES, script_setup, seeded_inputs, shard_weights, timed_us

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
_, dev, head = script_setup("quant_probe")
print(head)
for tokens in [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,4,512").split(",")]:
    e, k, h, _, _ = SHAPES[shape]
    scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128))
    w13, w2, emap = shard_weights(SHAPES[shape], scheme, dev)
    x, logits = seeded_inputs(tokens, h, e, torch.bfloat16, dev)
    w, ids = fused_topk_softmax(logits, k, renormalize=True)
    kern = moebench.make_kernel("triton", "no-dpep")
    calls = []
    real = Q.quantize_rows

    def spy(xx, sch, st=None, **kw):
        calls.append((xx, sch, st, kw))
        return real(xx, sch, st, **kw)

    G.quantize_rows = X.quantize_rows = Q.quantize_rows = spy
    kern.apply(x, w13, w2, w, ids, expert_map=emap, num_experts=e)
    torch.cuda.synchronize()
    G.quantize_rows = X.quantize_rows = Q.quantize_rows = real
    layer = timed_us(lambda: kern.apply(x, w13, w2, w, ids, expert_map=emap, num_experts=e), 20, 10)
    print(f"tokens={tokens} layer_us={layer:.1f} quant_calls={len(calls)}")
    for xx, sch, st, kw in calls:
        lim = kw.get("row_limit")
        us = timed_us(lambda: real(xx, sch, st, **kw), 20, 10)
        cont = xx.contiguous()
        us_c = timed_us(lambda: real(cont, sch, st), 20, 10)
        print(f"  x {tuple(xx.shape)} stride {xx.stride()} dtype {xx.dtype} row_limit "
              f"{None if lim is None else int(lim.item())}: {us:.2f} us; contiguous, no limit: {us_c:.2f} us")

# Synthetic inputs of the same shapes: random, zeros, random with zero rows.
for t, kk in ((128, 768), (512, 2048), (128, 2048), (512, 768), (128, 256)):
    scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128))
    r = torch.randn(t, kk, device=dev, dtype=torch.bfloat16)
    z = torch.zeros(t, kk, device=dev, dtype=torch.bfloat16)
    m = r.clone()
    m[1:] = 0
    out = []
    for name, a in (("randn", r), ("zeros", z), ("one row", m)):
        out.append(f"{name} {timed_us(lambda: Q.quantize_rows(a, scheme), 20, 10):.2f}")
    print(f"({t}, {kk}): " + ", ".join(out))
