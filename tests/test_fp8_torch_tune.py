"""fp8 outside the Triton kernels, on the CPU: the `torch` experts' fp8 path (refused cleanly
without a Hopper/B200 GPU; its operand layout checked against an emulated scaled grouped GEMM),
the fp8 matmul ceiling key, and `moebench tune --dtype fp8_w8a8` end to end under the Triton
interpreter (block and per-tensor scales), pruning and file names included."""

from __future__ import annotations

import json

import click
import pytest
import torch
from click.testing import CliRunner

from moebench.bench import hardware as HW
from moebench.bench.timing import time_cpu
from moebench.correctness import FP8_TOLERANCE, relative_error
from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels import torch_experts as TE
from moebench.kernels.modular import PrepareResult
from moebench.kernels.reference import reference_moe
from moebench.backends import check_combination
from moebench.layout import ParallelLayout
from moebench.models import custom_shape, get_model
from moebench.quant import QuantScheme, quantize_activation, quantize_weights
from moebench.kernels.triton import configs as C
from moebench.tuning import space as SP
from moebench.tuning import tuner as T
from moebench.cli.tune import configs as configs_group
from moebench.kernels.tuned_files import parse_file_name as parse_config_name
from moebench.cli.tune import tune as tune_command
from test_tune import _journal_lines, assert_vllm_loadable, tune_with
from moebench.kernels import tuned_files as TF

TENSOR = QuantScheme("fp8_w8a8", "tensor")
TOKEN = QuantScheme("fp8_w8a8", "token")
BLOCK = QuantScheme("fp8_w8a8", "block", (128, 128))


# ---------------------------------------------------------------------------------------------
# torch experts, fp8


def _problem(e=4, k=2, h=64, i=32, m=7, scheme=TENSOR, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    x = torch.randn(m, h, generator=g).bfloat16()
    tw, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(k, -1)
    q13, q2 = quantize_weights(w13, w2, scheme, act_dtype=torch.bfloat16)
    return x, q13, q2, tw, ids.to(torch.int32)


def _prep(x, q13, tw, ids, expert_map=None, num_experts=None):
    """What no-dpep's prepare hands the experts for an fp8 scheme."""
    a, s = quantize_activation(x, q13.scheme, q13.input_scale)
    return PrepareResult(a, ids, tw, None, expert_map, num_experts or q13.shape[0], a_scale=s, quant=q13.scheme,
                         out_dtype=x.dtype)


def test_torch_fp8_declares_and_refuses_on_cpu():
    assert TE.TorchExperts.supported_quant == ("tensor", "token")
    assert TE.BatchedTorchExperts.supported_quant == ()
    for scheme in (TENSOR, TOKEN):
        reason = TE.TorchExperts.quant_unavailable_reason("cpu", scheme)
        assert reason is not None and "needs CUDA" in reason
    assert "do not support" in TE.TorchExperts.quant_unavailable_reason("cuda", BLOCK)
    x, q13, q2, tw, ids = _problem()
    with pytest.raises(UnsupportedError, match="needs CUDA"):
        TE.TorchExperts().apply(_prep(x, q13, tw, ids), q13, q2)
    # The unquantised path on the same device still runs.
    out = TE.TorchExperts().apply(PrepareResult(x, ids, tw, None, None, 4), q13.dequantize(torch.bfloat16),
                                  q2.dequantize(torch.bfloat16))
    assert out.shape == (7, 2, 64) and torch.isfinite(out).all()


def test_torch_fp8_listed_as_unusable_on_cpu():
    reason = check_combination("no-dpep", "torch", "cpu", torch.bfloat16, quant=TENSOR)
    assert reason is not None and "CUDA" in reason
    assert "do not support" in check_combination("no-dpep", "torch", "cpu", torch.bfloat16, quant=BLOCK)


def _emulated_scaled_grouped_mm(out_dtype):
    """torch's scaled grouped GEMM as arithmetic, with the operand checks torch makes (2-D x 3-D,
    rowwise scales): out[r] = (a[r] @ b[g]) * scale_a[r] * scale_b[g], rounded to out_dtype."""

    def fn(a, b, sa, sb, offs):
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.dim() == 2 and b.dim() == 3
        assert a.stride(-1) == 1 and b.stride(-2) == 1, "mat_a row-major, mat_b column-major"
        assert a.shape[1] == b.shape[1] and a.shape[1] % 16 == 0 and b.shape[2] % 16 == 0, "K, N multiples of 16"
        assert sa.dtype == sb.dtype == torch.float32 and sa.dim() == 1 and sa.is_contiguous()
        assert sa.shape[0] == a.shape[0] and sb.shape == (b.shape[0], b.shape[2]) and sb.stride(1) == 1
        assert offs.dtype == torch.int32 and offs.shape == (b.shape[0],)
        out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=out_dtype)  # rows past offs[-1]: garbage
        start = 0
        for g, end in enumerate(offs.tolist()):
            acc = a[start:end].double() @ b[g].double()
            out[start:end] = (acc * sa[start:end, None].double() * sb[g][None].double()).to(out_dtype)
            start = end
        return out

    return fn


