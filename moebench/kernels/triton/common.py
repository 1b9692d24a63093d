"""@triton.jit pieces shared by moebench's Triton kernels (and the launch arguments of PDL).

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

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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
def scale_ptrs(base, expert, stride_e, stride_n, rows, QUANT: tl.constexpr, GROUP_N: tl.constexpr):
    """Pointers to the fp8 scales of weight rows `rows` (output channels) of `expert`: each row's
    own scale (QUANT 1; stride_n = 0 when there is one per expert) or its block row rows // GROUP_N
    (QUANT 2, where K group g is at + g * stride_k)."""
    if QUANT == 2:
        rows = rows // GROUP_N
    return base + expert * stride_e + rows * stride_n


@triton.jit
def scaled_mma(a, b, acc, k_start, as_ptrs, bs_ptrs, row_ok, col_ok, stride_ag, stride_bk,
               QUANT: tl.constexpr, GROUP_K: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr,
               SWAP_AB: tl.constexpr = False):
    """One K step starting at column k_start: acc += a @ b, or for block scales (QUANT 2) the
    step's own product times its scale column k_start // GROUP_K of a's rows and b's columns.
    SWAP_AB: acc is (BN, BM), as in `mma`."""
    if QUANT == 2:
        kg = k_start // GROUP_K
        a_s = tl.load(as_ptrs + kg * stride_ag, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kg * stride_bk, mask=col_ok, other=0.0)
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
def gate_up_epilogue(acc_g, acc_u, b_ptrs, b_up_off, col_ok, alpha, limit, ACTIVATION: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """GEMM1's epilogue on fp32 gate / up tiles (BM, BN): + the expert's b13 columns (HAS_BIAS;
    b_ptrs: the gate columns' biases, b_up_off: elements from a gate bias to its up bias), then
    the activation (moebench.activation kinds): 0 silu(g) * u; 1 gelu(g) * u, exact (erf);
    2 swigluoai: g = min(g, limit), u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g)."""
    if HAS_BIAS:
        acc_g += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + b_up_off, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 2:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * g * tl.sigmoid(alpha * g)
    elif ACTIVATION == 1:
        h = 0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476)) * acc_u
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    return h
