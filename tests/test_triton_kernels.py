"""The `triton-kernels` experts (OpenAI's triton_kernels, optional): reading its API from the
installed package, the refusals (not installed, the older matmul_ogs API, an unknown API, fp8
scales and dtypes it does not take), what `env` and `check_combination` say where it cannot run,
and the adapter's bookkeeping (sort, gather, scatter, router weights, biases, activations, fp8
and mxfp4 weights, EP) against the float64 reference through a torch model of matmul's contract.

triton_kernels' own kernels do not run on a CPU, not even under the Triton interpreter: its
launchers ask the active Triton driver for the target (a CPU machine has none) and build their
kernels by specialising JITFunctions from generated source, which the interpreter cannot run.
tests/gpu/test_triton_kernels_gpu.py runs the real package on a GPU."""

from __future__ import annotations

import inspect
import json
import types

import pytest
import torch

import moebench
from helpers import random_expert_map, rel_err
from test_cli import moebench_inproc
from moebench.activation import Activation
from moebench.backends import check_combination
from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels import triton_kernels as tk
from moebench.kernels.modular import ExpertBias, poisoned_outputs
from moebench.kernels.reference import reference_moe
from moebench.quant import QuantScheme, e2m1_decode, quantize_weights, unpack_nibbles


# ---------------------------------------------------------------------------------------------
# Reading the API


def _fn(params):
    def f(*a, **k):
        return None
    f.__signature__ = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                         for p in params])
    return f


def _modules(drop: dict[str, str] | None = None, lack: tuple[str, str, str] | None = None, ogs=False):
    """Fake triton_kernels modules with every name of MATMUL_API; drop {module: why}: that module
    fails to import (why: 'missing' or 'broken'); lack (module, name, param): that parameter is gone."""
    mods = {"triton_kernels": types.SimpleNamespace()}
    for modname, wanted in tk.MATMUL_API.items():
        ns = types.SimpleNamespace()
        for name, params in wanted.items():
            ps = [p for p in params if lack is None or (modname, name, p) != lack]
            setattr(ns, name, _fn(ps) if params else object())
        mods[modname] = ns
    if ogs:
        mods[tk.OGS_MODULE] = types.SimpleNamespace(matmul_ogs=_fn(("x", "w")))

    def importer(name):
        why = (drop or {}).get(name)
        if why == "broken":
            raise ImportError("cannot import name 'is_hip_gfx1250' from 'triton.language.target_info'", name="triton")
        if why == "missing" or name not in mods:
            raise ImportError(f"No module named '{name}'", name=name)
        return mods[name]
    return importer


def test_reads_the_matmul_api():
    api, why = tk.read_api(_modules(), version="tokenspeed-triton-kernels 1.0.0.post20260510")
    assert why is None and api.version == "tokenspeed-triton-kernels 1.0.0.post20260510"
    assert set(tk.MATMUL_API["triton_kernels.matmul"]) <= set(api.names) and callable(api.matmul)


@pytest.mark.parametrize("importer,needles", [
    (_modules({"triton_kernels": "missing"}), ["not installed", "vendor install triton-kernels"]),
    (_modules({"triton_kernels": "broken"}), ["does not import", "is_hip_gfx1250"]),
    (_modules({"triton_kernels.matmul": "missing"}, ogs=True), ["tk 0.9", "matmul_ogs API", "tokenspeed-triton-kernels 1.0"]),
    (_modules({"triton_kernels.matmul": "missing"}), ["tk 0.9 is an API moebench does not know", "no triton_kernels.matmul"]),
    (_modules(lack=("triton_kernels.matmul", "matmul", "gammas")), ["no triton_kernels.matmul.matmul(gammas)"]),
    (_modules(lack=("triton_kernels.reduce", "reduce", "mask")), ["triton_kernels.reduce.reduce(mask)"]),
], ids=["missing", "broken", "matmul_ogs", "no-matmul", "no-gammas", "no-mask"])
def test_refuses_what_it_cannot_read(importer, needles):
    api, why = tk.read_api(importer, version="tk 0.9")
    assert api is None and "\n" not in why
    for n in needles:
        assert n in why, why


