"""Activations (silu, gelu, swigluoai), expert biases, shared experts and the checkpoint's
quantization_config: every experts backend against the float64 reference, and the reference
against formulas written out here (independently of moebench's code)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import moebench
from helpers import random_expert_map, rel_err
from test_cli import moebench_inproc
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
    from moebench.backends import check_combination, get_experts_class
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


# ---------------------------------------------------------------------------------------------
# Shared experts


def _shared_formula(x, shape, seed, act, gate=None):
    """The shared MLP written out from freshly generated weights (same seeds as the layer)."""
    from moebench.inputs import make_weights
    from moebench.sweep.layer import _SHARED_SEED_ID

    sw13, sw2 = make_weights([_SHARED_SEED_ID], shape.hidden, shape.shared_intermediate, torch.float32, "cpu", seed)
    i = shape.shared_intermediate
    gu = x.double() @ sw13[0].double().t()
    h = gu[:, :i] / (1 + torch.exp(-gu[:, :i])) * gu[:, i:]
    y = h @ sw2[0].double().t()
    return y if gate is None else y * gate.double()[:, None]


@pytest.mark.parametrize("gated", [False, True])
def test_shared_fused_and_separate_match_formula(gated):
    from moebench.kernels.layer import MoELayer
    from moebench.sweep.layer import layer_args, layer_reference, make_rank_layer, shared_gate_values
    from moebench.models import custom_shape

    shape = custom_shape(6, 2, 40, 24, shared_experts=1, shared_intermediate=48, shared_gate=gated)
    x, _, _, tw, ids, _ = _problem(7)
    gate = shared_gate_values(x, 3) if gated else None
    plain = make_rank_layer(shape, range(6), torch.float32, "cpu", 0, 0, 1, Activation("silu"), False, "none")
    routed = reference_moe(x, plain.w13, plain.w2, tw, ids)
    expect = routed + _shared_formula(x, shape, 0, Activation("silu"), gate)
    for mode in ("fused", "separate"):
        lw = make_rank_layer(shape, range(6), torch.float32, "cpu", 0, 0, 1, Activation("silu"), False, mode)
        assert (lw.num_fused == 2) == (mode == "fused")
        args = layer_args(lw, x, tw, ids, 6, gate)
        assert rel_err(layer_reference(lw, args, gate=gate), expect) < 1e-10
        for experts, pf in (("triton", "no-dpep"), ("torch", "no-dpep"), ("batched-triton", "batched-local")):
            kw = {"config": CFG} if "triton" in experts else None
            layer = MoELayer(moebench.make_kernel(experts, pf, experts_kwargs=kw), bias=lw.bias,
                             shared_w13=lw.shared_w13, shared_w2=lw.shared_w2, shared_gate=gate)
            with poisoned_outputs():
                out = layer.apply(*args)
            assert rel_err(out, expect) < 1e-4, (mode, experts)
    assert rel_err(routed, expect) > 1e-2  # the shared expert matters


def test_fused_needs_whole_chunks_and_modes_parse():
    from moebench.cli.options import parse_shared_modes
    from moebench.kernels.layer import fused_count

    assert fused_count(5632, 1408) == 4
    with pytest.raises(MoebenchError, match="separate"):
        fused_count(100, 24)
    assert parse_shared_modes(None, True) == ["separate"] and parse_shared_modes(None, False) == ["none"]
    assert parse_shared_modes("all", True) == ["none", "fused", "separate"]
    with pytest.raises(MoebenchError, match="no shared experts"):
        parse_shared_modes("fused", False)
    with pytest.raises(MoebenchError, match="unknown"):
        parse_shared_modes("both", True)


def test_simulated_tp_ep_sweep_with_shared_experts(tmp_path):
    from moebench.bench import metrics
    from moebench.layout import ParallelLayout
    from moebench.models import custom_shape
    from moebench.results import RunStore
    from moebench.comm.links import link_for
    from moebench.sweep import SweepSpec, run_simulated

    link, _ = link_for("cpu", None, None, None)
    shape = custom_shape(8, 2, 32, 16, shared_experts=1, shared_intermediate=32, shared_gate=True)
    flops = {}
    for name, lay in (("tp", ParallelLayout.from_args(2, None, None, None)),
                      ("ep", ParallelLayout.from_args(None, None, 2, None))):
        for mode in ("none", "fused", "separate"):
            spec = SweepSpec(shape=shape, tokens=[4], layout=lay, experts=["triton", "batched-triton"],
                             prepare_finalize=["no-dpep", "allgather-rs", "all2all-ll"], dtype=torch.float32,
                             activation=Activation("swigluoai"), bias=True, shared=mode, reps=1)
            rows = [r for r in run_simulated(spec, RunStore(tmp_path / f"{name}-{mode}", metadata={}), link)
                    if r.status != "skipped"]
            assert rows and all(r.status == "ok" and r.correct for r in rows), [(r.reason, r.max_rel_err) for r in rows]
            assert all(r.shared_experts == mode and r.activation == "swigluoai" and r.expert_bias for r in rows)
            flops[name, mode] = rows[0].tflops * rows[0].experts_us
    # the shared MLP adds work to each rank's experts (TP: its I shard; EP: its own tokens)
    for name in ("tp", "ep"):
        assert flops[name, "fused"] > flops[name, "none"] and flops[name, "separate"] > flops[name, "none"]
    assert metrics.shared_flops(4, 32, 32) == 2 * 4 * 3 * 32 * 32


# ---------------------------------------------------------------------------------------------
# quantization_config


def test_quant_from_config_mapping():
    from moebench.models import CheckpointQuant, checkpoint_scheme, quant_from_config

    ds = quant_from_config({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
    assert ds == CheckpointQuant("fp8_w8a8", block_shape=(128, 128)) and ds.describe() == "fp8_w8a8 block[128,128]"
    scheme = checkpoint_scheme(ds)
    assert scheme.scales == "block" and scheme.block_shape == (128, 128)
    assert checkpoint_scheme(quant_from_config({"quant_method": "fp8"})).scales == "tensor"
    oss = quant_from_config({"quant_method": "mxfp4", "modules_to_not_convert": ["router"]})
    assert (oss.dtype, oss.group_size) == ("mxfp4", 32)
    gptq = quant_from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})
    assert (gptq.dtype, gptq.group_size) == ("int4_w4a16", 128) and gptq.describe() == "int4_w4a16 group 128"
    assert not gptq.zero_points and checkpoint_scheme(gptq).zero_points is False
    asym = quant_from_config({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False})
    assert asym.zero_points and asym.describe() == "int4_w4a16 group 64 zero points"
    s = checkpoint_scheme(asym)
    assert (s.name, s.group_size, s.zero_points) == ("int4_w4a16", 64, True)
    awq4 = quant_from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"})
    assert awq4.zero_points and checkpoint_scheme(awq4).zero_points  # AWQ's zero_point defaults to true
    assert not quant_from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}).zero_points
    awq = quant_from_config({"quant_method": "awq", "bits": 8, "group_size": -1, "zero_point": False})
    assert (awq.dtype, awq.group_size) == ("int8_w8a16", None)
    with pytest.raises(MoebenchError, match="zero points with int4_w4a16 only"):
        checkpoint_scheme(quant_from_config({"quant_method": "awq", "bits": 8, "group_size": -1}))
    assert quant_from_config(None) is None
    from moebench.quant import QUANT_DTYPES

    for cq in (oss, gptq):
        if cq.dtype not in QUANT_DTYPES:
            with pytest.raises(MoebenchError, match=cq.dtype):
                checkpoint_scheme(cq)
    with pytest.raises(MoebenchError, match="bits 3"):
        quant_from_config({"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(MoebenchError, match="bitsandbytes"):
        quant_from_config({"quant_method": "bitsandbytes"})


def _write_config(path, **extra):
    cfg = {"model_type": "deepseek_v3", "n_routed_experts": 6, "num_experts_per_tok": 2, "hidden_size": 64,
           "moe_intermediate_size": 32, "n_shared_experts": 1, "hidden_act": "silu"}
    cfg.update(extra)
    path.write_text(json.dumps(cfg))
    return path


def test_read_config_shared_activation_quant(tmp_path):
    from moebench.models import get_model

    s = get_model(str(_write_config(tmp_path / "ds.json", quantization_config={"quant_method": "fp8",
                                                                              "weight_block_size": [32, 32]})))
    assert (s.shared_intermediate, s.shared_gate, s.activation) == (32, False, "silu")
    assert s.quantization.block_shape == (32, 32)
    q = get_model(str(_write_config(tmp_path / "q.json", model_type="qwen2_moe", n_shared_experts=None,
                                    shared_expert_intermediate_size=64)))
    assert (q.shared_intermediate, q.shared_gate) == (64, True)
    oss = get_model(str(_write_config(tmp_path / "o.json", model_type="gpt_oss", n_shared_experts=None,
                                      quantization_config={"quant_method": "mxfp4"})))
    assert (oss.activation, oss.expert_bias, oss.shared_intermediate, oss.quantization.dtype) == ("swigluoai", True, 0, "mxfp4")
    assert get_model("gpt-oss-20b").activation == "swigluoai" and get_model("deepseek-v3").quantization.block_shape == (128, 128)


def test_cli_applies_quantization_config_and_runs_shared(tmp_path, monkeypatch):
    # through the CLI's entry point in this process, its console 200 columns wide
    monkeypatch.setenv("COLUMNS", "200")
    cfg = _write_config(tmp_path / "config.json", quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32]})
    res = moebench_inproc("sweep", "--model", str(cfg), "--tokens", "2", "--experts", "triton", "--prepare-finalize",
                          "no-dpep", "--shared-experts", "fused,separate", "--reps", "1", "--out", str(tmp_path / "r"),
                          cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "applied quantization_config: fp8_w8a8 block[32,32] (from config.json; --dtype overrides)" in res.stdout
    assert "[shared fused]" in res.stdout and "[shared separate]" in res.stdout
    res = moebench_inproc("sweep", "--model", str(cfg), "--tokens", "2", "--experts", "torch", "--prepare-finalize",
                          "no-dpep", "--dtype", "fp32", "--shared-experts", "none", "--reps", "1",
                          "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "not applied: --dtype fp32 given" in res.stdout


@pytest.mark.parametrize("args,msg", [
    (("--model", "gpt-oss-20b", "--tokens", "1", "--dtype", "fp32", "--shared-experts", "fused"), "no shared experts"),
    (("--model", "gpt-oss-20b", "--tokens", "1", "--dtype", "fp32", "--experts", "deepgemm"), "swigluoai"),
    (("--model", "gpt-oss-20b", "--tokens", "1"), "mxfp4"),
    (("--num-experts", "4", "--topk", "2", "--hidden", "16", "--intermediate", "8", "--activation", "relu"),
     "unknown activation"),
    (("--model", "deepseek-v2-lite", "--dtype", "fp32", "--tokens", "1", "--world-size", "2", "--tp", "2",
      "--shared-experts", "fused"), "real ranks"),
])
def test_cli_bad_combinations_exit_2(tmp_path, args, msg):
    from moebench.quant import QUANT_DTYPES

    if msg == "mxfp4" and "mxfp4" in QUANT_DTYPES:
        pytest.skip("mxfp4 is a known dtype in this build")
    res = moebench_inproc("sweep", *args, "--out", str(tmp_path / "r"), cwd=tmp_path)  # refused before running
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert msg in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2


@pytest.mark.parametrize("world", [2, 4])
def test_real_ranks_run_the_whole_layer(tmp_path, world):
    """Real gloo ranks run the model's layer: swigluoai with expert biases and a gated separate
    shared MLP, TP (shards, all-reduced) and EP (each rank's own tokens), checked against the
    float64 reference of the whole layer."""
    from moebench.layout import ParallelLayout
    from moebench.models import custom_shape
    from moebench.results import RunStore
    from moebench.sweep import SweepSpec, run_multirank

    shape = custom_shape(8, 2, 32, 16, shared_experts=1, shared_intermediate=32, shared_gate=True)
    for name, lay in (("tp", ParallelLayout.from_args(world, None, None, None)),
                      ("ep", ParallelLayout.from_args(None, None, world, None))):
        spec = SweepSpec(shape=shape, tokens=[5], layout=lay, experts=["torch", "batched-torch"],
                         prepare_finalize=["no-dpep", "allgather-rs", "all2all-ll"], dtype=torch.float32,
                         activation=Activation("swigluoai"), bias=True, shared="separate", reps=1, warmup=0)
        folder = tmp_path / name
        RunStore(folder, metadata={}).close()
        run_multirank(spec, folder, world_size=world)
        rows = [r for r in RunStore(folder).rows if r.status != "skipped"]
        assert rows and all(r.status == "ok" and r.correct for r in rows), [(r.reason, r.max_rel_err) for r in rows]
        assert all(r.shared_experts == "separate" and r.expert_bias and not r.modeled for r in rows)
