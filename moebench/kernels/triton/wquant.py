"""Weight-only quantised weight tiles for the Triton GEMMs (int8_w8a16, int4_w4a16, mxfp4).

    wq_offsets   the K offsets of a weight tile's rows in bytes (k0 / WQ_PACK ..)
    weight_tile  a GEMM's weight tile through pointers: `wq_load`'s, or the stored values, masked
    wq_load      one (BLOCK_SIZE_K, BLOCK_SIZE_N) weight tile of a K loop: the packed bytes, unpacked,
                 scaled (and shifted by the zero points), rounded once to the activation dtype
    wq_meta      the GEMMs' constexprs for a weight (WQ, WQ_GROUP, WQ_ZP, WQ_PACK)
    wq_zero_args the zero-point pointer and strides (dummies without them)
    check_wq_config  the tile-config rule: BLOCK_SIZE_K divides the group or is a multiple of it

Layouts (moebench.quant): int8 q (E, N, K) with an (E, N) scale; int4 / mxfp4 q (E, N, Kp / 2)
uint8 with two codes per byte along K (k in byte k // 2, low nibble for even k) and an (E, N, G)
scale (int4: act dtype; mxfp4: e8m0 uint8, 2^(s - 127)); int4 zero points (E, ceil(N/2), G) uint8,
two per byte along N. The GEMMs point at a tile's (BLOCK_SIZE_K // WQ_PACK, BN) bytes, each once (`wq_offsets`),
and step them by BLOCK_SIZE_K // WQ_PACK bytes; the scales come through the weight-scale pointer and the
weight strides of `common.Scales` (expert, row, group), which also carries the zero points and the constexprs.

Arithmetic, the same as moebench.quant.dequantize_weight_only: fp32 (q - z) * s (exact: a 4/8-bit
integer times a 16-bit scale; mxfp4 e2m1 x a power of two), then one rounding to the activation
dtype (nearest even, also under the interpreter: `cast_rne`) before the dot.
"""

from __future__ import annotations

from typing import Mapping

import triton
import triton.language as tl

from moebench.errors import MoebenchError
from moebench.kernels.triton.common import cast_rne
from moebench.quant import QuantScheme, QuantWeight, scheme_of, stored

#: WQ constexpr values.
WQ_NONE, WQ_INT8, WQ_INT4, WQ_MXFP4 = 0, 1, 2, 3
_WQ_OF = {"int8_w8a16": WQ_INT8, "int4_w4a16": WQ_INT4, "mxfp4": WQ_MXFP4}


@triton.jit
def _e2m1_to_f32(code):
    """e2m1 codes (int32 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> fp32 values:
    exponent e > 0 is 2^(e - 1) * (1 + m / 2) (fp32 bits (e + 126) << 23 | m << 22), e = 0 is m / 2."""
    e = (code >> 1) & 3
    m = code & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def wq_offsets(k0, BLOCK_SIZE_K: tl.constexpr, WQ_PACK: tl.constexpr):
    """The byte offsets along K of a weight tile starting at K index k0 (a multiple of
    BLOCK_SIZE_K): k0 / WQ_PACK + 0 .. BLOCK_SIZE_K / WQ_PACK - 1 (the K indices themselves when
    the weight is not packed)."""
    return k0 // WQ_PACK + tl.arange(0, BLOCK_SIZE_K // WQ_PACK)


