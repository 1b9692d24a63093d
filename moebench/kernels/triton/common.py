"""@triton.jit pieces shared by moebench's Triton kernels, their argument groups, and the launch
arguments of PDL.

Argument groups (named tuples a launcher builds and a kernel takes as one argument; the fields in
capitals are constexprs, passed as `tl.constexpr`):

    Rows      the alignment a sorted-token GEMM reads: sorted pair ids, block experts, expert map
    Scales    how the fp8 / weight-only scales are laid out: the activation scales' strides, the
              weight scales' strides, the int4 zero points, the scheme's constexprs (the two
              scale pointers come as arguments of their own)
    GateUp    where a gate row's up row is (of w13 and of b13), the biases and the activation
    Bias      GEMM2's per-expert biases b2

    mma, block_scaled_mma, scaled_mma, dequant   one K step of a (fp8-scaled) GEMM; its epilogue scales
    acc_zeros                                    a tile's accumulator (transposed for swapped operands)
    scale_ptrs                                   where a weight row's fp8 scales are
    grouped_tile                                 program id -> (row tile, column tile), L2-friendly order
    block_expert, tile_rows                      a sorted block's expert and rows (sorted-token GEMMs)
    token_rows                                   a token-rows block's rows: local expert e's pairs among all tokens
    pdl_wait, pdl_release, pdl_launch_args       programmatic dependent launch (Hopper+)
    cast_rne                                     fp32 -> bf16 rounded to nearest even, also in the interpreter
    gate_up_epilogue                             GEMM1's bias and activation (moebench.activation kinds)
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


class Rows(NamedTuple):
    """The alignment's output as a sorted-token GEMM reads it (moebench.kernels.triton.align)."""

    sorted_ids_ptr: Any  # (max_padded,) flat pair ids, sentinel = num_pairs; TOKEN_ROWS: topk_ids (M, K)
    expert_ids_ptr: Any  # (max_blocks,) local expert per block (MAPPED: global id)
    expert_map_ptr: Any  # MAPPED: (E,) global -> local expert, -1 = remote
    ntpp_ptr: Any  # (1,) used length of sorted_ids
    TOPK: Any
    TOPK_PAD: Any  # TOKEN_ROWS: TOPK's next power of two
    MAPPED: Any  # expert_ids are global ids, mapped through expert_map (direct_align)
    TOKEN_ROWS: Any  # the token-rows layout: block = local expert, row t = token t


class Scales(NamedTuple):
    """The layout of a GEMM's quantisation scales (the pointers are arguments of their own).
    fp8 (QUANT 1: per-row x per-channel scales in the epilogue; 2: block scales [GROUP_N, GROUP_K]
    per K step): the activation's scale of (row, K group) at row * stride_asm + g * stride_asg (0:
    per tensor). The weight's scale of (expert, row n, K group) at e * stride_wse + n' * stride_wsn +
    g * stride_wsk, n' = n (QUANT 1, weight-only) or n // GROUP_N (QUANT 2); 0 for broadcast
    dimensions. Weight-only (WQ 1 int8, 2 int4, 3 mxfp4; moebench.kernels.triton.wquant): WQ_GROUP
    values per scale along K, WQ_PACK codes per byte, int4 zero points (WQ_ZP) at wz_ptr."""

    stride_asm: Any
    stride_asg: Any
    stride_wse: Any
    stride_wsn: Any
    stride_wsk: Any
    wz_ptr: Any  # (E_local, ceil(N/2), G) uint8, two per byte along N
    stride_wze: Any
    stride_wzn: Any
    stride_wzk: Any
    QUANT: Any
    GROUP_N: Any
    GROUP_K: Any  # QUANT 2: a multiple of BLOCK_SIZE_K
    WQ: Any
    WQ_GROUP: Any
    WQ_ZP: Any
    WQ_PACK: Any


