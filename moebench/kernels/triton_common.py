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


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    """Program id -> (row tile, column tile), walking GROUP_SIZE_M row tiles down one column tile
    before moving right, so neighbouring programs share weight tiles in L2 (Triton tutorial order)."""
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def block_scaled_mma(a, b, acc, a_s, b_s, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr):
    """acc + (a @ b) * a_s[:, None] * b_s[None, :]: one K step of a block-scaled fp8 GEMM (the dot
    of this step alone, then its row and column dequantisation scales). UPCAST as in `mma` (the
    interpreter cannot dot fp8 operands)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE_DOT:
        d = tl.dot(a, b, input_precision="ieee")
    else:
        d = tl.dot(a, b)
    return acc + d * a_s[:, None] * b_s[None, :]


@triton.jit
def cast_rne(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """fp32 x -> dtype. EXACT (the interpreter, whose fp32 -> bf16 cast truncates): round to
    nearest even on the bits first, as the GPU and torch do, so the cast only drops zero bits."""
    if EXACT and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
