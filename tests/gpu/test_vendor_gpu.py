"""The vendor adapters on a GPU with the real libraries: DeepGEMM's experts (contiguous psum and
m-indices layouts, masked; bf16 and fp8 block[128,128]; all-local and an EP shard; in a CUDA graph)
and DeepEP's refusal of one rank (two ranks on one GPU: test_shared_gpu_gpu.py). Skipped where a
library does not import."""

from __future__ import annotations

import pytest
import torch

from moebench.correctness import is_correct, relative_error
from moebench.kernels.modular import FusedMoEKernel
from moebench.kernels.reference import reference_moe
from moebench.backends import make_experts, make_prepare_finalize
from moebench.quant import QuantScheme, quantize_weights

pytestmark = pytest.mark.gpu
BLOCK = QuantScheme("fp8_w8a8", "block", (128, 128))


def _needs(module: str):
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"{module} does not import: {e}")


def _problem(m, e, k, h, i, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, h, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g, device="cuda") / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g, device="cuda") / i**0.5).bfloat16()
    tw, ti = torch.softmax(torch.randn(m, e, generator=g, device="cuda"), -1).topk(k, -1)
    return x, w13, w2, tw / tw.sum(-1, keepdim=True), ti.to(torch.int32)


CASES = [("deepgemm", "no-dpep", {"layout": "psum"}), ("deepgemm", "no-dpep", {"layout": "indices"}),
         ("batched-deepgemm", "batched-local", {})]


@pytest.mark.parametrize("quant", [None, BLOCK], ids=["bf16", "fp8-block"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2].get('layout', 'masked')}")
@pytest.mark.parametrize("m,ep", [(1, False), (77, True), (300, False)], ids=["m1", "m77-ep-shard", "m300"])
def test_deepgemm_matches_reference(case, ep, quant, m):
    _needs("deep_gemm")
    ex, pf, kw = case
    e, k, h, i = 16, 4, 1024, 384
    x, w13, w2, tw, ti = _problem(m, e, k, h, i, seed=m)
    emap = None
    if ep:
        emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
        emap[4:12] = torch.arange(8, dtype=torch.int32, device="cuda")
        w13, w2 = w13[4:12].contiguous(), w2[4:12].contiguous()
    qw13, qw2 = quantize_weights(w13, w2, quant)
    kernel = FusedMoEKernel(make_prepare_finalize(pf), make_experts(ex, **kw))
    out = kernel.apply(x, qw13, qw2, tw, ti, emap, e)
    err = relative_error(out, reference_moe(x, qw13, qw2, tw, ti, emap))
    print(f"{ex} {kw} ep={ep} quant={quant is not None} m={m}: rel err {err:.2e}")
    assert is_correct(err, torch.bfloat16, quant), err


@pytest.mark.parametrize("quant", [None, BLOCK], ids=["bf16", "fp8-block"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["contiguous", "masked"])
def test_deepgemm_in_a_cuda_graph(case, quant):
    """Captured once, replayed on new routings and activations: no host synchronisation inside."""
    _needs("deep_gemm")
    ex, pf, kw = case
    e, k, h, i, m = 16, 4, 1024, 384, 64
    x, w13, w2, tw, ti = _problem(m, e, k, h, i, seed=1)
    qw13, qw2 = quantize_weights(w13, w2, quant)
    kernel = FusedMoEKernel(make_prepare_finalize(pf), make_experts(ex, **kw))
    kernel.apply(x, qw13, qw2, tw, ti)  # JIT compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.apply(x, qw13, qw2, tw, ti)
    for seed in (2, 3):
        x2, _, _, tw2, ti2 = _problem(m, e, k, h, i, seed=seed)
        x.copy_(x2), tw.copy_(tw2), ti.copy_(ti2)
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, reference_moe(x, qw13, qw2, tw, ti))
        assert is_correct(err, torch.bfloat16, quant), err


def test_deepep_ll_refuses_one_rank():
    """DeepEP stops a one-rank buffer ("Unsupported ranks"): the adapter refuses first, in a line
    that says how to run it (two ranks, which may share a GPU: tests/gpu/test_shared_gpu_gpu.py)."""
    _needs("deep_ep")
    from moebench.errors import UnsupportedError

    e, k, h, i = 16, 4, 2048, 256
    kernel = FusedMoEKernel(make_prepare_finalize("deepep-ll", max_tokens_per_rank=128), make_experts("batched-torch"))
    x, w13, w2, tw, ti = _problem(8, e, k, h, i, seed=1)
    with pytest.raises(UnsupportedError, match=">= 2 ranks"):
        kernel.apply(x, w13, w2, tw, ti)
