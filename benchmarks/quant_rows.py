"""The activation quantisation launches (`quantize_rows`, fp8 with 128-column scale groups), each
timed alone: those of one fp8 block layer call of the `triton` experts (x, then the intermediate,
whose rows are mostly the alignment's zero sentinel rows at decode), and synthetic rows of the
same shapes (random, all zeros, one random row among zeros). Every call is checked bit for bit
against moebench.quant.quantize_activation.

    PYTHONPATH=. python -m benchmarks quant_rows [--shape qwen3-30b-a3b] [--tokens 1,4,512] [--smoke]

Columns: what (layer x / layer intermediate / randn / zeros / one row), rows, cols, row_limit (the
intermediate's used rows, read on the device), pair_rows (of those, the pairs' rows: the only
ones quantised), us (CUDA-graph replay), layer_us (the whole layer
call, for scale). Writes quant_rows.csv / .md under $OUT (default ./bench-out). --smoke: a tiny
shape on CPU under the Triton interpreter (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import sys

import torch

import moebench
import moebench.kernels.triton.experts as experts_mod
import moebench.kernels.triton.gemm as gemm_mod
import moebench.kernels.triton.quant as quant_mod
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.quant import quantize_activation

from benchmarks.bench_common import SHAPES, script_setup, seeded_inputs, shard_weights, timed_us, write_rows

SMOKE = {"tiny": (16, 2, 256, 128, 16)}
SYNTHETIC = ((128, 768), (512, 2048), (128, 256))
SMOKE_SYNTHETIC = ((8, 256),)


def _layer_calls(kern, args: tuple, kwargs: dict) -> list[tuple]:
    """The quantize_rows calls (x, scheme, static, keyword args) one layer call makes."""
    calls = []
    real = quant_mod.quantize_rows

    def spy(x, scheme, static=None, **kw):
        calls.append((x, scheme, static, kw))
        return real(x, scheme, static, **kw)

    modules = (quant_mod, gemm_mod, experts_mod)
    for mod in modules:
        mod.quantize_rows = spy
    try:
        kern.apply(*args, **kwargs)
    finally:
        for mod in modules:
            mod.quantize_rows = real
    return calls


def _checked_us(x: torch.Tensor, scheme, static, kw: dict) -> float:
    """us of quantize_rows(x, ...) alone, after checking the rows it quantises bit for bit (those
    below row_limit and, with pair_rows, of pairs)."""
    q, s = quant_mod.quantize_rows(x, scheme, static, **kw)
    rows = torch.arange(x.shape[0], device=x.device)
    if kw.get("row_limit") is not None:
        rows = rows[rows < kw["row_limit"].item()]
    if kw.get("pair_rows") is not None:
        ids, num_pairs = kw["pair_rows"]
        rows = rows[ids[rows] < num_pairs]
    q_ref, s_ref = quantize_activation(x[rows], scheme, static)
    if not (torch.equal(q[rows].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s[rows], s_ref)):
        raise SystemExit(f"error: quantize_rows of {tuple(x.shape)} differs from quantize_activation")
    return timed_us(lambda: quant_mod.quantize_rows(x, scheme, static, **kw), 20, 10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quant_rows")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a bench_common.SHAPES entry")
    ap.add_argument("--tokens", default="1,4,512")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        SHAPES.update(SMOKE)
        a.shape, a.tokens = "tiny", "1,3"
    if a.shape not in SHAPES:
        print(f"error: unknown --shape {a.shape!r}; pick one of {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    out_dir, dev, head = script_setup("quantize_rows launches alone (fp8, 128-column groups)")
    print("# " + head, flush=True)
    scheme = moebench.QuantScheme(scales="block", block_shape=(128, 128))
    e, k, h, _, _ = SHAPES[a.shape]
    w13, w2, emap = shard_weights(SHAPES[a.shape], scheme, dev)
    kern = moebench.make_kernel("triton", "no-dpep")
    rows: list[dict] = []
    for tokens in (int(t) for t in a.tokens.split(",")):
        x, logits = seeded_inputs(tokens, h, e, torch.bfloat16, dev)
        w, ids = fused_topk_softmax(logits, k, renormalize=True)
        args, kwargs = (x, w13, w2, w, ids), dict(expert_map=emap, num_experts=e)
        layer_us = timed_us(lambda: kern.apply(*args, **kwargs), 20, 10)
        for xq, sch, static, kw in _layer_calls(kern, args, kwargs):
            lim, pairs = kw.get("row_limit"), kw.get("pair_rows")
            rows.append(dict(shape=a.shape, tokens=tokens, what="layer x" if lim is None else "layer intermediate",
                             rows=xq.shape[0], cols=xq.shape[1], row_limit="" if lim is None else int(lim.item()),
                             pair_rows="" if pairs is None else pairs[1],
                             us=round(_checked_us(xq, sch, static, kw), 2), layer_us=round(layer_us, 1)))
            write_rows(rows, out_dir, "quant_rows", head)
    g = torch.Generator().manual_seed(0)
    for t, c in SMOKE_SYNTHETIC if a.smoke else SYNTHETIC:
        r = torch.randn(t, c, generator=g).to(dev, torch.bfloat16)
        one = torch.zeros_like(r)
        one[0] = r[0]
        for what, xs in (("randn", r), ("zeros", torch.zeros_like(r)), ("one row", one)):
            rows.append(dict(shape="", tokens="", what=what, rows=t, cols=c, row_limit="", pair_rows="",
                             us=round(_checked_us(xs, scheme, None, {}), 2), layer_us=""))
            write_rows(rows, out_dir, "quant_rows", head)
    print((out_dir / "quant_rows.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
