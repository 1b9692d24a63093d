"""The `triton-kernels` experts on a GPU with OpenAI's triton_kernels installed: `moebench sweep
--experts triton-kernels` in bf16, fp8 (per-tensor scales) and mxfp4 (gpt-oss-20b, swigluoai with
biases), every row checked against the float64 reference by the sweep; and the adapter alone
against the reference on an EP shard (remote pairs masked out of the top-k sum). Skipped where
triton_kernels' API does not read (not installed, an API moebench does not know)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moebench.activation import Activation
from moebench.backends import make_experts, make_prepare_finalize
from moebench.correctness import relative_error
from moebench.kernels.modular import ExpertBias, FusedMoEKernel, poisoned_outputs
from moebench.kernels.reference import reference_moe
from moebench.quant import QuantScheme, quantize_weights

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _api():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from moebench.kernels.triton_kernels import installed_api

    api, why = installed_api()
    if api is None:
        pytest.skip(why)


def _sweep(tmp_path, *args: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               COLUMNS="200")
    cmd = [sys.executable, "-m", "moebench.cli", "sweep", "--device", "cuda", "--prepare-finalize", "no-dpep",
           "--experts", "triton-kernels", "--tokens", "1,64,512", "--reps", "3", "--out", str(tmp_path), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    print(res.stdout[-4000:], res.stderr[-4000:])
    assert res.returncode == 0, res.stderr[-2000:]
    (run,) = tmp_path.iterdir()
    return [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("args", [
    ("--model", "qwen3-30b-a3b", "--dtype", "bf16"),
    ("--model", "qwen3-30b-a3b", "--dtype", "fp8_w8a8", "--scales", "tensor"),
    ("--model", "gpt-oss-20b", "--dtype", "mxfp4"),
    ("--model", "gpt-oss-20b", "--dtype", "bf16"),
], ids=["bf16", "fp8-tensor", "mxfp4-gpt-oss", "bf16-gpt-oss"])
def test_sweep_rows_are_correct(tmp_path, args):
    rows = [r for r in _sweep(tmp_path, *args) if r["experts"] == "triton-kernels"]
    assert len(rows) == 3
    for r in rows:
        assert r["status"] == "ok" and r["correct"], r


@pytest.mark.parametrize("quant", [None, "mxfp4"], ids=["bf16", "mxfp4"])
def test_ep_shard_matches_reference(quant):
    g = torch.Generator(device="cuda").manual_seed(0)
    e_glob, e_loc, k, h, i, m = 32, 8, 4, 512, 256, 96
    x = torch.randn(m, h, generator=g, device="cuda").bfloat16() * 3
    w13 = (torch.randn(e_loc, 2 * i, h, generator=g, device="cuda") / h**0.5).bfloat16()
    w2 = (torch.randn(e_loc, h, i, generator=g, device="cuda") / i**0.5).bfloat16()
    bias = ExpertBias(torch.randn(e_loc, 2 * i, generator=g, device="cuda").bfloat16(),
                      torch.randn(e_loc, h, generator=g, device="cuda").bfloat16() * 0.5)
    tw, ids = torch.softmax(torch.randn(m, e_glob, generator=g, device="cuda"), -1).topk(k, -1)
    emap = torch.full((e_glob,), -1, dtype=torch.int32, device="cuda")
    emap[8:16] = torch.arange(e_loc, dtype=torch.int32, device="cuda")
    w13q, w2q = quantize_weights(w13, w2, QuantScheme(quant)) if quant else (w13, w2)
    act = Activation("swigluoai")
    kernel = FusedMoEKernel(make_prepare_finalize("no-dpep"), make_experts("triton-kernels"))
    with poisoned_outputs():
        out = kernel.apply(x, w13q, w2q, tw, ids.to(torch.int32), emap, e_glob, activation=act, bias=bias)
    ref = reference_moe(x, w13q, w2q, tw, ids, emap, activation=act, bias=bias)
    assert relative_error(out, ref) < 2e-2
