"""`triton` and `batched-triton` experts and the block alignment, against the float64 reference.

Runs under the Triton interpreter on CPU (tests/conftest.py), so shapes are small and blocks big;
the shapes are deliberately odd (H=72, I=40: not multiples of any block) and E=20 with top-4.
One test per code path: each names the path it checks through a TritonOptions (or the launcher's
resolved flags); the rules that pick the paths are tested as the pure functions they are.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton

import moebench
from helpers import random_expert_map, rel_err
from moebench.errors import MoebenchError
from moebench.kernels.modular import ExpertBias, TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOp, poisoned_outputs
from moebench.kernels.triton import align as A
from moebench.kernels.triton import configs as C
from moebench.kernels.triton.align import (
    direct_align,
    max_padded_size,
    moe_align_block_size,
    moe_align_block_size_torch,
    token_rows_align,
)
from moebench.kernels.triton.batched import batched_default_config
from moebench.kernels.triton import experts as X
from moebench.kernels.triton.experts import BatchedTritonExperts, TritonExperts, fused_moe
from moebench.kernels.triton.launch import fused_moe_gemms, launch_gemm1, sorted_rows, topk_sum
from moebench.kernels.triton.options import (
    Gemm1Plan,
    TritonOptions,
    align_kernels,
    choose_split_k,
    ctas_per_sm,
    expected_blocks,
    gemm1_walk,
    layer_split_k,
    plan_layer,
    resolve_pair_store,
    resolve_pdl,
    resolve_swap_ab,
    resolve_use_tma,
    use_pair_store,
    use_sorted_a,
    wants_direct_align,
    wants_token_rows,
    wave_split,
)
from moebench.kernels.triton.common import pdl_launch_args
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.quant import QuantScheme
from moebench.tuning import files as F
from moebench.kernels import tuned_files as TF

H, I, E, K = 72, 40, 20, 4
CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
#: One program along each GEMM's N (GEMM1's 64 gate + 64 up columns >= I, GEMM2's 128 >= H), for
#: the tests whose subject is a rule that picks a path, or the config lookup, not the tiling: the
#: interpreter's time goes with the programs run. The tests of each path run CFG's two N tiles.
ONE_TILE = dict(CFG, BLOCK_SIZE_N=128)
#: Forces the alignment's two-launch kernels at any pair count.
TWO_LAUNCHES = TritonOptions(one_launch_max_pairs=0)


def _weights(e: int, dtype: torch.dtype, h: int = H, i: int = I, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(DEV, dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(DEV, dtype)
    return w13, w2


def _routing(m: int, e: int, k: int, seed: int = 1, first: int | None = None):
    """Softmax top-k of random logits; `first`: every token's first choice (its other k - 1 differ)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, e, generator=g)
    if first is not None:
        logits[:, first] += 100.0
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return w.to(DEV), ids.to(DEV, torch.int32)


def _x(m: int, dtype: torch.dtype, h: int = H, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, h, generator=g).to(DEV, dtype)


def _run(experts: str, pf: str, x, w13, w2, tw, ti, expert_map=None, num_experts=None, **kw):
    kernel = moebench.make_kernel(experts, pf, experts_kwargs=kw)
    with poisoned_outputs():
        return kernel.apply(x, w13, w2, tw, ti, expert_map=expert_map, num_experts=num_experts)


def _uneven_routing(m: int, e: int, counts: dict[int, int], seed: int = 3):
    """(topk_weights, topk_ids) (m, 2): expert j in counts gets exactly counts[j] pairs (first
    choices); every other pair goes to the other experts: blocks of every fill level."""
    g = torch.Generator().manual_seed(seed)
    first = torch.cat([torch.full((c,), j) for j, c in counts.items()])
    others = torch.tensor([j for j in range(e) if j not in counts])
    first = torch.cat([first, others[torch.randint(len(others), (m - len(first),), generator=g)]])
    second = others[torch.randint(len(others), (m,), generator=g)]
    clash = second == first  # a token's two experts differ
    second[clash] = others[(torch.searchsorted(others, second[clash]) + 1) % len(others)]
    ids = torch.stack([first, second], 1).to(torch.int32)
    w = torch.softmax(torch.randn(m, 2, generator=g), -1)
    return w.to(DEV), ids.to(DEV)


# ---------------------------------------------------------------------------------------------
# Options and the rules that resolve them (pure functions: no kernel runs)


def test_options_are_frozen_and_validated():
    opts = TritonOptions()
    with pytest.raises(Exception):
        opts.use_tma = False  # type: ignore[misc]
    for bad in (dict(use_tma="yes"), dict(sorted_a=None), dict(align_method="bubble"), dict(pdl_max_inter=-1)):
        with pytest.raises(MoebenchError, match="TritonOptions"):
            TritonOptions(**bad)


