"""End-to-end: run the CLI as a user would, through its entry point: in this process
(`moebench_inproc`, which skips a second interpreter start), or as a subprocess of the installed
module (`moebench`) where a test needs a process of its own (signals, locks, the environment)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def moebench(*args, cwd=None, timeout=300):
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "moebench.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def run_here(entry, argv, env=None, cwd=None) -> subprocess.CompletedProcess:
    """A program's entry point called in this process as if started with `argv` (sys.argv while it
    runs), `env` added to the environment and `cwd` the working directory: the exit status (its
    return value or SystemExit's code), stdout and stderr a user sees. An uncaught exception (what
    would print a traceback) propagates and fails the test."""
    out, err = io.StringIO(), io.StringIO()
    argv_before, here = sys.argv, os.getcwd()
    sys.argv = [str(a) for a in argv]
    try:
        with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = entry() or 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv_before
        os.chdir(here)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def moebench_inproc(*args, cwd=None, env=None):
    """`moebench *args` through its entry point (`moebench.cli.main`) in this process."""
    from moebench.cli import main

    return run_here(main, ["moebench", *args], env=env, cwd=cwd)


def assert_bad_input(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    err = res.stderr.strip()
    assert "Traceback" not in res.stderr
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


SMALL = ["--num-experts", "6", "--topk", "2", "--hidden", "24", "--intermediate", "16", "--tokens", "3"]


@pytest.mark.parametrize("args,needles", [
    (["--num-experts", "4", "--topk", "5", "--hidden", "8", "--intermediate", "8"], ["topk"]),
    (["--num-experts", "4", "--topk", "0", "--hidden", "8", "--intermediate", "8"], ["topk"]),
    (["--num-experts", "4", "--topk", "2", "--hidden", "-8", "--intermediate", "8"], ["hidden"]),
    (["--num-experts", "4", "--topk", "2", "--hidden", "8"], ["--intermediate"]),
    (SMALL[:-2] + ["--tokens", "1,-4"], ["negative"]),
    (SMALL[:-2] + ["--tokens", "1,2.5"], ["not an integer"]),
    (["--model", "mixtrall-8x7b"], ["unknown model", "mixtral-8x7b"]),
    (SMALL + ["--experts", "trition"], ["unknown experts backend", "triton"]),
    (SMALL + ["--prepare-finalize", "deepep"], ["unknown prepare/finalize", "deepep-ll"]),
    (SMALL + ["--device", "cuda"], ["no CUDA GPU"]),
    (["--model", "mixtral-8x7b", "--tp", "3", "--tokens", "1"], ["does not divide"]),
    (["--model", "mixtral-8x7b", "--ep", "16", "--tokens", "1"], ["larger than the number of experts"]),
    (["--model", "mixtral-8x7b", "--ep", "8", "--dp", "2", "--tokens", "1"], ["must equal"]),
    (SMALL + ["--routing", "zipf:abc"], ["zipf"]),
    (SMALL + ["--routing", "file:/nonexistent/ids.json"], ["ids.json"]),
    (SMALL + ["--format", "csv,xls"], ["xls"]),
])
def test_bad_input_one_line_exit_2(args, needles):
    assert_bad_input(moebench_inproc("sweep", *args), *needles)


def test_malformed_config_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert_bad_input(moebench_inproc("sweep", "--model", str(bad)), "config.json")
    not_moe = tmp_path / "dense.json"
    not_moe.write_text(json.dumps({"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32}))
    assert_bad_input(moebench_inproc("sweep", "--model", str(not_moe)), "dense.json")


def test_unwritable_output_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_bad_input(moebench_inproc("sweep", *SMALL, "--out", str(blocker / "sub")), "cannot write")


def test_too_large_for_memory():
    # 4096 experts of 16384 x 65536: ~26 TB of fp32 weights
    res = moebench_inproc("sweep", "--num-experts", "4096", "--topk", "2", "--hidden", "16384", "--intermediate", "65536",
                   "--tokens", "1", "--experts", "torch", "--prepare-finalize", "no-dpep")
    assert_bad_input(res, "needs about", "--tp/--ep")


def test_click_usage_error_is_one_line():
    assert_bad_input(moebench_inproc("sweep", "--tp", "x"), "--tp")
    assert_bad_input(moebench_inproc("nonsense"), "nonsense")


def test_sweep_end_to_end(tmp_path):
    res = moebench_inproc("sweep", *SMALL[:-2], "--tokens", "0,1,5", "--reps", "1", "--out", str(tmp_path),
                          "--format", "csv,json,md")
    assert res.returncode == 0, res.stderr
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1
    run = runs[0]
    meta = json.loads((run / "metadata.json").read_text())
    assert meta["device"] == "cpu" and "git_revision" in meta and "torch" in json.dumps(meta)
    df = pd.read_csv(run / "results.csv")
    ok = df[df.status == "ok"]
    assert set(ok.experts) >= {"torch", "batched-torch", "triton", "batched-triton"}  # Triton: interpreter
    assert ok.correct.all()
    assert (ok[ok.experts.isin(["triton", "batched-triton"])].config_source == "default heuristic").all()
    assert set(ok.tokens) == {0, 1, 5}
    skipped = df[df.status == "skipped"]
    mismatch = skipped[skipped.reason.str.contains("format mismatch")]
    assert len(mismatch) > 0  # e.g. no-dpep + batched-torch is listed, not dropped
    assert (run / "results.md").read_text().startswith("# moebench sweep: custom")
    assert "moebench sweep" in res.stdout and "CPU times are wall clock" in res.stdout


def test_sweep_triton_experts_read_the_tuned_file(tmp_path, monkeypatch):
    # Both Triton experts look up the vLLM-format file of their (local experts, I, device): the
    # sorted-token kernel at the token count, the batched one at its rows per expert; each row
    # names the entry it ran with.
    entry = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    (tmp_path / "cfg").mkdir()
    name = "E=6,N=16,device_name=cpu.json"
    (tmp_path / "cfg" / name).write_text(json.dumps({"triton_version": "3.6.0", "3": entry, "64": entry}))
    monkeypatch.setenv("MOEBENCH_CONFIG_DIR", str(tmp_path / "cfg"))
    res = moebench_inproc("sweep", *SMALL, "--experts", "triton,batched-triton", "--reps", "1",
                          "--out", str(tmp_path / "out"), "--format", "csv")
    assert res.returncode == 0, res.stderr
    df = pd.read_csv(next((tmp_path / "out").iterdir()) / "results.csv")
    ok = df[df.status == "ok"]
    assert set(ok.experts) == {"triton", "batched-triton"} and ok.correct.all()
    assert ok.config_source.str.contains(name, regex=False).all()
    assert ok.config_source.str.endswith("[3]").all()


def test_sweep_resume_skips_finished_rows(tmp_path):
    args = ["sweep", *SMALL, "--experts", "torch", "--prepare-finalize", "no-dpep"]
    assert moebench_inproc(*args, "--out", str(tmp_path)).returncode == 0
    (run,) = tmp_path.iterdir()
    lines = (run / "rows.jsonl").read_text().splitlines()
    assert len(lines) == 1
    res = moebench_inproc(*args, "--resume", str(run))  # the same options again: accepted, nothing left to run
    assert res.returncode == 0, res.stderr
    assert (run / "rows.jsonl").read_text().splitlines() == lines


def test_env_and_models():
    res = moebench_inproc("env", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    names = {b["name"]: b for b in info["backends"]}
    assert names["torch"]["usable"]
    assert not names["deepep-ll"]["usable"] and names["deepep-ll"]["reason"]
    assert not names["aiter"]["usable"] and names["aiter"]["reason"]
    res = moebench_inproc("models")
    assert res.returncode == 0
    for m in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "dbrx", "olmoe-1b-7b"):
        assert m in res.stdout


def test_out_of_gpu_memory_is_one_line(monkeypatch):
    import moebench.cli as cli_module

    def oom(**kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity ...")

    monkeypatch.setattr(cli_module.cli, "main", oom)
    assert_bad_input(moebench_inproc("sweep", *SMALL), "error: out of GPU memory (CUDA out of memory); free the GPU")


def test_target_gpu_is_one_option_across_commands(tmp_path):
    """`--target-gpu` names the modeled GPU in comm, compare and sweep; `--gpu` is the same option."""
    comm = ["comm", "--transport", "nccl-all-reduce", "--op", "all-reduce", "--world-size", "8", "--bytes", "1e6", "--json"]
    said = {flag: json.loads(moebench_inproc(*comm, flag, "H100").stdout) for flag in ("--target-gpu", "--gpu")}
    assert said["--target-gpu"] == said["--gpu"] and said["--gpu"]["nvlink"] == "h100-nvlink"
    sweep = ["sweep", "--num-experts", "8", "--topk", "2", "--hidden", "32", "--intermediate", "16", "--tokens", "2",
             "--experts", "torch", "--device", "cpu"]
    for flag in ("--target-gpu", "--gpu"):
        res = moebench_inproc(*sweep, "--ep", "2", "--simulate", flag, "B200", "--out", str(tmp_path / flag),
                              env={"COLUMNS": "400"})
        assert res.returncode == 0, res.stderr
        assert "link: the profile of B200 (from --target-gpu)" in res.stdout
    assert_bad_input(moebench_inproc(*sweep, "--target-gpu", "B200", "--out", str(tmp_path / "x")), "--simulate")
    for flag in ("--target-gpu", "--gpu"):  # compare's own refusal of an unknown GPU: the option is read either way
        assert_bad_input(moebench_inproc("compare", "tp-vs-ep", "--num-experts", "8", "--topk", "2", "--hidden", "32",
                                         "--intermediate", "16", "--world-size", "2", "--tokens", "2", "--no-check",
                                         flag, "Z9000", "--out", str(tmp_path / "c")), "no datasheet profile", "Z9000")
