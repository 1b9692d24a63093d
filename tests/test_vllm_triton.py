"""The vllm-triton experts (vLLM's fused-MoE kernel structure) against the float64 reference, its
code paths (per-pair blocks, swap-AB, expert map, fp8 block with a partial last K group), the
engines' config files, and `tune --kernel vllm|sglang` / `configs commit --kernel` end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import moebench
from moebench.cli.tune import configs as configs_group
from moebench.cli.tune import tune as tune_command
from moebench.correctness import is_correct, relative_error
from moebench.errors import MoebenchError
from moebench.inputs import make_weights
from moebench.kernels import engine_configs as EC
from moebench.kernels.reference import silu_and_mul
from moebench.kernels.vllm_triton import (
    VllmTritonExperts,
    VllmTritonOptions,
    use_per_pair,
    use_swap_ab,
    vllm_align,
    vllm_fused_experts,
)
from moebench.quant import QuantScheme, as_float, fake_quant, scheme_of
from moebench.routing import make_routing
from moebench.tuning import space as SP
from test_cli import moebench_inproc
from moebench.kernels import tuned_files as TF

BLOCK = QuantScheme("fp8_w8a8", "block", (128, 128))
CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2)


def _emulated(x, w13, w2, tw, ids, emap=None):
    """float64 with vLLM's rounding points: GEMM1 out and the SiLU-mul output stored in x's dtype
    (then quantised for fp8), GEMM2 out (weighted) stored in x's dtype, the top-k sum in fp32."""
    quant = scheme_of(w13)
    xd = fake_quant(x, quant, x.dtype) if quant is not None else x.double()
    local = ids.long() if emap is None else emap.long()[ids.long()]
    m, k = ids.shape
    c2 = torch.zeros(m, k, x.shape[1], dtype=x.dtype)
    for t in range(m):
        for j in range(k):
            e = int(local[t, j])
            if e < 0:
                continue
            c1 = (xd[t] @ as_float(w13[e : e + 1])[0].t()).to(x.dtype).double()
            act = silu_and_mul(c1).to(x.dtype)
            a2 = fake_quant(act, quant, x.dtype) if quant is not None else act.double()
            c2[t, j] = (a2 @ as_float(w2[e : e + 1])[0].t() * tw[t, j].double()).to(x.dtype)
    return c2.float().sum(1).to(x.dtype).double()


def _problem(e, k, h, i, m, dtype, quant=None, seed=0, experts=None):
    w13, w2 = make_weights(experts if experts is not None else range(e), h, i, dtype, "cpu", seed, quant=quant)
    x = torch.randn(m, h, dtype=dtype, generator=torch.Generator().manual_seed(seed + 1))
    tw, ids = make_routing("uniform", m, e, k, seed=seed + 2, device="cpu")
    return x, w13, w2, tw, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_against_reference(dtype):
    x, w13, w2, tw, ids = _problem(8, 2, 96, 64, 5, dtype)
    out = vllm_fused_experts(x, w13, w2, tw, ids, CFG, options=VllmTritonOptions(per_pair=False))
    err = relative_error(out, moebench.reference_moe(x, w13, w2, tw, ids))
    assert is_correct(err, dtype), err
    if dtype == torch.float16:  # the interpreter truncates bf16 stores; fp16 checks the kernel tightly
        assert relative_error(out, _emulated(x, w13, w2, tw, ids)) < 2e-3


@pytest.mark.parametrize("swap", [False, True])
def test_fp8_block_partial_last_k_group(swap):
    # H = 200 and I = 160: the last 128-column group of both GEMMs' K is partial
    x, w13, w2, tw, ids = _problem(8, 2, 200, 160, 6, torch.float16, BLOCK)
    opts = VllmTritonOptions(per_pair=False, swap_ab=swap)
    assert use_swap_ab(opts, CFG, True, torch.device("cpu")) is swap
    out = vllm_fused_experts(x, w13, w2, tw, ids, dict(CFG, BLOCK_SIZE_K=256), options=opts)  # K cut to 128
    assert is_correct(relative_error(out, moebench.reference_moe(x, w13, w2, tw, ids)), torch.float16, BLOCK)
    assert relative_error(out, _emulated(x, w13, w2, tw, ids)) < 2e-3


def test_per_pair_path_and_its_rule():
    x, w13, w2, tw, ids = _problem(16, 2, 64, 64, 2, torch.float16)
    opts = VllmTritonOptions()
    assert use_per_pair(opts, 2, 2, 16, None)  # 2 * 2 * 4 <= 16
    assert not use_per_pair(opts, 3, 2, 16, None) and not use_per_pair(opts, 2, 2, 16, torch.zeros(16))
    blocks = vllm_align(ids, 16, 16, None, per_pair=True)
    assert blocks.sorted_ids is None and blocks.em == 4 * 16 and int(blocks.ntpp) == 4 * 16
    out = vllm_fused_experts(x, w13, w2, tw, ids, CFG, options=opts)
    assert relative_error(out, _emulated(x, w13, w2, tw, ids)) < 2e-3
    with pytest.raises(MoebenchError, match="per-pair"):
        use_per_pair(VllmTritonOptions(per_pair=True), 2, 2, 16, torch.zeros(16))


