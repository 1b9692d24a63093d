"""Compile moebench's Triton GEMM kernels for Hopper (sm_90) without a GPU.

Lowers every kernel through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
ptxas Triton ships), so a kernel change that would fail to build on the H200 fails here, on a CPU
machine, first. Prints one line per kernel variant; exit status 1 on the first failure.

    python scripts/compile_sm90.py          # not under TRITON_INTERPRET=1
"""

from __future__ import annotations

import inspect
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces the kernels being compiled")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moebench.kernels import batched_triton as B  # noqa: E402
from moebench.kernels import triton_moe as T  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(jit, consts: dict, ptr_types: dict, unused: tuple[str, ...] = ()) -> str:
    """Compile `jit` with `consts` as constexprs; other args are pointers (ptr_types) or i32.
    `unused` args (TMA descriptors when USE_TMA=False) are passed as None constexprs."""
    names = list(inspect.signature(jit.fn).parameters)
    consts = dict(consts, **{n: None for n in unused})
    sig = {n: "constexpr" if n in consts else ptr_types.get(n, "i32") for n in names}
    src = ASTSource(fn=jit, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=TARGET)
    return f"{jit.fn.__name__}: cubin {len(k.asm['cubin'])} bytes, shared {k.metadata.shared} B"


def main() -> int:
    std_ptrs = {"x_ptr": "*bf16", "w13_ptr": "*bf16", "w2_ptr": "*bf16", "inter_ptr": "*bf16", "ws_ptr": "*fp32",
                "topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "ntpp_ptr": "*i32"}
    for bm, bn, bk in ((16, 64, 256), (64, 128, 64)):  # a decode and a mid-size tile
        c = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=16, TOPK=8, EVEN_K=True,
                 UPCAST=False, IEEE_DOT=False, USE_TMA=False)
        print(compile_kernel(T._silu_mul_gemm1_kernel, c, std_ptrs, ("w13_desc",)))
        print(compile_kernel(T._gemm2_weighted_sum_kernel, dict(c, ATOMIC=True), std_ptrs, ("w2_desc",)))
        for name in ("_batched_silu_mul_gemm1_kernel", "_batched_gemm2_kernel"):
            jit = getattr(B, name)
            params = set(inspect.signature(jit.fn).parameters)
            ptrs = {p: ("*i32" if "num_tokens" in p else "*bf16") for p in params if p.endswith("_ptr")}
            print(compile_kernel(jit, {k: v for k, v in c.items() if k in params}, ptrs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
