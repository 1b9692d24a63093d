"""A stand-in for `deep_gemm` that does DeepGEMM 2.6.1's grouped GEMMs in torch on any device and
asserts the operand layouts its sm90 kernels take without converting anything themselves (psum /
m-indices grouped layouts, MN-major TMA-aligned fp32 activation scales, contiguous (G, N/128, K/128)
weight scales). The CPU tests of the DeepGEMM adapters and `deepgemm_breakdown --smoke` run the
adapters' glue through it; it is never a backend and never times anything."""

from __future__ import annotations

import types

import torch

from moebench.kernels.deepgemm import mn_major_strides

#: the stand-in's row alignment (DeepGEMM's is 128 on sm90): small shapes still span several blocks
ALIGN = 16


def _k_major(t):
    assert t.stride(-1) == 1, "DeepGEMM wants K-major operands"


def _dequant_a(a, sfa):
    q, s = a
    assert q.dtype == torch.float8_e4m3fn and sfa is s
    assert s.dtype == torch.float32 and s.stride() == mn_major_strides(tuple(s.shape)), \
        f"sfa must be MN-major TMA-aligned, got strides {s.stride()} for {tuple(s.shape)}"
    k = q.shape[-1]
    assert s.shape[-1] == k // 128
    return q.float() * s.repeat_interleave(128, dim=-1)


def _dequant_b(b):
    q, s = b
    g, n, k = q.shape
    assert s.shape == (g, -(-n // 128), k // 128) and s.is_contiguous()
    return q.float() * s.repeat_interleave(128, dim=1)[:, :n].repeat_interleave(128, dim=2)


def _contiguous(a, b, d, grouped, use_psum_layout=False, expected_m_for_psum_layout=None):
    _k_major(a)
    assert d.is_contiguous() and d.dtype == torch.bfloat16 and grouped.dtype == torch.int32 and grouped.is_contiguous()
    r = a.shape[0]
    assert d.shape == (r, b.shape[1])
    d.fill_(float("nan"))  # rows outside every group hold garbage
    if use_psum_layout:
        assert grouped.shape == (b.shape[0],) and expected_m_for_psum_layout >= 1
        start = 0
        for g, end in enumerate(grouped.tolist()):
            assert start % ALIGN == 0 and start <= end <= r
            d[start:end] = (a[start:end] @ b[g].t()).to(d.dtype)
            start = -(-end // ALIGN) * ALIGN
    else:
        assert grouped.shape == (r,) and expected_m_for_psum_layout is None
        # each row with group g >= 0 gets a[row] @ b[g]^T: one GEMM per group over its rows (a
        # Python loop over rows made the CPU tests of the m-indices layout spend seconds here)
        for g in grouped[grouped >= 0].unique().tolist():
            rows = torch.nonzero(grouped == g).reshape(-1)
            d[rows] = (a[rows] @ b[g].t()).to(d.dtype)


MASKED_BLOCK = 64  # a BLOCK_M DeepGEMM's sm90 heuristic picks for masked GEMMs


def _masked(a, b, d, masked_m, expected_m):
    """As DeepGEMM's sm90 kernel: whole BLOCK_M row blocks over the (G * T) rows its 2-D TMA
    descriptors see, so a block that runs past T reads and overwrites the next group's rows.
    Groups go last to first, so such a spill lands after the next group wrote its rows."""
    _k_major(a)
    g, t, k = a.shape
    assert d.is_contiguous() and d.dtype == torch.bfloat16 and d.shape == (g, t, b.shape[1])
    assert masked_m.dtype == torch.int32 and masked_m.shape == (g,) and 1 <= expected_m
    d.fill_(float("nan"))
    a2, d2 = a.reshape(g * t, k), d.view(g * t, -1)
    for j in reversed(range(g)):
        for r0 in range(j * t, j * t + int(masked_m[j]), MASKED_BLOCK):
            r1 = min(r0 + MASKED_BLOCK, g * t)
            d2[r0:r1] = (a2[r0:r1] @ b[j].t()).to(d.dtype)


def fake_deep_gemm():
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "2.6.1 (test stand-in)"
    mod.get_mk_alignment_for_contiguous_layout = lambda: ALIGN

    def bf16_contiguous(a, b, d, grouped, **kw):
        assert a.dtype == b.dtype == torch.bfloat16
        _contiguous(a.float(), b.float(), d, grouped, **kw)

    def fp8_contiguous(a, b, d, grouped, **kw):
        _contiguous(_dequant_a(a, a[1]), _dequant_b(b), d, grouped, **kw)

    def bf16_masked(a, b, d, masked_m, expected_m):
        assert a.dtype == b.dtype == torch.bfloat16
        _masked(a.float(), b.float(), d, masked_m, expected_m)

    def fp8_masked(a, b, d, masked_m, expected_m):
        _masked(_dequant_a(a, a[1]), _dequant_b(b), d, masked_m, expected_m)

    mod.m_grouped_bf16_gemm_nt_contiguous = bf16_contiguous
    mod.m_grouped_fp8_gemm_nt_contiguous = fp8_contiguous
    mod.m_grouped_bf16_gemm_nt_masked = bf16_masked
    mod.m_grouped_fp8_gemm_nt_masked = fp8_masked
    return mod
