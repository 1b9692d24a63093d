"""Is GEMM1's prefill gap to cuBLAS the gathered A tile? GEMM1 + SiLU-and-mul at the layer's tile
config, as shipped (x's rows gathered by pointer loads, w13 by pointer loads as one wide tile)
against a probe kernel that takes x already gathered into sorted order (one torch gather launch,
timed apart) so that both operands come through TMA, as in the dense GEMM that reached
torch.matmul's speed (benchmarks/warp_spec.py, PERF.md section 3, ninth session). An experiment:
PERF.md section 3, tenth session.

    PYTHONPATH=. python benchmarks/gemm1_tma.py [--tokens 1024,4096] [--shapes a,b] [--smoke]

Columns (us, CUDA-graph replay; /shipped = against the shipped GEMM1 in the same process):
  shipped     launch_gemm1 as the layer runs it at 128-row tiles (wide walk, pointer loads)
  paired_tma  launch_gemm1 with w13 through TMA (paired walk), A still gathered by pointer loads
  tma, tma_p  the probe: A (sorted copy of x) and w13 through TMA, gate and up tiles, two dots;
              one program per tile (`tma`) or one per SM walking the tiles (`tma_p`);
              `_s3`: 3 stages instead of the config's
  gather      building the sorted copy of x (torch indexing), the cost the probe adds
  cublas      torch.mm per expert on the sorted copy (padding rows included), gate_up only
Every probe output is checked against the shipped GEMM1 on the used rows first.
Writes gemm1_tma.csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on a CPU under
the Triton interpreter (checks the script; times mean nothing).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moebench.kernels.triton.align import moe_align_block_size
from moebench.kernels.triton.common import grouped_tile, mma
from moebench.kernels.triton.env import interpreter_compat, interpreting, num_sms
from moebench.kernels.triton.gemm import launch_gemm1
from moebench.kernels.triton.routing import fused_topk_softmax

from bench_common import SHAPES, layer_config, script_setup, seeded_inputs, timed_us, write_rows

SMOKE = {"tiny": (16, 2, 64, 48, 16)}


@triton.jit
def _gemm1_tma_kernel(a_desc, w_desc, inter_ptr, expert_ids_ptr, ntpp_ptr, N_INTER, stride_im,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_STEPS: tl.constexpr,
                      GROUP_SIZE_M: tl.constexpr, UPCAST: tl.constexpr):
    # Tiles (block of sorted rows, intermediate tile) of the used blocks; program p takes tiles
    # p, p + P, ... (one each when the grid covers them all, as the shipped kernel's does).
    num_m = tl.load(ntpp_ptr) // BM
    num_n = tl.cdiv(N_INTER, BN)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_SIZE_M)
        expert = tl.load(expert_ids_ptr + pid_m)
        # w13 viewed as (E_local * 2I, H): the gate rows of this tile, and the up rows I further.
        g_row = (expert * 2 * N_INTER + pid_n * BN).to(tl.int32)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(K_STEPS):
            a = a_desc.load([pid_m * BM, ks * BK])
            acc_g = mma(a, w_desc.load([g_row, ks * BK]).T, acc_g, UPCAST, False)
            acc_u = mma(a, w_desc.load([g_row + N_INTER, ks * BK]).T, acc_u, UPCAST, False)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        tl.store(inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_n[None, :], h.to(inter_ptr.dtype.element_ty),
                 mask=(offs_n < N_INTER)[None, :])


def torch_sorted_rows(x: torch.Tensor, sorted_ids: torch.Tensor, topk: int) -> torch.Tensor:
    """(max_padded, H): row r = x[sorted_ids[r] // topk], zeros for sentinels (and anything past
    the used length)."""
    m = x.shape[0]
    x_pad = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return x_pad[(sorted_ids.long() // topk).clamp(0, m)]


def gemm1_tma(xs: torch.Tensor, w13: torch.Tensor, align, config: dict, programs: int | None, stages: int) -> torch.Tensor:
    """The probe: xs (max_padded, H) sorted rows, w13 (E_local, 2I, H) -> inter (max_padded, I).
    programs None: one per (block, tile); else that many, persistent."""
    h = xs.shape[1]
    n_inter = w13.shape[1] // 2
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"] // 2, config["BLOCK_SIZE_K"]
    assert h % bk == 0, "the probe takes H a multiple of BLOCK_SIZE_K"
    inter = torch.empty(xs.shape[0], n_inter, dtype=xs.dtype, device=xs.device)
    grid = programs or align.max_blocks * triton.cdiv(n_inter, bn)
    _gemm1_tma_kernel[(grid,)](
        TensorDescriptor.from_tensor(xs, [bm, bk]), TensorDescriptor.from_tensor(w13.view(-1, h), [bn, bk]), inter,
        align.expert_ids, align.num_tokens_post_padded, n_inter, inter.stride(0),
        BM=bm, BN=bn, BK=bk, K_STEPS=h // bk, GROUP_SIZE_M=config["GROUP_SIZE_M"], UPCAST=interpreting(),
        num_warps=config["num_warps"], num_stages=stages)
    return inter


def expert_spans(align) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each local expert's blocks in sorted order (host copy)."""
    used = int(align.num_tokens_post_padded.item()) // align.block_size_m
    ids = align.expert_ids[:used].tolist()
    spans: list[tuple[int, int, int]] = []
    for b, e in enumerate(ids):
        lo, hi = b * align.block_size_m, (b + 1) * align.block_size_m
        if spans and spans[-1][0] == e and spans[-1][2] == lo:
            spans[-1] = (e, spans[-1][1], hi)
        else:
            spans.append((e, lo, hi))
    return spans


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--shapes", default="mixtral,qwen3-30b-a3b,dsv3-ep8-local")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    interpreter_compat()  # before the first launch (a no-op unless TRITON_INTERPRET=1)
    if args.smoke:
        SHAPES.update(SMOKE)
        args.shapes, args.tokens = ",".join(SMOKE), "8"
    out_dir, dev, head = script_setup("bf16 GEMM1 + SiLU-and-mul (us); /shipped = against the shipped GEMM1")
    print("# " + head, flush=True)
    sms = num_sms(dev)
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, inter, e_local = SHAPES[shape]
        assert e_local == e, "the probe runs without an expert map"
        dt = torch.bfloat16
        w13 = torch.randn(e, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5)
        w2 = torch.randn(e, h, inter, dtype=dt, device=dev).mul_(inter**-0.5)
        for m in [int(t) for t in args.tokens.split(",")]:
            x, logits = seeded_inputs(m, h, e, dt, dev)
            _, ids = fused_topk_softmax(logits, k, renormalize=True)
            cfg = layer_config(shape, m, w13, w2, e, k, dt)
            if args.smoke:
                cfg.update(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
            align = moe_align_block_size(ids, cfg["BLOCK_SIZE_M"], e, None)
            used = int(align.num_tokens_post_padded.item())
            valid = align.sorted_token_ids[:used] < align.num_pairs
            row = dict(shape=shape, tokens=m, config="/".join(str(cfg[c]) for c in
                       ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")))
            want = launch_gemm1(x, w13, align, k, cfg, wide=True)[:used][valid].float()
            base = row["shipped_us"] = round(timed_us(lambda: launch_gemm1(x, w13, align, k, cfg, wide=True), 20, 5), 1)
            xs = torch_sorted_rows(x, align.sorted_token_ids, k)
            row["gather_us"] = round(timed_us(lambda: torch_sorted_rows(x, align.sorted_token_ids, k), 20, 5), 1)
            st = cfg["num_stages"]
            variants = {"paired_tma": lambda: launch_gemm1(x, w13, align, k, cfg, use_tma=True),
                        "tma": lambda: gemm1_tma(xs, w13, align, cfg, None, st),
                        "tma_p": lambda: gemm1_tma(xs, w13, align, cfg, sms, st),
                        "tma_s3": lambda: gemm1_tma(xs, w13, align, cfg, None, 3),
                        "tma_p_s3": lambda: gemm1_tma(xs, w13, align, cfg, sms, 3)}
            for name, fn in variants.items():
                print(f"  {shape} {m} {name} ...", flush=True)
                try:
                    got = fn()[:used][valid].float()
                    err = ((got - want).norm() / want.norm()).item()
                    if err > 1e-2:
                        raise RuntimeError(f"differs from the shipped GEMM1 by {err:.1e}")
                    row[f"{name}_us"] = round(timed_us(fn, 20, 5), 1)
                    row[f"{name}/shipped"] = round(row[f"{name}_us"] / base, 3)
                except Exception as ex:  # noqa: BLE001 - report the variant's failure, go on with the others
                    row[f"{name}_us"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:80]}"
            spans = expert_spans(align)
            gate_up = torch.empty(xs.shape[0], 2 * inter, dtype=dt, device=dev)

            def cublas():
                for ex_, lo, hi in spans:
                    torch.mm(xs[lo:hi], w13[ex_].t(), out=gate_up[lo:hi])

            row["cublas_us"] = round(timed_us(cublas, 20, 5), 1)
            row["cublas/shipped"] = round(row["cublas_us"] / base, 3)
            rows.append(row)
            write_rows(rows, out_dir, "gemm1_tma", head)
        w13 = w2 = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