def test_gemm_path_rules():
    o = TritonOptions()
    big, mid = dict(CFG, BLOCK_SIZE_M=128), dict(CFG, BLOCK_SIZE_M=32)
    # TMA: 16-bit with BLOCK_SIZE_M >= 32
    assert resolve_use_tma(o, mid, torch.bfloat16) and not resolve_use_tma(o, CFG, torch.bfloat16)
    assert not resolve_use_tma(o, big, torch.float32)
    assert resolve_use_tma(TritonOptions(use_tma=True), CFG, torch.float32)
    # GEMM1's walk: wide from 64-row tiles when unquantised, for fp8 from 128 pairs per expert (block
    # scales) or 32 (tensor, token scales; fields); sorted_a from 512 pairs per expert (256 where I >= 4096), with TMA only
    assert gemm1_walk(o, CFG, torch.bfloat16, None, False, 768, 1) == (False, False)
    assert gemm1_walk(o, big, torch.bfloat16, None, True, 768, 256) == (True, False)
    assert gemm1_walk(o, big, torch.bfloat16, None, True, 768, 512) == (True, True)
    assert gemm1_walk(o, big, torch.bfloat16, None, False, 768, 512) == (True, False)  # no TMA: no sorted_a
    block, tensor = QuantScheme("fp8_w8a8", "block", (128, 128)), QuantScheme("fp8_w8a8", "tensor")
    f8 = torch.float8_e4m3fn
    assert gemm1_walk(o, big, f8, tensor, True, 768, 32) == (True, False)  # per-tensor fp8: wide from 32
    assert gemm1_walk(o, big, f8, tensor, True, 768, 16) == (False, False)
    assert gemm1_walk(o, big, f8, QuantScheme("fp8_w8a8", "token"), True, 768, 32) == (True, False)
    assert gemm1_walk(o, big, torch.bfloat16, QuantScheme("int4_w4a16", group_size=128), True, 768, 512) == (False, False)
    assert gemm1_walk(o, big, f8, block, True, 768, 128) == (True, False)  # block fp8: wide, never sorted_a
    assert gemm1_walk(o, big, f8, block, True, 768, 64) == (False, False)
    assert gemm1_walk(o, CFG, f8, block, True, 768, 512) == (False, False)  # 16-row tiles
    assert gemm1_walk(TritonOptions(wide_fp8_block_min_rows=64), big, f8, block, True, 768, 64) == (True, False)
    assert gemm1_walk(TritonOptions(wide_fp8_tensor_min_rows=64), big, f8, tensor, True, 768, 32) == (False, False)
    # sorted_a implies the wide walk; an "auto" sorted_a yields to wide_gemm1=False, a True raises
    assert gemm1_walk(TritonOptions(sorted_a=True), mid, torch.bfloat16, None, True, 8, 1) == (True, True)
    assert gemm1_walk(TritonOptions(wide_gemm1=False), big, torch.bfloat16, None, True, 768, 4096) == (False, False)
    with pytest.raises(MoebenchError, match="sorted_a"):
        gemm1_walk(TritonOptions(sorted_a=True, wide_gemm1=False), big, torch.bfloat16, None, True, 768, 4096)
    with pytest.raises(MoebenchError, match="sorted_a"):
        gemm1_walk(TritonOptions(sorted_a=True), big, torch.bfloat16, None, False, 768, 4096)
    with pytest.raises(MoebenchError, match="sorted_a"):
        gemm1_walk(TritonOptions(sorted_a=True), big, f8, block, True, 768, 4096)
    # the sorted_a rule's thresholds are fields
    assert use_sorted_a(o, big, torch.bfloat16, 14336, 256) and use_sorted_a(o, big, torch.float16, 2048, 1024)
    assert not use_sorted_a(o, big, torch.bfloat16, 2048, 256)  # DeepSeek-V3 local 1024 tokens: a loss
    assert not use_sorted_a(o, big, torch.bfloat16, 14336, 64) and not use_sorted_a(o, big, torch.float32, 14336, 1024)
    assert not use_sorted_a(o, CFG, torch.bfloat16, 14336, 1024)  # 16-row tiles
    assert use_sorted_a(TritonOptions(sorted_a_min_rows=1), big, torch.bfloat16, 768, 1)
    # PDL: never off CUDA / under the interpreter, whatever is asked
    for pdl in (True, "auto"):
        assert not resolve_pdl(TritonOptions(pdl=pdl), torch.device("cpu"), 768)
    assert pdl_launch_args(False) == {} and pdl_launch_args(True) == {"PDL": True, "launch_pdl": True}


def test_pair_store_rules():
    o = TritonOptions()
    # "auto": short GEMM2 K loops (I <= 1024) at >= 32 pairs per expert, all pairs local, no K split
    assert use_pair_store(o, 192, 32, False) and use_pair_store(o, 1024, 4096, False)
    assert not use_pair_store(o, 192, 31, False) and not use_pair_store(o, 2048, 4096, False)
    assert not use_pair_store(o, 192, 4096, True)  # an expert map: remote pairs leave rows unwritten
    assert resolve_pair_store(o, 192, 4096, False, 1) and not resolve_pair_store(o, 192, 4096, False, 2)
    assert use_pair_store(TritonOptions(pair_store_max_inter=2048, pair_store_min_rows=1), 2048, 1, False)
    # forced: on / off whatever the shape; on with a K split raises
    assert resolve_pair_store(TritonOptions(pair_store=True), 4096, 1, True, 1)
    assert not resolve_pair_store(TritonOptions(pair_store=False), 192, 4096, False, 1)
    with pytest.raises(MoebenchError, match="pair_store"):
        resolve_pair_store(TritonOptions(pair_store=True), 192, 4096, False, 2)


def test_swap_ab_rules():
    # fp8 without TMA only; "auto" = block scales on 16-row tiles >= swap_ab_min_cols (128) wide
    block, token = QuantScheme("fp8_w8a8", "block", (128, 128)), QuantScheme("fp8_w8a8", "token")
    cfg = lambda bm, bn: dict(CFG, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn)  # noqa: E731
    auto = TritonOptions()
    assert resolve_swap_ab(auto, cfg(16, 128), block, False) and resolve_swap_ab(auto, cfg(16, 256), block, False)
    assert not resolve_swap_ab(auto, cfg(16, 64), block, False) and not resolve_swap_ab(auto, cfg(32, 128), block, False)
    assert not resolve_swap_ab(auto, cfg(16, 128), token, False) and not resolve_swap_ab(auto, cfg(16, 128), block, True)
    assert resolve_swap_ab(TritonOptions(swap_ab_min_cols=64), cfg(16, 64), block, False)
    assert resolve_swap_ab(TritonOptions(swap_ab=True), cfg(64, 128), token, False)
    assert not resolve_swap_ab(TritonOptions(swap_ab=True), cfg(16, 64), None, False)  # 16-bit: not an fp8 GEMM
    assert not resolve_swap_ab(TritonOptions(swap_ab=False), cfg(16, 128), block, False)


def test_use_tma_rules():
    # "auto": 16-bit x from 32-row tiles, fp8 x at tma_fp8_min_rows..tma_fp8_max_rows (64); True / False as given
    auto = TritonOptions()
    cfg = lambda bm: dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1)  # noqa: E731
    fp8 = torch.float8_e4m3fn
    assert resolve_use_tma(auto, cfg(32), torch.bfloat16) and not resolve_use_tma(auto, cfg(16), torch.bfloat16)
    assert resolve_use_tma(auto, cfg(64), fp8) and not resolve_use_tma(auto, cfg(32), fp8)
    assert not resolve_use_tma(auto, cfg(128), fp8) and resolve_use_tma(auto, cfg(128), torch.bfloat16)
    assert resolve_use_tma(TritonOptions(tma_fp8_max_rows=128), cfg(128), fp8)
    assert not resolve_use_tma(auto, cfg(128), torch.float32)
    assert resolve_use_tma(TritonOptions(use_tma=True), cfg(16), fp8)
    assert not resolve_use_tma(TritonOptions(use_tma=False), cfg(128), fp8)
    assert not resolve_use_tma(TritonOptions(tma_fp8_min_rows=128), cfg(64), fp8)


