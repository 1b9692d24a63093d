"""How many fp8 scale groups one K step should take at decode: the experts' weight stream with one
128-column block-scale group per K step (the `triton` layer's fp8 block GEMMs, vLLM's too) against
two groups per step (two loads, two dots, two scalings in one iteration), beside bf16.

    PYTHONPATH=. python -m benchmarks fp8_k_step [--shapes dsv3-tp8-gemm1,...] [--smoke]

Why: at 16-256 tokens both fp8 block kernels run at 1.17-1.47x of the weight-read floor where bf16
reaches 1.06 (PERF.md section 1), and Nsight Compute puts the fp8 GEMMs at 79-87% of peak DRAM
bandwidth against 86-91% for bf16. An fp8 K step of 128 columns moves 128 bytes of each weight row,
half of a bf16 step of the same shape.

Each case is one GEMM of a decode layer with its own 16 rows per expert: y[e] = x[e] @ w[e]^T for
every expert e (grid: N tiles x experts), the weights read once. Variants: dtype (fp8 with
[128, 128] weight and 1 x 128 activation scales, or bf16), BLOCK_SIZE_K x groups per step,
BLOCK_SIZE_N, stages; every fp8 tile is swapped (w^T x^T into a (BN, 16) accumulator) as the layer
does for 16-row tiles. Each variant is checked against torch on the same dequantised values, then
CUDA-graph timed; GB/s = the weight bytes (and scales) over the time. Writes fp8_k_step.csv / .md
under $OUT. --smoke: tiny shapes under the Triton interpreter (checks the script; times mean nothing).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from moebench.kernels.triton.common import block_scaled_mma, mma
from moebench.quant import FP8_DTYPE

from benchmarks.bench_common import ON_GPU, script_setup, timed_us, write_rows

#: name: (experts, N, K) of one GEMM of a decode layer (GEMM1: N = 2I, K = H; GEMM2: N = H, K = I).
SHAPES = {"dsv3-tp8-gemm1": (256, 512, 7168), "dsv3-tp8-gemm2": (256, 7168, 256),
          "qwen3-30b-gemm1": (128, 1536, 2048), "qwen3-30b-gemm2": (128, 2048, 768)}
SMOKE = {"tiny": (2, 256, 512)}
#: (dtype, BLOCK_SIZE_K, groups per step, BLOCK_SIZE_N, stages)
VARIANTS = [("fp8", 128, 1, 128, 3), ("fp8", 128, 1, 128, 4), ("fp8", 128, 1, 256, 3), ("fp8", 128, 2, 128, 2),
            ("fp8", 128, 2, 128, 3), ("fp8", 128, 2, 128, 4), ("fp8", 128, 2, 64, 3), ("bf16", 128, 1, 128, 3),
            ("bf16", 64, 2, 128, 3), ("bf16", 256, 1, 128, 2)]
GROUP = 128  # the scale block along K and N


@triton.jit
def _expert_gemm(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, K, stride_xe, stride_xm, stride_we, stride_wn,
                 stride_xse, stride_xsm, stride_wse, stride_wsn, stride_ye, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUPS: tl.constexpr, QUANT: tl.constexpr,
                 UPCAST: tl.constexpr):
    # Program (N tile, expert): the expert's 16 rows times BN of its weight rows, K in steps of
    # GROUPS x BK (QUANT: each BK-wide part scaled by its own column of scales, swapped tiles).
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + e * stride_xe + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    if QUANT:
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK * GROUPS):
        for g in tl.static_range(GROUPS):
            a = tl.load(x_ptrs + k + g * BK)
            b = tl.load(w_ptrs + k + g * BK)
            if QUANT:  # the layer's K step (common.block_scaled_mma), swapped as for its 16-row tiles
                kg = (k + g * BK) // 128
                a_s = tl.load(xs_ptr + e * stride_xse + offs_m * stride_xsm + kg)
                b_s = tl.load(ws_ptr + e * stride_wse + (offs_n // 128) * stride_wsn + kg)
                acc = block_scaled_mma(a, b, acc, a_s, b_s, UPCAST, False, True)
            else:
                acc = mma(a, b, acc, UPCAST, False)
    if QUANT:
        acc = tl.trans(acc)
    y = y_ptr + e * stride_ye + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc)


def _inputs(e: int, n: int, k: int, dev, fp8: bool):
    g = torch.Generator(device=dev).manual_seed(n + k)
    x = torch.randn(e, 16, k, generator=g, device=dev)
    w = torch.randn(e, n, k, generator=g, device=dev)
    if not fp8:
        return x.bfloat16(), w.bfloat16(), None, None
    xs = torch.rand(e, 16, k // GROUP, generator=g, device=dev) + 0.5
    ws = torch.rand(e, n // GROUP, k // GROUP, generator=g, device=dev) + 0.5
    return x.to(FP8_DTYPE), w.to(FP8_DTYPE), xs, ws


def _reference(x, w, xs, ws) -> torch.Tensor:
    xf, wf = x.float(), w.float()
    if xs is not None:
        xf = xf * xs.repeat_interleave(GROUP, dim=2)
        wf = wf * ws.repeat_interleave(GROUP, dim=1).repeat_interleave(GROUP, dim=2)
    return xf @ wf.transpose(1, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fp8_k_step")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    shapes = SMOKE if a.smoke else {s: SHAPES[s] for s in a.shapes.split(",")}
    out_dir, dev, head = script_setup("experts' weight stream at decode (16 rows per expert): K step x scale groups")
    print("# " + head, flush=True)
    rows = []
    for name, (e, n, k) in shapes.items():
        data = {d: _inputs(e, n, k, dev, d == "fp8") for d in ("fp8", "bf16")}
        refs = {d: _reference(*v) for d, v in data.items()}
        for dtype, bk, groups, bn, stages in VARIANTS:
            x, w, xs, ws = data[dtype]
            quant = xs is not None
            y = torch.empty(e, 16, n, device=dev, dtype=torch.float32)
            sx = xs.stride() if quant else (0, 0, 0)
            sw = ws.stride() if quant else (0, 0, 0)

            def run(x=x, w=w, xs=xs, ws=ws, y=y, bn=bn, bk=bk, groups=groups, stages=stages, quant=quant, sx=sx, sw=sw):
                _expert_gemm[(n // bn, e)](x, w, xs if quant else x, ws if quant else x, y, k, x.stride(0), x.stride(1),
                                           w.stride(0), w.stride(1), sx[0], sx[1], sw[0], sw[1], y.stride(0),
                                           y.stride(1), BM=16, BN=bn, BK=bk, GROUPS=groups, QUANT=quant,
                                           UPCAST=not ON_GPU, num_warps=4, num_stages=stages)

            run()
            err = ((y.double() - refs[dtype].double()).norm() / refs[dtype].double().norm()).item()
            us = timed_us(run, reps=30, graph_calls=5)
            nbytes = w.numel() * w.element_size() + (ws.numel() * 4 if quant else 0)
            rows.append(dict(shape=name, dtype=dtype, BLOCK_SIZE_K=bk, groups_per_step=groups, BLOCK_SIZE_N=bn,
                             stages=stages, us=round(us, 1), GBps=round(nbytes / us / 1e3, 0), err=f"{err:.1e}"))
            write_rows(rows, out_dir, "fp8_k_step", head)
            if err > 1e-2:
                raise SystemExit(f"error: {name} {dtype} BK={bk} x{groups}: relative error {err:.1e} against torch")
    print((out_dir / "fp8_k_step.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
