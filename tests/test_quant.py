"""fp8 quantisation (moebench.quant): scale layouts, rounding, partial blocks, byte rows, the
reference's emulation, capabilities and CLI errors."""

from __future__ import annotations

import pytest
import torch

from moebench.bench import metrics
from moebench.errors import MoebenchError, UnsupportedError
from moebench.inputs import make_weights
from moebench.kernels.act_quant import maybe_quantize
from moebench.kernels.reference import reference_moe
from moebench.backends import check_combination, make_kernel
from moebench.quant import (
    FP8_DTYPE,
    ActQuant,
    QuantScheme,
    dequantize_activation,
    fake_quant,
    pack_rows,
    parse_quant,
    quantize_activation,
    quantize_weight,
    quantize_weights,
    unpack_rows,
)

SCHEMES = [
    QuantScheme("fp8_w8a8", "tensor"),
    QuantScheme("fp8_w8a8", "token"),
    QuantScheme("fp8_w8a8", "block", (128, 128)),
    QuantScheme("fp8_w8a8", "block", (32, 48)),
]
IDS = ["tensor", "token", "block128", "block32x48"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_weight_scale_layout_and_roundtrip(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 72, generator=g) * 0.1  # N, K not multiples of the block
    qw = quantize_weight(w, scheme)
    assert qw.q.dtype == FP8_DTYPE and qw.q.shape == w.shape
    want = {"tensor": (3,), "token": (3, 200)}.get(scheme.scales)
    if scheme.scales == "block":
        bn, bk = scheme.block_shape
        want = (3, -(-200 // bn), -(-72 // bk))
    assert tuple(qw.scale.shape) == want
    # e4m3 keeps 3 mantissa bits: about 2-4 % relative error, never more than 1/16 of the value
    assert _rel(qw.dequantize(), w) < 0.04
    # the largest magnitude of each scale's region maps to 448 (the top of e4m3)
    assert float(qw.q.float().abs().max()) == 448.0


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_weights_are_quantised_a_few_experts_at_a_time(scheme, monkeypatch):
    # Chunks of experts (bounded temporaries) give the same codes and scales as one pass.
    import moebench.quant as Q

    w = torch.randn(5, 200, 72, generator=torch.Generator().manual_seed(1)) * 0.1
    whole = quantize_weight(w, scheme)
    monkeypatch.setattr(Q, "_QUANT_CHUNK_BYTES", 2 * 200 * 72 * 4)  # two experts per chunk: 2 + 2 + 1
    parts = quantize_weight(w, scheme)
    assert torch.equal(parts.q.view(torch.uint8), whole.q.view(torch.uint8))
    assert torch.equal(parts.scale, whole.scale) and parts.scale.shape == whole.scale.shape


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_activation_scales_per_row_and_group(scheme):
    x = torch.randn(5, 72).bfloat16()
    static = torch.tensor([0.01]) if scheme.scales == "tensor" else None
    q, s = quantize_activation(x, scheme, static)
    assert q.shape == x.shape and s.shape == (5, scheme.num_groups(72)) and s.dtype == torch.float32
    if scheme.scales == "tensor":
        assert s.stride(0) == 0 and torch.all(s == 0.01)  # one static scale, viewed per row
    back = dequantize_activation(q, s, scheme)
    assert _rel(back, x) < (0.2 if scheme.scales == "tensor" else 0.04)  # static scale saturates a little
    # the last, partial group has its own scale
    if scheme.scales == "block":
        last = x[:, (scheme.num_groups(72) - 1) * scheme.group_k :].float().abs().amax(dim=1)
        assert torch.allclose(s[:, -1], last / 448.0)


def test_dynamic_tensor_scale_and_empty_input():
    x = torch.randn(4, 16)
    q, s = quantize_activation(x, QuantScheme(scales="tensor"))
    assert torch.allclose(s[0, 0], x.abs().max() / 448.0)
    q0, s0 = quantize_activation(torch.empty(0, 16), QuantScheme(scales="block", block_shape=(8, 8)))
    assert q0.shape == (0, 16) and s0.shape == (0, 2)


def test_pack_rows_roundtrip_is_bit_exact():
    scheme = QuantScheme(scales="block", block_shape=(16, 16))
    q, s = quantize_activation(torch.randn(7, 40), scheme)
    buf = pack_rows(q, s)
    assert buf.dtype == torch.uint8 and buf.shape == (7, 40 + 4 * 3)
    q2, s2 = unpack_rows(buf, 40)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


def test_maybe_quantize_without_scheme_is_identity():
    x = torch.randn(3, 8)
    a, s = maybe_quantize(x, None)
    assert a is x and s is None
    a, s = maybe_quantize(x, ActQuant(QuantScheme(scales="token")))
    assert a.dtype == FP8_DTYPE and s.shape == (3, 1)


def test_static_input_scales_are_calibrated_and_shared_by_shards():
    scheme = QuantScheme(scales="tensor")
    w13, w2 = make_weights(range(4), 64, 32, torch.bfloat16, "cpu", 0, quant=scheme)
    assert w13.input_scale.shape == (1,) and w2.input_scale.shape == (1,)
    assert w13.input_scale > 0 and w2.input_scale > 0
    # an EP rank holding experts 2..3 derives the same x scale (same calibration tokens)
    r13, _ = make_weights(range(2, 4), 64, 32, torch.bfloat16, "cpu", 0, quant=scheme)
    assert torch.equal(r13.input_scale, w13.input_scale)
    assert torch.equal(r13.q.view(torch.uint8), w13[2:4].q.view(torch.uint8))


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_reference_emulates_the_scheme(scheme):
    """The float64 reference of quantised weights passes the activations through the scheme's
    rounding points: its distance to the unquantised reference is fp8's error (a few %), and the
    `reference` experts (which quantise their own input) reproduce it exactly."""
    e, h, i = 6, 72, 40
    w13, w2 = make_weights(range(e), h, i, torch.bfloat16, "cpu", 0)
    q13, q2 = quantize_weights(w13, w2, scheme, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, h, generator=g).bfloat16()
    ids = torch.rand(9, e, generator=g).argsort(dim=1)[:, :2].int()
    w = torch.rand(9, 2, generator=g)
    ref_q = reference_moe(x, q13, q2, w, ids)
    ref = reference_moe(x, w13, w2, w, ids)
    assert 0.01 < _rel(ref_q, ref) < 0.12
    out = make_kernel("reference", "no-dpep").apply(x, q13, q2, w, ids)
    assert _rel(out, ref_q) < 5e-3  # only the final bf16 rounding


def test_fake_quant_is_dequantised_quantisation():
    scheme = QuantScheme(scales="token")
    t = torch.randn(4, 24, dtype=torch.float64)
    q, s = quantize_activation(t.to(torch.bfloat16), scheme)
    assert torch.equal(fake_quant(t, scheme, torch.bfloat16), dequantize_activation(q, s, scheme))


def test_capabilities_decide_the_pairs():
    block = QuantScheme(scales="block", block_shape=(128, 128))
    assert "do not support" in check_combination("batched-local", "batched-torch", "cpu", torch.bfloat16, quant=block)
    assert check_combination("no-dpep", "reference", "cpu", torch.bfloat16, quant=block) is None
    w13, w2 = make_weights(range(2), 16, 8, torch.bfloat16, "cpu", 0, quant=block)
    with pytest.raises(UnsupportedError, match="batched-torch"):
        make_kernel("batched-torch", "batched-local").apply(torch.randn(2, 16).bfloat16(), w13, w2,
                                                          torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32))


def test_fp8_bytes_count_payload_and_scales():
    h, i = 256, 128
    assert metrics.expert_weight_bytes(h, i, 2) == 3 * h * i * 2
    assert metrics.expert_weight_bytes(h, i, 2, QuantScheme(scales="tensor")) == 3 * h * i + 8
    assert metrics.expert_weight_bytes(h, i, 2, QuantScheme(scales="token")) == 3 * h * i + 4 * (2 * i + h)
    blk = QuantScheme(scales="block", block_shape=(128, 128))
    assert metrics.expert_weight_bytes(h, i, 2, blk) == 3 * h * i + 4 * (2 * 2 + 2 * 1)
    ids = torch.tensor([[0, 1]])
    assert metrics.layer_bytes(ids, 4, h, i, 2, 1, blk) == 2 * metrics.expert_weight_bytes(h, i, 2, blk) + 2 * h * 2


def test_parse_quant_errors():
    assert parse_quant("bf16") is None
    assert parse_quant("fp8_w8a8") == QuantScheme("fp8_w8a8", "tensor")
    assert parse_quant("fp8_w8a8", "128,128").block_shape == (128, 128)
    assert parse_quant("fp8_w8a8", None, "token").scales == "token"
    for args in (("bf16", "128,128"), ("fp8_w8a8", "128"), ("fp8_w8a8", "a,b"), ("fp8_w8a8", None, "block"),
                 ("fp8_w8a8", "128,128", "token")):
        with pytest.raises(MoebenchError):
            parse_quant(*args)


def test_quantised_tp_shards_are_built_per_shard():
    from moebench.layout import ParallelLayout

    w13, w2 = make_weights(range(2), 16, 8, torch.bfloat16, "cpu", 0, quant=QuantScheme(scales="token"))
    with pytest.raises(MoebenchError, match="per shard"):
        ParallelLayout(tp=2).shard_weights(w13, w2, 0)