class GateUp(NamedTuple):
    """GEMM1's pairing of gate and up and what combines them: a gate row's up row is up_off
    elements further in w13 (I rows, or one row when INTERLEAVED: swigluoai's 2j, 2j + 1); the
    biases b13 (HAS_BIAS) of gate column n at e * stride_be + n * stride_bn, its up bias b_up_off
    further; the activation (moebench.activation kind, `gate_up_epilogue`) with swigluoai's alpha
    and limit."""

    b13_ptr: Any
    stride_be: Any
    stride_bn: Any
    up_off: Any
    b_up_off: Any
    alpha: Any
    limit: Any
    ACTIVATION: Any
    HAS_BIAS: Any
    INTERLEAVED: Any


class Bias(NamedTuple):
    """Per-expert biases (E_local, N) of a GEMM's output columns (HAS_BIAS): column n of expert e at
    e * stride_e + n * stride_n."""

    b2_ptr: Any
    stride_b2e: Any
    stride_b2n: Any
    HAS_BIAS: Any


def bias_arg(b, dummy) -> Bias:
    """Bias of an (E_local, N) bias tensor b, or of None (the dummy pointer, never read)."""
    if b is None:
        return Bias(dummy, 0, 0, tl.constexpr(False))
    return Bias(b, b.stride(0), b.stride(1), tl.constexpr(True))


def gate_up_args(w13, n_inter: int, activation, b13=None) -> tuple[int, GateUp]:
    """(w13's row stride between gate columns, GateUp) for stored weights w13 (E_local, 2I, H):
    gate rows one apart and up rows I further, or (interleaved) gate rows two apart, each up row
    the next; b13 (E_local, 2I) in the same row order, or None (a dummy pointer, never read)."""
    il = activation.interleaved
    row = w13.stride(1)
    stride_wn, up_off = (2 * row, row) if il else (row, n_inter * row)
    if b13 is not None:
        assert b13.shape == (w13.shape[0], 2 * n_inter), "b13 must be (E_local, 2I)"
        bcol = b13.stride(1)
        bias = (b13, b13.stride(0), 2 * bcol if il else bcol, up_off, bcol if il else n_inter * bcol)
    else:
        bias = (w13, 0, 0, up_off, 0)
    return stride_wn, GateUp(*bias, float(activation.alpha), float(activation.limit), tl.constexpr(activation.kind),
                             tl.constexpr(b13 is not None), tl.constexpr(il))


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """acc += a @ b with fp32 accumulation. UPCAST: operands to fp32 first (the CPU interpreter
    gets 16-bit tl.dot wrong); IEEE_DOT: exact fp32 products (no TF32) for fp32 inputs. SWAP_AB:
    acc is the transposed (BN, BM) accumulator and gets b^T @ a^T, so that b's columns fill the
    MMA's M side when a has few rows."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if SWAP_AB:
        a, b = tl.trans(b), tl.trans(a)
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
def block_expert(pid_m, ntpp_ptr, expert_ids_ptr, expert_map_ptr, BLOCK_SIZE_M: tl.constexpr, FROM_L2: tl.constexpr,
                 MAPPED: tl.constexpr):
    """The local expert of sorted block pid_m (int64), or -1 when the block has nothing to do:
    past the used length (padding of the worst-case grid) or a remote expert (direct_align).
    FROM_L2: load with the ".cg" modifier (for reads before `pdl_wait`). MAPPED: expert_ids hold
    global ids (direct_align with an expert_map), mapped here through expert_map (global -> local,
    -1 = remote); a negative id stays -1."""
    if FROM_L2:
        expert = tl.load(expert_ids_ptr + pid_m, cache_modifier=".cg").to(tl.int64)
        used = tl.load(ntpp_ptr, cache_modifier=".cg")
    else:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        used = tl.load(ntpp_ptr)
    if MAPPED:  # the map is an input of the step, written by no kernel of it
        expert = tl.load(expert_map_ptr + expert, mask=expert >= 0, other=-1).to(tl.int64)
    return tl.where(pid_m * BLOCK_SIZE_M >= used, -1, expert)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Programmatic dependent launch (a kernel launched with launch_pdl=True, Hopper+): wait until
    the previous kernel has finished and its writes are visible. Before this point a program may
    only compute indices and read what no kernel of the step writes (weights) or what the kernel
    two back wrote (its predecessor waited for it before releasing this one); it must not write
    anything."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel (launched with launch_pdl=True) start once every program of this one
    has called this or exited; call it after `pdl_wait`."""
    if PDL:
        gdc_launch_dependents()