@pytest.mark.parametrize("scheme", [TENSOR, TOKEN], ids=["tensor", "token"])
@pytest.mark.parametrize("h,i", [(64, 32), (40, 24)], ids=["aligned", "padded"])
def test_torch_fp8_operands_match_reference(monkeypatch, scheme, h, i):
    """The fp8 path's gathers, padding, scale layouts and intermediate quantisation, with the GEMM
    emulated exactly (float64 output): only the bf16 output rounding is left. With a bf16 GEMM
    output (what the GPU op returns) the error stays inside the fp8 tolerance."""
    monkeypatch.setattr(TE, "fp8_grouped_mm_unavailable_reason", lambda device: None)
    x, q13, q2, tw, ids = _problem(h=h, i=i, scheme=scheme)
    emap = torch.tensor([0, -1, 1, -1], dtype=torch.int32)  # EP: experts 0 and 2 local
    local = torch.tensor([0, 2])
    for out_dtype, tol in ((torch.float64, 5e-3), (torch.bfloat16, FP8_TOLERANCE)):
        monkeypatch.setattr(TE, "_scaled_grouped_mm", _emulated_scaled_grouped_mm(out_dtype))
        for w13, w2, em in ((q13, q2, None), (q13[local], q2[local], emap)):
            out = TE.TorchExperts().apply(_prep(x, w13, tw, ids, em, 4), w13, w2)
            assert out.shape == (7, 2, h) and out.dtype == torch.bfloat16
            y = (out.double() * tw.double().unsqueeze(-1)).sum(1)
            err = relative_error(y, reference_moe(x, w13, w2, tw, ids, em))
            assert err < tol, (out_dtype, em is not None, err)
            if em is not None:  # remote pairs are zero
                remote = emap[ids.long()] < 0
                assert (out[remote] == 0).all()


def test_fp8_weight_operand_padding_keeps_gate_and_up():
    _, q13, _, _, _, = _problem(h=40, i=24, scheme=TOKEN)
    b, s = TE._fp8_weight_operand(q13, 64, 48, split_halves=True)
    assert b.shape == (4, 48, 64) and b.stride(1) == 1 and s.shape == (4, 64) and s.is_contiguous()
    qb = b.transpose(1, 2).view(torch.uint8)  # (E, N', K')
    raw = q13.q.view(torch.uint8)
    assert torch.equal(qb[:, :24, :40], raw[:, :24]) and torch.equal(qb[:, 32:56, :40], raw[:, 24:])
    assert (qb[:, 24:32] == 0).all() and (qb[:, :, 40:] == 0).all()
    assert torch.equal(s[:, :24], q13.scale[:, :24]) and torch.equal(s[:, 32:56], q13.scale[:, 24:])


# ---------------------------------------------------------------------------------------------
# Ceilings


