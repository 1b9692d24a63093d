"""Pieces shared by moebench's Triton kernels."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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
def second_half_empty(pid_m, sorted_ids_ptr, num_pairs, BLOCK_SIZE_M: tl.constexpr):
    """Whether rows BLOCK_SIZE_M/2 .. BLOCK_SIZE_M - 1 of sorted block pid_m are all sentinels, so
    that the block's pairs fit in a half-height tile of its first rows."""
    half = pid_m * BLOCK_SIZE_M + BLOCK_SIZE_M // 2 + tl.arange(0, BLOCK_SIZE_M // 2)
    return tl.max((tl.load(sorted_ids_ptr + half) < num_pairs).to(tl.int32), axis=0) == 0


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


@triton.jit
def gate_up_mainloop(
    a_ptrs,  # (BM, BK) pointers to the activation rows at K = 0
    stride_ak,
    row_ok,  # (BM,) rows that exist (others load zeros)
    a_desc,  # A_TMA: TMA descriptor of the activation rows, block (BLOCK_SIZE_M, BLOCK_SIZE_K)
    a_row,  # A_TMA: the descriptor row of this program's first activation row
    w_ptr,  # w13 (E_local, 2I, H)
    w_desc,  # USE_TMA: TMA descriptor of w13 as (E_local * 2I, H), block (BLOCK_SIZE_N, BLOCK_SIZE_K); with
    #          WIDE as (2 E_local, I, H), block (2, BLOCK_SIZE_N, BLOCK_SIZE_K): a gate and its up tile
    expert,
    stride_we,
    stride_wn,
    stride_wk,
    n0,  # first intermediate column of this program
    N_INTER,
    H,
    as_ptrs,  # QUANT: (BM,) pointers to the rows' scales at K group 0
    stride_asg,
    ws_ptr,  # QUANT: w13's scales
    stride_wse,
    stride_wsn,
    stride_wsk,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    WIDE: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    A_TMA: tl.constexpr,
):
    """GEMM1's K loop for one (rows, intermediate tile) program of both Triton experts: the
    activation tiles times the gate rows n0.. and the up rows I + n0.. of w13[expert] ->
    (acc_g, acc_u), each (BLOCK_SIZE_M, BLOCK_SIZE_N) fp32 with the fp8 scales applied.

    Paired walk: gate and up tiles loaded separately (through TMA when USE_TMA; with A_TMA the
    activation tiles too, from rows that are contiguous in a_desc), two dots. WIDE: one (BK, 2 BN)
    tile of both, one dot, halves split at the end; with USE_TMA that tile is one TMA box of the
    (2 E_local, I, H) view (gate rows n0.. of slice 2e, the same up rows of slice 2e + 1; rows past
    I read zeros), fed to the MMA from shared memory as it landed."""
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    if WIDE:
        # Columns 0..BN-1 are gate rows n0.., BN..2BN-1 the same up rows I further.
        offs_w = tl.arange(0, 2 * BLOCK_SIZE_N)
        n_w = n0 + offs_w % BLOCK_SIZE_N
        wcol_ok = n_w < N_INTER
        rows_w = n_w + (offs_w // BLOCK_SIZE_N) * N_INTER
        w_ptrs = w_ptr + expert * stride_we + rows_w[None, :] * stride_wn + offs_k[:, None] * stride_wk
        wsc_ptrs = scale_ptrs(ws_ptr, expert, stride_wse, stride_wsn, rows_w, QUANT, GROUP_N)
        acc = tl.zeros((BLOCK_SIZE_M, 2 * BLOCK_SIZE_N), dtype=tl.float32)
        w_slice = (2 * expert).to(tl.int32)
        for k in range(0, tl.cdiv(H, BLOCK_SIZE_K)):
            if USE_TMA:
                if A_TMA:
                    a = a_desc.load([a_row, k * BLOCK_SIZE_K])
                else:
                    k_ok = offs_k < H - k * BLOCK_SIZE_K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                # (2, BN, BK) -> (2 BN, BK): rows 0..BN-1 gate, BN..2BN-1 up, as the columns below
                w = tl.reshape(w_desc.load([w_slice, n0, k * BLOCK_SIZE_K]), (2 * BLOCK_SIZE_N, BLOCK_SIZE_K)).T
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=wcol_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < H - k * BLOCK_SIZE_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & wcol_ok[None, :], other=0.0)
            acc = scaled_mma(a, w, acc, k * BLOCK_SIZE_K, as_ptrs, wsc_ptrs, row_ok, wcol_ok, stride_asg, stride_wsk,
                             QUANT, GROUP_K, UPCAST, IEEE_DOT)
            a_ptrs += BLOCK_SIZE_K * stride_ak
            w_ptrs += BLOCK_SIZE_K * stride_wk
        acc = dequant(acc, as_ptrs, wsc_ptrs, row_ok, wcol_ok, QUANT)
        # (BM, 2 BN) -> (BM, 2, BN) -> (BM, BN, 2) -> gate, up
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_SIZE_M, 2, BLOCK_SIZE_N)), (0, 2, 1)))
    else:
        offs_n = n0 + tl.arange(0, BLOCK_SIZE_N)
        col_ok = offs_n < N_INTER
        g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        u_ptrs = g_ptrs + N_INTER * stride_wn
        # TMA: the gate tile's first row in the (E_local * 2I, H) view; rows past I (last tile)
        # read the neighbouring rows or zeros, their columns are masked at the caller's store.
        g_row = (expert * 2 * N_INTER + n0).to(tl.int32)
        gs_ptrs = scale_ptrs(ws_ptr, expert, stride_wse, stride_wsn, offs_n, QUANT, GROUP_N)
        us_ptrs = scale_ptrs(ws_ptr, expert, stride_wse, stride_wsn, offs_n + N_INTER, QUANT, GROUP_N)
        acc_g = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_SIZE_K)):
            if USE_TMA:
                if A_TMA:  # rows past the tensor (and K past H) come back as zeros
                    a = a_desc.load([a_row, k * BLOCK_SIZE_K])
                else:
                    k_ok = offs_k < H - k * BLOCK_SIZE_K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                g = w_desc.load([g_row, k * BLOCK_SIZE_K]).T
                u = w_desc.load([g_row + N_INTER, k * BLOCK_SIZE_K]).T
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < H - k * BLOCK_SIZE_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            kk = k * BLOCK_SIZE_K
            acc_g = scaled_mma(a, g, acc_g, kk, as_ptrs, gs_ptrs, row_ok, col_ok, stride_asg, stride_wsk,
                               QUANT, GROUP_K, UPCAST, IEEE_DOT)
            acc_u = scaled_mma(a, u, acc_u, kk, as_ptrs, us_ptrs, row_ok, col_ok, stride_asg, stride_wsk,
                               QUANT, GROUP_K, UPCAST, IEEE_DOT)
            a_ptrs += BLOCK_SIZE_K * stride_ak
            g_ptrs += BLOCK_SIZE_K * stride_wk
            u_ptrs += BLOCK_SIZE_K * stride_wk
        acc_g = dequant(acc_g, as_ptrs, gs_ptrs, row_ok, col_ok, QUANT)
        acc_u = dequant(acc_u, as_ptrs, us_ptrs, row_ok, col_ok, QUANT)
    return acc_g, acc_u
