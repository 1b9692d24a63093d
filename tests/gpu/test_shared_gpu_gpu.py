"""Two ranks on ONE GPU (a gloo group) through `moebench sweep --world-size 2 --device cuda`: DeepEP
low-latency (`deepep-ll` + batched experts) and normal (`deepep-ht` + standard experts), and the
other multi-rank paths with CUDA tensors, each row checked against the float64 reference and
marked as timed on a shared GPU. The sweep sees only the first GPU (CUDA_VISIBLE_DEVICES), so
this runs the shared mode on a machine with more GPUs too. DeepEP cases skip where deep_ep does
not import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["--num-experts", "16", "--topk", "4", "--hidden", "2048", "--intermediate", "256"]


def _deep_ep_imports() -> str | None:
    res = subprocess.run([sys.executable, "-c", "import deep_ep"], capture_output=True, text=True)
    return None if res.returncode == 0 else (res.stderr.strip().splitlines() or ["?"])[-1]


def _sweep(tmp_path, pf: str, experts: str, extra=()) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], COLUMNS="200")
    cmd = [sys.executable, "-m", "moebench.cli", "sweep", *SHAPE, "--tokens", "1,64,128", "--world-size", "2",
           "--device", "cuda", "--prepare-finalize", pf, "--experts", experts, "--out", str(tmp_path), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=480)
    print(res.stdout[-4000:], res.stderr[-4000:])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "share a GPU" in res.stdout + res.stderr  # the notice
    (run,) = tmp_path.iterdir()
    return [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]


CASES = [
    ("deepep-ll", "batched-torch", ["--ep", "2"]),
    ("deepep-ll", "batched-triton", ["--ep", "2"]),
    ("deepep-ht", "torch", ["--ep", "2"]),
    ("deepep-ht", "triton", ["--ep", "2"]),
    ("all2all-ll", "batched-triton", ["--ep", "2"]),
    ("allgather-rs", "triton", ["--ep", "2"]),
    ("no-dpep", "triton", ["--tp", "2"]),
]


@pytest.mark.parametrize("pf,experts,layout", CASES, ids=[f"{c[0]}+{c[1]}" for c in CASES])
def test_two_ranks_share_one_gpu(tmp_path, pf, experts, layout):
    if pf.startswith("deepep") and (why := _deep_ep_imports()) is not None:
        pytest.skip(f"deep_ep does not import: {why}")
    rows = _sweep(tmp_path, pf, experts, layout)
    assert [r["tokens"] for r in rows] == [1, 64, 128]
    for r in rows:
        assert r["status"] == "ok", r["reason"]
        assert r["correct"] is True and r["max_rel_err"] < 2e-2, (r["tokens"], r["max_rel_err"])
        assert r["device"] == "cuda-shared" and r["x_ranks_per_gpu"] == 2
        assert "ranks shared each GPU" in r["reason"] and r["latency_us"] > 0
        assert r["allreduce"] == ("gloo" if pf == "no-dpep" else "")
