"""GPU checks of the Triton experts at real model shapes (design.md), and CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

import moebench
from moebench.bench.timing import capture_graph
from moebench.kernels.modular import poisoned_outputs
from moebench.kernels.triton import align as A
from moebench.kernels.triton import experts as X
from moebench.kernels.triton.align import moe_align_block_size, moe_align_block_size_torch
from moebench.kernels.triton.options import TritonOptions
from moebench.kernels.triton.routing import fused_topk_softmax

from gpu_helpers import first_experts_map, replay_on_new_inputs, softmax_topk
from helpers import rel_err

pytestmark = pytest.mark.gpu

# name: (E global, topk, H, I, E local)
SHAPES = {
    "mixtral": (8, 2, 4096, 14336, 8),
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128),
    "dsv3-ep8": (256, 8, 7168, 2048, 32),
}


def _setup(shape: str, m: int, dtype=torch.bfloat16, seed: int = 0):
    e, k, h, i, e_local = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(e_local, 2 * i, h, device="cuda", generator=g, dtype=dtype) / h**0.5)
    w2 = (torch.randn(e_local, h, i, device="cuda", generator=g, dtype=dtype) / i**0.5)
    x = torch.randn(m, h, device="cuda", generator=g, dtype=dtype)
    tw, ti = softmax_topk(torch.randn(m, e, device="cuda", generator=g), k)
    return x, w13, w2, tw, ti, first_experts_map(e, e_local), e


def _rel(out, ref):
    return rel_err(out, ref)  # an all-remote token under EP: zero output against a zero reference


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("m", [1, 64, 1024])
@pytest.mark.parametrize("experts,pf", [("triton", "no-dpep"), ("batched-triton", "batched-local")])
def test_real_shapes_bf16(shape, m, experts, pf):
    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    kernel = moebench.make_kernel(experts, pf)
    with poisoned_outputs():
        out = kernel.apply(x, w13, w2, tw, ti, expert_map=emap, num_experts=e)
    assert _rel(out, moebench.reference_moe(x, w13, w2, tw, ti, emap)) < 2e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_qwen3_other_dtypes(dtype, tol):
    x, w13, w2, tw, ti, emap, e = _setup("qwen3-30b-a3b", 256, dtype)
    with poisoned_outputs():
        out = moebench.make_kernel("triton", "no-dpep").apply(x, w13, w2, tw, ti, expert_map=emap, num_experts=e)
    assert _rel(out, moebench.reference_moe(x, w13, w2, tw, ti, emap)) < tol


@pytest.mark.parametrize("m", [1, 16, 128, 333, 4096])
def test_align_gpu_matches_torch(m):
    x, w13, w2, tw, ti, emap, e = _setup("dsv3-ep8", m)
    for bm in (16, 64):
        b = moe_align_block_size_torch(ti, bm, 32, emap)
        # the one-launch kernel takes up to 1024 pairs (m <= 128 here); both two-launch methods
        for opts in (TritonOptions(), TritonOptions(one_launch_max_pairs=0, align_method="scan"),
                     TritonOptions(one_launch_max_pairs=0, align_method="sort")):
            a = moe_align_block_size(ti, bm, 32, emap, options=opts)
            assert torch.equal(a.sorted_token_ids, b.sorted_token_ids)
            assert torch.equal(a.expert_ids, b.expert_ids)
            assert torch.equal(a.num_tokens_post_padded, b.num_tokens_post_padded)


@pytest.mark.parametrize("m,e", [(4096, 128), (1024, 512), (16384, 32)])
def test_align_sort_gpu_many_experts(m, e):
    # The sort method where "auto" picks it (many experts x pairs), top-8, 128-row blocks.
    g = torch.Generator(device="cuda").manual_seed(m + e)
    ti = torch.randint(0, e, (m, 8), device="cuda", generator=g, dtype=torch.int32)
    for bm in (16, 128):
        a = moe_align_block_size(ti, bm, e, options=TritonOptions(one_launch_max_pairs=0, align_method="sort"))
        b = moe_align_block_size_torch(ti, bm, e)
        assert torch.equal(a.sorted_token_ids, b.sorted_token_ids) and torch.equal(a.expert_ids, b.expert_ids)
        assert torch.equal(a.num_tokens_post_padded, b.num_tokens_post_padded)


@pytest.mark.parametrize("shape,m", [("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 1024), ("dsv3-ep8", 256)])
def test_cuda_graph_capture_and_replay(shape, m):
    # Capture routing + the whole layer; replay on new inputs copied into the captured buffers.
    # (M=1024 on Qwen3 takes the BLOCK_SIZE_M=128 config with TMA weight loads.)
    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    k = ti.shape[1]
    kernel = moebench.make_kernel("triton", "no-dpep")
    logits = torch.randn(m, e, device="cuda")

    def layer():
        w, ids = torch.softmax(logits, -1).topk(k, -1)
        return kernel.apply(x, w13, w2, w / w.sum(-1, keepdim=True), ids.to(torch.int32), expert_map=emap, num_experts=e)

    graph, out = capture_graph(layer)
    for seed in (5, 6):
        replay_on_new_inputs(graph, x, seed, logits)
        w, ids = torch.softmax(logits, -1).topk(k, -1)
        ref = moebench.reference_moe(x, w13, w2, w / w.sum(-1, keepdim=True), ids, emap)
        assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("m,e,k", [(1, 8, 2), (4096, 128, 8), (777, 256, 8)])
def test_fused_topk_gpu(m, e, k):
    logits = torch.randn(m, e, device="cuda", generator=torch.Generator(device="cuda").manual_seed(m))
    w, ids = fused_topk_softmax(logits, k)
    p = torch.softmax(logits, -1)
    rw, rids = p.topk(k, -1)
    # Rank by rank the kernel's expert has torch's probability; the ids themselves may differ
    # only where two probabilities are equal to within rounding.
    assert torch.allclose(p.gather(-1, ids.long()), rw, rtol=1e-6, atol=0)
    assert (ids.long() == rids).all(-1).float().mean() >= 0.999
    assert torch.allclose(w, rw / rw.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "dsv3-ep8"])
def test_launch_trimming_in_a_cuda_graph(shape):
    # direct_align + GEMM1 zeroing GEMM2's accumulator: the direct
    # layout is first built while the graph is captured (not cached then), replays give the
    # reference, and an eager call afterwards (cached layout) too.
    m = 1
    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    k = ti.shape[1]
    logits = torch.randn(m, e, device="cuda")

    def layer():
        w, ids = fused_topk_softmax(logits, k, renormalize=True)
        return X.fused_moe(x, w13, w2, w, ids, emap, e)

    layer()  # compile outside the capture
    torch.cuda.synchronize()
    A._DIRECT_LAYOUTS.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    assert not A._DIRECT_LAYOUTS
    for seed in (5, 6):
        replay_on_new_inputs(graph, x, seed, logits)
        w, ids = fused_topk_softmax(logits, k, renormalize=True)
        ref = moebench.reference_moe(x, w13, w2, w, ids, emap)
        assert _rel(out, ref) < 2e-2
        assert _rel(layer(), ref) < 2e-2


def _routed_layer(w13, w2, emap, e, logits, k, **options):
    """layer(x, pdl=True): the routing of `logits` (top-k, renormalised), then the Triton experts
    (`options`: further TritonOptions fields)."""
    def layer(inp, pdl=True):
        w, ids = fused_topk_softmax(logits, k, renormalize=True)
        return X.fused_moe(inp, w13, w2, w, ids, emap, e, options=TritonOptions(pdl=pdl, **options))
    return layer


def _chain(layer, x):
    """[x, y1, y2, y3]: three layers chained, each input the previous output times 8 (keeping the
    magnitude up through the layers)."""
    ys = [x]
    for _ in range(3):
        ys.append(layer(ys[-1]) * 8.0)
    return ys


def _chain_in_graph(layer, x):
    """`_chain` run once eagerly, then captured in a CUDA graph: (graph, its [x, y1, y2, y3])."""
    _chain(layer, x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _chain(layer, x)
    return graph, outs


@pytest.mark.parametrize("shape,m", [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 64), ("mixtral", 16), ("dsv3-ep8", 1),
                                     ("dsv3-ep8", 256), ("qwen3-30b-a3b", 1024)])
def test_pdl_chain_in_a_cuda_graph(shape, m):
    # GEMM1 and GEMM2 with programmatic dependent launch: three layers chained in one graph (each
    # layer's input is the previous one's output), replayed several times on new inputs. A GEMM2
    # that read `inter` or added into its accumulator before GEMM1 finished would leave stale or
    # doubled rows that the reference catches; so would a GEMM1 that started before the routing
    # (which releases it early where PDL is on) or an alignment launched with PDL that read the
    # routing's ids before they were written (Qwen3 64: the one-launch alignment), or a GEMM2 that
    # mapped its block's global id (DeepSeek-V3 EP8 one token: direct alignment, expert_map in the
    # GEMMs) before the routing had written it.
    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    k = ti.shape[1]
    logits = torch.randn(m, e, device="cuda")
    layer = _routed_layer(w13, w2, emap, e, logits, k)
    graph, outs = _chain_in_graph(layer, x)
    for seed in (5, 6, 7):
        replay_on_new_inputs(graph, x, seed, logits)
        torch.cuda.synchronize()
        y = x.clone()
        w, ids = fused_topk_softmax(logits, k, renormalize=True)
        for _ in range(3):
            y = (moebench.reference_moe(y, w13, w2, w, ids, emap) * 8.0).to(x.dtype)
        assert _rel(outs[-1], y) < 3e-2
        eager_pdl, eager = _chain(layer, x)[-1], _chain(lambda inp: layer(inp, False), x)[-1]
        assert _rel(eager_pdl, eager.double()) < 2e-2  # eager, with and without PDL


@pytest.mark.parametrize("shape,m,fp8", [("dsv3-ep8", 8, False), ("qwen3-30b-a3b", 16, True), ("mixtral", 4, True)])
def test_token_rows_in_a_cuda_graph(shape, m, fp8):
    # The token-rows layout forced on, PDL on, three layers chained in one graph and replayed on new
    # routings: each GEMM program reads its expert's tokens from topk_ids at every replay (under EP
    # through the expert map; fp8 block: GEMM2 on the swapped 16-row tile after the quantisation
    # launch). Each layer against the reference on its graph input, and eagerly against the
    # alignment kernels' layout.
    from moebench.quant import QuantScheme, quantize_weights

    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    if fp8:
        w13, w2 = quantize_weights(w13, w2, QuantScheme("fp8_w8a8", "block", (128, 128)))
    k = ti.shape[1]
    logits = torch.randn(m, e, device="cuda")
    layer = _routed_layer(w13, w2, emap, e, logits, k, token_rows=True, direct_align=False)
    aligned = _routed_layer(w13, w2, emap, e, logits, k, token_rows=False, direct_align=False)
    graph, outs = _chain_in_graph(layer, x)
    tol = 1e-2 if fp8 else 2e-2
    for seed in (5, 6, 7):
        replay_on_new_inputs(graph, x, seed, logits)
        torch.cuda.synchronize()
        w, ids = fused_topk_softmax(logits, k, renormalize=True)
        for n in range(3):
            ref = (moebench.reference_moe(outs[n], w13, w2, w, ids, emap) * 8.0).to(x.dtype)
            assert _rel(outs[n + 1], ref) < tol, (seed, n)
            assert _rel(outs[n + 1], (aligned(outs[n]) * 8.0).double()) < tol, (seed, n)


@pytest.mark.parametrize("m", [1, 16, 512])
def test_pdl_chain_fp8_block_in_a_cuda_graph(m):
    # fp8 128 x 128 block at Qwen3-30B (one token: the direct alignment; 16: a swapped 16 x 128 tile;
    # 512: 32 pairs per expert, the pair store): the quantisation launches between PDL-launched kernels. Three layers in
    # one graph, replayed on new inputs; each layer against the reference on the input it was given,
    # not three layers against a reference chain: there an early difference flips the next layers'
    # fp8 roundings (on a CPU, the reference chain with 3e-4 of noise added per layer ends 6% away),
    # so the bound would measure accumulation order, not races. A quantisation that read GEMM1's
    # rows early, or a GEMM2 that read its fp8 rows or scales before they were written, would
    # leave stale rows.
    from moebench.quant import QuantScheme, quantize_weights

    x, w13, w2, tw, ti, emap, e = _setup("qwen3-30b-a3b", m)
    q13, q2 = quantize_weights(w13, w2, QuantScheme("fp8_w8a8", "block", (128, 128)))
    k = ti.shape[1]
    logits = torch.randn(m, e, device="cuda")
    layer = _routed_layer(q13, q2, None, e, logits, k)
    graph, outs = _chain_in_graph(layer, x)
    for seed in (5, 6, 7):
        replay_on_new_inputs(graph, x, seed, logits)
        torch.cuda.synchronize()
        w, ids = fused_topk_softmax(logits, k, renormalize=True)
        for n in range(3):  # layer n + 1 against the reference and eagerly without PDL, on its graph input
            ref = (moebench.reference_moe(outs[n], q13, q2, w, ids) * 8.0).to(x.dtype)
            assert _rel(outs[n + 1], ref) < 1e-2, (seed, n)
            assert _rel(outs[n + 1], (layer(outs[n], False) * 8.0).double()) < 1e-2, (seed, n)


@pytest.mark.parametrize("m", [1, 16, 1024])
def test_gemm2_own_config_gpu(m):
    # GEMM2 with its own tile config (a `_down.json` entry), with and without USE_TMA (w2's tiles
    # through TMA or not), at Qwen3's shape
    x, w13, w2, tw, ti, emap, e = _setup("qwen3-30b-a3b", m)
    cfg, _ = X.select_config(m, ti.shape[1], w13, w2, e, x.dtype)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    for down in (dict(cfg, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, num_stages=5),
                 dict(cfg, BLOCK_SIZE_K=64, USE_TMA=True), dict(cfg, num_warps=8, USE_TMA=False)):
        out = X.fused_moe(x, w13, w2, tw, ti, emap, e, config=cfg, down_config=down)
        assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("shape,m", [("mixtral", 1024), ("qwen3-30b-a3b", 4096), ("dsv3-ep8", 4096),
                                     ("mixtral", 16)])
def test_sorted_a_gpu(shape, m):
    # GEMM1 reading x through TMA from a sorted copy (sorted_a, with the wide walk) with the shapes'
    # own configs: the reference, and the layer with the gathered pointer loads
    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    got = X.fused_moe(x, w13, w2, tw, ti, emap, e, options=TritonOptions(use_tma=True, sorted_a=True))
    base = X.fused_moe(x, w13, w2, tw, ti, emap, e, options=TritonOptions(use_tma=True, sorted_a=False))
    assert _rel(got, ref) < 2e-2 and _rel(got, base) < 1e-2


@pytest.mark.parametrize("shape,m,sorted_a", [("mixtral", 1024, True), ("mixtral", 256, False),
                                              ("qwen3-30b-a3b", 4096, True), ("qwen3-30b-a3b", 1024, False),
                                              ("dsv3-ep8", 4096, True), ("dsv3-ep8", 1024, False)])
def test_wide_tma_gpu(shape, m, sorted_a):
    # The wide GEMM1 with its weight box through TMA, with and without the sorted copy, at the
    # shapes' own configs (128- or 64-row tiles): the reference, and the layer with the wide walk's
    # pointer loads (no TMA)
    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    base = X.fused_moe(x, w13, w2, tw, ti, emap, e, options=TritonOptions(use_tma=False, wide_gemm1=True))
    got = X.fused_moe(x, w13, w2, tw, ti, emap, e, options=TritonOptions(use_tma=True, wide_gemm1=True, sorted_a=sorted_a))
    assert _rel(got, ref) < 2e-2 and _rel(got, base) < 1e-2


@pytest.mark.parametrize("shape,m", [("mixtral", 1024), ("mixtral", 2048)])
def test_wave_split_gpu(shape, m, monkeypatch):
    # GEMM2 split over K by the wave rule (2 splits at these points) against the reference and the
    # unsplit layer (split_k=1)
    x, w13, w2, tw, ti, emap, e = _setup(shape, m)
    ref = moebench.reference_moe(x, w13, w2, tw, ti, emap)
    base = X.fused_moe(x, w13, w2, tw, ti, emap, e, split_k=1)
    calls = []
    real = X.fused_moe_gemms
    monkeypatch.setattr(X, "fused_moe_gemms", lambda *a, **kw: calls.append(a[6].gemm2.split_k) or real(*a, **kw))
    got = X.fused_moe(x, w13, w2, tw, ti, emap, e)
    assert calls == [2] and _rel(got, ref) < 2e-2 and _rel(got, base) < 1e-2
