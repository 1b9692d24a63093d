"""Does Triton's automatic warp specialisation pay on Hopper at moebench's GEMM tiles? A persistent
bf16 GEMM C = A @ B^T through TMA, with and without `tl.range(..., warp_specialize=True)`, against
torch.matmul in the same process (an experiment: PERF.md section 3, ninth session).

    PYTHONPATH=. python benchmarks/warp_spec.py [--dense-k 768,4096] [--only NAME,...] [--smoke]
    # as run on the device: one process per variant, so a kernel that hangs loses only itself
    for v in host_plain_n256_s3 dev_plain_n256_s3 dev_ws_n256_s3 dev_ws_n128_s3 ...; do
      OUT=$OUT/$v timeout -s KILL 50 python -u benchmarks/warp_spec.py --dense-k 4096,768 --only $v; done

Variant names: {host,dev}_{plain,ws}_n{BLOCK_N}_s{stages}, BLOCK_M 128, BLOCK_K 64. `host`: host
TensorDescriptors and a pointer-store epilogue; `dev`: descriptors made in the kernel
(`tl.make_tensor_descriptor`) and a TMA store, the form of Triton's persistent-matmul tutorial.

What Triton 3.6's Hopper pass does (compiled for sm_90 on a CPU, 2026-12-01): it engages only at
num_warps=4, then adds a producer warp group for the TMA loads to two consumer warp groups (12
warps), splitting the tile's rows between the consumers. It fails to build (1) a loop whose A tile
is a gathered pointer load, as GEMM1's rows of x are, (2) an atomic-add epilogue at 128-row tiles,
as GEMM2's top-k sum is (64-row tiles build), (3) a host-descriptor TMA store of the whole tile.
On the H200 the `host_ws` form (pointer stores) compiles but never finishes (hangs the GPU), so it
runs only when named in --only. So the MoE GEMMs themselves were not warp-specialised; this dense
probe asks whether the pass would pay at their tiles if they could be.

Writes warp_spec_dense.csv / .md under $OUT (default ./bench-out). --smoke: tiny shapes on a CPU
under the Triton interpreter (checks the script; the interpreter ignores warp_specialize; times
mean nothing).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moebench.kernels.triton.common import grouped_tile, mma
from moebench.kernels.triton.env import interpreter_compat, interpreting, num_sms

from bench_common import ON_GPU, script_setup, timed_us, write_rows

#: (descriptors made on the device, warp-specialised, stages) of the default run; ("host", ws) hangs
#: on an H200 and runs only through --only.
VARIANTS = ((False, False, 3), (False, False, 4), (True, False, 3), (True, True, 3), (True, True, 4))
HANGS = ((False, True, 3),)


@triton.jit
def _dense_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
                  WS: tl.constexpr, UPCAST: tl.constexpr):
    # Persistent: program p walks tiles p, p + P, ...; A (M, K) and B (N, K) through TMA.
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_SIZE_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k])
            b = b_desc.load([pid_n * BN, k])
            acc = mma(a, b.T, acc, UPCAST, False)
        om = pid_m * BM + tl.arange(0, BM)
        on = pid_n * BN + tl.arange(0, BN)
        tl.store(c_ptr + om[:, None] * stride_cm + on[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(om < M)[:, None] & (on < N)[None, :])


@triton.jit
def _dense_dev_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr, UPCAST: tl.constexpr):
    # As _dense_kernel with device-side descriptors, the epilogue a TMA store (the form Triton's
    # persistent-matmul tutorial warp-specialises; a and b (M, K) / (N, K), c (M, N) contiguous).
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    num_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * num_n, tl.num_programs(0), warp_specialize=WS):
        pid_m = tile // num_n
        pid_n = tile % num_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            acc = mma(a_desc.load([pid_m * BM, k]), b_desc.load([pid_n * BN, k]).T, acc, UPCAST, False)
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_ptr.dtype.element_ty))


def _warps(ws: bool, num_warps: int) -> int:
    """Warp specialisation engages at num_warps=4 (the pass then adds the other warp groups)."""
    return 4 if ws else num_warps


def dense(a, b, bm, bn, bk, ws, stages, programs, num_warps=8):
    """a (M, K) @ b (N, K)^T -> (M, N) in a's dtype, host descriptors, `programs` persistent programs."""
    c = torch.empty((a.shape[0], b.shape[0]), dtype=a.dtype, device=a.device)
    _dense_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]), c,
        a.shape[0], b.shape[0], a.shape[1], c.stride(0), BM=bm, BN=bn, BK=bk, GROUP_SIZE_M=8, WS=ws,
        UPCAST=interpreting(), num_warps=_warps(ws, num_warps), num_stages=stages)
    return c


