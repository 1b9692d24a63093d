"""GPU checks of the `torch` experts' fp8 path (torch's scaled grouped GEMM, tensor / token
scales) at real and unaligned shapes, under CUDA-graph capture, and of the fp8 matmul ceiling.
Skipped where the scaled grouped GEMM cannot run (not sm90 / sm100, ROCm, older torch)."""

from __future__ import annotations

import pytest
import torch

import moebench
from moebench.bench.timing import capture_graph
from moebench.correctness import FP8_TOLERANCE, relative_error
from moebench.errors import UnsupportedError
from moebench.kernels.modular import poisoned_outputs
from moebench.kernels.torch_experts import TorchExperts
from moebench.quant import QuantScheme, quantize_weights

from gpu_helpers import first_experts_map, replay_on_new_inputs, softmax_topk

pytestmark = pytest.mark.gpu

SCHEMES = {"tensor": QuantScheme("fp8_w8a8", "tensor"), "token": QuantScheme("fp8_w8a8", "token")}
# name: (E global, topk, H, I, E local)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128),
    "mixtral-tp8": (8, 2, 4096, 1792, 8),
    "dsv3-ep8": (256, 8, 7168, 2048, 32),
    "unaligned": (8, 2, 200, 72, 8),  # H, I not multiples of 16: padded
}


def _need_fp8(scheme):
    reason = TorchExperts.quant_unavailable_reason("cuda", scheme)
    if reason is not None:
        pytest.skip(reason)


def _setup(shape: str, m: int, scheme: QuantScheme, seed: int = 0):
    e, k, h, i, e_local = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(e_local, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e_local, h, i, device="cuda", generator=g, dtype=torch.bfloat16) / i**0.5
    q13, q2 = quantize_weights(w13, w2, scheme, act_dtype=torch.bfloat16)
    x = torch.randn(m, h, device="cuda", generator=g, dtype=torch.bfloat16)
    tw, ti = softmax_topk(torch.randn(m, e, device="cuda", generator=g), k)
    return x, q13, q2, tw, ti, first_experts_map(e, e_local), e


@pytest.mark.parametrize("scales", list(SCHEMES))
@pytest.mark.parametrize("shape,m", [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 1024),
                                     ("mixtral-tp8", 16), ("dsv3-ep8", 256), ("unaligned", 33)])
def test_torch_fp8_matches_reference(scales, shape, m):
    scheme = SCHEMES[scales]
    _need_fp8(scheme)
    x, q13, q2, tw, ti, emap, e = _setup(shape, m, scheme)
    kernel = moebench.make_kernel("torch", "no-dpep")
    with poisoned_outputs():
        out = kernel.apply(x, q13, q2, tw, ti, expert_map=emap, num_experts=e)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    err = relative_error(out, moebench.reference_moe(x, q13, q2, tw, ti, emap))
    assert err < FP8_TOLERANCE, err


@pytest.mark.parametrize("scales", list(SCHEMES))
def test_torch_fp8_cuda_graph(scales):
    scheme = SCHEMES[scales]
    _need_fp8(scheme)
    x, q13, q2, tw, ti, emap, e = _setup("qwen3-30b-a3b", 64, scheme)
    kernel = moebench.make_kernel("torch", "no-dpep")

    def layer():
        return kernel.apply(x, q13, q2, tw, ti, expert_map=emap, num_experts=e)

    graph, out = capture_graph(layer)
    for seed in (5, 6):
        replay_on_new_inputs(graph, x, seed)
        ref = moebench.reference_moe(x, q13, q2, tw, ti, emap)
        assert relative_error(out, ref) < FP8_TOLERANCE


def test_torch_fp8_refuses_block_scales():
    scheme = QuantScheme("fp8_w8a8", "block", (128, 128))
    x, q13, q2, tw, ti, emap, e = _setup("qwen3-30b-a3b", 4, scheme)
    with pytest.raises(UnsupportedError, match="do not support"):
        moebench.make_kernel("torch", "no-dpep").apply(x, q13, q2, tw, ti)


def test_fp8_matmul_ceiling():
    from moebench.bench.hardware import _fp8_matmul_tflops, fp8_matmul_unavailable_reason

    dev = torch.device("cuda", torch.cuda.current_device())
    reason = fp8_matmul_unavailable_reason(dev)
    tflops, note = _fp8_matmul_tflops(dev, n=4096, reps=5)
    if reason is not None:
        assert tflops is None and reason in note
        return
    assert tflops is not None and tflops > 0, note
    if "H200" in torch.cuda.get_device_name(dev) or "H100" in torch.cuda.get_device_name(dev):
        assert 300 < tflops < 2000, tflops  # dense e4m3 peak 1979