def test_alignment_rules():
    o = TritonOptions()
    tensor, token = QuantScheme("fp8_w8a8", "tensor"), QuantScheme("fp8_w8a8", "token")
    block = QuantScheme("fp8_w8a8", "block", (128, 128))
    # one token: always, but for an expert map with a quantisation launch between the GEMMs
    for scheme in (None, tensor, token, block):
        assert wants_direct_align(o, 1, 8, 128, scheme) and wants_direct_align(o, 1, 2, 4, scheme)
    assert wants_direct_align(o, 1, 8, 256, mapped=True) and wants_direct_align(o, 1, 8, 256, tensor, mapped=True)
    assert not wants_direct_align(o, 1, 8, 256, block, mapped=True) and not wants_direct_align(o, 1, 8, 256, token, mapped=True)
    # more tokens: up to a quarter as many pairs as global experts, without an expert map
    for scheme in (None, tensor, token, block):
        assert wants_direct_align(o, 4, 8, 128, scheme) and not wants_direct_align(o, 5, 8, 128, scheme)
        assert wants_direct_align(o, 8, 8, 256, scheme) and not wants_direct_align(o, 2, 8, 256, scheme, mapped=True)
    assert not wants_direct_align(o, 2, 2, 8) and wants_direct_align(o, 12, 10, 512) and not wants_direct_align(o, 13, 10, 512)
    assert not wants_direct_align(o, 0, 8, 256) and not wants_direct_align(o, 0, 8, 256, block)
    assert wants_direct_align(TritonOptions(direct_max_fill=0.5), 8, 8, 128, block)
    assert wants_direct_align(TritonOptions(direct_align=True), 9, 8, 128, token)
    assert not wants_direct_align(TritonOptions(direct_align=False), 1, 8, 128)
    # one launch up to 1024 pairs; above, sort from 2^20 experts x pairs
    assert align_kernels(o, 128, 1024) == "one_launch" and align_kernels(o, 8, 1025) == "scan"
    assert align_kernels(o, 128, 32768) == "sort" and align_kernels(TWO_LAUNCHES, 4, 10) == "scan"
    assert align_kernels(TritonOptions(one_launch_max_pairs=0, align_method="sort"), 4, 10) == "sort"


def test_choose_split_k():
    o = TritonOptions()
    cfg = dict(CFG, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128)
    # Mixtral M=1: 2 blocks x 64 hidden tiles on 132 SMs -> split; big grids -> no split.
    assert choose_split_k(o, 2, 4096, 14336, cfg, 132) == 2
    assert choose_split_k(o, 100, 4096, 14336, cfg, 132) == 1
    assert choose_split_k(o, 1, 4096, 256, cfg, 132) == 1  # too little K to split


def test_wave_split_rule():
    # The wave rule: the prefill tile, one program per SM on 132 SMs.
    o = TritonOptions()
    big = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=4)
    assert ctas_per_sm(big) == 1 and ctas_per_sm(dict(big, BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, num_warps=4)) == 2
    # 256 pairs per expert on 128-row blocks: 2 full blocks and half a block of padding each
    assert expected_blocks(2048, 8, 128) == 20 and expected_blocks(8, 8, 128) == pytest.approx(8 * (1 - 2.718281828**-1))
    # 320 programs of 224 steps: 3 waves (the last 40% full) -> 2 splits, 5 waves of 112 + 7 steps
    assert wave_split(320, 224, 132, 8, 7) == 2
    assert wave_split(264, 224, 132, 8, 7) == 1  # two full waves: nothing to gain
    assert wave_split(2536, 12, 132, 8, 7) == 1  # short K: the per-tile overhead outweighs the idle SMs
    mixtral = (8, 8, 4096, 14336)  # E, E local, H, I; top-2
    split = lambda m, e, el, h, i, k=2, opts=o: layer_split_k(opts, m, k, e, el, h, i, big, 10**6, 132)  # noqa: E731
    assert split(1024, *mixtral) == 2
    assert split(1024, *mixtral, opts=TritonOptions(wave_tile_overhead_steps=200)) == 1  # the fitted cost moves it
    assert split(4096, *mixtral) == 1  # 68 blocks x 16 tiles: 8.2 waves, < 3% to gain
    assert split(256, *mixtral) == 1  # 64 pairs per expert: below a block, not compute-bound
    assert split(4096, 128, 128, 2048, 768, k=8) == 1  # Qwen3-30B-A3B: K = 12 steps
    assert split(1024, 32, 32, 7168, 2048, k=8) == 1  # DeepSeek-V3's 32 experts: 17 waves


# ---------------------------------------------------------------------------------------------
# Alignment