def dense_dev(a, b, bm, bn, bk, ws, stages, programs, num_warps=8):
    """As `dense`, descriptors made in the kernel (a, b contiguous)."""
    if ON_GPU:  # device-side descriptors take their scratch from this allocator
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    c = torch.empty((a.shape[0], b.shape[0]), dtype=a.dtype, device=a.device)
    _dense_dev_kernel[(programs,)](a, b, c, a.shape[0], b.shape[0], a.shape[1], BM=bm, BN=bn, BK=bk, WS=ws,
                                   UPCAST=interpreting(), num_warps=_warps(ws, num_warps), num_stages=stages)
    return c


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _try(row: dict, name: str, fn, want, base_us: float) -> None:
    """Check fn() against want (bf16 output), then time it: row[name_us], row[name/base]; a variant that does not
    build or is wrong says so in its cell. Prints the variant's name first (a warp-specialised
    kernel that deadlocks on the GPU is then named in the log of a run stopped by its timeout)."""
    print(f"  {name} ...", flush=True)
    try:
        err = _rel(fn(), want)
        if err > 2e-2:
            raise RuntimeError(f"differs from the reference by {err:.1e}")
        row[f"{name}_us"] = round(timed_us(fn, reps=20, graph_calls=3), 1)
        row[f"{name}/base"] = round(row[f"{name}_us"] / base_us, 3)
    except Exception as ex:  # noqa: BLE001 - report the variant's failure, go on with the others
        row[f"{name}_us"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:80]}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense-k", default="768,2048,4096", help="K values of the 8192 x 8192 GEMMs")
    ap.add_argument("--only", default="", help="comma-separated variant names: run these only")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    interpreter_compat()  # before the first launch (a no-op unless TRITON_INTERPRET=1)
    only = [v for v in args.only.split(",") if v]
    size, block_m, widths = (256, 64, (64,)) if args.smoke else (8192, 128, (128, 256))
    if args.smoke:
        args.dense_k = "64"
    out_dir, dev, head = script_setup("bf16 C = A @ B^T, us; /base = against torch.matmul in the same process")
    print("# " + head, flush=True)
    sms = num_sms(dev)
    rows = []
    for kk in (int(v) for v in args.dense_k.split(",")):
        a = torch.randn(size, kk, dtype=torch.bfloat16, device=dev)
        b = torch.randn(size, kk, dtype=torch.bfloat16, device=dev)
        want = a @ b.T
        row = dict(M=size, N=size, K=kk, torch_us=round(timed_us(lambda: a @ b.T, reps=20, graph_calls=3), 1))
        row["torch_tflops"] = round(2 * size * size * kk / row["torch_us"] / 1e6, 1)
        for bn in widths:
            for dev_desc, ws, stages in VARIANTS + HANGS:
                name = f"{'dev' if dev_desc else 'host'}_{'ws' if ws else 'plain'}_n{bn}_s{stages}"
                if (only and name not in only) or (not only and (dev_desc, ws, stages) in HANGS):
                    continue
                fn = dense_dev if dev_desc else dense
                _try(row, name, lambda fn=fn, bn=bn, ws=ws, st=stages: fn(a, b, block_m, bn, 64, ws, st, sms),
                     want, row["torch_us"])
        rows.append(row)
        write_rows(rows, out_dir, "warp_spec_dense", head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