def test_expert_map_zeroes_remote_blocks():
    emap = torch.full((16,), -1, dtype=torch.int32)
    emap[8:] = torch.arange(8, dtype=torch.int32)
    x, w13, w2, tw, ids = _problem(16, 2, 64, 96, 6, torch.float16, experts=range(8, 16))
    blocks = vllm_align(ids, 16, 16, emap, per_pair=False)
    assert (blocks.expert_ids[: int(blocks.ntpp) // 16] == -1).any()  # remote experts' blocks are there, as -1
    out = vllm_fused_experts(x, w13, w2, tw, ids, CFG, emap, 16)
    ref = moebench.reference_moe(x, w13, w2, tw, ids, emap)
    assert is_correct(relative_error(out, ref), torch.float16)
    assert relative_error(out, _emulated(x, w13, w2, tw, ids, emap)) < 2e-3


def test_through_make_kernel_and_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TF.ENV_CONFIG_DIR, raising=False)
    x, w13, w2, tw, ids = _problem(8, 2, 200, 64, 5, torch.bfloat16, BLOCK)
    ex = VllmTritonExperts()
    cfg = ex.config_for(5, w2, 8, torch.bfloat16)
    assert cfg == EC.vllm_default_config(5, 8, BLOCK) and "default" in ex.last_config_source
    name = TF.engine_file_name("vllm", 8, 64, "cpu", BLOCK)
    assert name == "E=8,N=64,device_name=cpu,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert TF.engine_file_name("sglang", 8, 64, "cpu", BLOCK).endswith("block_shape=[128, 128].json")
    assert TF.engine_device_name("vllm", "NVIDIA H200 NVL") == "NVIDIA_H200"
    small = dict(CFG, BLOCK_SIZE_N=32)
    TF.write_engine_file(tmp_path / "results" / "configs" / "vllm" / name, {1: CFG, 16: small})
    assert ex.config_for(9, w2, 8, torch.bfloat16) == small  # nearest key: 16
    assert ex.config_for(8, w2, 8, torch.bfloat16) == CFG  # 8 is nearer 1 than 16
    k = moebench.make_kernel(experts="vllm-triton", prepare_finalize="no-dpep")
    out = k.apply(x, w13, w2, tw, ids)
    assert is_correct(relative_error(out, moebench.reference_moe(x, w13, w2, tw, ids)), torch.bfloat16, BLOCK)
    assert moebench.backends.check_combination("no-dpep", "vllm-triton", "cpu", torch.float32) is not None


def _group():
    g = click.group()(lambda: None)
    g.add_command(tune_command)
    g.add_command(configs_group)
    return g


SIZES = ["--num-experts", "8", "--topk", "2", "--hidden", "64", "--intermediate", "64", "--device", "cpu"]


@pytest.mark.parametrize("kernel", ["vllm", "sglang"])
def test_tune_kernel_end_to_end(tmp_path, monkeypatch, kernel):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(_group(), ["tune", *SIZES, "--kernel", kernel, "--tokens", "2", "--search", "random",
                                        "--budget", "1", "--reps", "1", "--final-reps", "1"])  # (sorted blocks, as at 4)
    assert res.exit_code == 0, res.output
    folder = tmp_path / "results" / "configs" / kernel
    if kernel == "sglang":
        folder = folder / TF.triton_folder()
    path = folder / "E=8,N=64,device_name=cpu.json"
    raw = json.loads(path.read_text())
    assert list(raw) == ["2"] and set(raw["2"]) == set(TF.TILE_KEYS)  # exactly as the engines read it
    assert not list((tmp_path / "results" / "configs").glob("*.json"))  # nothing beside moebench's own files
    run = next((tmp_path / "results").glob("*-tune-*"))
    meta = json.loads((run / "metadata.json").read_text())
    assert meta["kernel"] == kernel and meta["experts"] == "vllm-triton" and meta["config_file"] == str(path)
    assert json.loads((run / "tune.json").read_text())["spec"]["kernel"] == kernel
    assert f"tuned for kernel `{kernel}`" in (run / "report.md").read_text()
    res = CliRunner().invoke(_group(), ["configs", "list", "--json"])
    rows = [r for r in json.loads(res.output) if r["E"] == 8 and r["N"] == 64]
    assert [(r["kernel"], r["tokens"]) for r in rows] == [(kernel, [2])]


def test_tune_against_an_engine_file(tmp_path, monkeypatch):
    """`tune --kernel vllm --against FILE`: the file's nearest entry runs in each count's final stage
    (its candidate rows), the winner is never slower than it, and the report and tune.json say so."""
    monkeypatch.chdir(tmp_path)
    shipped = {1: CFG, 8: dict(CFG, BLOCK_SIZE_N=32, num_stages=3)}
    path = TF.write_engine_file(tmp_path / "shipped" / "E=8,N=64,device_name=cpu.json", shipped)
    res = CliRunner().invoke(_group(), ["tune", *SIZES, "--kernel", "vllm", "--tokens", "1,6", "--search", "random",
                                        "--budget", "1", "--reps", "1", "--final-reps", "1", "--against", str(path)])
    assert res.exit_code == 0, res.output
    name = f"shipped/{path.name}"
    assert f"winner / `{name}`: median" in " ".join(res.output.split())
    run = next((tmp_path / "results").glob("*-tune-*"))
    final = [json.loads(line) for line in (run / "candidates.jsonl").read_text().splitlines()]
    final = {(m["tokens"], SP.key_str(m["x_config"])) for m in final if m.get("x_stage") == "final"}
    assert {(1, SP.key_str(shipped[1])), (6, SP.key_str(shipped[8]))} <= final  # nearest entry: 6 -> 8
    rows = {int(r["tokens"]): r for r in csv.DictReader(open(run / "report.csv"))}
    for m, entry in ((1, shipped[1]), (6, shipped[8])):
        assert rows[m]["against"].startswith(f"{name} {SP.key_str(entry)} ")
        ratio = float(rows[m]["against"].rsplit("winner / file ", 1)[1].rstrip(")"))
        assert ratio <= 1.0
    md = (run / "report.md").read_text()
    assert f"winner / `{name}`: median" in md and "| against |" in md
    assert json.loads((run / "tune.json").read_text())["spec"]["against"][name]["8"] == shipped[8]
    bad = CliRunner().invoke(_group(), ["tune", *SIZES, "--kernel", "vllm", "--tokens", "1", "--dry-run",
                                        "--against", str(tmp_path / "missing.json")])
    assert isinstance(bad.exception, MoebenchError) and "missing.json" in str(bad.exception)


def test_configs_commit_kernel_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TF, "PACKAGE_CONFIG_DIR", tmp_path / "pkg")
    v = TF.write_engine_file(tmp_path / "a" / TF.engine_file_name("vllm", 8, 64, "NVIDIA_H200", BLOCK), {1: CFG})
    s = TF.write_engine_file(tmp_path / "b" / "triton_3_4_0" / TF.engine_file_name("sglang", 8, 64, "NVIDIA_H200", BLOCK),
                             {1: CFG})
    g, r = _group(), CliRunner()
    res = r.invoke(g, ["configs", "commit", "--kernel", "vllm", str(v)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "pkg" / "vllm" / v.name).is_file() and not (tmp_path / "pkg" / v.name).exists()
    res = r.invoke(g, ["configs", "commit", "--kernel", "sglang", str(s)])
    assert res.exit_code == 0 and (tmp_path / "pkg" / "sglang" / "triton_3_4_0" / s.name).is_file()
    res = r.invoke(g, ["configs", "commit", "--kernel", "sglang", str(v)])  # vLLM's name in SGLang's folder
    assert isinstance(res.exception, MoebenchError) and "SGLang's" in str(res.exception)
    moe = TF.write_config_file(tmp_path / "c" / "E=8,N=64,device_name=cpu.json", {1: CFG})  # has triton_version
    res = r.invoke(g, ["configs", "commit", "--kernel", "vllm", str(moe)])
    assert isinstance(res.exception, MoebenchError) and "token counts" in str(res.exception)


@pytest.mark.parametrize("args, words", [
    (["--kernel", "nope"], "unknown --kernel 'nope'"),
    (["--kernel", "vllm", "--dtype", "fp32"], "does not support fp32"),
    (["--kernel", "vllm", "--dtype", "fp8_w8a8", "--scales", "token"], "do not support fp8_w8a8 per-token"),
])
def test_bad_kernel_input_is_one_line_exit_2(tmp_path, args, words):
    p = moebench_inproc("tune", *SIZES, "--tokens", "1", "--dry-run", *args, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], p.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", [None, BLOCK])
def test_gpu_paths_against_reference(quant):
    # every code path on the device: per-pair blocks (2 x 8 x 4 <= 64), sorted blocks, swap-AB (fp8), an expert map
    w13, w2 = make_weights(range(64), 2000, 192, torch.bfloat16, "cuda", 0, quant=quant)  # H, I not multiples of 128
    for m, per_pair, swap, emap in ((2, "auto", False, None), (3, False, True, None), (200, "auto", "auto", None),
                                    (40, "auto", False, "ep")):
        x = torch.randn(m, 2000, dtype=torch.bfloat16, device="cuda")
        tw, ids = make_routing("uniform", m, 128 if emap else 64, 8, seed=m, device="cuda")
        mp = None
        ww13, ww2 = w13, w2
        if emap:
            mp = torch.full((128,), -1, dtype=torch.int32, device="cuda")
            mp[64:] = torch.arange(64, dtype=torch.int32, device="cuda")
        opts = VllmTritonOptions(per_pair=per_pair, swap_ab=swap)
        for cfg in (CFG, dict(CFG, BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, num_warps=8, num_stages=3)):
            out = vllm_fused_experts(x, ww13, ww2, tw, ids, cfg, mp, 128 if emap else 64, options=opts)
            err = relative_error(out, moebench.reference_moe(x, ww13, ww2, tw, ids, mp))
            assert is_correct(err, torch.bfloat16, quant), (m, per_pair, swap, emap, cfg, err)