def test_fp8_ceiling_key():
    c = HW.Ceilings("X", 1000.0, None, {"bf16": 700.0, "fp16": 700.0, "fp8": 1400.0})
    assert c.tflops("fp8_w8a8") == c.tflops(torch.float8_e4m3fn) == c.tflops("fp8") == 1400.0
    assert c.tflops("bf16") == 700.0
    no_fp8 = HW.Ceilings("X", 1000.0, None, {"bf16": 700.0, "fp32": 60.0})
    assert no_fp8.tflops("fp8_w8a8") == 700.0  # not measured: the highest known rate
    peaks = {"NVIDIA H200": 1979.0, "NVIDIA H100 80GB HBM3": 1979.0, "NVIDIA H800": 1979.0, "NVIDIA B200": 4500.0,
             "AMD Instinct MI300X": 2614.9, "NVIDIA L40S": 733.0}
    for name, peak in peaks.items():
        assert HW.datasheet_ceilings(name).matmul_tflops["fp8"] == peak, name
    assert "fp8" not in HW.datasheet_ceilings("NVIDIA A100-SXM4-80GB").matmul_tflops
    tflops, note = HW._fp8_matmul_tflops(torch.device("cpu"))
    assert tflops is None and "skipped" in note


# ---------------------------------------------------------------------------------------------
# Tuning


def test_prune_block_scheme_like_vllm():
    s = get_model("qwen3-30b-a3b")
    base = SP.Problem(64, s.num_experts, s.num_experts, s.topk, s.hidden, s.intermediate, 1, SP.DEFAULT_SMEM_BYTES)
    block = SP.Problem(64, s.num_experts, s.num_experts, s.topk, s.hidden, s.intermediate, 1, SP.DEFAULT_SMEM_BYTES,
                       quant_block=(128, 128))
    space = SP.full_space()
    rep = SP.prune(space, block)
    assert rep.kept and all(128 % c["BLOCK_SIZE_K"] == 0 for c in rep.kept)
    assert {c["BLOCK_SIZE_K"] for c in rep.kept} == {64, 128} and 256 in {c["BLOCK_SIZE_N"] for c in rep.kept}
    misfits = [c for c in space if c["BLOCK_SIZE_K"] > 128]
    assert rep.pruned[SP.FP8_BLOCK_REASON] == len(misfits)
    # Every config the block rule lets through is judged as without it.
    unblocked = {SP.config_key(c) for c in SP.prune(space, base).kept}
    assert {SP.config_key(c) for c in rep.kept} <= unblocked
    # 1-byte operands: fewer configs exceed shared memory than with bf16.
    bf16 = SP.Problem(4096, 8, 8, 2, 4096, 14336, 2, SP.DEFAULT_SMEM_BYTES)
    fp8 = SP.Problem(4096, 8, 8, 2, 4096, 14336, 1, SP.DEFAULT_SMEM_BYTES)
    assert 0 < SP.prune(space, fp8).pruned.get("shared memory", 0) < SP.prune(space, bf16).pruned["shared memory"]


def test_tune_spec_carries_the_scheme(tmp_path):
    shape = get_model("qwen3-30b-a3b")
    specs = {q: T.TuneSpec(shape, ParallelLayout(), [1, 64], torch.bfloat16, "cpu", quant=q)
             for q in (None, TENSOR, TOKEN, BLOCK)}
    for q, spec in specs.items():
        back = T.TuneSpec.from_json(json.loads(json.dumps(spec.to_json())))
        assert back.quant == q and back.identity() == spec.identity()
    assert len({json.dumps(s.identity(), sort_keys=True) for s in specs.values()}) == 4
    names = {q: T.config_path_for(s, tmp_path).name for q, s in specs.items()}
    assert names[None] == "E=128,N=768,device_name=cpu.json"
    assert names[TENSOR] == "E=128,N=768,device_name=cpu,dtype=fp8_w8a8.json"  # as vLLM names them
    assert names[TOKEN] == "E=128,N=768,device_name=cpu,dtype=fp8_w8a8,per_channel_quant=True.json"  # SGLang's
    assert names[BLOCK] == "E=128,N=768,device_name=cpu,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert parse_config_name(names[BLOCK])["block_shape"] == "128,128"
    assert specs[BLOCK].elem_bytes == 1 and specs[None].elem_bytes == 2
    assert "block[128,128]" in specs[BLOCK].precision
    for m in (1, 64, 4096):  # the default baseline fits the scale block
        d = T.default_for(specs[BLOCK], m)
        assert 128 % d["BLOCK_SIZE_K"] == 0
    assert T.default_for(specs[TENSOR], 4096) == dict(C.quant_default(C.default_config(4096, 128, 768, 2048, 8, torch.bfloat16), TENSOR))
    counts = T.prune_counts(specs[BLOCK])
    assert all(SP.FP8_BLOCK_REASON in rep.pruned for rep in counts.values())


