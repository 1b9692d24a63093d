"""DeepGEMM adapters on the CPU, without deep_gemm: the layout helpers against plain-Python
references, and both adapters end to end against the float64 reference with a stand-in module that
does DeepGEMM's grouped GEMMs in torch and asserts the operand layouts DeepGEMM 2.6.1's sm90 kernels
take without converting anything themselves (psum / m-indices grouped layouts, MN-major TMA-aligned
fp32 activation scales, contiguous (G, N/128, K/128) weight scales)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.deepgemm_standin import fake_deep_gemm
from moebench.correctness import is_correct, relative_error
from moebench.kernels.deepgemm import (
    BatchedDeepGemmExperts,
    DeepGemmExperts,
    grouped_layout,
    masked_rows,
    masked_rows_per_group,
    mn_major_scales,
    mn_major_strides,
    tma_aligned,
)
from moebench.kernels.triton.align import moe_align_block_size, pair_rows
from moebench.kernels.modular import FusedMoEKernel
from moebench.kernels.reference import reference_moe
from moebench.backends import check_combination, make_prepare_finalize
from moebench.quant import QuantScheme, quantize_weights

BLOCK = QuantScheme("fp8_w8a8", "block", (128, 128))


# ---------------------------------------------------------------------------------------------
# Layout helpers


def test_tma_aligned():
    assert [tma_aligned(n) for n in (1, 4, 5, 77, 128)] == [4, 4, 8, 80, 128]
    assert tma_aligned(5, element_size=2) == 8


@pytest.mark.parametrize("shape", [(77, 3), (4, 16), (1, 1), (6, 77, 2), (3, 8, 5)])
def test_mn_major_scales(shape):
    s = torch.rand(shape)
    out = mn_major_scales(s)
    assert torch.equal(out, s)
    r, g = shape[-2], shape[-1]
    ra = -(-r // 4) * 4
    want = (1, ra) if len(shape) == 2 else (ra * g, 1, ra)
    assert out.stride() == want == mn_major_strides(shape)
    assert mn_major_scales(out) is out  # already in DeepGEMM's layout: no copy


def test_mn_major_scales_refuses_other_dtypes():
    from moebench.errors import MoebenchError

    with pytest.raises(MoebenchError, match="float32"):
        mn_major_scales(torch.rand(4, 2).half())


def _reference_layout(local: torch.Tensor, e: int, align: int):
    """Plain-Python contiguous layout: per group, its pairs in flat order, runs aligned. Returns
    (each pair's row or None when remote, each group's end row, each used row's group or -1)."""
    flat = local.reshape(-1).tolist()
    dest = [None] * len(flat)
    group_of_row = []
    ends = []
    for g in range(e):
        members = [p for p, x in enumerate(flat) if x == g]
        start = len(group_of_row)
        for j, p in enumerate(members):
            dest[p] = start + j
        ends.append(start + len(members))
        run = -(-len(members) // align) * align
        group_of_row += [g] * len(members) + [-1] * (run - len(members))
    return dest, ends, group_of_row


@pytest.mark.parametrize("m,k,e,align,seed", [(1, 1, 1, 4, 0), (9, 2, 5, 4, 1), (30, 4, 8, 16, 2), (3, 8, 16, 128, 3),
                                              (300, 8, 6, 16, 4)])
def test_grouped_layout_and_pair_rows_match_reference(m, k, e, align, seed):
    # DeepGEMM's contiguous layout read off the block alignment (moe_align_block_size with DeepGEMM's
    # row alignment as the block): psum ends, m-indices, and each pair's row for the top-k sum
    g = torch.Generator().manual_seed(seed)
    local = torch.randint(-1, e, (m, k), generator=g, dtype=torch.int32)  # -1: remote (EP)
    al = moe_align_block_size(local, align, e)
    rows = al.sorted_token_ids.numel()
    dest, ends, group_of_row = _reference_layout(local, e, align)
    used = len(group_of_row)
    assert int(al.num_tokens_post_padded) == used and used <= rows
    psum = grouped_layout(al, local, e)
    assert psum.dtype == torch.int32 and psum.tolist() == ends
    idx = grouped_layout(al, local, e, "indices")
    assert idx.dtype == torch.int32 and idx.shape == (rows,)
    assert idx[:used].tolist() == group_of_row and (idx[used:] == -1).all()
    inv = pair_rows(al, rows)
    assert inv.dtype == torch.int32 and inv.tolist() == [rows if d is None else d for d in dest]


def test_masked_rows_per_group_are_whole_blocks():
    assert [masked_rows_per_group(t) for t in (1, 16, 128, 129, 1024)] == [128, 128, 128, 256, 1024]


def test_masked_rows_matches_reference():
    counts = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    t = 5
    want = [g * t + j for g in range(4) for j in range(int(counts[g]))]
    assert masked_rows(counts, t, len(want)).tolist() == want
    assert masked_rows(counts, t, len(want) + 3).tolist() == want + [4 * t] * 3  # sink slots
    assert masked_rows(torch.tensor([9, 2]), 4, 6).tolist() == [0, 1, 2, 3, 4, 5]  # counts clamp to T


# ---------------------------------------------------------------------------------------------
# A stand-in deep_gemm: DeepGEMM's grouped GEMMs in torch, with its operand checks


def _problem(m, e, k, h, i, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    logits = torch.randn(m, e, generator=g)
    tw, ti = torch.softmax(logits, -1).topk(k, -1)
    return x, w13, w2, (tw / tw.sum(-1, keepdim=True)), ti.to(torch.int32)


_ADAPTER_PROBLEMS: dict = {}


def _adapter_problem(m, ep, quant):
    """The inputs, quantised weights and float64 reference of one (m, ep, quant) point, made once
    for the four adapter cases that run it (the adapters only read them)."""
    key = (m, ep, quant)
    if key not in _ADAPTER_PROBLEMS:
        e, k, h, i = 6, 2, 256, 128
        x, w13, w2, tw, ti = _problem(m, e, k, h, i, seed=m)
        emap = None
        if ep:  # this rank holds experts 2..4 of 6
            emap = torch.full((e,), -1, dtype=torch.int32)
            emap[2:5] = torch.arange(3, dtype=torch.int32)
            w13, w2 = w13[2:5], w2[2:5]
        qw13, qw2 = quantize_weights(w13, w2, quant)
        ref = reference_moe(x, qw13, qw2, tw, ti, emap)
        _ADAPTER_PROBLEMS[key] = (x, qw13, qw2, tw, ti, emap, ref)
    return _ADAPTER_PROBLEMS[key]


CASES = [  # (experts, prepare/finalize, experts kwargs)
    ("deepgemm", "no-dpep", {"layout": "psum"}),
    ("deepgemm", "no-dpep", {"layout": "indices"}),
    ("batched-deepgemm", "batched-local", {}),
]


@pytest.mark.parametrize("quant", [None, BLOCK], ids=["bf16", "fp8-block"])
@pytest.mark.parametrize("ep", [False, True], ids=["all-local", "ep-shard"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2].get('layout', 'masked')}")
@pytest.mark.parametrize("m", [1, 37, 128])
def test_adapters_match_reference(monkeypatch, case, ep, quant, m):
    monkeypatch.setitem(__import__("sys").modules, "deep_gemm", fake_deep_gemm())
    ex_name, pf_name, kw = case
    e = 6
    x, qw13, qw2, tw, ti, emap, ref = _adapter_problem(m, ep, quant)
    experts = DeepGemmExperts(**kw) if ex_name == "deepgemm" else BatchedDeepGemmExperts(**kw)
    kernel = FusedMoEKernel(make_prepare_finalize(pf_name), experts)
    out = kernel.apply(x, qw13, qw2, tw, ti, emap, e)
    err = relative_error(out, ref)
    assert out.shape == (m, 256) and is_correct(err, torch.bfloat16, quant), err


def test_deepgemm_refuses_what_it_cannot_run(monkeypatch):
    from moebench.errors import MoebenchError, UnsupportedError

    monkeypatch.setitem(__import__("sys").modules, "deep_gemm", fake_deep_gemm())
    with pytest.raises(MoebenchError, match="layout"):
        DeepGemmExperts(layout="rows")
    x, w13, w2, tw, ti = _problem(4, 4, 2, 256, 96, seed=0)  # I = 96: not whole 64-column K blocks
    kernel = FusedMoEKernel(make_prepare_finalize("no-dpep"), DeepGemmExperts())
    with pytest.raises(UnsupportedError, match="divisible by 64"):
        kernel.apply(x, w13, w2, tw, ti)
    tok = QuantScheme("fp8_w8a8", "token")
    assert "block[128,128]" in DeepGemmExperts.quant_unavailable_reason("cuda", tok)
    other = QuantScheme("fp8_w8a8", "block", (64, 128))
    assert "block[128,128]" in BatchedDeepGemmExperts.quant_unavailable_reason("cuda", other)


def test_capabilities_are_declared():
    assert DeepGemmExperts.supported_quant == BatchedDeepGemmExperts.supported_quant == ("block",)
    assert DeepGemmExperts.supported_dtypes == (torch.bfloat16,)
    assert "does not run on cpu" in check_combination("no-dpep", "deepgemm", "cpu")
    reason = check_combination("batched-local", "batched-deepgemm", "cuda")
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        assert reason is not None and "deep_gemm" in reason
