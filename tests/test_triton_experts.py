"""`triton` and `batched-triton` experts and the block alignment, against the float64 reference.

Runs under the Triton interpreter on CPU (tests/conftest.py), so shapes are small and blocks big;
the shapes are deliberately odd (H=72, I=40: not multiples of any block) and E=60 with top-4.
"""

from __future__ import annotations

import pytest
import torch
import triton

import moebench
from helpers import random_expert_map, rel_err
from moebench.kernels.batched_triton import BatchedTritonExperts, batched_default_config
from moebench.kernels import moe_align
from moebench.kernels.modular import TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOp, poisoned_outputs
from moebench.kernels.moe_align import (
    direct_align,
    max_padded_size,
    moe_align_block_size,
    moe_align_block_size_torch,
    use_direct_align,
)
from moebench.kernels.triton_moe import (
    TritonExperts,
    choose_split_k,
    fused_moe,
    fused_moe_gemms,
    fused_topk_softmax,
    launch_gemm1,
    sorted_rows,
    use_sorted_a,
)

H, I, E, K = 72, 40, 60, 4
CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(e: int, dtype: torch.dtype, h: int = H, i: int = I, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(DEV, dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(DEV, dtype)
    return w13, w2


def _routing(m: int, e: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, e, generator=g)
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return w.to(DEV), ids.to(DEV, torch.int32)


def _x(m: int, dtype: torch.dtype, h: int = H, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, h, generator=g).to(DEV, dtype)


def _run(experts: str, pf: str, x, w13, w2, tw, ti, expert_map=None, num_experts=None, **kw):
    kernel = moebench.make_kernel(experts, pf, experts_kwargs=kw)
    with poisoned_outputs():
        return kernel.apply(x, w13, w2, tw, ti, expert_map=expert_map, num_experts=num_experts)


# ---------------------------------------------------------------------------------------------
# Alignment


@pytest.mark.parametrize("m,k,e,bm,use_map", [(1, 4, 60, 16, False), (37, 4, 60, 16, True), (9, 2, 5, 32, False),
                                              (64, 8, 128, 16, True)])
def test_align_matches_torch(m, k, e, bm, use_map):
    e_global = 2 * e if use_map else e
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, e_global, (m, k), generator=g).to(DEV)
    emap = random_expert_map(e_global, e, DEV) if use_map else None
    # Several chunks per expert: 4 to 8 (the interpreter's time grows with experts x chunks).
    several = max(16, triton.next_power_of_2(m * k) // 4)
    a = moe_align_block_size(ids, bm, e, emap, chunk=max(16, several // 2), one_launch=False, method="scan")
    b = moe_align_block_size_torch(ids, bm, e, emap)
    for method in ("scan", "sort"):
        for chunk in (None, several):  # one chunk or several (sort: each chunk sorted)
            d = moe_align_block_size(ids, bm, e, emap, chunk=chunk, one_launch=False, method=method)
            assert torch.equal(a.sorted_token_ids, d.sorted_token_ids) and torch.equal(a.expert_ids, d.expert_ids)
            assert torch.equal(a.num_tokens_post_padded, d.num_tokens_post_padded)
    o = moe_align_block_size(ids, bm, e, emap, one_launch=True)  # one launch, every program counts all pairs
    assert torch.equal(a.sorted_token_ids, o.sorted_token_ids) and torch.equal(a.expert_ids, o.expert_ids)
    assert torch.equal(a.num_tokens_post_padded, o.num_tokens_post_padded)
    assert torch.equal(a.sorted_token_ids, b.sorted_token_ids)
    assert torch.equal(a.expert_ids, b.expert_ids)
    assert torch.equal(a.num_tokens_post_padded, b.num_tokens_post_padded)
    # Invariants: every local pair exactly once, in its expert's blocks; the rest sentinel.
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
    a = moe_align_block_size(ids, 16, 1, emap)
    assert a.num_tokens_post_padded.item() == 0
    assert (a.sorted_token_ids == 6).all() and (a.expert_ids == -1).all()
    z = moe_align_block_size(torch.zeros((0, 2), dtype=torch.int32, device=DEV), 16, 4)
    assert z.num_tokens_post_padded.item() == 0 and z.sorted_token_ids.numel() == 0


# ---------------------------------------------------------------------------------------------
# triton (Standard)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 13])
def test_triton_matches_reference(dtype, m):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_expert_map_remote(dtype):
    # 60 global experts, 20 here; token 0 routes only to remote experts -> its row must be zero.
    e_local = 20
    emap = random_expert_map(E, e_local, DEV)
    w13, w2 = _weights(e_local, dtype)
    m = 11
    x = _x(m, dtype)
    tw, ti = _routing(m, E, K)
    remote = torch.nonzero(emap.cpu() < 0).reshape(-1)[:K].to(DEV, torch.int32)
    ti[0] = remote
    out = _run("triton", "no-dpep", x, w13, w2, tw, ti, expert_map=emap, config=dict(CFG, BLOCK_SIZE_M=32))
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    assert rel_err(out, ref) < TOL[dtype]
    assert (out[0] == 0).all()


def test_triton_default_config_path():
    # No explicit config: lookup -> default heuristic (no tuned file for this shape on CPU).
    dtype = torch.bfloat16
    w13, w2 = _weights(8, dtype, h=64, i=32)
    x = _x(5, dtype, h=64)
    tw, ti = _routing(5, 8, 2)
    experts = TritonExperts()
    kernel = moebench.FusedMoEKernel(moebench.make_kernel("triton", "no-dpep").prepare_finalize, experts)
    with poisoned_outputs():
        out = kernel.apply(x, w13, w2, tw, ti)
    assert experts.last_config_source == "default heuristic"
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]


def test_fused_moe_direct_matches_modular():
    dtype = torch.float32
    w13, w2 = _weights(E, dtype)
    x = _x(6, dtype)
    tw, ti = _routing(6, E, K)
    a = fused_moe(x, w13, w2, tw, ti, config=CFG)
    b = _run("triton", "no-dpep", x, w13, w2, tw, ti, config=CFG)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_choose_split_k():
    cfg = dict(CFG, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128)
    # Mixtral M=1: 2 blocks x 64 hidden tiles on 132 SMs -> split; big grids -> no split.
    assert choose_split_k(2, 4096, 14336, cfg, 132) == 2
    assert choose_split_k(100, 4096, 14336, cfg, 132) == 1
    assert choose_split_k(1, 4096, 256, cfg, 132) == 1  # too little K to split


def test_wave_split_rule():
    # The wave rule (DEFAULT_WAVE_SPLIT): the prefill tile, one program per SM on 132 SMs.
    from moebench.kernels.triton_moe import ctas_per_sm, expected_blocks, layer_split_k, wave_split

    big = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=256, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=4)
    assert ctas_per_sm(big) == 1 and ctas_per_sm(dict(big, BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, num_warps=4)) == 2
    # 256 pairs per expert on 128-row blocks: 2 full blocks and half a block of padding each
    assert expected_blocks(2048, 8, 128) == 20 and expected_blocks(8, 8, 128) == pytest.approx(8 * (1 - 2.718281828**-1))
    # 320 programs of 224 steps: 3 waves (the last 40% full) -> 2 splits, 5 waves of 112 + 7 steps
    assert wave_split(320, 224, 132, 8) == 2
    assert wave_split(264, 224, 132, 8) == 1  # two full waves: nothing to gain
    assert wave_split(2536, 12, 132, 8) == 1  # short K: the per-tile overhead outweighs the idle SMs
    mixtral = (8, 8, 4096, 14336)  # E, E local, H, I; top-2
    split = lambda m, e, el, h, i, k=2, **kw: layer_split_k(m, k, e, el, h, i, big, 10**6, 132, **kw)  # noqa: E731
    assert split(1024, *mixtral, wave=True) == 2 and split(1024, *mixtral, wave=False) == 1
    assert split(4096, *mixtral, wave=True) == 1  # 68 blocks x 16 tiles: 8.2 waves, < 3% to gain
    assert split(256, *mixtral, wave=True) == 1  # 64 pairs per expert: below a block, not compute-bound
    assert split(4096, 128, 128, 2048, 768, k=8, wave=True) == 1  # Qwen3-30B-A3B: K = 12 steps
    assert split(1024, 32, 32, 7168, 2048, k=8, wave=True) == 1  # DeepSeek-V3's 32 experts: 17 waves


# ---------------------------------------------------------------------------------------------
# batched-triton (BatchedExperts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_batched_triton_matches_reference(dtype):
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
    tw, ti = _routing(m, E, K)
    here = torch.nonzero(emap.cpu() >= 0).reshape(-1)
    ti[:, 0] = int(here[0])  # every token also visits one local expert: a run of 20 rows
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
    # 64-row tiles up to BATCHED_WIDE_ROWS rows per expert, 128-row ones above (H200: PERF.md)
    assert batched_default_config(3, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 16
    assert batched_default_config(100, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 64
    assert batched_default_config(128, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 64
    assert batched_default_config(129, 768, 2048, torch.bfloat16)["BLOCK_SIZE_M"] == 128


def test_batched_config_lookup(tmp_path, monkeypatch):
    # The tuned file of (E_local, I) wins, at the entry nearest to the routed token count (the
    # P/F's num_tokens: the sorted-token kernel's key for the same load), whatever the buffer's
    # rows per expert; another shape, or no token count, falls back to the batched heuristic
    # (BLOCK_SIZE_M capped at 64); an explicit config wins over all.
    from moebench.tuning import configs as C

    monkeypatch.setenv(C.ENV_CONFIG_DIR, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    small, big = dict(CFG, num_stages=3), dict(CFG, BLOCK_SIZE_M=128, BLOCK_SIZE_N=128)
    C.write_config_file(tmp_path / C.config_file_name(8, 768, "cpu"), {4: small, 256: big})
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


def test_batched_prepare_reports_the_routed_tokens():
    # what the batched experts' lookup keys on: all tokens on one rank
    x = _x(5, torch.float32)
    tw, ti = _routing(5, E, K)
    pf = moebench.make_kernel("batched-triton", "batched-local").prepare_finalize
    prep = pf.prepare(x, tw, ti, E, E, None)
    assert (prep.num_tokens, prep.topk) == (5, K)


@pytest.mark.parametrize("m,e,k,renorm", [(5, 60, 4, True), (33, 8, 2, False), (3, 256, 8, True), (4, 512, 10, True),
                                          (17, 16, 1, False)])
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


@pytest.mark.parametrize("use_tma,atomic", [(True, True), (False, False), (True, False)])
def test_triton_variants_tma_and_store(use_tma, atomic):
    # TMA weight loads (emulated by the interpreter) and the store-then-sum reduction, with an
    # expert_map (remote pairs) and a ragged K tail (H=72, BLOCK_SIZE_K=32).
    dtype = torch.bfloat16
    e_local = 20
    emap = random_expert_map(E, e_local, DEV)
    w13, w2 = _weights(e_local, dtype)
    m = 7
    x = _x(m, dtype)
    tw, ti = _routing(m, E, K)
    cfg = dict(CFG, BLOCK_SIZE_K=32)
    out = _run("triton", "no-dpep", x, w13, w2, tw, ti, expert_map=emap, config=cfg, use_tma=use_tma, atomic=atomic)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti, emap)) < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# Launch trimming for decode: direct_align (no alignment kernels) and GEMM2's accumulator zeroed
# by GEMM1


def test_use_direct_align_rule():
    assert use_direct_align(1, 8, 128) and use_direct_align(1, 2, 8)
    assert not use_direct_align(2, 8, 128) and not use_direct_align(16, 2, 8) and not use_direct_align(0, 8, 128)
    assert use_direct_align(2, 10, 512) and not use_direct_align(3, 10, 512)


def test_direct_align_layout(monkeypatch):
    ids = torch.tensor([[5, 2], [2, 7]], dtype=torch.int32, device=DEV)
    a = direct_align(ids, 4)
    s = torch.full((4, 4), 4, dtype=torch.int32)
    s[:, 0] = torch.arange(4)
    assert torch.equal(a.sorted_token_ids.cpu(), s.reshape(-1))
    assert a.expert_ids.tolist() == [5, 2, 2, 7] and a.num_tokens_post_padded.tolist() == [16]
    emap = torch.full((8,), -1, dtype=torch.int32, device=DEV)
    emap[2], emap[7] = 0, 1
    # The GEMMs map the global ids themselves (no launch here); the switch off gathers first.
    mapped = direct_align(ids, 4, emap)
    assert mapped.expert_ids.tolist() == [5, 2, 2, 7] and torch.equal(mapped.expert_map, emap)
    monkeypatch.setattr(moe_align, "DEFAULT_MAP_IN_GEMM", False)
    gathered = direct_align(ids, 4, emap)
    assert gathered.expert_ids.tolist() == [-1, 0, 0, 1] and gathered.expert_map is None


@pytest.mark.parametrize("map_in_gemm", [True, False])
def test_direct_align_map_in_gemm_or_gather_same_output(map_in_gemm, monkeypatch):
    # Both ways of mapping a direct alignment's ids give the reference's result, with 16-row blocks
    # whose one used row holds a remote pair (skipped) or a local one, and GEMM2 split over K.
    emap = random_expert_map(E, 20, DEV)
    w13, w2 = _weights(20, torch.float32)
    x = _x(3, torch.float32)
    tw, ti = _routing(3, E, K)
    monkeypatch.setattr(moe_align, "DEFAULT_MAP_IN_GEMM", map_in_gemm)
    with poisoned_outputs():
        out = fused_moe(x, w13, w2, tw, ti, emap, E, CFG, 2, direct=True, atomic=True)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti, emap)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,use_map,split_k", [(1, False, 1), (1, True, 2), (3, True, 1), (5, False, 2)])
def test_triton_direct_align_matches_reference(dtype, m, use_map, split_k):
    # Forced direct: also with pairs sharing an expert (m=5 over few experts: the weights are read
    # once per pair, the result must not change), remote experts skipped, and GEMM2 split over K.
    e_global, e_local = (E, 20) if use_map else (6, 6)
    emap = random_expert_map(e_global, e_local, DEV) if use_map else None
    w13, w2 = _weights(e_local, dtype)
    x = _x(m, dtype)
    tw, ti = _routing(m, e_global, K)
    if use_map and m > 1:
        ti[1] = torch.nonzero(emap.cpu() < 0).reshape(-1)[:K].to(DEV, torch.int32)  # token 1: all remote
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    with poisoned_outputs():
        out = fused_moe(x, w13, w2, tw, ti, emap, e_global, CFG, split_k, direct=True, atomic=True)
    assert rel_err(out, ref) < TOL[dtype]
    if use_map and m > 1:
        assert (out[1] == 0).all()


def test_fp32_output_is_the_accumulator():
    # fp32 layers need no cast: GEMM2 adds into the output, which GEMM1 (or a memset) zeroes.
    w13, w2 = _weights(E, torch.float32)
    x = _x(5, torch.float32)
    tw, ti = _routing(5, E, K)
    align = moe_align_block_size(ti, 16, E)
    for zero in (True, False):
        out = torch.full((5, H), float("nan"), device=DEV)
        got = fused_moe_gemms(x, w13, w2, tw, align, K, CFG, out=out, zero_in_gemm1=zero)
        assert got is out
        assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[torch.float32]


@pytest.mark.parametrize("numel", [5, 3 * 6 * 1024 + 17])
def test_gemm1_zeroes_the_gemm2_accumulator(numel):
    # A NaN-filled buffer comes back zeroed: smaller than one program's share, and larger than
    # 1024 elements per program of the grid (6 programs here), so the grid-stride loop repeats.
    m = 40
    w13, w2 = _weights(2, torch.float32)
    x = _x(m, torch.float32)
    align = moe_align_block_size(torch.zeros((m, 1), dtype=torch.int32, device=DEV), 64, 2)
    acc = torch.full((numel,), float("nan"), device=DEV)
    inter = launch_gemm1(x, w13, align, 1, dict(CFG, BLOCK_SIZE_M=64), zero=acc)
    assert (acc == 0).all()
    assert inter.shape[0] // 64 * triton.cdiv(I, 32) == 6  # the grid size the comment assumes


@pytest.mark.parametrize("direct,zero", [(True, True), ("auto", True), (False, True)])
def test_fused_moe_launch_trimming_matches_default(direct, zero):
    dtype = torch.bfloat16
    w13, w2 = _weights(E, dtype)
    for m in (1, 9):
        x = _x(m, dtype)
        tw, ti = _routing(m, E, K)
        base = fused_moe(x, w13, w2, tw, ti, config=CFG, direct=False)
        align = direct_align(ti, 16) if direct is True or (direct == "auto" and m == 1) else moe_align_block_size(ti, 16, E)
        got = fused_moe_gemms(x, w13, w2, tw, align, K, CFG, zero_in_gemm1=zero)
        again = fused_moe(x, w13, w2, tw, ti, config=CFG, direct=direct)
        assert torch.allclose(got.float(), again.float(), rtol=1e-2, atol=1e-3)  # atomics: any order
        assert rel_err(got, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]
        assert torch.allclose(got.float(), base.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bk", [64, 32])
def test_wide_gemm1_matches_paired(dtype, bk):
    # GEMM1 with gate and up loaded as one tile and one dot: the same intermediate as the paired
    # walk (I=40 is not a multiple of the 32-column halves; H=72 leaves a K tail with bk=32).
    w13, w2 = _weights(E, dtype)
    x = _x(9, dtype)
    tw, ti = _routing(9, E, K)
    align = moe_align_block_size(ti, 16, E)
    cfg = dict(CFG, BLOCK_SIZE_K=bk)
    paired = launch_gemm1(x, w13, align, K, cfg)
    wide = launch_gemm1(x, w13, align, K, cfg, wide=True)
    used = int(align.num_tokens_post_padded)
    torch.testing.assert_close(wide[:used].float(), paired[:used].float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    out = fused_moe_gemms(x, w13, w2, tw, align, K, cfg, wide=True)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]


@pytest.mark.parametrize("split_k", [1, 2])
def test_gemm2_a_through_tma(split_k):
    # GEMM2 loading inter's tiles through a TMA descriptor too (emulated by the interpreter): a K
    # tail (I=40, BLOCK_SIZE_K=16 -> 3 steps, the last one past I) and K splits of whole steps.
    dtype = torch.bfloat16
    w13, w2 = _weights(E, dtype)
    x = _x(9, dtype)
    tw, ti = _routing(9, E, K)
    cfg = dict(CFG, BLOCK_SIZE_K=16)
    align = moe_align_block_size(ti, 16, E)
    out = fused_moe_gemms(x, w13, w2, tw, align, K, cfg, split_k, use_tma=True, tma_a=True)
    base = fused_moe_gemms(x, w13, w2, tw, align, K, cfg, split_k, use_tma=True, tma_a=False)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti)) < TOL[dtype]
    torch.testing.assert_close(out.float(), base.float(), rtol=1e-2, atol=1e-3)


def test_direct_align_caches_only_small_layouts():
    from moebench.kernels import moe_align

    moe_align._DIRECT_LAYOUTS.clear()
    a = direct_align(torch.zeros((1, 8), dtype=torch.int32, device=DEV), 16)
    assert direct_align(torch.ones((1, 8), dtype=torch.int32, device=DEV), 16).sorted_token_ids is a.sorted_token_ids
    big = direct_align(torch.zeros((512, 8), dtype=torch.int32, device=DEV), 32)  # 4096 pairs x 32 rows
    assert len(moe_align._DIRECT_LAYOUTS) == 1 and big.num_tokens_post_padded.item() == 4096 * 32


def test_pdl_is_off_without_hopper():
    from moebench.kernels import triton_moe
    from moebench.kernels.triton_common import pdl_launch_args

    # The interpreter / a CPU tensor: never PDL, whatever is asked (launch_pdl is a CUDA launch).
    for pdl in (True, "auto", None):
        assert not triton_moe.resolve_pdl(pdl, torch.device("cpu"), 768)
    assert pdl_launch_args(False) == {}
    assert pdl_launch_args(True) == {"PDL": True, "launch_pdl": True}


def test_gemm2_with_its_own_config_matches_reference(tmp_path, monkeypatch):
    # GEMM2 with other N/K/warps/stages than GEMM1 (same BLOCK_SIZE_M), explicit and from a
    # `_down.json` file next to GEMM1's; USE_TMA in the entry switches GEMM2's TMA loads.
    from moebench.errors import MoebenchError
    from moebench.tuning import configs as C

    m, dtype = 9, torch.bfloat16
    w13, w2 = _weights(E, dtype)
    tw, ti = _routing(m, E, K)
    x = _x(m, dtype)
    ref = moebench.reference_moe(x, w13, w2, tw, ti)
    down = dict(CFG, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, num_stages=3)
    for d in (down, dict(down, USE_TMA=True), dict(down, USE_TMA=False)):
        out = fused_moe(x, w13, w2, tw, ti, num_experts=E, config=CFG, down_config=d)
        assert rel_err(out, ref) < TOL[dtype]
    with pytest.raises(MoebenchError, match="share one alignment"):
        fused_moe(x, w13, w2, tw, ti, num_experts=E, config=CFG, down_config=dict(down, BLOCK_SIZE_M=32))
    with pytest.raises(MoebenchError, match="BLOCK_SIZE_M must equal"):
        TritonExperts(config=CFG, down_config=dict(down, BLOCK_SIZE_M=32))
    # the lookup: GEMM1's file and GEMM2's `_down` file in $MOEBENCH_CONFIG_DIR (device name "cpu")
    monkeypatch.setenv(C.ENV_CONFIG_DIR, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    C.write_config_file(tmp_path / C.config_file_name(E, I, "cpu"), {1: CFG})
    C.write_config_file(tmp_path / C.config_file_name(E, I, "cpu", down=True), {1: dict(down, USE_TMA=False)})
    kernel = moebench.make_kernel("triton", "no-dpep")
    out = kernel.apply(x, w13, w2, tw, ti, num_experts=E)
    assert rel_err(out, ref) < TOL[dtype]
    src = kernel.experts.last_config_source
    assert src.startswith(str(tmp_path)) and "; GEMM2: " in src and src.endswith("_down.json[1]")


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


@pytest.mark.parametrize("dtype,bm,use_tma,tma_a,split_k,atomic", [
    (torch.float32, 32, False, False, 1, True), (torch.bfloat16, 32, True, True, 2, True),
    (torch.bfloat16, 64, True, False, 1, True), (torch.float32, 32, False, False, 1, False)])
def test_half_blocks_match_whole_tiles(dtype, bm, use_tma, tma_a, split_k, atomic, monkeypatch):
    # Blocks holding at most BLOCK_SIZE_M / 2 pairs run half-height tiles (DEFAULT_HALF_BLOCKS):
    # the same output. Experts get bm + bm/4 (a full block, then a quarter-filled one), bm/2 (exactly
    # half), bm/2 + 1 (one row into the second half), 0, and the rest a few each.
    e, m = 10, 3 * bm
    tw, ti = _uneven_routing(m, e, {0: bm + bm // 4, 1: bm // 2, 2: bm // 2 + 1, 3: 0})
    w13, w2 = _weights(e, dtype)
    x = _x(m, dtype)
    ref = moebench.reference_moe(x, w13, w2, tw, ti)
    cfg = dict(CFG, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
    align = moe_align_block_size(ti, bm, e)
    # The rows a half tile leaves unwritten keep what the buffer held: NaN here, masked by GEMM2.
    real_empty = torch.empty

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    whole = fused_moe_gemms(x, w13, w2, tw, align, 2, cfg, split_k, use_tma=use_tma, atomic=atomic, tma_a=tma_a, half=False)
    half = fused_moe_gemms(x, w13, w2, tw, align, 2, cfg, split_k, use_tma=use_tma, atomic=atomic, tma_a=tma_a, half=True)
    assert rel_err(half, ref) < TOL[dtype] and rel_err(whole, ref) < TOL[dtype]
    torch.testing.assert_close(half.float(), whole.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    # The half tiles ran: the second halves of blocks 1 (expert 0's quarter block) and of expert 1's
    # block are NaN in GEMM1's output; expert 2's block (bm/2 + 1 pairs) was computed whole.
    inter_half = launch_gemm1(x, w13, align, 2, cfg, use_tma, half=True)
    inter_whole = launch_gemm1(x, w13, align, 2, cfg, use_tma)
    used = int(align.num_tokens_post_padded)
    nan_rows = inter_half[:used].isnan().any(1).view(-1, bm)
    assert nan_rows[:, : bm // 2].sum() == 0 and not inter_whole[:used].isnan().any()
    half_blocks = nan_rows[:, bm // 2:].all(1)
    expert_of_block = align.expert_ids[: used // bm].cpu()
    assert half_blocks[1] and half_blocks[expert_of_block.tolist().index(1)]
    assert not half_blocks[0] and not half_blocks[expert_of_block.tolist().index(2)]


@pytest.mark.parametrize("dtype,bm,use_map", [(torch.bfloat16, 32, False), (torch.float16, 64, True)])
def test_sorted_a_matches_gathered_loads(dtype, bm, use_map):
    # GEMM1 reading x through TMA from a copy in sorted order (sorted_a) gives the layer the
    # gathered pointer loads give: full, part-filled and empty experts, H = 72 (a K tail the TMA
    # zero-fills), and with an expert_map some experts remote.
    e, m = 10, 3 * bm
    tw, ti = _uneven_routing(m, e, {0: bm + bm // 4, 1: bm // 2, 2: 0})
    emap = random_expert_map(e, 6, DEV) if use_map else None
    w13, w2 = _weights(6 if use_map else e, dtype)
    x = _x(m, dtype)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    cfg = dict(CFG, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
    kw = dict(expert_map=emap, num_experts=e, config=cfg, use_tma=True)
    got = fused_moe(x, w13, w2, tw, ti, sorted_a=True, **kw)
    base = fused_moe(x, w13, w2, tw, ti, sorted_a=False, **kw)
    assert rel_err(got, ref) < TOL[dtype]
    torch.testing.assert_close(got.float(), base.float(), rtol=1e-2, atol=1e-3)


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


def test_sorted_a_rule():
    # "auto": 16-bit, BLOCK_SIZE_M >= 64, >= 512 pairs per expert (>= 256 where I >= 4096); explicit values stand
    big = dict(CFG, BLOCK_SIZE_M=128)
    assert use_sorted_a("auto", big, torch.bfloat16, 14336, 256) and use_sorted_a("auto", big, torch.float16, 2048, 1024)
    assert not use_sorted_a("auto", big, torch.bfloat16, 2048, 256)  # DeepSeek-V3 local 1024 tokens: a loss
    assert not use_sorted_a("auto", big, torch.bfloat16, 768, 256)  # Qwen3 4096 tokens: neutral
    assert not use_sorted_a("auto", big, torch.bfloat16, 14336, 64)  # Mixtral 256 tokens
    assert not use_sorted_a("auto", big, torch.float32, 14336, 1024)
    assert not use_sorted_a("auto", CFG, torch.bfloat16, 14336, 1024)  # 16-row tiles
    assert use_sorted_a(True, CFG, torch.float16, 8, 1) and not use_sorted_a(False, big, torch.bfloat16, 14336, 1024)


@pytest.mark.parametrize("wide_tma", [False, True])
def test_sorted_a_yields_to_a_wide_gemm1_asked_for(wide_tma, monkeypatch):
    # Without the TMA wide walk: "auto" sorted_a (here on from one pair per expert) does not override
    # wide=True (a benchmark's named variant), both asked for by name are an error. With it
    # (DEFAULT_WIDE_TMA) the two go together.
    from moebench.errors import MoebenchError
    from moebench.kernels import triton_moe

    monkeypatch.setattr(triton_moe, "DEFAULT_WIDE_TMA", wide_tma)
    monkeypatch.setattr(triton_moe, "SORTED_A_MIN_ROWS", 1)
    monkeypatch.setattr(triton_moe, "SORTED_A_WIDE_MIN_ROWS", 1)
    tw, ti = _uneven_routing(64, 4, {0: 40})
    w13, w2 = _weights(4, torch.bfloat16)
    x = _x(64, torch.bfloat16)
    cfg = dict(CFG, BLOCK_SIZE_M=64, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
    calls = []
    real = triton_moe.launch_gemm1
    monkeypatch.setattr(triton_moe, "launch_gemm1", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    fused_moe(x, w13, w2, tw, ti, config=cfg, use_tma=True, wide=True, sorted_a="auto")
    fused_moe(x, w13, w2, tw, ti, config=cfg, use_tma=True, sorted_a="auto")
    if wide_tma:
        fused_moe(x, w13, w2, tw, ti, config=cfg, use_tma=True, wide=True, sorted_a=True)
        assert [(c["wide"], c["sorted_a"]) for c in calls] == [(True, True)] * 3
        return
    assert [(c["wide"], c["sorted_a"]) for c in calls] == [(True, False), (False, True)]
    with pytest.raises(MoebenchError, match="wide"):
        fused_moe(x, w13, w2, tw, ti, config=cfg, use_tma=True, wide=True, sorted_a=True)


@pytest.mark.parametrize("dtype,bm,sorted_a,use_map", [(torch.bfloat16, 32, False, False), (torch.float16, 64, True, True),
                                                       (torch.bfloat16, 64, True, False)])
def test_wide_gemm1_through_tma_matches_pointer_loads(dtype, bm, sorted_a, use_map, monkeypatch):
    # The wide GEMM1 with its (2, BN, BK) weight box through TMA (DEFAULT_WIDE_TMA), A gathered or
    # from the sorted copy: the intermediate of the pointer-load wide walk, row for row. I = 40 is
    # not a multiple of the 16-column halves (the last box reads rows past I: zeros, masked at the
    # store), H = 72 leaves a K tail; full, part-filled and empty experts, some remote.
    from moebench.kernels import triton_moe

    e, m = 10, 3 * bm
    tw, ti = _uneven_routing(m, e, {0: bm + bm // 4, 1: bm // 2, 2: 0})
    emap = random_expert_map(e, 6, DEV) if use_map else None
    w13, w2 = _weights(6 if use_map else e, dtype)
    x = _x(m, dtype)
    cfg = dict(CFG, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)
    align = moe_align_block_size(ti, bm, w13.shape[0], emap)
    base = launch_gemm1(x, w13, align, 2, cfg, use_tma=True, wide=True, wide_tma=False)
    got = launch_gemm1(x, w13, align, 2, cfg, use_tma=True, wide=True, wide_tma=True, sorted_a=sorted_a)
    used = int(align.num_tokens_post_padded)
    torch.testing.assert_close(got[:used].float(), base[:used].float(), rtol=1e-2, atol=1e-3)
    # the layer with the switch on: wide and sorted_a together where both are asked for
    monkeypatch.setattr(triton_moe, "DEFAULT_WIDE_TMA", True)
    calls = []
    real = triton_moe.launch_gemm1
    monkeypatch.setattr(triton_moe, "launch_gemm1", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    out = fused_moe(x, w13, w2, tw, ti, emap, e, config=cfg, use_tma=True, wide=True, sorted_a=sorted_a)
    assert (calls[0]["wide"], calls[0]["sorted_a"]) == (True, sorted_a)
    assert rel_err(out, moebench.reference_moe(x, w13, w2, tw, ti, emap)) < TOL[dtype]