def test_reads_the_installed_package():
    """Runs where triton_kernels is installed (a side folder on PYTHONPATH on the CPU machine)."""
    pytest.importorskip("triton_kernels.matmul")
    api, why = tk.read_api()
    assert why is None, why
    assert "tokenspeed-triton-kernels" in api.version or "source tree" in api.version


# ---------------------------------------------------------------------------------------------
# Where it cannot run: env, check_combination, the refusals of apply


def test_check_combination_says_why(monkeypatch):
    assert "does not run on cpu" in check_combination("no-dpep", "triton-kernels", "cpu")
    monkeypatch.setattr(tk, "installed_api", lambda: (None, "triton_kernels tk 0.9 has the matmul_ogs API"))
    assert check_combination("no-dpep", "triton-kernels", "cuda") == "triton_kernels tk 0.9 has the matmul_ogs API"
    api = tk.TritonKernelsApi("fake", {})
    monkeypatch.setattr(tk, "installed_api", lambda: (api, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_combination("no-dpep", "triton-kernels", "cuda") is None
    assert "does not support fp32" in check_combination("no-dpep", "triton-kernels", "cuda", dtype=torch.float32)
    block = QuantScheme("fp8_w8a8", "block", (128, 128))
    assert "do not support fp8_w8a8" in check_combination("no-dpep", "triton-kernels", "cuda", quant=block)
    assert "format mismatch" in check_combination("batched-local", "triton-kernels", "cuda")
    assert check_combination("no-dpep", "triton-kernels", "cuda", quant=QuantScheme("fp8_w8a8", "tensor")) is None
    assert check_combination("no-dpep", "triton-kernels", "cuda", quant=QuantScheme("mxfp4"),
                             activation=Activation("swigluoai"), bias=True) is None
    assert "do not support int4_w4a16" in check_combination("no-dpep", "triton-kernels", "cuda",
                                                            quant=QuantScheme("int4_w4a16"))


def test_env_lists_it_with_the_reason():
    res = moebench_inproc("env", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    row = next(b for b in out["backends"] if b["name"] == "triton-kernels")
    assert row["kind"] == "experts" and not row["usable"] and row["reason"]
    lib = next(v for v in out["vendor"] if v["module"] == "triton_kernels")
    assert lib["backends"] == ["triton-kernels"]


def test_sweep_lists_it_skipped_with_the_reason(tmp_path):
    res = moebench_inproc("sweep", "--num-experts", "4", "--topk", "2", "--hidden", "32", "--intermediate", "32",
                          "--tokens", "2", "--experts", "torch,triton-kernels", "--prepare-finalize", "no-dpep", "--reps", "1", "--out", str(tmp_path / "r"),
                          "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in next((tmp_path / "r").rglob("rows.jsonl")).read_text().splitlines()]
    row = next(r for r in rows if r["experts"] == "triton-kernels")
    assert row["status"] == "skipped" and "does not run on cpu" in row["reason"]


def test_mx_layout_and_missing_package_refusals(monkeypatch):
    with pytest.raises(MoebenchError, match="mx_layout must be one of default, strided"):
        tk.TritonKernelsExperts(mx_layout="hopper")
    monkeypatch.setattr(tk, "installed_api", lambda: (None, "triton_kernels is not installed"))
    with pytest.raises(UnsupportedError, match="triton_kernels is not installed"):
        tk.TritonKernelsExperts().api


# ---------------------------------------------------------------------------------------------
# The adapter against the reference, through a torch model of matmul's contract


class _T:
    """triton_kernels.Tensor's stand-in: storage data (K-major), its dtype, its layout."""

    def __init__(self, data, dtype=None, layout="strided"):
        self.data, self.dtype, self.layout = data, dtype, layout


class _Flex:
    def __init__(self, dtype=None, scale=None):
        self.dtype, self.scale = dtype, scale


def _swiglu(out, alpha, limit):
    gate, lin = out[:, 0::2].clamp(max=limit), out[:, 1::2].clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (lin + 1)


def _weights(b, pc):
    """matmul's b and precision config -> (E, K, N) float32 values."""
    if isinstance(b, _T):  # mxfp4: e2m1 codes packed along K, e8m0 scales (E, K / 32, N)
        codes = unpack_nibbles(b.data.transpose(1, 2).contiguous(), dim=-1)  # (E, N, K)
        s = pc.b_mx_scale.data.transpose(1, 2).float()  # (E, N, K / 32)
        w = e2m1_decode(codes) * torch.exp2(s - 127).repeat_interleave(32, dim=-1)
        return w.transpose(1, 2)
    w = b.float()
    flex = getattr(pc, "flex_ctx", None)
    if flex is not None and flex.rhs_data.scale is not None:
        w = w * flex.rhs_data.scale.view(-1, 1, 1)
    return w


def _matmul(a, b, bias, a_ragged_metadata=None, gather_indx=None, scatter_indx=None, precision_config=None,
            gammas=None, fused_activation=None):
    """Y[scatter[r]] = act((X[gather[r]] @ W[e(r)] + bias[e(r)]) * gammas[r]), rows r in expert
    order, e(r) from the slice sizes; rows outside every slice are not written."""
    pc = precision_config
    x = a.float()
    flex = getattr(pc, "flex_ctx", None)
    if flex is not None and flex.lhs_data.scale is not None:
        x = x * flex.lhs_data.scale
    w = _weights(b, pc)
    rows = gather_indx.shape[0] if gather_indx is not None else a.shape[0]
    n = w.shape[-1] // (2 if fused_activation is not None else 1)
    out = torch.full((scatter_indx.shape[0] if scatter_indx is not None else rows, n), float("nan"))
    lo = 0
    for e, size in enumerate(a_ragged_metadata.slice_sizes.tolist()):
        r = torch.arange(lo, lo + size)
        lo += size
        y = x[gather_indx[r].long() if gather_indx is not None else r] @ w[e]
        if bias is not None:
            y = y + bias[e].float()
        if gammas is not None:
            y = y * gammas[r].unsqueeze(-1)
        if fused_activation is not None:
            y = _swiglu(y, *fused_activation.fn_args)
        out[scatter_indx[r].long() if scatter_indx is not None else r] = y
    return out.to(pc.out_dtype)


def _reduce(x, dim, mask=None, y=None):
    v = x.float() if mask is None else torch.where(mask.bool(), x.float(), 0.0)
    y.copy_(v.sum(dim))
    return y, None


def _fake_api() -> tk.TritonKernelsApi:
    class PrecisionConfig:
        def __init__(self, flex_ctx=None, b_mx_scale=None, b_microblock_size=None, out_dtype=None):
            self.flex_ctx, self.b_mx_scale, self.out_dtype = flex_ctx, b_mx_scale, out_dtype
            assert b_mx_scale is None or b_microblock_size == 32

    names = dict(
        matmul=_matmul, reduce=_reduce, PrecisionConfig=PrecisionConfig, InFlexData=_Flex,
        FlexCtx=lambda lhs_data, rhs_data: types.SimpleNamespace(lhs_data=lhs_data, rhs_data=rhs_data),
        FusedActivation=lambda specs, fn_args: types.SimpleNamespace(specs=specs, fn_args=fn_args),
        FnSpecs=lambda name, fn, names, reduction_n: (name, reduction_n), swiglu_fn=None,
        make_ragged_tensor_metadata=lambda sizes, n: types.SimpleNamespace(slice_sizes=sizes),
        wrap_torch_tensor=lambda t, dtype=None: _T(t, dtype), FP4="fp4",
        convert_layout=lambda t, layout: _T(t.data, t.dtype, layout),
        make_default_matmul_mxfp4_w_layout=lambda mx_axis: "value", StridedLayout=None,
        make_default_matmul_mxfp4_w_scale_layout=lambda mx_axis, num_warps: "scale")
    return tk.TritonKernelsApi("model", names)


H, I, E, K, M = 64, 32, 6, 2, 9


def _problem(seed, act: Activation):
    g = torch.Generator().manual_seed(seed)
    scale = 3.0 if act.interleaved else 1.0  # swigluoai: reach its clamps
    x = (torch.randn(M, H, generator=g) * scale).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    bias = ExpertBias(torch.randn(E, 2 * I, generator=g).bfloat16(), (torch.randn(E, H, generator=g) * 0.5).bfloat16())
    tw, ids = torch.topk(torch.softmax(torch.randn(M, E, generator=g), -1), K, dim=-1)
    return x, w13, w2, tw.float(), ids.to(torch.int64), bias


@pytest.mark.parametrize("act,quant,with_bias,ep", [
    ("silu", None, False, False), ("gelu", None, True, False), ("swigluoai", None, True, True),
    ("silu", "tensor", False, True), ("swigluoai", "mxfp4", True, False),
], ids=["bf16-silu", "bf16-gelu-bias", "bf16-swigluoai-bias-ep", "fp8-tensor-ep", "mxfp4-swigluoai-bias"])
def test_adapter_matches_reference(act, quant, with_bias, ep):
    act = Activation(act)
    x, w13, w2, tw, ids, bias = _problem(3, act)
    bias = bias if with_bias else None
    emap = None
    if ep:
        emap = random_expert_map(2 * E, E, "cpu", seed=1)
        g = torch.Generator().manual_seed(4)
        ids = torch.stack([torch.randperm(2 * E, generator=g)[:K] for _ in range(M)])
    scheme = None if quant is None else (QuantScheme("fp8_w8a8", "tensor") if quant == "tensor" else QuantScheme(quant))
    w13q, w2q = quantize_weights(w13, w2, scheme) if scheme is not None else (w13, w2)
    experts = tk.TritonKernelsExperts(api=_fake_api())
    kernel = moebench.FusedMoEKernel(moebench.make_kernel("triton", "no-dpep").prepare_finalize, experts)
    with poisoned_outputs():
        out = kernel.apply(x, w13q, w2q, tw, ids, emap, 2 * E if ep else None, activation=act, bias=bias)
    ref = reference_moe(x, w13q, w2q, tw, ids, emap, activation=act, bias=bias)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref) < (3e-2 if quant == "tensor" else 2e-2)
    # the check can fail: the router weights, the activation or the expert order matter
    wrong = reference_moe(x, w13q, w2q, tw.flip(-1), ids, emap, activation=act, bias=bias)
    assert rel_err(out, wrong) > 5e-2


def test_mxfp4_weights_convert_once():
    act = Activation("swigluoai")
    x, w13, w2, tw, ids, bias = _problem(5, act)
    w13q, w2q = quantize_weights(w13, w2, QuantScheme("mxfp4"))
    experts = tk.TritonKernelsExperts(api=_fake_api())
    kernel = moebench.FusedMoEKernel(moebench.make_kernel("triton", "no-dpep").prepare_finalize, experts)
    a = kernel.apply(x, w13q, w2q, tw, ids, activation=act, bias=bias)
    first = experts._weight(w13q)
    b = kernel.apply(x, w13q, w2q, tw, ids, activation=act, bias=bias)
    assert experts._weight(w13q) is first and first[0].layout == "value" and first[1].layout == "scale"
    assert torch.equal(a, b)
    strided = tk.TritonKernelsExperts(mx_layout="strided", api=_fake_api())
    assert strided._weight(w13q)[0].layout == "strided"


def test_mxfp4_needs_whole_groups():
    w13 = torch.randn(2, 2 * 40, 64).bfloat16()
    w2 = torch.randn(2, 64, 40).bfloat16()
    w13q, w2q = quantize_weights(w13, w2, QuantScheme("mxfp4"))
    with pytest.raises(UnsupportedError, match="divisible by 32"):
        tk.check_shapes(w13q, w2q, QuantScheme("mxfp4"), "triton-kernels")
