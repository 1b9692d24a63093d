"""A persistent GEMM2 for prefill, against the shipped GEMM2, in one run (an experiment: the kernel
lives here until it measures faster).

    PYTHONPATH=. python benchmarks/persistent_gemm2.py [--points qwen3-30b-a3b:4096,...] [--smoke]

GEMM2 at prefill has a short K loop where I is small (Qwen3-30B-A3B: I = 768, 12 steps of 64),
and every (block, hidden tile) program ends in an atomic epilogue of BLOCK_SIZE_M x BLOCK_SIZE_N
fp32 adds. The persistent form launches one program per SM (or two) that walks the tiles of the
used blocks (their count read on the device), so the next tile's loads can start while the last
one's epilogue drains; with FLATTEN, Triton flattens the tile and K loops into one and pipelines
across tiles. bf16, atomic top-k sum, w2 through TMA, the layer's tile config. Every variant's
output is checked against the shipped GEMM2's before it is timed.

Writes persistent_gemm2.csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on CPU
under the Triton interpreter (checks the script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moebench.kernels.triton.align import align_pairs
from moebench.kernels.triton.common import grouped_tile, mma, tile_rows
from moebench.kernels.triton.env import interpreter_compat, interpreting, num_sms
from moebench.kernels.triton.gemm import launch_gemm1, launch_gemm2
from moebench.kernels.triton.options import TritonOptions, resolve_use_tma
from moebench.kernels.triton.routing import fused_topk_softmax

from bench_common import ON_GPU, SHAPES, layer_config, script_setup, timed_us, write_rows

POINTS = ("qwen3-30b-a3b:4096,qwen3-30b-a3b:1024,dsv3-ep8-local:4096,dsv3-ep8-local:1024,mixtral:4096,"
          "mixtral:1024,qwen3-30b-a3b:256")
SMOKE = {"tiny": (8, 2, 64, 96, 8)}


@triton.jit
def _gemm2_persistent_kernel(
    inter_ptr,  # (max_padded, I) bf16, rows in sorted order
    w2_desc,  # TMA descriptor of w2 as (E_local * H, I), block (BLOCK_SIZE_N, BLOCK_SIZE_K)
    ws_ptr,  # (M, H) fp32, zeroed: the top-k sum
    topk_weights_ptr,  # (M*K,) fp32
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    num_pairs,
    H,
    N_INTER,
    stride_im,
    stride_wsm,
    TOPK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # The tiles of the used blocks only (alignment's used length, read here): no padding programs.
    used_blocks = tl.load(ntpp_ptr) // BLOCK_SIZE_M
    num_pid_n = tl.cdiv(H, BLOCK_SIZE_N)
    for tile in tl.range(tl.program_id(0), used_blocks * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, used_blocks, num_pid_n, GROUP_SIZE_M)
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # used blocks hold local experts only
        offs_m, pair, row_ok, token = tile_rows(pid_m * BLOCK_SIZE_M, sorted_ids_ptr, num_pairs, TOPK, BLOCK_SIZE_M)
        offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
        offs_k = tl.arange(0, BLOCK_SIZE_K)
        a_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_k[None, :]
        b_row = (expert * H + pid_n * BLOCK_SIZE_N).to(tl.int32)
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k in range(0, N_INTER, BLOCK_SIZE_K):
            a = tl.load(a_ptrs, mask=(offs_k < N_INTER - k)[None, :], other=0.0)
            b = w2_desc.load([b_row, k]).T
            acc = mma(a, b, acc, UPCAST, False)
            a_ptrs += BLOCK_SIZE_K
        w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        o_ptrs = ws_ptr + token[:, None] * stride_wsm + offs_n[None, :]
        tl.atomic_add(o_ptrs, acc * w[:, None], mask=row_ok[:, None] & (offs_n < H)[None, :], sem="relaxed")


def gemm2_persistent(inter, w2, topk_weights, align, topk, cfg, programs: int, flatten: bool,
                     stages: int | None = None) -> torch.Tensor:
    """(M, H) fp32 weighted top-k sum, as launch_gemm2 makes it; stages: num_stages
    instead of cfg's (flattening multi-buffers across tiles: 4 stages of 128x256x64 bf16 tiles
    need 262 KB of shared memory, 3 stages 229 KB, compiled for sm_90)."""
    m, _ = topk_weights.shape
    e_local, h, n_inter = w2.shape
    bn, bk = cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    ws = torch.zeros((m, h), dtype=torch.float32, device=inter.device)
    desc = TensorDescriptor.from_tensor(w2.view(-1, n_inter), [bn, bk])
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _gemm2_persistent_kernel[(programs,)](
        inter, desc, ws, weights, align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded,
        align.num_pairs, h, n_inter, inter.stride(0), ws.stride(0),
        TOPK=topk, BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=cfg["GROUP_SIZE_M"], FLATTEN=flatten, UPCAST=interpreting(),
        num_warps=cfg["num_warps"], num_stages=stages or cfg["num_stages"],
    )
    return ws


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=POINTS)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    interpreter_compat()  # before the first launch (a no-op unless TRITON_INTERPRET=1)
    if args.smoke:
        SHAPES.update(SMOKE)
        args.points = "tiny:64"
    out_dir, dev, head = script_setup("bf16; GEMM2 alone, us")
    print("# " + head, flush=True)
    rows = []
    for point in args.points.split(","):
        shape, m = point.split(":")[0], int(point.split(":")[1])
        e, k, h, inter_size, e_local = SHAPES[shape]
        dt = torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(m)
        w13 = torch.randn(e_local, 2 * inter_size, h, dtype=dt, device=dev, generator=g).mul_(h**-0.5)
        w2 = torch.randn(e_local, h, inter_size, dtype=dt, device=dev, generator=g).mul_(inter_size**-0.5)
        x = torch.randn(m, h, dtype=dt, device=dev, generator=g)
        tw, ids = fused_topk_softmax(torch.randn(m, e, device=dev, generator=g), k, renormalize=True)
        cfg = layer_config(shape, m, w13, w2, e, k, dt)
        if args.smoke:
            cfg.update(BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
        align = align_pairs(ids, cfg["BLOCK_SIZE_M"], e_local, None, e, options=TritonOptions(direct_align=False))
        tma = resolve_use_tma(TritonOptions(), cfg, dt)
        inter = launch_gemm1(x, w13, align, k, cfg, tma, wide=cfg["BLOCK_SIZE_M"] >= 64)

        def timed(fn):
            return timed_us(fn, reps=20, graph_calls=3)

        shipped = lambda: launch_gemm2(inter, w2, tw, align, k, cfg, 1, tma)  # noqa: E731
        want = shipped()
        row = dict(shape=shape, tokens=m, config="/".join(str(cfg[c]) for c in cfg), shipped_us=round(timed(shipped), 1))
        sms = num_sms(dev)
        # (name, programs, flatten, num_stages, tile changes): one / two programs per SM, flattened
        # loops. Flattening multi-buffers across tiles; compiled for sm_90 on a CPU (seventh
        # session) at 128-row tiles it fits 227 KB with 2 stages of 128x256x64 (192 KB), 3 of
        # 128x256x32 (176 KB) or 3-4 of 128x128x64 (112-128 KB, two programs per SM).
        for name, programs, flatten, stages, tile in (
                ("p1", sms, False, None, {}), ("p1s3", sms, False, 3, {}), ("p1f3", sms, True, 3, {}),
                ("p1f", sms, True, None, {}), ("p2", 2 * sms, False, None, {}), ("p1f2", sms, True, 2, {}),
                ("p1f3k32", sms, True, 3, {"BLOCK_SIZE_K": 32}), ("p1f4n128", sms, True, 4, {"BLOCK_SIZE_N": 128}),
                ("p2f4n128", 2 * sms, True, 4, {"BLOCK_SIZE_N": 128})):
            if args.smoke and tile:
                continue  # the smoke shape's tile is set above
            c = dict(cfg, **tile)
            fn = lambda p=programs, f=flatten, st=stages, c=c: gemm2_persistent(inter, w2, tw, align, k, c, p, f, st)  # noqa: E731
            try:
                got = fn()
                err = ((got - want).norm() / want.norm()).item()
                if err > 1e-3:  # the same products summed in another order (fp32 atomics)
                    raise RuntimeError(f"differs from the shipped GEMM2 by {err:.1e}")
                row[f"{name}_us"] = round(timed(fn), 1)
                row[f"{name}/shipped"] = round(row[f"{name}_us"] / row["shipped_us"], 3)
            except Exception as ex:  # noqa: BLE001 - a variant that does not build or is wrong: say so
                row[f"{name}_us"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:80]}"
        rows.append(row)
        write_rows(rows, out_dir, "persistent_gemm2", head)
        w13 = w2 = x = inter = None
        if ON_GPU:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
