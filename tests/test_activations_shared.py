"""Activations (silu, gelu, swigluoai), expert biases, shared experts and the checkpoint's
quantization_config: every experts backend against the float64 reference, and the reference
against formulas written out here (independently of moebench's code)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import moebench
from helpers import random_expert_map, rel_err
from moebench.activation import Activation, activation_from_config, parse_activation
from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels.modular import ExpertBias, poisoned_outputs
from moebench.kernels.reference import reference_moe

H, I, E, K, M = 40, 24, 6, 2, 9
CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
ACTS = [Activation("silu"), Activation("gelu"), Activation("swigluoai")]


def _problem(seed: int = 0, scale: float = 1.0, e: int = E, h: int = H, i: int = I, m: int = M, k: int = K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g) * scale
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    bias = ExpertBias(torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g) * 0.5)
    logits = torch.randn(m, e, generator=g)
    tw, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, w13, w2, tw.float(), ids.to(torch.int64), bias


def _formula(x, w13, w2, tw, ids, act: Activation, bias: ExpertBias | None):
    """The layer written out token by token in float64, from the models' definitions."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    i = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double()
            if bias is not None:
                gu = gu + bias.b13[e].double()
            if act.name == "swigluoai":
                gate = torch.minimum(gu[0::2], torch.tensor(act.limit, dtype=torch.float64))
                up = gu[1::2].clamp(-act.limit, act.limit)
                h = (up + 1) * gate / (1 + torch.exp(-act.alpha * gate))
            else:
                gate, up = gu[:i], gu[i:]
                if act.name == "gelu":
                    f = torch.tensor([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in gate.tolist()], dtype=torch.float64)
                else:
                    f = gate / (1 + torch.exp(-gate))
                h = f * up
            y = w2[e].double() @ h
            if bias is not None:
                y = y + bias.b2[e].double()
            out[t] += float(tw[t, j]) * y
    return out


@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.name)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_reference_matches_formula(act, with_bias):
    # scale 3: swigluoai's clamps (limit 7) are reached by some gate / up values
    x, w13, w2, tw, ids, bias = _problem(1, scale=3.0)
    b = bias if with_bias else None
    gu = torch.einsum("mh,enh->men", x.double(), w13.double())
    if act.name == "swigluoai":
        assert (gu.abs() > act.limit).any(), "the test should reach the clamp"
    ref = reference_moe(x, w13, w2, tw, ids, activation=act, bias=b)
    assert rel_err(ref, _formula(x, w13, w2, tw, ids, act, b)) < 1e-12
    # the activation and the bias change the result (a test that could not fail otherwise)
    if act.name != "silu" or with_bias:
        assert rel_err(reference_moe(x, w13, w2, tw, ids), ref) > 1e-2


def test_interleaved_layout_is_even_gate_odd_up():
    # swigluoai on interleaved rows equals swigluoai on the same rows de-interleaved into halves
    # through the explicit formula; and differs from reading the halves layout.
    x, w13, w2, tw, ids, _ = _problem(2, scale=3.0)
    act = Activation("swigluoai")
    ref = reference_moe(x, w13, w2, tw, ids, activation=act)
    halves = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
    # the formula on halves: gate rows first, up rows after
    gate_up = torch.einsum("mh,enh->men", x.double(), halves.double())
    g, u = gate_up[..., :I].clamp(max=act.limit), gate_up[..., I:].clamp(-act.limit, act.limit)
    h = (u + 1) * g * torch.sigmoid(act.alpha * g)
    y = torch.einsum("men,ehn->meh", h, w2.double())
    manual = torch.zeros(M, H, dtype=torch.float64)
    for j in range(K):
        manual += tw[:, j : j + 1].double() * y[torch.arange(M), ids[:, j]]
    assert rel_err(ref, manual) < 1e-12
    assert rel_err(reference_moe(x, halves, w2, tw, ids, activation=act), ref) > 1e-2


def _run(experts: str, pf: str, x, w13, w2, tw, ids, act, bias, emap=None, num_experts=None, **kw):
    kernel = moebench.make_kernel(experts, pf, experts_kwargs=kw or None)
    with poisoned_outputs():
        return kernel.apply(x, w13, w2, tw, ids, emap, num_experts, activation=act, bias=bias)