@pytest.mark.parametrize("m,k,e,bm,use_map", [(37, 4, 20, 16, True), (9, 2, 5, 32, False)])
def test_align_matches_torch(m, k, e, bm, use_map):
    e_global = 2 * e if use_map else e
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, e_global, (m, k), generator=g).to(DEV)
    emap = random_expert_map(e_global, e, DEV) if use_map else None
    b = moe_align_block_size_torch(ids, bm, e, emap)
    # Several chunks per expert: 4 (the interpreter's time grows with experts x chunks).
    several = max(16, triton.next_power_of_2(m * k) // 4)
    results = [moe_align_block_size(ids, bm, e, emap)]  # one launch, every program counts all pairs
    for method in ("scan", "sort"):
        for chunk in (None, several):  # one chunk or several (sort: each chunk sorted)
            opts = TritonOptions(one_launch_max_pairs=0, align_method=method)
            results.append(moe_align_block_size(ids, bm, e, emap, options=opts, chunk=chunk))
    for a in results:
        assert torch.equal(a.sorted_token_ids, b.sorted_token_ids) and torch.equal(a.expert_ids, b.expert_ids)
        assert torch.equal(a.num_tokens_post_padded, b.num_tokens_post_padded)
    # Invariants: every local pair exactly once, in its expert's blocks; the rest sentinel.
    a = results[0]
    local = emap.long()[ids.long()] if use_map else ids.long()
    total = int(a.num_tokens_post_padded.item())
    assert total % bm == 0 and a.sorted_token_ids.numel() == max_padded_size(m * k, e, bm)
    s = a.sorted_token_ids[:total].long().cpu()
    real = s[s < m * k]
    want = torch.nonzero(local.reshape(-1).cpu() >= 0).reshape(-1)
    assert torch.equal(torch.sort(real).values, want)
    blk_expert = a.expert_ids[: total // bm].long().cpu().repeat_interleave(bm)
    flat = local.reshape(-1).cpu()
    ok = s < m * k
    assert torch.equal(flat[s[ok]], blk_expert[ok])
    assert (a.sorted_token_ids[total:] == m * k).all() and (a.expert_ids[total // bm :] == -1).all()


def test_align_all_remote_and_empty():
    ids = torch.zeros((3, 2), dtype=torch.int32, device=DEV)
    emap = torch.full((4,), -1, dtype=torch.int32, device=DEV)
    emap[3] = 0
    for opts in (None, TWO_LAUNCHES):
        a = moe_align_block_size(ids, 16, 1, emap, options=opts)
        assert a.num_tokens_post_padded.item() == 0
        assert (a.sorted_token_ids == 6).all() and (a.expert_ids == -1).all()
    z = moe_align_block_size(torch.zeros((0, 2), dtype=torch.int32, device=DEV), 16, 4)
    assert z.num_tokens_post_padded.item() == 0 and z.sorted_token_ids.numel() == 0


def test_direct_align_layout():
    ids = torch.tensor([[5, 2], [2, 7]], dtype=torch.int32, device=DEV)
    a = direct_align(ids, 4)
    s = torch.full((4, 4), 4, dtype=torch.int32)
    s[:, 0] = torch.arange(4)
    assert torch.equal(a.sorted_token_ids.cpu(), s.reshape(-1))
    assert a.expert_ids.tolist() == [5, 2, 2, 7] and a.num_tokens_post_padded.tolist() == [16]
    emap = torch.full((8,), -1, dtype=torch.int32, device=DEV)
    emap[2], emap[7] = 0, 1
    # The GEMMs map the global ids themselves (no launch here).
    mapped = direct_align(ids, 4, emap)
    assert mapped.expert_ids.tolist() == [5, 2, 2, 7] and torch.equal(mapped.expert_map, emap)


def test_direct_align_caches_only_small_layouts():
    A._DIRECT_LAYOUTS.clear()
    a = direct_align(torch.zeros((1, 8), dtype=torch.int32, device=DEV), 16)
    assert direct_align(torch.ones((1, 8), dtype=torch.int32, device=DEV), 16).sorted_token_ids is a.sorted_token_ids
    big = direct_align(torch.zeros((512, 8), dtype=torch.int32, device=DEV), 32)  # 4096 pairs x 32 rows
    assert len(A._DIRECT_LAYOUTS) == 1 and big.num_tokens_post_padded.item() == 4096 * 32


# ---------------------------------------------------------------------------------------------
# triton (Standard): one test per code path of the GEMMs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(dtype):
    # paired walk, pointer loads, K tails in both GEMMs (H=72, I=40 against BLOCK_SIZE_K 64)
    m = 13
    w13, w2 = _weights(E, dtype)
    x = _x(m, dtype)
    tw, ti = _routing(m, E, K)
    out = _run("triton", "no-dpep", x, w13, w2, tw, ti, config=CFG)
    assert out.dtype == dtype and out.shape == (m, H)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]


def test_triton_weight_and_reduce_is_noop():
    assert isinstance(TritonExperts().weight_and_reduce(), TopKWeightAndReduceNoOp)


@pytest.mark.parametrize("experts,pf", [("triton", "no-dpep"), ("batched-triton", "batched-local")])
def test_zero_tokens(experts, pf):
    w13, w2 = _weights(E, torch.bfloat16)
    out = _run(experts, pf, _x(0, torch.bfloat16), w13, w2, *_routing(0, E, K), config=CFG)
    assert out.shape == (0, H)


def test_triton_all_tokens_on_one_expert_split_k_groups():
    # Every token's top-1 is expert 7 (60 experts, K=1): one long run of blocks; BLOCK_SIZE_K=16
    # with split_k=2 exercises uneven K splits of GEMM2; GROUP_SIZE_M=4 the grouped order.
    dtype = torch.float32
    w13, w2 = _weights(E, dtype)
    m = 40
    x = _x(m, dtype)
    ti = torch.full((m, 1), 7, dtype=torch.int32, device=DEV)
    tw = torch.rand(m, 1, device=DEV)
    cfg = dict(CFG, BLOCK_SIZE_K=16, BLOCK_SIZE_M=16, GROUP_SIZE_M=4)
    out = _run("triton", "no-dpep", x, w13, w2, tw, ti, config=cfg, split_k=2)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]


def test_triton_expert_map_remote_through_tma():
    # 20 global experts, 8 here; token 0 routes only to remote experts -> its row must be zero.
    # 32-row bf16 tiles: the weight tiles through TMA ("auto"), emulated by the interpreter.
    dtype = torch.bfloat16
    e_local = 8
    emap = random_expert_map(E, e_local, DEV)
    w13, w2 = _weights(e_local, dtype)
    m = 11
    x = _x(m, dtype)
    tw, ti = _routing(m, E, K)
    remote = torch.nonzero(emap.cpu() < 0).reshape(-1)[:K].to(DEV, torch.int32)
    ti[0] = remote
    cfg = dict(CFG, BLOCK_SIZE_M=32, BLOCK_SIZE_K=32)
    assert resolve_use_tma(TritonOptions(), cfg, dtype)
    out = _run("triton", "no-dpep", x, w13, w2, tw, ti, expert_map=emap, config=cfg)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    assert rel_err(out, ref) < TOL[dtype]
    assert (out[0] == 0).all()


def test_triton_default_config_path():
    # No explicit config: lookup -> default heuristic (no tuned file for this shape on CPU); H = I
    # = 64 are multiples of its blocks: the loads without K masks (EVEN_K) in both GEMMs.
    dtype = torch.bfloat16
    w13, w2 = _weights(8, dtype, h=64, i=64)
    x = _x(5, dtype, h=64)
    tw, ti = _routing(5, 8, 2)
    experts = TritonExperts()
    kernel = moebench.FusedMoEKernel(moebench.make_kernel("triton", "no-dpep").prepare_finalize, experts)
    with poisoned_outputs():
        out = kernel.apply(x, w13, w2, tw, ti)
    assert experts.last_config_source == "default heuristic"
    cfg = C.default_config(5, 8, 64, 64, 2, dtype)
    assert 64 % cfg["BLOCK_SIZE_K"] == 0 and cfg["BLOCK_SIZE_K"] == 64
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]


@pytest.mark.parametrize("m,use_map,split_k", [(3, True, 2), (5, False, 1)])
def test_triton_direct_align_matches_reference(m, use_map, split_k):
    # Forced direct: pairs sharing an expert (m=5 over 6 experts: the weights are read once per
    # pair, the result must not change), with a map remote experts skipped and a token all remote,
    # global ids mapped in the GEMMs, GEMM2 split over K.
    dtype = torch.float32
    e_global, e_local = (E, 8) if use_map else (6, 6)
    emap = random_expert_map(e_global, e_local, DEV) if use_map else None
    w13, w2 = _weights(e_local, dtype)
    x = _x(m, dtype)
    tw, ti = _routing(m, e_global, K)
    if use_map:
        ti[1] = torch.nonzero(emap.cpu() < 0).reshape(-1)[:K].to(DEV, torch.int32)  # token 1: all remote
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    with poisoned_outputs():
        out = fused_moe(x, w13, w2, tw, ti, emap, e_global, CFG, split_k, options=TritonOptions(direct_align=True))
    assert rel_err(out, ref) < TOL[dtype]
    if use_map:
        assert (out[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_direct_align_auto_rule(dtype, monkeypatch):
    # 16-bit layers take one block per pair for one token and, without an expert map, up to a
    # quarter as many pairs as global experts (32 experts, top-4: 2 tokens yes, 3 no; with a map
    # only one token): a spy on which alignment ran, the layer against the reference each time.
    calls = []
    real = A.direct_align
    monkeypatch.setattr(A, "direct_align", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    e_global = 32
    for m, e_local, want in ((1, 32, [1]), (2, 32, [2]), (3, 32, []), (1, 8, [1]), (2, 8, [])):
        calls.clear()
        emap = random_expert_map(e_global, e_local, DEV) if e_local < e_global else None
        w13, w2 = _weights(e_local, dtype)
        x = _x(m, dtype)
        tw, ti = _routing(m, e_global, K)
        out = _run("triton", "no-dpep", x, w13, w2, tw, ti, emap, e_global, config=ONE_TILE)
        assert calls == want, (m, e_local)
        assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti, emap)) < TOL[dtype]


def test_token_rows_layout():
    # One block per local expert, the routing itself as the rows' source, no launch; more tokens
    # than a block's rows are refused.
    ids = torch.tensor([[5, 2], [2, 7]], dtype=torch.int32, device=DEV)
    a = token_rows_align(ids, 16, 8)
    assert a.token_rows and a.max_blocks == 8 and a.expert_ids.tolist() == list(range(8))
    assert a.sorted_token_ids.tolist() == [5, 2, 2, 7] and a.num_tokens_post_padded.tolist() == [128]
    emap = random_expert_map(8, 4, DEV)
    mapped = token_rows_align(ids, 16, 4, emap)
    assert mapped.max_blocks == 4 and torch.equal(mapped.expert_map, emap) and mapped.remote
    with pytest.raises(MoebenchError, match="at most BLOCK_SIZE_M \\(4\\) tokens, got 5"):
        token_rows_align(torch.zeros((5, 2), dtype=torch.int32, device=DEV), 4, 8)


@pytest.mark.parametrize("m,use_map,split_k,dtype,with_bias,topk", [(5, False, 1, torch.float32, False, K),
                                                                    (16, True, 2, torch.bfloat16, False, K),
                                                                    (9, False, 1, torch.bfloat16, True, K),
                                                                    (7, True, 1, torch.float32, False, 3)])
def test_triton_token_rows_matches_reference(m, use_map, split_k, dtype, with_bias, topk):
    # Forced token rows against the reference: a token whose top-k repeats an expert (one row, the
    # router weights summed), with a map remote experts skipped and a token all remote, GEMM2 split
    # over K, the biases of both GEMMs; 16 tokens fill a 16-row block; a top-k that is not a power
    # of two (the routing tile's padded columns).
    e_global, e_local = (E, 8) if use_map else (6, 6)
    emap = random_expert_map(e_global, e_local, DEV) if use_map else None
    w13, w2 = _weights(e_local, dtype)
    x = _x(m, dtype)
    tw, ti = _routing(m, e_global, topk)
    ti[0, 1] = ti[0, 0]
    if use_map:
        ti[1] = torch.nonzero(emap.cpu() < 0).reshape(-1)[:topk].to(DEV, torch.int32)  # token 1: all remote
    bias = None
    if with_bias:
        g = torch.Generator().manual_seed(3)
        bias = ExpertBias(torch.randn(e_local, 2 * I, generator=g).to(DEV, dtype),
                          torch.randn(e_local, H, generator=g).to(DEV, dtype))
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap, bias=bias)
    with poisoned_outputs():
        out = fused_moe(x, w13, w2, tw, ti, emap, e_global, CFG, split_k,
                        options=TritonOptions(token_rows=True, direct_align=False), bias=bias)
    assert rel_err(out, ref) < TOL[dtype]
    if use_map:
        assert (out[1] == 0).all()


def test_triton_token_rows_auto_rule(monkeypatch):
    # Token rows where the direct alignment is not taken, the tokens fit one block and uniform
    # routing leaves few local experts idle in expectation. 16-bit, 8 experts (fewer than
    # token_rows_min_local), top-4: at most token_rows_max_idle (1); one token direct, 4 tokens
    # 8 x exp(-2) = 1.08 idle, 8 tokens 0.15, 16 tokens; 17 tokens the alignment kernels at 16-row
    # tiles, token rows at 32-row ones. 32 experts at 6 tokens: 15 idle, within
    # token_rows_max_idle_share (0.7 x 32), at 3 tokens 22 (0.69), past a share of 0.5. Not with
    # pair_store forced on or a lower idle bound; token_rows=True beside pair_store=True is refused.
    calls = []
    real = A.token_rows_align
    monkeypatch.setattr(A, "token_rows_align", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    dtype = torch.bfloat16
    for e, m, bm, opts, want in ((8, 1, 16, TritonOptions(), []), (8, 4, 16, TritonOptions(), []),
                                 (8, 8, 16, TritonOptions(), [8]), (8, 16, 16, TritonOptions(), [16]),
                                 (8, 17, 16, TritonOptions(), []), (8, 17, 32, TritonOptions(), [17]),
                                 (32, 6, 16, TritonOptions(), [6]), (32, 3, 16, TritonOptions(), [3]),
                                 (8, 8, 16, TritonOptions(pair_store=True), []),
                                 (8, 8, 16, TritonOptions(token_rows_max_idle=0.1), [])):
        calls.clear()
        w13, w2 = _weights(e, dtype)
        x = _x(m, dtype)
        tw, ti = _routing(m, e, K)
        out = fused_moe(x, w13, w2, tw, ti, None, e, dict(ONE_TILE, BLOCK_SIZE_M=bm), 1, options=opts)
        assert calls == want, (e, m, bm, opts)
        assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype], (e, m, bm)
    assert wants_token_rows(TritonOptions(), 8, K, 8, 8, 16)
    assert not wants_token_rows(TritonOptions(sorted_a=True), 8, K, 8, 8, 16)
    assert not wants_token_rows(TritonOptions(token_rows_max_idle_share=0.5), 3, K, 32, 32, 16)
    assert not wants_token_rows(TritonOptions(token_rows_min_local=64), 6, K, 32, 32, 16)
    # under EP the idle count is of the local experts, 16 tokens of top-4 over 64: 8 local x exp(-1)
    # = 2.9, 2 local 0.74, 16 local 5.9 (at least token_rows_min_local)
    assert not wants_token_rows(TritonOptions(), 16, K, 64, 8, 16) and wants_token_rows(TritonOptions(), 16, K, 64, 2, 16)
    assert wants_token_rows(TritonOptions(), 16, K, 64, 16, 16)
    # E 512 at 16 tokens of top-10: 374 idle, 73%; E 256 with 32 local (EP8) at 2 tokens of top-8: 94%
    assert not wants_token_rows(TritonOptions(), 16, 10, 512, 512, 16)
    assert not wants_token_rows(TritonOptions(), 2, 8, 256, 32, 16) and wants_token_rows(TritonOptions(), 16, 8, 256, 32, 16)
    # quantised weights: up to token_rows_quant_max_idle (4), whatever the expert count: 8 x exp(-1)
    # = 2.9 on, 16 local 5.9 off
    block = QuantScheme("fp8_w8a8", "block", (128, 128))
    assert wants_token_rows(TritonOptions(), 16, K, 64, 8, 16, block)
    assert not wants_token_rows(TritonOptions(), 16, K, 64, 16, 16, block)
    w13, w2 = _weights(8, dtype)
    x = _x(4, dtype)
    tw, ti = _routing(4, 8, K)
    with pytest.raises(MoebenchError, match="pair_store stores one row per pair"):
        fused_moe(x, w13, w2, tw, ti, None, 8, CFG, 1, options=TritonOptions(token_rows=True, pair_store=True))


def test_fp32_output_is_the_accumulator():
    # fp32 layers need no cast: GEMM2 adds into the output, which GEMM1 zeroes.
    w13, w2 = _weights(E, torch.float32)
    x = _x(5, torch.float32)
    tw, ti = _routing(5, E, K)
    align = moe_align_block_size(ti, 16, E)
    out = torch.full((5, H), float("nan"), device=DEV)
    got = fused_moe_gemms(x, w13, w2, tw, align, K, plan_layer(None, x, w13, w2, align, K, ONE_TILE), out=out)
    assert got is out
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[torch.float32]


def test_gemm1_zeroes_the_gemm2_accumulator():
    # A NaN-filled buffer comes back zeroed: larger than 1024 elements per program of the grid (6
    # programs here), so the grid-stride loop repeats, and not a multiple of 1024 (masked tail).
    m, numel = 40, 3 * 6 * 1024 + 17
    w13, w2 = _weights(2, torch.float32)
    x = _x(m, torch.float32)
    align = moe_align_block_size(torch.zeros((m, 1), dtype=torch.int32, device=DEV), 64, 2)
    acc = torch.full((numel,), float("nan"), device=DEV)
    inter = launch_gemm1(x, w13, align, 1, dict(CFG, BLOCK_SIZE_M=64), zero=acc)
    assert (acc == 0).all()
    assert inter.shape[0] // 64 * triton.cdiv(I, 32) == 6  # the grid size the comment assumes


def test_gemm1_walks_give_the_same_intermediate():
    # GEMM1's walks at 64-row fp16 tiles, some experts remote: paired (pointer loads, TMA weight
    # tiles), wide (pointer loads, the (2, BN, BK) TMA box, and with sorted_a the A tiles through
    # TMA from the sorted copy) give the same intermediate, row for row. I = 40 is not a multiple
    # of the 16-column halves (the last box reads rows past I: zeros, masked at the store), H = 72
    # leaves a K tail; full, part-filled and empty experts.
    dtype, bm, e = torch.float16, 64, 10
    tw, ti = _uneven_routing(3 * bm, e, {0: bm + bm // 4, 1: bm // 2, 2: 0})
    emap = random_expert_map(e, 6, DEV)
    w13, _ = _weights(6, dtype)
    x = _x(3 * bm, dtype)
    cfg = dict(CFG, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
    align = moe_align_block_size(ti, bm, 6, emap)
    used = int(align.num_tokens_post_padded)
    base = launch_gemm1(x, w13, align, 2, cfg)[:used].float()
    for kw in (dict(use_tma=True), dict(wide=True), dict(use_tma=True, wide=True),
               dict(use_tma=True, wide=True, sorted_a=True)):
        got = launch_gemm1(x, w13, align, 2, cfg, Gemm1Plan(**kw))
        torch.testing.assert_close(got[:used].float(), base, rtol=1e-2, atol=1e-3, msg=str(kw))
    with pytest.raises(MoebenchError, match="sorted_a"):
        launch_gemm1(x, w13, align, 2, cfg, Gemm1Plan(use_tma=True, sorted_a=True))  # the paired walk has no A through TMA


def test_sorted_a_layer_matches_reference():
    # The layer with sorted_a (the sorted copy, one launch, then GEMM1's A tiles through TMA):
    # the reference, with remote experts.
    dtype, bm, e = torch.bfloat16, 64, 10
    tw, ti = _uneven_routing(3 * bm, e, {0: bm + bm // 4, 1: bm // 2, 2: 0})
    emap = random_expert_map(e, 6, DEV)
    w13, w2 = _weights(6, dtype)
    x = _x(3 * bm, dtype)
    cfg = dict(CFG, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
    got = fused_moe(x, w13, w2, tw, ti, emap, e, cfg, options=TritonOptions(sorted_a=True))
    assert rel_err(got, moebench.reference_moe(x, w13, w2, tw, ti, emap)) < TOL[dtype]


def test_topk_sum_matches_torch():
    # a token's K rows summed in fp32, rounded once to the output's dtype
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(7 * K, 1100, generator=g).to(DEV, torch.bfloat16)  # 1100: a masked column block
    want = rows.float().view(7, K, 1100).sum(1)
    for dtype in (torch.bfloat16, torch.float32):
        got = topk_sum(rows, torch.empty(7, 1100, dtype=dtype, device=DEV), K)
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)


def test_topk_sum_gathers_and_weights():
    # rows picked through a row index (DeepGEMM's layout order), each times its router weight, summed in fp32
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 1100, generator=g).to(DEV, torch.bfloat16)
    idx = torch.randperm(40, generator=g)[: 7 * K].to(DEV, torch.int32).view(7, K)
    w = torch.rand(7, K, generator=g).to(DEV)
    want = (rows.float()[idx.long()] * w.unsqueeze(-1)).sum(1)
    got = topk_sum(rows, torch.empty(7, 1100, dtype=torch.float32, device=DEV), K, row_index=idx, weights=w)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    unweighted = topk_sum(rows, torch.empty(7, 1100, dtype=torch.float32, device=DEV), K, row_index=idx)
    torch.testing.assert_close(unweighted, rows.float()[idx.long()].sum(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,use_map", [(torch.bfloat16, False), (torch.float32, True)],
                         ids=["bf16-all-local", "fp32-expert-map"])
def test_pair_store_matches_reference(dtype, use_map):
    # GEMM2 stores each pair's row and topk_sum adds them (no atomics, no zeroing by GEMM1): the
    # reference, with blocks of every fill level; under an expert map the remote pairs' rows are
    # zeros. The atomic path gives the same result within the dtype's rounding. Each dtype's rows
    # (bf16 rows, rounded by topk_sum; fp32 rows) once, and each of the two row buffers (all local:
    # every row written, left unset; a map: zeroed first) once: the two choices are independent.
    bm, e = 32, 10
    tw, ti = _uneven_routing(3 * bm, e, {0: bm + bm // 4, 1: bm // 2, 2: 0})
    emap = random_expert_map(e, 6, DEV) if use_map else None
    w13, w2 = _weights(6 if use_map else e, dtype)
    x = _x(3 * bm, dtype)
    cfg = dict(CFG, BLOCK_SIZE_M=bm)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    got = fused_moe(x, w13, w2, tw, ti, emap, e, cfg, options=TritonOptions(pair_store=True))
    assert got.dtype == dtype and rel_err(got, ref) < TOL[dtype]
    atomic = fused_moe(x, w13, w2, tw, ti, emap, e, cfg, options=TritonOptions(pair_store=False))
    assert rel_err(got, atomic.double()) < TOL[dtype]


def test_pair_store_auto_and_its_split_k():
    # "auto" takes the pair store where the thresholds say (here: any shape, all local); with it
    # forced, split_k=None means one K split and an explicit split raises (8 experts: the rule and
    # the forced choice are the subject, the pair store's GEMMs are test_pair_store_matches_reference's)
    dtype, e = torch.bfloat16, 8
    tw, ti = _routing(24, e, K)
    w13, w2 = _weights(e, dtype)
    x = _x(24, dtype)
    ref = moebench.reference_moe(x, w13, w2, tw, ti)
    auto = TritonOptions(pair_store_min_rows=1)
    assert resolve_pair_store(auto, I, 24 * K / e, False, 1)
    assert rel_err(fused_moe(x, w13, w2, tw, ti, None, e, ONE_TILE, 1, options=auto), ref) < TOL[dtype]
    forced = TritonOptions(pair_store=True)
    assert rel_err(fused_moe(x, w13, w2, tw, ti, None, e, ONE_TILE, options=forced), ref) < TOL[dtype]
    with pytest.raises(MoebenchError, match="pair_store"):
        fused_moe(x, w13, w2, tw, ti, None, e, ONE_TILE, 2, options=forced)


def test_sorted_rows_copies_x_in_sorted_order():
    # row r of the copy is x[sorted_ids[r] // K] for used rows, zeros for sentinel rows
    m, k, e, bm = 37, 2, 6, 16
    tw, ti = _uneven_routing(m, e, {0: 20, 1: 3, 2: 0})
    x = _x(m, torch.bfloat16)
    align = moe_align_block_size(ti, bm, e)
    xs = sorted_rows(x, align, k)
    used = int(align.num_tokens_post_padded)
    ids = align.sorted_token_ids[:used].long()
    real = ids < m * k
    assert torch.equal(xs[:used][real], x[ids[real] // k]) and not xs[:used][~real].any()
    # zero_pad=False: sentinel rows untouched; an fp8 x moves bit for bit; any output strides
    q = x.to(torch.float8_e4m3fn)
    out = torch.full_like(xs, 5.0).to(torch.float8_e4m3fn)
    sorted_rows(q, align, k, out=out, zero_pad=False)
    assert torch.equal(out[:used][real].view(torch.uint8), q[ids[real] // k].view(torch.uint8))
    assert (out[:used][~real].float() == 5.0).all()
    s = torch.arange(m * 3, dtype=torch.float32).view(m, 3)
    st = torch.empty_strided((xs.shape[0], 3), (1, xs.shape[0]))  # column-major, as DeepGEMM's scales
    sorted_rows(s, align, k, out=st)
    assert torch.equal(st[:used][real], s[ids[real] // k])


def test_gemm2_with_its_own_config_matches_reference(tmp_path, monkeypatch):
    # GEMM2 with other N/K/warps/stages than GEMM1 (same BLOCK_SIZE_M), explicit and from a
    # `_down.json` file next to GEMM1's; USE_TMA in the entry switches GEMM2's w2 loads to TMA
    # (GEMM1's 16-row tiles load theirs by pointer).
    m, dtype, e = 9, torch.bfloat16, 8  # 8 experts: GEMM2's own config is the subject, not the layer's size
    w13, w2 = _weights(e, dtype)
    tw, ti = _routing(m, e, K)
    x = _x(m, dtype)
    ref = moebench.reference_moe(x, w13, w2, tw, ti)
    down = dict(CFG, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, num_stages=3)
    out = fused_moe(x, w13, w2, tw, ti, num_experts=e, config=CFG, down_config=dict(down, USE_TMA=True))
    assert rel_err(out, ref) < TOL[dtype]
    with pytest.raises(MoebenchError, match="share one alignment"):
        fused_moe(x, w13, w2, tw, ti, num_experts=e, config=CFG, down_config=dict(down, BLOCK_SIZE_M=32))
    with pytest.raises(MoebenchError, match="BLOCK_SIZE_M must equal"):
        TritonExperts(config=CFG, down_config=dict(down, BLOCK_SIZE_M=32))
    # the lookup: GEMM1's file and GEMM2's `_down` file in $MOEBENCH_CONFIG_DIR (this device's name)
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    dev = TF.device_name(w2.device)
    TF.write_config_file(tmp_path / TF.config_file_name(e, I, dev), {1: CFG})
    TF.write_config_file(tmp_path / TF.config_file_name(e, I, dev, down=True), {1: dict(down, USE_TMA=False)})
    kernel = moebench.make_kernel("triton", "no-dpep")
    out = kernel.apply(x, w13, w2, tw, ti, num_experts=e)
    assert rel_err(out, ref) < TOL[dtype]
    src = kernel.experts.last_config_source
    assert src.startswith(str(tmp_path)) and "; GEMM2: " in src and src.endswith("_down.json[1]")


# ---------------------------------------------------------------------------------------------
# batched-triton (BatchedExperts)


def test_batched_triton_matches_reference():
    dtype = torch.float16
    m = 9
    w13, w2 = _weights(E, dtype)
    x = _x(m, dtype)
    tw, ti = _routing(m, E, K)
    out = _run("batched-triton", "batched-local", x, w13, w2, tw, ti, config=CFG)
    assert out.dtype == dtype and out.shape == (m, H)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]


def test_batched_triton_expert_map_and_one_expert():
    dtype = torch.bfloat16
    e_local = 6
    emap = random_expert_map(E, e_local, DEV)
    w13, w2 = _weights(e_local, dtype)
    m = 20
    x = _x(m, dtype)
    here = torch.nonzero(emap.cpu() >= 0).reshape(-1)
    tw, ti = _routing(m, E, K, first=int(here[0]))  # every token also visits one local expert: a run of 20 rows
    ti[1] = torch.nonzero(emap.cpu() < 0).reshape(-1)[:K].to(DEV, torch.int32)  # token 1: all remote
    out = _run("batched-triton", "batched-local", x, w13, w2, tw, ti, expert_map=emap,
               config=dict(CFG, BLOCK_SIZE_M=16, BLOCK_SIZE_K=32, GROUP_SIZE_M=2))
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    assert rel_err(out, ref) < TOL[dtype]
    assert (out[1] == 0).all()


def test_batched_skips_rows_past_counts():
    # Rows past expert_num_tokens stay as allocated (NaN when poisoned): the kernel skips them.
    dtype = torch.float32
    w13, w2 = _weights(3, dtype)
    a = torch.randn(3, 16, H, device=DEV, dtype=dtype)
    counts = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEV)
    prep = moebench.kernels.modular.PrepareResult(a, None, None, counts, None, 3)
    with poisoned_outputs():
        out = BatchedTritonExperts(config=CFG).apply(prep, w13, w2)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1, 5:]).all()
    from moebench.kernels.reference import silu_and_mul

    for e, c in ((1, 5), (2, 16)):
        ref = silu_and_mul(a[e, :c].double() @ w13[e].double().t()) @ w2[e].double().t()
        assert rel_err(out[e, :c], ref) < 1e-4
    assert isinstance(BatchedTritonExperts().weight_and_reduce(), TopKWeightAndReduceDelegate)


def test_batched_default_config_block_m_by_rows():
    # 64-row tiles up to options.batched_wide_rows rows per expert, 128-row ones above (H200: PERF.md)
    assert batched_default_config(3, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 16
    assert batched_default_config(100, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 64
    assert batched_default_config(128, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 64
    assert batched_default_config(129, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 128
    narrow = TritonOptions(batched_wide_rows=64)
    assert batched_default_config(100, 768, 2048, torch.bfloat16, narrow)["BLOCK_SIZE_M"] == 128


def test_batched_config_lookup(tmp_path, monkeypatch):
    # The tuned file of (E_local, I) wins, at the entry nearest to the routed token count (the
    # P/F's num_tokens: the sorted-token kernel's key for the same load), whatever the buffer's
    # rows per expert; another shape, or no token count, falls back to the batched heuristic
    # (BLOCK_SIZE_M capped at 64); an explicit config wins over all.
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    small, big = dict(CFG, num_stages=3), dict(CFG, BLOCK_SIZE_M=128, BLOCK_SIZE_N=128)
    TF.write_config_file(tmp_path / TF.config_file_name(8, 768, "cpu"), {4: small, 256: big})
    exp = BatchedTritonExperts()
    assert exp.config_for(2048, 8, 768, 2048, torch.bfloat16, device_type="cpu", tokens=6) == small
    assert exp.last_config_source.endswith("E=8,N=768,device_name=cpu.json[4]")
    assert exp.config_for(64, 8, 768, 2048, torch.bfloat16, device_type="cpu", tokens=300) == big  # as is
    heuristic = batched_default_config(4096, 768, 2048, torch.bfloat16)
    assert exp.config_for(4096, 16, 768, 2048, torch.bfloat16, device_type="cpu", tokens=4096) == heuristic
    assert exp.last_config_source == "default heuristic"
    assert exp.config_for(4096, 8, 768, 2048, torch.bfloat16, device_type="cpu") == heuristic
    assert exp.last_config_source == "default heuristic (token count unknown)"
    # with the load known, the heuristic sizes tiles for the mean routed pairs per expert (here 8),
    # not for the buffer's rows (all2all-ll's buffer holds max_tokens_per_rank x world rows)
    assert exp.config_for(2048, 16, 768, 2048, torch.bfloat16, device_type="cpu", tokens=64, topk=2,
                          num_experts=16) == batched_default_config(8, 768, 2048, torch.bfloat16)
    explicit = BatchedTritonExperts(config=CFG)
    assert explicit.config_for(6, 8, 768, 2048, torch.bfloat16, device_type="cpu", tokens=6) == CFG
    assert explicit.last_config_source == "explicit"


@pytest.mark.parametrize("experts, pf", [("triton", "no-dpep"), ("batched-triton", "batched-local")])
def test_apply_looks_nothing_up_after_the_first_call(tmp_path, monkeypatch, experts, pf):
    # The lookup's folders are resolved when the experts are built and each file is read once per
    # process: after the first call, apply() neither reads the environment again nor touches a
    # config folder, and runs with the same tuned entry.
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    dtype, m, e = torch.float32, 6, 8  # 8 experts: the lookup is the subject, not the layer's size
    w13, w2 = _weights(e, dtype)
    tw, ti = _routing(m, e, K)
    x = _x(m, dtype)
    ref = moebench.reference_moe(x, w13, w2, tw, ti)
    path = TF.write_config_file(tmp_path / TF.config_file_name(e, I, TF.device_name(DEV)), {4: ONE_TILE})
    kernel = moebench.make_kernel(experts, pf)
    with poisoned_outputs():
        kernel.apply(x, w13, w2, tw, ti)
    source = kernel.experts.last_config_source
    assert source == f"{path}[4]"

    watched = (tmp_path, TF.PACKAGE_CONFIG_DIR)
    touched: list[Path] = []
    for name in ("stat", "is_file", "is_dir", "exists"):
        real = getattr(Path, name)

        def spy(self, *a, _real=real, **kw):
            if any(self == d or d in self.parents for d in watched):
                touched.append(self)
            return _real(self, *a, **kw)

        monkeypatch.setattr(Path, name, spy)
    monkeypatch.delenv(TF.ENV_CONFIG_DIR)  # a lookup that read it again would find no file
    monkeypatch.setattr(X, "config_search_dirs", lambda: pytest.fail("the lookup's folders were resolved again"))
    before = TF.find.cache_info()
    with poisoned_outputs():
        out = kernel.apply(x, w13, w2, tw, ti)
    assert rel_err(out, ref) < TOL[dtype]
    assert kernel.experts.last_config_source == source
    assert touched == []
    after = TF.find.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


def test_batched_prepare_reports_the_routed_tokens():
    # what the batched experts' lookup keys on: all tokens on one rank
    x = _x(5, torch.float32)
    tw, ti = _routing(5, E, K)
    pf = moebench.make_kernel("batched-triton", "batched-local").prepare_finalize
    prep = pf.prepare(x, tw, ti, E, E, None)
    assert (prep.num_tokens, prep.topk) == (5, K)


def test_batched_finalize_with_empty_first_expert():
    # Token 0 routes only to remote experts and local expert 0 receives no token: the
    # batched-local finalize gathers row 0 of expert 0 for remote slots and multiplies it by 0.
    # The kernel leaves that row unwritten (allowed), so a poisoned NaN row must not leak.
    dtype = torch.float32
    e_local = 4
    emap = torch.full((E,), -1, dtype=torch.int32, device=DEV)
    emap[10:14] = torch.arange(e_local, dtype=torch.int32, device=DEV)
    w13, w2 = _weights(e_local, dtype)
    x = _x(2, dtype)
    ti = torch.tensor([[0, 1], [11, 12]], dtype=torch.int32, device=DEV)  # local 1, 2 only
    tw = torch.rand(2, 2, device=DEV)
    out = _run("batched-triton", "batched-local", x, w13, w2, tw, ti, expert_map=emap, config=CFG)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    assert rel_err(out, ref) < 1e-4


# ---------------------------------------------------------------------------------------------
# Routing


@pytest.mark.parametrize("m,e,k,renorm", [(5, 60, 4, True), (33, 8, 2, False), (4, 512, 10, True)])
def test_fused_topk_softmax_matches_torch(m, e, k, renorm):
    g = torch.Generator().manual_seed(e)
    logits = torch.randn(m, e, generator=g).to(DEV)
    w, ids = fused_topk_softmax(logits, k, renorm)
    rw, rids = torch.softmax(logits, -1).topk(k, -1)
    if renorm:
        rw = rw / rw.sum(-1, keepdim=True)
    assert torch.equal(ids.long(), rids) and ids.dtype == torch.int32
    assert torch.allclose(w, rw, rtol=1e-5, atol=1e-6)


def test_fused_topk_softmax_ties_go_to_the_lower_expert():
    logits = torch.zeros(3, 40, device=DEV)
    logits[1, 7] = logits[1, 30] = 2.0  # two equal winners, then 38 equal runners-up
    w, ids = fused_topk_softmax(logits, 4, renormalize=True)
    assert ids.tolist() == [[0, 1, 2, 3], [7, 30, 0, 1], [0, 1, 2, 3]]
    assert torch.allclose(w[0], torch.full((4,), 0.25, device=DEV)) and torch.allclose(w.sum(-1), torch.ones(3, device=DEV))
