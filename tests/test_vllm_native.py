"""vLLM's own fused_experts (`vllm` experts, moebench/kernels/vllm_native.py), against a stand-in
`vllm` package on the CPU: the calls moebench makes (override_config around every launch, both
quantisation APIs, the expert map), the backend's capabilities, and `tune --kernel vllm` timing it
when it imports. The real vLLM runs it on a GPU."""

from __future__ import annotations

import contextlib
import json
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from moebench.inputs import make_weights
from moebench.kernels import engine_configs as EC
from moebench.kernels import vllm_native as VN
from moebench.kernels.reference import reference_moe
from moebench.quant import QuantScheme
from moebench.routing import make_routing

CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
BLOCK = QuantScheme("fp8_w8a8", "block", (128, 128))


def install_fake_vllm(monkeypatch, new_api: bool = True) -> list[dict]:
    """A `vllm` package with the three entry points moebench calls; fused_experts records its
    keyword arguments and the override config in force, and computes the float64 reference."""
    calls: list[dict] = []
    state: dict = {"config": None}
    pkg = types.ModuleType(VN.FUSED_MOE)

    @contextlib.contextmanager
    def override_config(config):
        old, state["config"] = state["config"], config
        try:
            yield
        finally:
            state["config"] = old

    pkg.override_config = override_config
    fm = types.ModuleType(f"{VN.FUSED_MOE}.fused_moe")

    def record(x, w1, w2, topk_weights, topk_ids, kw):
        calls.append(dict(kw, config=state["config"], w1=w1, w2=w2))
        if w1.dtype == torch.float8_e4m3fn:
            return torch.zeros_like(x)  # the quantisation arguments are what the unit test checks
        return reference_moe(x, w1, w2, topk_weights, topk_ids, kw.get("expert_map")).to(x.dtype)

    if new_api:
        def fused_experts(x, w1, w2, topk_weights, topk_ids, inplace=False, expert_map=None, global_num_experts=-1,
                          quant_config=None):
            return record(x, w1, w2, topk_weights, topk_ids,
                          {k: v for k, v in dict(expert_map=expert_map, global_num_experts=global_num_experts,
                                                 quant_config=quant_config).items() if v is not None})
    else:
        def fused_experts(x, w1, w2, topk_weights, topk_ids, inplace=False, use_fp8_w8a8=False, w1_scale=None,
                          w2_scale=None, block_shape=None, expert_map=None, global_num_experts=-1):
            return record(x, w1, w2, topk_weights, topk_ids,
                          dict(use_fp8_w8a8=use_fp8_w8a8, w1_scale=w1_scale, w2_scale=w2_scale, block_shape=block_shape))

    fm.fused_experts = fused_experts
    cfg = types.ModuleType(f"{VN.FUSED_MOE}.config")
    cfg.fp8_w8a8_moe_quant_config = lambda **kw: {"fp8_block": kw}
    top = types.ModuleType("vllm")
    top.__version__ = "0.0-standin"
    for name in ("vllm.model_executor", "vllm.model_executor.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for mod in (top, pkg, fm, cfg):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(VN.importlib.util, "find_spec", lambda name: object() if name == "vllm" else None)
    return calls


def test_unavailable_without_vllm_or_gpu(monkeypatch):
    monkeypatch.setattr(VN.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in VN.vllm_unavailable_reason("cuda")
    assert EC.engine_experts("vllm", "cuda") == "vllm-triton"
    install_fake_vllm(monkeypatch)
    assert "CUDA GPU" in VN.vllm_unavailable_reason("cpu") and VN.vllm_unavailable_reason("cuda:0") is None
    assert EC.engine_experts("vllm", "cuda:0") == "vllm" and EC.engine_experts("sglang", "cuda:0") == "vllm-triton"
    assert EC.engine_experts("vllm", "cpu") == "vllm-triton"


@pytest.mark.parametrize("new_api", [True, False])
def test_calls_fused_experts_under_the_override(monkeypatch, new_api):
    calls = install_fake_vllm(monkeypatch, new_api)
    torch.manual_seed(0)
    e, h, n, m, k = 8, 256, 128, 5, 2
    w13, w2 = make_weights(range(e), h, n, torch.bfloat16, "cpu", 0)
    x = torch.randn(m, h, dtype=torch.bfloat16)
    tw, ids = make_routing("uniform", m, e, k, seed=1)
    out = VN.vllm_own_fused_experts(x, w13, w2, tw, ids, CFG)
    assert calls[-1]["config"] == CFG and calls[-1]["w1"] is w13
    assert out.shape == x.shape and out.dtype == x.dtype
    VN.vllm_own_fused_experts(x, w13, w2, tw, ids, None)
    assert calls[-1]["config"] is None  # no config: vLLM's own file lookup
    emap = torch.full((16,), -1, dtype=torch.int32)
    emap[8:] = torch.arange(8, dtype=torch.int32)
    if new_api:
        VN.vllm_own_fused_experts(x, w13, w2, tw, ids + 8, CFG, emap, 16)
        assert calls[-1]["expert_map"] is emap and calls[-1]["global_num_experts"] == 16
    q13, q2 = make_weights(range(e), h, n, torch.bfloat16, "cpu", 0, quant=BLOCK)
    VN.vllm_own_fused_experts(x, q13, q2, tw, ids, CFG)
    got = calls[-1]
    assert got["w1"] is q13.q and got["w2"] is q2.q
    if new_api:
        assert got["quant_config"] == {"fp8_block": dict(w1_scale=q13.scale, w2_scale=q2.scale, block_shape=[128, 128])}
    else:
        assert got["use_fp8_w8a8"] and got["w1_scale"] is q13.scale and got["block_shape"] == [128, 128]


def test_tune_kernel_vllm_times_vllm_itself_where_it_imports(tmp_path, monkeypatch):
    """With vllm importable on the (here: pretended) GPU, `tune --kernel vllm` times vLLM's own
    fused_experts, each candidate under override_config, and says so in the run's files."""
    calls = install_fake_vllm(monkeypatch)
    monkeypatch.setattr(VN, "vllm_unavailable_reason", lambda device: None)
    monkeypatch.setattr(VN.VllmExperts, "supported_devices", ("cpu", "cuda"))
    monkeypatch.chdir(tmp_path)
    from tests.test_vllm_triton import SIZES, _group

    res = CliRunner().invoke(_group(), ["tune", *SIZES, "--kernel", "vllm", "--tokens", "2", "--search", "random",
                                        "--budget", "2", "--reps", "1", "--final-reps", "1"])
    assert res.exit_code == 0, res.output
    run = next((tmp_path / "results").glob("*-tune-*"))
    meta = json.loads((run / "metadata.json").read_text())
    assert meta["experts"] == "vllm" and "vLLM's own fused_experts (vllm 0.0-standin)" in meta["timed"]
    assert "vLLM's own fused_experts" in (run / "report.md").read_text()
    tried = {json.dumps(c["config"], sort_keys=True) for c in calls}
    measured = {json.dumps(json.loads(line)["x_config"], sort_keys=True)
                for line in (run / "candidates.jsonl").read_text().splitlines()}
    assert measured and measured <= tried  # every timed config reached vLLM through override_config
