"""FP8 (e4m3) activation quantisation on the device, with moebench.quant's arithmetic bit for bit.

    quantize_rows(x, scheme, static_scale)  same contract as moebench.quant.quantize_activation:
                                            x (..., K) -> q (..., K) float8_e4m3fn, scale (..., G) fp32

One Triton kernel over (row tiles, scale groups, batches). Each program takes BLOCK_M rows of one
group of columns (bk columns for `block`, the whole row for `token` and `tensor`): the group's amax
per row (dynamic schemes), scale = max(amax, AMAX_EPS) / 448, q = clamp(x / scale, +-448) rounded to
e4m3, nearest even. The per-tensor scheme uses a static scale read from the device (no amax, and
the returned scale is that scalar expanded over rows, stride 0).

Rows to skip are read on the device, never synchronised to the host: `row_limit` (1,) int32 (the
Standard kernel's intermediate: only rows < num_tokens_post_padded are in use) or `batch_counts`
(B,) int (the BatchedExperts layout: rows [0, count[b]) of batch b); skipped rows of q and scale
stay unwritten.

Exactness: x / scale is an IEEE round-to-nearest division (`div_rn`, as torch's division of two
tensors); the scale is amax * fp32(1/448) (moebench.quant.scale_of, the same bits on every
device); the fp32 -> e4m3 cast rounds to nearest even in hardware. Triton's CPU interpreter gets that
cast wrong when the rounding carries into the exponent (1.97 -> 1.0) and for e4m3 subnormals, so
under the interpreter the kernel rounds in fp32 first (`round_e4m3`, exact bit arithmetic) and
the cast only converts an exactly representable value.

    silu_mul_rows(gate_up, row_limit, quant_block, q, scale)
                                            gate_up (R, 2I) [gate | up] -> silu(gate) * up rounded to
                                            bf16, then (quant_block) quantised per row and 1 x bk group

The second is the step between two GEMMs done by a library (DeepGEMM's grouped GEMMs in
moebench.kernels.deepgemm): it writes the scales with whatever strides the caller's tensor has.

Also here, for the GEMM kernels: `quant_meta` (their QUANT / GROUP_N / GROUP_K constexprs),
`gemm_scales` (a GEMM's scale pointers and its `common.Scales` argument, fp8 and weight-only) and
`check_block_config`, the tile-config rule of block scales (BLOCK_SIZE_K divides bk: one scale
column per K step).
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from moebench.errors import MoebenchError
from moebench.kernels.triton.common import Scales, cast_rne
from moebench.kernels.triton.env import interpreter_compat, interpreting
from moebench.kernels.triton.wquant import wq_meta, wq_zero_args
from moebench.quant import AMAX_EPS, FP8_DTYPE, INV_FP8_MAX, QuantScheme, QuantWeight, scale_of, scheme_of

_EPS = tl.constexpr(AMAX_EPS)
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)


@triton.jit
def round_e4m3(v):
    """fp32 v (already within +-448) rounded to the nearest e4m3 value (ties to even), in fp32:
    exact bit arithmetic, for the interpreter whose own cast rounds wrongly. The step of e4m3 at
    v is 2^(e - 3) with e = exponent of v, at least -6 (subnormals)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3), a power of two
    y = tl.abs(v) / step  # exact: < 16
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where(tie & odd, r - 1.0, r)
    a = tl.minimum(r * step, 448.0)
    return (a.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quant_group(x, scale, q_ptrs, mask, EXACT_ROUND: tl.constexpr):
    """Store clamp(x / scale[:, None], +-448) as e4m3 at q_ptrs (x (BM, BK) fp32; also the fused
    epilogue of the Triton experts' GEMM1, moebench.kernels.triton.gemm1). A zero is stored as itself
    (its sign kept) and divided as scale / scale: a zero dividend sends div_rn down its slow path,
    which made the quantisation of the alignment's zero sentinel rows twice as slow as random rows."""
    s = tl.broadcast_to(scale[:, None], x.shape)
    zero = x == 0.0
    v = tl.where(zero, x, tl.math.div_rn(tl.where(zero, s, x), s))
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if EXACT_ROUND:
        v = round_e4m3(v)
    tl.store(q_ptrs, v.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def quant_rows_kernel(
    x_ptr,  # (B, T, K) any float dtype
    q_ptr,  # (B, T, K) float8_e4m3fn out
    s_ptr,  # (B, T, G) fp32 out (dynamic schemes only)
    static_ptr,  # (1,) fp32 static scale (STATIC only)
    limit_ptr,  # LIMIT == 1: (1,) rows in use; LIMIT == 2: (B,) rows in use per batch
    ids_ptr,  # PAIR_ROWS: (T,) sorted pair ids of the rows; a row is quantised where its id < num_pairs
    num_pairs,
    T,
    K,
    group_k,  # columns per scale group (K for one group per row)
    stride_xb,
    stride_xm,
    stride_xk,
    stride_qb,
    stride_qm,
    stride_qk,
    stride_sb,
    stride_sm,
    stride_sg,
    STATIC: tl.constexpr,  # per-tensor: the scale is static_ptr[0]
    LIMIT: tl.constexpr,  # 0: all T rows; 1: limit_ptr[0]; 2: limit_ptr[batch]
    ONE_CHUNK: tl.constexpr,  # group_k <= BLOCK_K: the group is loaded once
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT_ROUND: tl.constexpr,  # interpreter: round in fp32 before the cast
    PAIR_ROWS: tl.constexpr = False,  # only the rows of pairs (not the alignment's sentinel rows)
):
    pid_m = tl.program_id(0)
    grp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows_used = T
    if LIMIT == 1:
        rows_used = tl.minimum(tl.load(limit_ptr), T)
    elif LIMIT == 2:
        rows_used = tl.minimum(tl.load(limit_ptr + b).to(tl.int32), T)
    if pid_m * BLOCK_M >= rows_used:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows_used
    if PAIR_ROWS:
        row_ok &= tl.load(ids_ptr + offs_m, mask=row_ok, other=num_pairs) < num_pairs
    rows = offs_m.to(tl.int64)
    k_lo = grp * group_k
    k_hi = tl.minimum(k_lo + group_k, K)
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + b * stride_xb + rows[:, None] * stride_xm
    q_row = q_ptr + b * stride_qb + rows[:, None] * stride_qm

    if ONE_CHUNK:
        cols = k_lo + offs_k
        mask = row_ok[:, None] & (cols < k_hi)[None, :]
        x = tl.load(x_row + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.full((BLOCK_M,), 1.0, tl.float32) * tl.load(static_ptr)
        else:
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), _EPS)
            scale = amax * _INV_FP8_MAX  # moebench.quant.scale_of
        quant_group(x, scale, q_row + cols[None, :] * stride_qk, mask, EXACT_ROUND)
    else:
        if STATIC:
            scale = tl.full((BLOCK_M,), 1.0, tl.float32) * tl.load(static_ptr)
        else:
            amax = tl.zeros((BLOCK_M,), tl.float32)
            for c in range(k_lo, k_hi, BLOCK_K):
                cols = c + offs_k
                mask = row_ok[:, None] & (cols < k_hi)[None, :]
                x = tl.load(x_row + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            amax = tl.maximum(amax, _EPS)
            scale = amax * _INV_FP8_MAX  # moebench.quant.scale_of
        for c in range(k_lo, k_hi, BLOCK_K):
            cols = c + offs_k
            mask = row_ok[:, None] & (cols < k_hi)[None, :]
            x = tl.load(x_row + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            quant_group(x, scale, q_row + cols[None, :] * stride_qk, mask, EXACT_ROUND)

    if not STATIC:
        tl.store(s_ptr + b * stride_sb + rows * stride_sm + grp * stride_sg, scale, mask=row_ok)


def _launch(
    x3: torch.Tensor,
    q3: torch.Tensor,
    s3: torch.Tensor | None,
    scheme: QuantScheme,
    static: torch.Tensor | None,
    row_limit: torch.Tensor | None,
    batch_counts: torch.Tensor | None,
    pair_rows: tuple[torch.Tensor, int] | None = None,
) -> None:
    """x3, q3 (B, T, K); s3 (B, T, G) for the dynamic schemes; static (1,) fp32 for tensor."""
    nb, t, k = x3.shape
    if nb == 0 or t == 0 or k == 0:
        return
    interpreter_compat()
    group_k = scheme.group_k or k
    groups = scheme.num_groups(k)
    block_k = min(triton.next_power_of_2(group_k), 1024)
    block_m = max(1, min(triton.next_power_of_2(t), 4096 // block_k))
    if batch_counts is not None:
        limit, mode = batch_counts, 2
    elif row_limit is not None:
        limit, mode = row_limit, 1
    else:
        limit, mode = x3, 0  # unused
    is_static = scheme.scales == "tensor"
    s_arg = s3 if s3 is not None else q3
    s_strides = s3.stride() if s3 is not None else (0, 0, 0)
    static_arg = static if static is not None else x3
    grid = (triton.cdiv(t, block_m), groups, nb)
    ids, num_pairs = pair_rows if pair_rows is not None else (limit, 0)
    quant_rows_kernel[grid](
        x3, q3, s_arg, static_arg, limit, ids, num_pairs, t, k, group_k,
        x3.stride(0), x3.stride(1), x3.stride(2), q3.stride(0), q3.stride(1), q3.stride(2), *s_strides,
        STATIC=is_static, LIMIT=mode, ONE_CHUNK=group_k <= block_k, BLOCK_M=block_m, BLOCK_K=block_k,
        EXACT_ROUND=interpreting(), PAIR_ROWS=pair_rows is not None, num_warps=4,
    )


def quantize_rows(
    x: torch.Tensor,
    scheme: QuantScheme,
    static_scale: torch.Tensor | None = None,
    *,
    row_limit: torch.Tensor | None = None,
    batch_counts: torch.Tensor | None = None,
    pair_rows: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> (q (..., K) float8_e4m3fn, scale (..., G) float32), equal bit for bit to
    moebench.quant.quantize_activation(x, scheme, static_scale), computed by one Triton launch.

    tensor: `static_scale` (1,) (the dynamic amax of all of x when None), returned expanded over
    rows (stride 0); token: one scale per row; block: one per row and bk columns.

    row_limit (1,) int32 on the device: only rows < row_limit[0] of a 2-D x are quantised;
    batch_counts (B,): x is (B, T, K) and only rows [0, count[b]) of batch b are. pair_rows
    (sorted_ids (rows,), num_pairs), with a 2-D x: only rows whose sorted id is a pair (< num_pairs)
    are, not the alignment's sentinel rows (most of a decode call's intermediate; GEMM2 masks their
    output rows). Skipped rows of q and of a dynamic scale stay unwritten. None of these
    synchronises with the host."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise MoebenchError(f"quantize_rows takes fp32/fp16/bf16 activations, got {x.dtype}")
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    if batch_counts is not None:
        if x.dim() != 3 or batch_counts.numel() != x.shape[0]:
            raise MoebenchError("quantize_rows: batch_counts needs x (B, T, K) and B counts")
        x3 = x
    else:
        if (row_limit is not None or pair_rows is not None) and x.dim() != 2:
            raise MoebenchError("quantize_rows: row_limit and pair_rows need a 2-D x (rows, K)")
        if pair_rows is not None and pair_rows[0].numel() < x.shape[0]:
            raise MoebenchError(f"quantize_rows: pair_rows gives {pair_rows[0].numel()} sorted ids for {x.shape[0]} rows")
        x3 = x.reshape(1, -1, k)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    q3 = q.view(x3.shape)
    if scheme.scales == "tensor":
        if static_scale is None:
            amax = x.abs().amax() if x.numel() else x.new_zeros(())
            static = scale_of(amax).reshape(1)
        else:
            static = static_scale.to(device=x.device, dtype=torch.float32).reshape(1)
        _launch(x3, q3, None, scheme, static, row_limit, batch_counts, pair_rows)
        return q, static.reshape([1] * (len(lead) + 1)).expand(*lead, 1)
    groups = scheme.num_groups(k)
    if x.numel() == 0:
        return q, torch.ones((*lead, groups), dtype=torch.float32, device=x.device)
    s = torch.empty((*lead, groups), dtype=torch.float32, device=x.device)
    _launch(x3, q3, s.view(*x3.shape[:-1], groups), scheme, None, row_limit, batch_counts, pair_rows)
    return q, s


@triton.jit
def silu_mul_rows_kernel(gu_ptr, q_ptr, s_ptr, limit_ptr, I, stride_gg, stride_gm, stride_qg, stride_qm,
                         stride_sgrp, stride_sm, stride_sg,
                         QUANT: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr, EXACT: tl.constexpr):
    # Program (r, g, e): rows r * BLOCK_M .. of row group e (those below limit_ptr[e]), columns
    # g * GROUP .. of the intermediate. h = silu(gate) * up in fp32, rounded to bf16 (where the
    # reference rounds it), then stored as bf16 or, QUANT, as e4m3 with one scale per row and GROUP
    # columns.
    pid_m = tl.program_id(0)
    grp = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows_used = tl.load(limit_ptr + e)
    if pid_m * BLOCK_M >= rows_used:
        return
    gu_ptr += e * stride_gg
    q_ptr += e * stride_qg
    s_ptr += e * stride_sgrp
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = grp * GROUP + tl.arange(0, GROUP)
    row_ok = rows < rows_used
    mask = row_ok[:, None] & (cols < I)[None, :]
    gate = tl.load(gu_ptr + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + rows[:, None] * stride_gm + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = cast_rne(gate * tl.sigmoid(gate) * up, tl.bfloat16, EXACT).to(tl.float32)
    q_ptrs = q_ptr + rows[:, None] * stride_qm + cols[None, :]
    if QUANT:
        scale = tl.maximum(tl.max(tl.abs(h), axis=1), _EPS) * _INV_FP8_MAX  # moebench.quant.scale_of
        quant_group(h, scale, q_ptrs, mask, EXACT)
        tl.store(s_ptr + rows * stride_sm + grp * stride_sg, scale, mask=row_ok)
    else:
        tl.store(q_ptrs, h.to(q_ptr.dtype.element_ty), mask=mask)


def silu_mul_rows(gate_up: torch.Tensor, row_limit: torch.Tensor, out: torch.Tensor,
                  scale: torch.Tensor | None = None, group: int = 128) -> None:
    """out[r] = silu(gate_up[r, :I]) * gate_up[r, I:] for rows r < row_limit[0] ((1,) int32 on the
    device; later rows stay unwritten), computed in fp32 and rounded to bf16. out (R, I): bf16, or
    float8_e4m3fn with `scale` (R, I / group) float32 (any strides) taking one dynamic scale per
    row and `group` columns, the arithmetic of moebench.quant's block scheme. Grouped rows: gate_up
    (E, T, 2I), out (E, T, I), scale (E, T, I / group) and row_limit (E,): rows t < row_limit[e] of
    each group e (a masked layout's valid rows). One launch, no host synchronisation."""
    grouped = gate_up.dim() == 3
    g3, o3 = (gate_up, out) if grouped else (gate_up.unsqueeze(0), out.unsqueeze(0))
    e, r, two_i = g3.shape
    i = two_i // 2
    quant = out.dtype == FP8_DTYPE
    if row_limit.numel() != e:
        raise MoebenchError(f"silu_mul_rows: one row limit per row group ({e}), got {row_limit.numel()}")
    if quant and (scale is None or i % group or tuple(scale.shape) != (tuple(out.shape[:-1]) + (i // group,))):
        raise MoebenchError(f"silu_mul_rows: fp8 output needs (rows, {i} / {group}) scales and I a multiple of {group}")
    if out.dtype not in (FP8_DTYPE, torch.bfloat16) or o3.shape != (e, r, i) or o3.stride(2) != 1 or g3.stride(2) != 1:
        raise MoebenchError("silu_mul_rows: gate_up (R, 2I) and out (R, I) bf16 / fp8, rows contiguous")
    if r == 0 or e == 0:
        return
    interpreter_compat()
    if quant:
        s3 = scale if grouped else scale.unsqueeze(0)
        s_arg, s_strides = scale, s3.stride()
    else:
        s_arg, s_strides = out, (0, 0, 0)
    block_m = 16
    silu_mul_rows_kernel[(triton.cdiv(r, block_m), triton.cdiv(i, group), e)](
        gate_up, out, s_arg, row_limit, i, g3.stride(0), g3.stride(1), o3.stride(0), o3.stride(1), *s_strides,
        QUANT=quant, BLOCK_M=block_m, GROUP=group, EXACT=interpreting(), num_warps=4)


def quant_meta(w) -> dict[str, int]:
    """The GEMM kernels' fp8 constexprs for a weight: QUANT 0 = unquantised, 1 = tensor / token
    scales (applied in the epilogue), 2 = block scales (applied per K step); GROUP_N, GROUP_K =
    the block shape (1 otherwise). Weight-only schemes quantise no activation: QUANT 0 (their
    constexprs: moebench.kernels.triton.wquant.wq_meta)."""
    scheme = scheme_of(w)
    if scheme is None or scheme.weight_only:
        return dict(QUANT=0, GROUP_N=1, GROUP_K=1)
    if scheme.block_shape is None:
        return dict(QUANT=1, GROUP_N=1, GROUP_K=1)
    return dict(QUANT=2, GROUP_N=scheme.block_shape[0], GROUP_K=scheme.block_shape[1])


def gemm_scales(w, a_scale: torch.Tensor | None = None, a_dims: tuple[int, int] = (0, 1)) -> tuple[tuple, Scales]:
    """((a_scale pointer, weight scale pointer), common.Scales) of a GEMM on weight `w`: fp8 (w8a8)
    the activation scales a_scale (a_dims: its row and group dimensions) and the weight's; the
    weight-only schemes the weight's scales alone; unquantised weights dummy pointers (the weight
    itself) and zero strides, never read (QUANT = WQ = 0)."""
    if not isinstance(w, QuantWeight):
        ptrs, a_strides, w_strides = (w, w), (0, 0), (0, 0, 0)
    elif w.scheme.weight_only:
        ptrs, a_strides, w_strides = (w.scale, w.scale), (0, 0), w.scale_strides()
    else:
        ptrs, a_strides, w_strides = (a_scale, w.scale), (a_scale.stride(a_dims[0]), a_scale.stride(a_dims[1])), \
            w.scale_strides()
    q, wq = quant_meta(w), wq_meta(w)
    consts = (q["QUANT"], q["GROUP_N"], q["GROUP_K"], wq["WQ"], wq["WQ_GROUP"], wq["WQ_ZP"], wq["WQ_PACK"])
    return ptrs, Scales(*a_strides, *w_strides, *wq_zero_args(w), *(tl.constexpr(v) for v in consts))


def check_block_config(cfg: Mapping[str, int], scheme: QuantScheme | None, where: str,
                       device: torch.device | str = "cpu") -> None:
    """Block-scaled GEMMs step K by BLOCK_SIZE_K and apply one scale column per step, so
    BLOCK_SIZE_K must divide bk (moebench.kernels.triton.configs.fit_to_quant_block makes defaults so).
    On a GPU every fp8 (w8a8) dot needs BLOCK_SIZE_K >= 32 (the MMA's fp8 K)."""
    if scheme is None or scheme.weight_only:
        return
    if torch.device(device).type == "cuda" and cfg["BLOCK_SIZE_K"] < 32:
        raise MoebenchError(f"{where}: BLOCK_SIZE_K={cfg['BLOCK_SIZE_K']} is below 32, the GPU's smallest fp8 dot "
                            f"along K ({scheme.describe()}); use BLOCK_SIZE_K >= 32")
    if scheme.block_shape is None:
        return
    bk = scheme.block_shape[1]
    if bk % cfg["BLOCK_SIZE_K"]:
        raise MoebenchError(
            f"{where}: BLOCK_SIZE_K={cfg['BLOCK_SIZE_K']} does not divide the fp8 scale block's "
            f"bk={bk} ({scheme.describe()}); use a BLOCK_SIZE_K that divides {bk}"
        )