def pdl_launch_args(pdl: bool) -> dict:
    """Kernel keyword arguments for a launch with programmatic dependent launch: the kernel's PDL
    constexpr and Triton's launch_pdl (none without: the interpreter knows no launch_pdl)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


@triton.jit
def tile_rows(row0, sorted_ids_ptr, num_pairs, TOPK: tl.constexpr, ROWS: tl.constexpr):
    """Sorted rows row0 .. row0 + ROWS - 1: (offs_m, pair, row_ok, token), each (ROWS,); pair is
    the flat (token, k) index, token = pair // K (int64); sentinel rows have row_ok False."""
    offs_m = row0 + tl.arange(0, ROWS)
    pair = tl.load(sorted_ids_ptr + offs_m)
    return offs_m, pair, pair < num_pairs, (pair // TOPK).to(tl.int64)


@triton.jit
def token_rows(expert, ids_ptr, expert_map_ptr, weights_ptr, num_pairs, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
               ROWS: tl.constexpr, MAPPED: tl.constexpr, WEIGHTED: tl.constexpr):
    """Block `expert` of the token-rows layout (align.token_rows_align: M <= ROWS tokens, one block
    per local expert, row t = token t): (offs_m, pair, row_ok, token, weight), each (ROWS,). Row t
    is in use when token t routes to the expert (topk_ids at ids_ptr, (M, K) flat; global ids mapped
    through expert_map when MAPPED); pair = its (t, k) pair (the last such k; the sentinel M*K
    otherwise); weight (WEIGHTED) = the sum of the router weights of the token's pairs to this
    expert, one pair but for repeated ids, else zeros. TOPK_PAD: TOPK's next power of two. The
    routing is read as one (ROWS, TOPK_PAD) tile, so that a block without a token (most of them
    at a few tokens) exits after one load. Reads only the step's inputs, so also before `pdl_wait`."""
    token = tl.arange(0, ROWS).to(tl.int64)
    k = tl.arange(0, TOPK_PAD)
    flat = token[:, None] * TOPK + k[None, :]
    in_m = (k[None, :] < TOPK) & (flat < num_pairs)
    e = tl.load(ids_ptr + flat, mask=in_m, other=-1).to(tl.int64)
    if MAPPED:
        e = tl.load(expert_map_ptr + e, mask=e >= 0, other=-1).to(tl.int64)
    hit = e == expert
    pair = tl.max(tl.where(hit, flat, -1), axis=1)
    pair = tl.where(pair < 0, num_pairs, pair)
    weight = tl.zeros((ROWS,), tl.float32)
    if WEIGHTED:
        weight = tl.sum(tl.load(weights_ptr + flat, mask=hit, other=0.0).to(tl.float32), axis=1)
    return expert * ROWS + tl.arange(0, ROWS), pair, pair < num_pairs, token, weight


@triton.jit
def acc_zeros(ROWS: tl.constexpr, COLS: tl.constexpr, SWAP_AB: tl.constexpr):
    """The zero fp32 accumulator of a (ROWS, COLS) output tile: (COLS, ROWS) under SWAP_AB (`mma`)."""
    if SWAP_AB:
        acc = tl.zeros((COLS, ROWS), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
    return acc


@triton.jit
def block_scaled_mma(a, b, acc, a_s, b_s, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr,
                     SWAP_AB: tl.constexpr = False):
    """acc + (a @ b) * a_s[:, None] * b_s[None, :]: one K step of a block-scaled fp8 GEMM (the dot
    of this step alone, then its row and column dequantisation scales). UPCAST as in `mma` (the
    interpreter cannot dot fp8 operands); SWAP_AB: the transposed accumulator, as in `mma`."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if SWAP_AB:
        a, b, a_s, b_s = tl.trans(b), tl.trans(a), b_s, a_s
    if IEEE_DOT:
        d = tl.dot(a, b, input_precision="ieee")
    else:
        d = tl.dot(a, b)
    return acc + d * a_s[:, None] * b_s[None, :]


@triton.jit
def gate_up_rows(offs_n, N_INTER, INTERLEAVED: tl.constexpr):
    """The w13 rows of intermediate columns offs_n: gate rows n and up rows I + n, or (INTERLEAVED,
    swigluoai's layout) 2n and 2n + 1. Per-row weight scales are read at these rows."""
    if INTERLEAVED:
        return 2 * offs_n, 2 * offs_n + 1
    return offs_n, offs_n + N_INTER


@triton.jit
def scale_ptrs(base, expert, rows, sc):
    """Pointers to the fp8 scales of weight rows `rows` (output channels) of `expert` (sc: Scales):
    each row's own scale (QUANT 1; stride_wsn = 0 when there is one per expert) or its block row
    rows // GROUP_N (QUANT 2, where K group g is at + g * stride_wsk)."""
    if sc.QUANT == 2:
        rows = rows // sc.GROUP_N
    return base + expert * sc.stride_wse + rows * sc.stride_wsn


@triton.jit
def scaled_mma(a, b, acc, k_start, as_ptrs, bs_ptrs, row_ok, col_ok, sc, UPCAST: tl.constexpr,
               IEEE_DOT: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """One K step starting at column k_start: acc += a @ b, or for block scales (sc: Scales, QUANT 2)
    the step's own product times its scale column k_start // GROUP_K of a's rows and b's columns.
    SWAP_AB: acc is (BN, BM), as in `mma`."""
    if sc.QUANT == 2:
        kg = k_start // sc.GROUP_K
        a_s = tl.load(as_ptrs + kg * sc.stride_asg, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kg * sc.stride_wsk, mask=col_ok, other=0.0)
        acc = block_scaled_mma(a, b, acc, a_s, b_s, UPCAST, IEEE_DOT, SWAP_AB)
    else:
        acc = mma(a, b, acc, UPCAST, IEEE_DOT, SWAP_AB)
    return acc


@triton.jit
def dequant(acc, as_ptrs, bs_ptrs, row_ok, col_ok, QUANT: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """Epilogue of per-tensor / per-token fp8 (QUANT 1): acc * a's row scale * b's column scale.
    SWAP_AB: acc is (BN, BM) and comes back transposed to (BM, BN)."""
    if QUANT == 1:
        a_s = tl.load(as_ptrs, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs, mask=col_ok, other=0.0)
        if SWAP_AB:
            a_s, b_s = b_s, a_s
        acc = acc * a_s[:, None] * b_s[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)
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


@triton.jit
def gate_up_epilogue(acc_g, acc_u, expert, offs_n, col_ok, gu):
    """GEMM1's epilogue on fp32 gate / up tiles (BM, BN) of intermediate columns offs_n (gu: GateUp):
    + the expert's b13 columns (HAS_BIAS), then the activation (moebench.activation kinds): 0
    silu(g) * u; 1 gelu(g) * u, exact (erf); 2 swigluoai: g = min(g, limit), u = clamp(u, -limit,
    limit), (u + 1) * g * sigmoid(alpha * g)."""
    b_ptrs = gu.b13_ptr + expert * gu.stride_be + offs_n * gu.stride_bn
    if gu.HAS_BIAS:
        acc_g += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + gu.b_up_off, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if gu.ACTIVATION == 2:
        g = tl.minimum(acc_g, gu.limit)
        u = tl.minimum(tl.maximum(acc_u, -gu.limit), gu.limit)
        h = (u + 1.0) * g * tl.sigmoid(gu.alpha * g)
    elif gu.ACTIVATION == 1:
        h = 0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476)) * acc_u
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    return h
