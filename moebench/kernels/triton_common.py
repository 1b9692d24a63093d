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
def scale_ptrs(base, expert, stride_e, stride_n, rows, QUANT: tl.constexpr, GROUP_N: tl.constexpr):
    """Pointers to the fp8 scales of weight rows `rows` (output channels) of `expert`: each row's
    own scale (QUANT 1; stride_n = 0 when there is one per expert) or its block row rows // GROUP_N
    (QUANT 2, where K group g is at + g * stride_k)."""
    if QUANT == 2:
        rows = rows // GROUP_N
    return base + expert * stride_e + rows * stride_n


@triton.jit
def scaled_mma(a, b, acc, k_start, as_ptrs, bs_ptrs, row_ok, col_ok, stride_ag, stride_bk,
               QUANT: tl.constexpr, GROUP_K: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One K step starting at column k_start: acc += a @ b, or for block scales (QUANT 2) the
    step's own product times its scale column k_start // GROUP_K of a's rows and b's columns."""
    if QUANT == 2:
        kg = k_start // GROUP_K
        a_s = tl.load(as_ptrs + kg * stride_ag, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kg * stride_bk, mask=col_ok, other=0.0)
        acc = block_scaled_mma(a, b, acc, a_s, b_s, UPCAST, IEEE_DOT)
    else:
        acc = mma(a, b, acc, UPCAST, IEEE_DOT)
    return acc


@triton.jit
def dequant(acc, as_ptrs, bs_ptrs, row_ok, col_ok, QUANT: tl.constexpr):
    """Epilogue of per-tensor / per-token fp8 (QUANT 1): acc * a's row scale * b's column scale."""
    if QUANT == 1:
        a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs, mask=col_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def cast_rne(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """fp32 x -> dtype. EXACT (the interpreter, whose fp32 -> bf16 cast truncates): round to
    nearest even on the bits first, as the GPU and torch do, so the cast only drops zero bits."""
    if EXACT and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