@triton.jit
def wq_load(
    ptrs,  # (BLOCK_SIZE_K // PACK, BN) byte pointers of the tile: each packed byte once
    k0,  # first K index of the tile
    k_hi,  # K indices >= k_hi are masked (read as 0: they meet zero activations)
    rows,  # (BN,) weight rows (output channels) of the tile's columns
    col_ok,  # (BN,) columns in range
    s_ptr,  # scales (see the module docstring), indexed expert * stride_wse + row * stride_wsn + group * stride_wsk
    sc,  # common.Scales: the scales' strides, the zero points (row // 2 two per byte), WQ, WQ_GROUP, WQ_ZP
    expert,
    MASK_K: tl.constexpr,  # mask K indices >= k_hi (False where every tile is whole)
    BLOCK_SIZE_K: tl.constexpr,
    DTYPE: tl.constexpr,  # the activation dtype the tile is rounded to
    EXACT: tl.constexpr,  # interpreter: round to nearest even explicitly
):
    """One dequantised weight tile (BLOCK_SIZE_K, BN) in DTYPE."""
    WQ: tl.constexpr = sc.WQ
    GROUP: tl.constexpr = sc.WQ_GROUP  # values per scale along K (int4 / mxfp4; a power of two)
    PACK: tl.constexpr = 1 if WQ == 1 else 2
    BN: tl.constexpr = rows.shape[0]
    # The packed bytes: rows k0 / PACK .. of the tile, each byte once, contiguous along K; where K
    # tiles are whole (EVEN_K) the load is pipelined through shared memory (cp.async) as a 16-bit
    # weight tile's is (scripts/compile_sm90.py's "as launched, mxfp4" line).
    kb = k0 + tl.arange(0, BLOCK_SIZE_K // PACK) * PACK
    if MASK_K:
        mask = (kb < k_hi)[:, None] & col_ok[None, :]
    else:
        mask = col_ok[None, :]
    raw = tl.load(ptrs, mask=mask, other=0)
    base = s_ptr + expert * sc.stride_wse + rows * sc.stride_wsn
    if WQ == 1:
        # int8: one scale per output channel.
        s = tl.load(base, mask=col_ok, other=0.0).to(tl.float32)
        w = raw.to(tl.float32) * s[None, :]
    else:
        # Two codes per byte, the even k in the low nibble: interleave the nibbles back into K
        # order, (BK / 2, BN) x 2 -> (BK / 2, 2, BN) -> (BK, BN).
        b = raw.to(tl.int32)
        code = tl.reshape(tl.permute(tl.join(b & 0xF, b >> 4), (0, 2, 1)), (BLOCK_SIZE_K, BN))
        # The tile's scales: one group for every k (BLOCK_SIZE_K divides GROUP and k0 is a multiple
        # of BLOCK_SIZE_K) or BLOCK_SIZE_K / GROUP groups, each broadcast over its GROUP rows.
        if BLOCK_SIZE_K <= GROUP:
            g = k0 // GROUP
            s = tl.load(base + g * sc.stride_wsk, mask=col_ok, other=0)[None, :]
        else:
            NG: tl.constexpr = BLOCK_SIZE_K // GROUP
            g = (k0 // GROUP + tl.arange(0, NG))[:, None]
            s = tl.load(base[None, :] + g * sc.stride_wsk, mask=col_ok[None, :] & (g * GROUP < k_hi), other=0)
            s = tl.reshape(tl.broadcast_to(s[:, None, :], (NG, GROUP, BN)), (BLOCK_SIZE_K, BN))
        if WQ == 2:
            if sc.WQ_ZP:
                zrow = sc.wz_ptr + expert * sc.stride_wze + (rows // 2) * sc.stride_wzn
                zshift = ((rows % 2) * 4)[None, :]
                if BLOCK_SIZE_K <= GROUP:
                    zb = tl.load(zrow + g * sc.stride_wzk, mask=col_ok, other=0)[None, :]
                else:
                    zb = tl.load(zrow[None, :] + g * sc.stride_wzk, mask=col_ok[None, :] & (g * GROUP < k_hi), other=0)
                    zb = tl.reshape(tl.broadcast_to(zb[:, None, :], (NG, GROUP, BN)), (BLOCK_SIZE_K, BN))
                z = ((zb.to(tl.int32) >> zshift) & 0xF).to(tl.float32)
            else:
                z = 8.0
            w = (code.to(tl.float32) - z) * s.to(tl.float32)
        else:
            # mxfp4: e2m1 times the e8m0 scale 2^(s - 127) (fp32 bits s << 23; s >= 1).
            scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            w = _e2m1_to_f32(code) * scale
    return cast_rne(w, DTYPE, EXACT)


@triton.jit
def weight_tile(
    ptrs,  # (BLOCK_SIZE_K // WQ_PACK, BN) pointers of the tile (`wq_offsets` along K)
    k_ok,  # (BLOCK_SIZE_K,) K indices of the tile in range (used unless EVEN_K)
    k0,  # first K index of the tile; k_hi: K indices >= k_hi are out of range
    k_hi,
    rows,
    col_ok,
    s_ptr,  # the weight's scales
    sc,  # common.Scales
    expert,
    EVEN_K: tl.constexpr,  # every tile whole along K: no K mask
    BLOCK_SIZE_K: tl.constexpr,
    DTYPE: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One (BLOCK_SIZE_K, BN) weight tile of a GEMM's K loop through pointers: dequantised by
    `wq_load` (WQ != 0: the arguments are its own), else as stored; columns out of range and K
    indices out of range read as zeros."""
    if sc.WQ != 0:
        w = wq_load(ptrs, k0, k_hi, rows, col_ok, s_ptr, sc, expert, not EVEN_K, BLOCK_SIZE_K, DTYPE, EXACT)
    elif EVEN_K:
        w = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        w = tl.load(ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    return w


def wq_meta(w) -> dict[str, int]:
    """The GEMMs' weight-only constexprs for a weight: WQ (0 none / fp8, 1 int8, 2 int4, 3 mxfp4),
    WQ_GROUP (values per scale along K), WQ_ZP (int4 zero points), WQ_PACK (codes per byte)."""
    scheme = scheme_of(w)
    if scheme is None or not scheme.weight_only:
        return dict(WQ=WQ_NONE, WQ_GROUP=1, WQ_ZP=False, WQ_PACK=1)
    return dict(WQ=_WQ_OF[scheme.name], WQ_GROUP=scheme.group_size or 1, WQ_ZP=w.zeros is not None,
                WQ_PACK=2 if scheme.packed else 1)


def wq_zero_args(w) -> tuple:
    """(zero-point pointer, its expert / row-pair / group strides): int4's zeros, else a dummy
    pointer (the weight itself) and zeros, never read."""
    if isinstance(w, QuantWeight) and w.zeros is not None:
        return (w.zeros, *w.zeros.stride())
    return (stored(w), 0, 0, 0)


def check_wq_config(cfg: Mapping[str, int], scheme: QuantScheme | None, where: str) -> None:
    """Weight-only groups: BLOCK_SIZE_K must divide the group or be a multiple of it (`wq_load`
    reads one scale column per tile, or one per K index), and be even for the packed schemes."""
    if scheme is None or not scheme.weight_only or scheme.group_size is None:
        return
    bk, g = cfg["BLOCK_SIZE_K"], scheme.group_size
    if bk % g and g % bk:
        raise MoebenchError(f"{where}: BLOCK_SIZE_K={bk} neither divides nor is a multiple of the group size {g} "
                            f"({scheme.describe()}); use a power of two")