@pytest.mark.parametrize("experts,pf", [("torch", "no-dpep"), ("batched-torch", "batched-local"),
                                        ("triton", "no-dpep"), ("batched-triton", "batched-local")])
@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.name)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_experts_match_reference(experts, pf, act, with_bias):
    x, w13, w2, tw, ids, bias = _problem(3, scale=3.0)
    b = bias if with_bias else None
    kw = {"config": CFG} if "triton" in experts else {}
    out = _run(experts, pf, x, w13, w2, tw, ids, act, b, **kw)
    ref = reference_moe(x, w13, w2, tw, ids, activation=act, bias=b)
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("experts,pf", [("triton", "no-dpep"), ("torch", "no-dpep"),
                                        ("batched-triton", "batched-local")])
def test_bias_with_expert_map_and_odd_sizes(experts, pf):
    # EP share (remote experts contribute nothing, not even their bias); H, I not multiples of 8;
    # Triton's GEMM2 split over K adds b2 once.
    x, w13, w2, tw, ids, bias = _problem(4, e=8, h=36, i=20, m=7, k=3)
    emap = random_expert_map(8, 5, "cpu")
    keep = emap >= 0
    lw13, lw2 = w13[keep], w2[keep]
    lbias = ExpertBias(bias.b13[keep], bias.b2[keep])
    act = Activation("swigluoai")
    kw = {"config": CFG, "split_k": 2} if experts == "triton" else ({"config": CFG} if "triton" in experts else {})
    out = _run(experts, pf, x, lw13, lw2, tw, ids, act, lbias, emap, 8, **kw)
    ref = reference_moe(x, lw13, lw2, tw, ids, emap, activation=act, bias=lbias)
    assert rel_err(out, ref) < 1e-4


def test_bf16_swigluoai_triton():
    x, w13, w2, tw, ids, bias = _problem(5, scale=3.0)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    bias = ExpertBias(bias.b13.bfloat16(), bias.b2.bfloat16())
    act = Activation("swigluoai")
    out = _run("triton", "no-dpep", x, w13, w2, tw, ids, act, bias, config=CFG)
    assert rel_err(out, reference_moe(x, w13, w2, tw, ids, activation=act, bias=bias)) < 2e-2


def test_unsupported_activation_is_refused_with_reason():
    from moebench.kernels.registry import check_combination, get_experts_class
    from moebench.quant import QuantScheme

    act = Activation("swigluoai")
    why = get_experts_class("deepgemm").activation_unavailable_reason(act, True)
    assert why and "swigluoai" in why
    block = QuantScheme(scales="block", block_shape=(128, 128))
    why = check_combination("no-dpep", "triton", "cpu", torch.float32, quant=block, activation=act)
    assert why and "interleaved" in why
    assert check_combination("no-dpep", "triton", "cpu", torch.float32, activation=act, bias=True) is None
    x, w13, w2, tw, ids, bias = _problem(6)
    kernel = moebench.make_kernel("torch", "no-dpep")
    q13, q2 = moebench.quantize_weights(w13, w2, QuantScheme(scales="token"))
    with pytest.raises(UnsupportedError, match="biases"):
        kernel.apply(x, q13, q2, tw, ids, activation=Activation("gelu"), bias=bias)


def test_activation_from_config_and_parse():
    assert activation_from_config({"model_type": "gpt_oss", "swiglu_limit": 7.0}) == (Activation("swigluoai"), True)
    assert activation_from_config({"hidden_act": "silu"}) == (Activation("silu"), False)
    assert activation_from_config({"hidden_act": "gelu"})[0].name == "gelu"
    assert activation_from_config({})[0].name == "silu"
    with pytest.raises(MoebenchError, match="approximation"):
        activation_from_config({"hidden_act": "gelu_pytorch_tanh"})
    with pytest.raises(MoebenchError, match="relu2"):
        activation_from_config({"hidden_act": "relu2"})
    assert parse_activation(None) is None and parse_activation("GELU") == Activation("gelu")
    with pytest.raises(MoebenchError, match="unknown activation"):
        parse_activation("tanh")