TINY = custom_shape(4, 2, 64, 32, name="tiny")
FP8_SPACES = {
    # block [32, 32]: only BLOCK_SIZE_K 32 with BLOCK_SIZE_N 32 fits; the other 3 are pruned
    "block": (QuantScheme("fp8_w8a8", "block", (32, 32)),
              {"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [32, 64], "BLOCK_SIZE_K": [32, 64], "GROUP_SIZE_M": [1],
               "num_warps": [4], "num_stages": [2]}),
    "tensor": (TENSOR, {"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [32, 64], "BLOCK_SIZE_K": [64], "GROUP_SIZE_M": [1],
                        "num_warps": [4], "num_stages": [2]}),
}


def _fast_timer(fn, reps):
    return time_cpu(fn, warmup=0, reps=1)


@pytest.mark.parametrize("kind", list(FP8_SPACES))
def test_tiny_fp8_tune_end_to_end(tmp_path, monkeypatch, kind):
    scheme, space = FP8_SPACES[kind]
    out = tune_with(TINY, ParallelLayout(), [1, 4], torch.bfloat16, strategy="grid", out_dir=tmp_path / "cfg",
                    results_dir=tmp_path / "res", space=space, timer=_fast_timer, reps=1, final_reps=1, quant=scheme)
    expected = TF.config_file_name(4, 32, "cpu", "fp8_w8a8", scheme.file_block_shape)
    assert out.config_path == tmp_path / "cfg" / expected
    assert expected.endswith("dtype=fp8_w8a8,block_shape=[32,32].json" if kind == "block" else "dtype=fp8_w8a8.json")
    raw = assert_vllm_loadable(out.config_path, [1, 4])
    lines = _journal_lines(out.run_dir)
    assert lines and all(d["status"] == "ok" for d in lines), [d["reason"] for d in lines]
    checked = [d["max_rel_err"] for d in lines if d["checked"]]
    assert checked and all(0 < e < FP8_TOLERANCE for e in checked)  # fp8 error, inside the fp8 tolerance
    for r in out.results:
        assert raw[str(r.tokens)] == r.winner and r.failed == r.wrong == 0
        if kind == "block":
            assert r.pruned == {SP.FP8_BLOCK_REASON: 2} and r.space_kept == 2
            assert 32 % r.default["BLOCK_SIZE_K"] == 0
    assert T.load_run_spec(out.run_dir).quant == scheme
    assert "fp8_w8a8" in (out.run_dir / "report.md").read_text()
    # The run-time lookup finds the file by scheme; an unquantised lookup does not.
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path / "cfg"))
    dirs = TF.config_search_dirs()
    cfg, src = C.lookup_config(4, 32, 4, torch.bfloat16, "cpu", folders=dirs, quant=scheme)
    assert src.startswith(str(out.config_path)) and dict(cfg) == raw["4"]
    assert C.lookup_config(4, 32, 4, torch.bfloat16, "cpu", folders=dirs)[1] == "default heuristic"
    # Resuming with another scheme is refused; with the same one, nothing is measured again.
    with pytest.raises(MoebenchError, match="differs from the saved one in quant"):
        tune_with(TINY, ParallelLayout(), [1, 4], torch.bfloat16, strategy="grid", out_dir=tmp_path / "cfg",
                  resume=out.run_dir, space=space, timer=_fast_timer, reps=1, final_reps=1, quant=TOKEN)
    again = tune_with(TINY, ParallelLayout(), [1, 4], torch.bfloat16, strategy="grid", out_dir=tmp_path / "cfg",
                      resume=out.run_dir, space=space, timer=_fast_timer, reps=1, final_reps=1, quant=scheme)
    assert sum(r.measured for r in again.results) == 0


