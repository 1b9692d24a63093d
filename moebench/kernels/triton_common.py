"""Pieces shared by moebench's Triton kernels."""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr):
    """acc += a @ b with fp32 accumulation. UPCAST: operands to fp32 first (the CPU interpreter
    gets 16-bit tl.dot wrong); IEEE_DOT: exact fp32 products (no TF32) for fp32 inputs."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE_DOT:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
