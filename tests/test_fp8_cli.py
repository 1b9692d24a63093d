"""fp8 end to end through the CLI: single rank, real gloo ranks (fp8 over all2all-ll and
allgather-rs, TP shards quantised per rank), simulated ranks, and bad fp8 options."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.test_cli import assert_bad_input, moebench_inproc

SHAPE = ["--num-experts", "8", "--topk", "2", "--hidden", "80", "--intermediate", "48"]


def _rows(out_dir) -> pd.DataFrame:
    files = list(out_dir.glob("*/results.csv"))
    assert len(files) == 1, files
    return pd.read_csv(files[0])


@pytest.mark.parametrize("args,needles", [
    (["--dtype", "bf16", "--block-shape", "128,128"], ["fp8_w8a8 only"]),
    (["--dtype", "fp8_w8a8", "--block-shape", "128"], ["two positive integers"]),
    (["--dtype", "fp8_w8a8", "--scales", "block"], ["--block-shape"]),
    (["--dtype", "fp8_w8a8", "--block-shape", "128,128", "--scales", "token"], ["--block-shape"]),
])
def test_bad_fp8_options(args, needles):
    assert_bad_input(moebench_inproc("sweep", *SHAPE, "--tokens", "1", *args), *needles)


def test_sweep_fp8_block_single_rank(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "1,7", "--dtype", "fp8_w8a8", "--block-shape", "32,32",
                   "--experts", "triton,batched-triton,torch,reference", "--prepare-finalize", "no-dpep,batched-local",
                   "--reps", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df = _rows(tmp_path)
    ok = df[df.status == "ok"]
    assert set(ok.experts) == {"triton", "batched-triton", "reference"}
    assert (ok.dtype == "fp8_w8a8").all() and (ok["quant"] == "block[32,32]").all()
    assert ok.correct.all() and (ok.max_rel_err < 3e-2).all()
    # what fp8 costs against the unquantised layer is reported beside the kernel's own error
    assert ((ok.err_vs_unquantized > 0.01) & (ok.err_vs_unquantized < 0.15)).all()
    torch_rows = df[(df.experts == "torch") & (df.prepare_finalize == "no-dpep")]
    assert (torch_rows.status == "skipped").all() and torch_rows.reason.str.contains("block").all()


# (per-token scales; the rank paths of every fp8 scheme, per tensor too, are test_fp8_multirank's)
@pytest.mark.parametrize("scales", ["token"])
def test_sweep_fp8_ep_real_ranks(tmp_path, scales):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "5", "--dtype", "fp8_w8a8", "--scales", scales,
                   "--world-size", "2", "--ep", "2", "--dp", "2", "--experts", "triton,batched-triton",
                   "--prepare-finalize", "all2all-ll,allgather-rs", "--reps", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    ok = _rows(tmp_path).query("status == 'ok'")
    assert set(zip(ok.prepare_finalize, ok.experts)) == {("all2all-ll", "batched-triton"), ("allgather-rs", "triton")}
    assert ok.correct.all() and ((ok.err_vs_unquantized > 0.01) & (ok.err_vs_unquantized < 0.15)).all()
    # fp8 dispatch: the payload is one byte per element plus scales, fewer bytes than bf16 would move
    assert ok.dispatch_us.notna().all()


def test_sweep_fp8_tp_and_simulated(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "3", "--dtype", "fp8_w8a8", "--block-shape", "16,16",
                   "--world-size", "2", "--tp", "2", "--experts", "triton", "--prepare-finalize", "no-dpep",
                   "--reps", "1", "--out", str(tmp_path / "tp"))
    assert res.returncode == 0, res.stderr
    ok = _rows(tmp_path / "tp").query("status == 'ok'")
    assert len(ok) == 1 and ok.correct.all() and 0.01 < ok.err_vs_unquantized.iloc[0] < 0.15
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "4", "--dtype", "fp8_w8a8", "--block-shape", "16,16",
                   "--ep", "4", "--simulate", "--experts", "batched-triton", "--prepare-finalize", "all2all-ll",
                   "--reps", "1", "--out", str(tmp_path / "sim"))
    assert res.returncode == 0, res.stderr
    ok = _rows(tmp_path / "sim").query("status == 'ok'")
    assert len(ok) == 1 and ok.correct.all() and ok.modeled.all() and 0.01 < ok.err_vs_unquantized.iloc[0] < 0.15


def test_compare_tp_vs_ep_fp8(tmp_path):
    res = moebench_inproc("compare", "tp-vs-ep", "--num-experts", "8", "--topk", "2", "--hidden", "64", "--intermediate", "32",
                   "--world-size", "2", "--tokens", "2", "--dtype", "fp8_w8a8", "--block-shape", "16,16",
                   "--experts", "triton", "--reps", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df = pd.read_csv(next(tmp_path.glob("*/results.csv")))
    ok = df[df.status == "ok"]
    # both layouts ran fp8 (simulated share + real gloo ranks), every row correct
    assert {1, 2} <= set(ok.ep) and (ok.dtype == "fp8_w8a8").all() and ok.correct.all()
    assert {1, 2} <= set(ok[~ok.modeled.astype(bool)].ep) and ok.modeled.astype(bool).any()
    assert "fp8_w8a8 block[16,16]" in res.stdout.replace("\n", " ")


def test_nothing_runs_says_why_and_how(tmp_path):
    """fp8 on a CPU without the interpreter: no pair can run; the sweep says so and how to run them."""
    import os
    import subprocess
    import sys

    from tests.test_cli import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(COLUMNS="200")
    res = subprocess.run([sys.executable, "-m", "moebench.cli", "sweep", *SHAPE, "--tokens", "1", "--dtype", "fp8_w8a8",
                          "--experts", "triton", "--prepare-finalize", "no-dpep", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr  # refused before any folder: one line saying why and how
    err = " ".join(res.stderr.split())
    assert "no pair of --experts and --prepare-finalize can run here" in err and "TRITON_INTERPRET=1" in err
    assert not any(tmp_path.iterdir())