def test_fp8_tune_refuses_what_triton_cannot_run(monkeypatch):
    from moebench.kernels.triton.experts import TritonExperts

    monkeypatch.setattr(TritonExperts, "supported_quant", ("block",))
    with pytest.raises(MoebenchError, match="cannot tune fp8_w8a8 per-tensor"):
        tune_with(TINY, ParallelLayout(), [1], torch.bfloat16, quant=TENSOR)


def _group():
    g = click.group()(lambda: None)
    g.add_command(tune_command)
    g.add_command(configs_group)
    return g


def test_tune_cli_fp8(tmp_path, monkeypatch):
    """--dtype fp8_w8a8 [--block-shape] [--scales] on `tune`; `configs` list/show/diff/commit of
    the fp8 file names."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TF.ENV_CONFIG_DIR, raising=False)
    g, r = _group(), CliRunner()
    res = r.invoke(g, ["tune", "--model", "qwen3-30b-a3b", "--device", "cpu", "--tokens", "64", "--dtype", "fp8_w8a8",
                       "--block-shape", "128,128", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "BLOCK_SIZE_K not dividing" in res.output and "block_shape=[128,128]" in res.output
    sizes = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--device", "cpu"]
    res = r.invoke(g, ["tune", *sizes, "--tokens", "1", "--dtype", "fp8_w8a8", "--block-shape", "64,64", "--search",
                       "random", "--budget", "1", "--reps", "1", "--final-reps", "1"])
    assert res.exit_code == 0, res.output
    name = "E=4,N=32,device_name=cpu,dtype=fp8_w8a8,block_shape=[64,64].json"
    assert_vllm_loadable(tmp_path / "results" / "configs" / name, [1])
    rows = [x for x in json.loads(r.invoke(g, ["configs", "list", "--json"]).output) if x["E"] == 4]
    assert [(x["dtype"], x["block_shape"], x["tokens"]) for x in rows] == [("fp8_w8a8", "64,64", [1])]
    res = r.invoke(g, ["configs", "show", "4,32", "--device", "cpu", "--dtype", "fp8_w8a8", "--block-shape", "64,64",
                       "--json"])
    assert res.exit_code == 0 and set(json.loads(res.output)) == {"1"}
    res = r.invoke(g, ["configs", "diff", "4,32", str(tmp_path / "results" / "configs" / name), "--device", "cpu",
                       "--dtype", "fp8_w8a8", "--block-shape", "64,64"])
    assert res.exit_code == 0 and "identical" in res.output
    res = r.invoke(g, ["configs", "show", "4,32", "--device", "cpu", "--block-shape", "64,64"])
    assert isinstance(res.exception, MoebenchError) and "--dtype fp8_w8a8" in str(res.exception)
    monkeypatch.setattr(TF, "PACKAGE_CONFIG_DIR", tmp_path / "pkg")
    res = r.invoke(g, ["configs", "commit", "--allow-cpu", str(tmp_path / "results" / "configs" / name)])
    assert res.exit_code == 0 and "added" in res.output and (tmp_path / "pkg" / "moebench" / name).is_file()
    # One-line errors for impossible combinations.
    for bad, needle in ((["--dtype", "fp8_w8a8", "--scales", "block"], "--block-shape"),
                        (["--dtype", "bf16", "--block-shape", "128,128"], "fp8_w8a8 only"),
                        (["--dtype", "fp8_w8a8", "--block-shape", "12x8"], "two positive integers")):
        res = r.invoke(g, ["tune", *sizes, "--tokens", "1", *bad, "--dry-run"])
        assert isinstance(res.exception, MoebenchError) and needle in str(res.exception), res.output
