"""GPU checks of the weight-only schemes (int8_w8a16, int4_w4a16 with and without zero points,
mxfp4) in the Triton experts (`triton`, `batched-triton`) at model shapes (gpt-oss's 2880-wide
layers, Qwen3-30B-A3B, a DeepSeek-V3 EP8 shard) and an unaligned one, against the float64
reference of the dequantised weights; CUDA-graph capture of the layer."""

from __future__ import annotations

import pytest
import torch

import moebench
from moebench.correctness import relative_error
from moebench.kernels.modular import poisoned_outputs
from moebench.quant import QuantScheme

from gpu_helpers import assert_graph_replays_follow_reference, quantized_case

pytestmark = pytest.mark.gpu

SCHEMES = {
    "int8": QuantScheme("int8_w8a16"),
    "int4-g128": QuantScheme("int4_w4a16", group_size=128),
    "int4-g32-zp": QuantScheme("int4_w4a16", group_size=32, zero_points=True),
    "mxfp4": QuantScheme("mxfp4"),
}
# name: (E global, topk, H, I, E local)
SHAPES = {
    "gpt-oss-20b": (32, 4, 2880, 2880, 32),
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128),
    "dsv3-ep8": (256, 8, 7168, 2048, 32),
    "unaligned": (8, 2, 201, 72, 8),  # odd H, neither H nor I a multiple of any group
}
KERNELS = [("triton", "no-dpep"), ("batched-triton", "batched-local")]
#: bf16 rounding of the intermediate and output, fp32 accumulation (the reference dots the same weights).
TOL = 1e-2

def _setup(shape: str, m: int, scheme: QuantScheme, seed: int = 0):
    return quantized_case(SHAPES[shape], m, scheme, seed)


CASES = [(s, sh, m) for sh, schemes in (("gpt-oss-20b", ("mxfp4", "int4-g128")),
                                        ("qwen3-30b-a3b", ("int4-g128", "int4-g32-zp", "int8", "mxfp4")))
         for s in schemes for m in (1, 256)]
CASES += [(s, "unaligned", 33) for s in SCHEMES] + [("int4-g128", "dsv3-ep8", 64)]


@pytest.mark.parametrize("experts,pf", KERNELS, ids=["triton", "batched"])
@pytest.mark.parametrize("name,shape,m", CASES)
def test_weight_only_real_shapes(experts, pf, name, shape, m):
    x, q13, q2, tw, ti, emap, e = _setup(shape, m, SCHEMES[name])
    kernel = moebench.make_kernel(experts, pf)
    with poisoned_outputs():
        out = kernel.apply(x, q13, q2, tw, ti, expert_map=emap, num_experts=e)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    ref = moebench.reference_moe(x, q13, q2, tw, ti, emap)
    assert ref.norm() > 0
    err = relative_error(out, ref)
    assert err < TOL, err


@pytest.mark.parametrize("experts,pf", KERNELS, ids=["triton", "batched"])
@pytest.mark.parametrize("name", ["int4-g32-zp", "mxfp4"])
def test_weight_only_cuda_graph(experts, pf, name):
    assert_graph_replays_follow_reference(experts, pf, _setup("qwen3-30b-a3b", 64, SCHEMES[name]), TOL)
