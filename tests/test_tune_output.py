"""End-to-end (the CLI as a subprocess): where `tune` writes its config file and when, output
paths checked before anything runs (tune / compare / report), per-token fp8 file names, and what
`env`, `configs list` and `tune` say on a CPU."""

import csv
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from moebench.errors import MoebenchError
from moebench.quant import QuantScheme
from moebench.kernels.triton import configs as C
from test_cli import ROOT, assert_bad_input, moebench_inproc
from moebench.kernels import tuned_files as TF

SIZES = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--device", "cpu"]
FAST = ["--budget", "2", "--reps", "1", "--final-reps", "1"]
FILE = "E=4,N=32,device_name=cpu.json"

as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; "
                                                       "the missing / non-folder parent cases cover the check")


def _env(drop=(), **extra):
    env = dict(os.environ, COLUMNS="200", **extra)
    for k in drop:
        env.pop(k, None)
    return env


def _cli(*args, cwd=None, drop=(), timeout=300, **extra):
    return subprocess.run([sys.executable, "-m", "moebench.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=_env(drop, **extra), timeout=timeout)


def _run_dirs(results_dir):
    return sorted(p for p in results_dir.iterdir() if p.is_dir()) if results_dir.exists() else []


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    yield d
    d.chmod(stat.S_IRWXU)


# ---------------------------------------------------------------------------------------------
# 5: --resume keeps the run's --out; the file grows as each token count finishes


def test_resume_writes_to_the_runs_saved_out_folder(tmp_path):
    out, res = tmp_path / "my-configs", tmp_path / "res"
    first = moebench_inproc("tune", *SIZES, "--tokens", "1", *FAST, "--out", str(out), "--results-dir", str(res),
                     cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (out / FILE).unlink()  # as if the run had been cut off before writing it
    (run,) = _run_dirs(res)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = moebench_inproc("tune", "--resume", str(run), cwd=elsewhere)
    assert again.returncode == 0, again.stderr
    assert TF.load_config_file(out / FILE).keys() == {1}
    assert not (elsewhere / "results").exists()  # not ./results/configs of wherever it was resumed
    assert str(out / FILE) in again.stdout.replace("\n", "")


def test_config_file_is_updated_as_each_token_count_finishes(tmp_path):
    out, res = tmp_path / "cfg", tmp_path / "res"
    proc = subprocess.Popen([sys.executable, "-m", "moebench.cli", "tune", *SIZES, "--tokens", "1,2", *FAST,
                             "--out", str(out), "--results-dir", str(res)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # Ctrl-C as in a terminal
    try:
        deadline = time.time() + 240
        while not (out / FILE).exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert (out / FILE).exists(), proc.communicate()
        # written while the later token count was still being searched
        assert TF.load_config_file(out / FILE).keys() == {1}
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert 1 in TF.load_config_file(out / FILE)  # an interrupted run keeps its finished winners
    (run,) = _run_dirs(res)
    done = moebench_inproc("tune", "--resume", str(run), cwd=tmp_path / "res")
    assert done.returncode == 0, done.stderr
    assert TF.load_config_file(out / FILE).keys() == {1, 2}


# ---------------------------------------------------------------------------------------------
# 7: output paths are checked before the first measurement


@pytest.mark.parametrize("where", ["missing-parent", "parent-is-a-file", "out-is-a-file"])
def test_tune_out_that_cannot_be_written_fails_before_measuring(tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = {"missing-parent": blocker / "cfg", "parent-is-a-file": blocker / "sub" / "cfg",
           "out-is-a-file": blocker}[where]
    res = tmp_path / "res"
    r = moebench_inproc("tune", *SIZES, "--tokens", "1", *FAST, "--out", str(out), "--results-dir", str(res), cwd=tmp_path)
    assert_bad_input(r, "--out", str(out))
    assert _run_dirs(res) == []  # nothing was measured (no run folder, no journal)


@as_root
def test_tune_out_read_only_fails_before_measuring(tmp_path, read_only_dir):
    res = tmp_path / "res"
    r = moebench_inproc("tune", *SIZES, "--tokens", "1", *FAST, "--out", str(read_only_dir), "--results-dir", str(res),
                 cwd=tmp_path)
    assert_bad_input(r, "--out", str(read_only_dir))
    assert _run_dirs(res) == []


COMPARE = ["compare", "tp-vs-ep", "--num-experts", "4", "--topk", "2", "--hidden", "16", "--intermediate", "8",
           "--world-size", "2", "--tokens", "2", "--experts", "torch"]


@pytest.mark.parametrize("where", ["missing-parent", "parent-is-a-file", "is-a-folder"])
def test_compare_plot_that_cannot_be_written_fails_before_the_run(tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    plot = {"missing-parent": tmp_path / "nowhere" / "x.png", "parent-is-a-file": blocker / "x.png",
            "is-a-folder": tmp_path}[where]
    out = tmp_path / "res"
    r = moebench_inproc(*COMPARE, "--out", str(out), "--plot", str(plot), cwd=tmp_path)
    assert_bad_input(r, "--plot", str(plot))
    assert _run_dirs(out) == []


@as_root
def test_compare_plot_in_a_read_only_folder_fails_before_the_run(tmp_path, read_only_dir):
    out = tmp_path / "res"
    r = moebench_inproc(*COMPARE, "--out", str(out), "--plot", str(read_only_dir / "x.png"), cwd=tmp_path)
    assert_bad_input(r, "--plot", str(read_only_dir / "x.png"))
    assert _run_dirs(out) == []


@pytest.fixture
def results_folder(tmp_path):
    from moebench.report import write_exports
    from moebench.results import ResultRow, RunStore

    store = RunStore(tmp_path / "run")
    for m, lat in ((1, 10.0), (4, 20.0)):
        store.add(ResultRow("tiny", 4, 2, 16, 8, m, 1, 1, 1, 1, "no-dpep", "torch", "Standard", "fp32", "cpu",
                            "uniform", latency_us=lat, correct=True))
    write_exports(store, ["csv", "json", "md"])
    return tmp_path / "run"


@pytest.mark.parametrize("option", ["--out", "--plot"])
@pytest.mark.parametrize("where", ["missing-parent", "parent-is-a-file"])
def test_report_output_that_cannot_be_written_is_one_line(tmp_path, results_folder, option, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = {"missing-parent": tmp_path / "nowhere" / "x", "parent-is-a-file": blocker / "x"}[where]
    target = target.with_suffix(".png" if option == "--plot" else ".md")
    r = moebench_inproc("report", str(results_folder), option, str(target), cwd=tmp_path)
    assert_bad_input(r, option, str(target))
    assert not (results_folder / "report.md").exists()  # refused before writing anything


@as_root
@pytest.mark.parametrize("option", ["--out", "--plot"])
def test_report_output_in_a_read_only_folder_is_one_line(tmp_path, results_folder, read_only_dir, option):
    target = read_only_dir / ("x.png" if option == "--plot" else "x.md")
    r = moebench_inproc("report", str(results_folder), option, str(target), cwd=tmp_path)
    assert_bad_input(r, option, str(target))


# ---------------------------------------------------------------------------------------------
# 8: per-token fp8 files carry SGLang's per_channel_quant; schemes never share a file

TENSOR_FILE = "E=4,N=32,device_name=cpu,dtype=fp8_w8a8.json"
TOKEN_FILE = "E=4,N=32,device_name=cpu,dtype=fp8_w8a8,per_channel_quant=True.json"


def test_per_token_and_per_tensor_fp8_tunes_keep_separate_files(tmp_path, monkeypatch):
    out, res = tmp_path / "cfg", tmp_path / "res"
    common = [*SIZES, "--tokens", "1", *FAST, "--dtype", "fp8_w8a8", "--out", str(out), "--results-dir", str(res)]
    r = moebench_inproc("tune", *common, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    tensor_bytes = (out / TENSOR_FILE).read_bytes()
    r = moebench_inproc("tune", *common, "--scales", "token", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} == {TENSOR_FILE, TOKEN_FILE, "tuned_routing.json"}
    assert (out / TENSOR_FILE).read_bytes() == tensor_bytes  # the per-tensor entries are untouched
    (token_run,) = [d for d in _run_dirs(res) if json.loads((d / "tune.json").read_text())["spec"]["quant"]["scales"] == "token"]
    (report,) = csv.DictReader(io.StringIO((token_run / "report.csv").read_text()))
    winner = report["winner"]
    entry = TF.load_config_file(out / TOKEN_FILE)[1]
    assert winner == "M{BLOCK_SIZE_M},N{BLOCK_SIZE_N},K{BLOCK_SIZE_K},G{GROUP_SIZE_M},w{num_warps},s{num_stages}".format(**entry)
    # The triton experts look the per-token file up for per-token scales (and only for them).
    sw = moebench_inproc("configs", "list", "--json", "--dir", str(out), cwd=tmp_path)
    listed = {x["file"]: x for x in json.loads(sw.stdout) if x["dir"] == str(out)}
    assert listed[TOKEN_FILE]["per_channel_quant"] and not listed[TENSOR_FILE]["per_channel_quant"]
    monkeypatch.setenv("MOEBENCH_CONFIG_DIR", str(out))
    for scales, name in (("token", TOKEN_FILE), ("tensor", TENSOR_FILE)):
        swp = moebench_inproc("sweep", *SIZES, "--tokens", "1", "--dtype", "fp8_w8a8", "--scales", scales,
                              "--experts", "triton", "--prepare-finalize", "no-dpep", "--reps", "1",
                              "--out", str(tmp_path / f"sweep-{scales}"), cwd=tmp_path)
        assert swp.returncode == 0, swp.stderr
        (run,) = _run_dirs(tmp_path / f"sweep-{scales}")
        (row,) = [json.loads(x) for x in (run / "rows.jsonl").read_text().splitlines()]
        assert row["status"] == "ok" and row["config_source"].startswith(str(out / name)), row


def test_entries_of_another_scheme_are_not_merged_into_a_file(tmp_path):
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    token = QuantScheme("fp8_w8a8", "token")
    TF.write_config_file(tmp_path / TENSOR_FILE, {1: cfg})
    before = (tmp_path / TENSOR_FILE).read_bytes()
    with pytest.raises(MoebenchError, match="refusing to merge fp8_w8a8 per-token entries"):
        TF.merge_config_file(tmp_path / TENSOR_FILE, {4: cfg}, quant=token)
    with pytest.raises(MoebenchError, match="refusing to merge unquantised entries"):
        TF.merge_config_file(tmp_path / TOKEN_FILE, {4: cfg})
    assert (tmp_path / TENSOR_FILE).read_bytes() == before
    TF.merge_config_file(tmp_path / TOKEN_FILE, {4: cfg}, quant=token)
    TF.merge_config_file(tmp_path / TOKEN_FILE, {1: cfg}, quant=token)
    assert TF.load_config_file(tmp_path / TOKEN_FILE).keys() == {1, 4}


# ---------------------------------------------------------------------------------------------
# 16: env and sweep agree; readable ceilings; configs list order; tune without the interpreter


def test_env_says_what_an_fp8_sweep_says_about_the_torch_experts(tmp_path):
    env = moebench_inproc("env", "--json", "--device", "cpu", cwd=tmp_path)
    assert env.returncode == 0, env.stderr
    torch_row = next(b for b in json.loads(env.stdout)["backends"] if b["name"] == "torch")
    sw = moebench_inproc("sweep", *SIZES, "--tokens", "2", "--dtype", "fp8_w8a8", "--experts", "torch",
                  "--prepare-finalize", "no-dpep", "--out", str(tmp_path / "sw"), cwd=tmp_path)
    assert sw.returncode == 2 and not (tmp_path / "sw").exists()  # nothing can run: refused, nothing written
    assert "fp8" not in torch_row["dtypes"]  # no fp8 claimed where the sweep refuses it
    assert "fp8 'torch' experts do not run on cpu" in sw.stderr and "fp8" in torch_row["reason"]
    assert torch_row["usable"]  # still usable for fp32 / bf16


def test_env_prints_ceilings_as_lines_with_units(tmp_path):
    r = moebench_inproc("env", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "{'" not in r.stdout and "{\"" not in r.stdout
    lines = r.stdout.splitlines()
    assert any("memory read" in x and "GB/s" in x for x in lines)
    assert any("matmul fp32" in x and "TFLOP/s" in x for x in lines)


def test_configs_list_sorts_by_e_then_n_as_numbers(tmp_path):
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    d = tmp_path / "mine"
    for e, n in ((128, 64), (16, 1024), (8, 512), (16, 96), (8, 64)):
        TF.write_config_file(d / TF.config_file_name(e, n, "cpu"), {1: cfg})
    r = moebench_inproc("configs", "list", "--json", "--dir", str(d), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["E"], x["N"]) for x in rows if x["dir"] == str(d)] == [(8, 64), (8, 512), (16, 96), (16, 1024), (128, 64)]
    keys = [(x["E"], x["N"]) for x in rows]
    assert keys == sorted(keys)  # across folders too (the shipped files included)


def test_tune_on_cpu_without_the_interpreter_refuses_before_starting(tmp_path):
    res = tmp_path / "res"
    r = _cli("tune", *SIZES, "--tokens", "1", *FAST, "--out", str(tmp_path / "cfg"), "--results-dir", str(res),
             cwd=tmp_path, drop=("TRITON_INTERPRET",))
    assert_bad_input(r, "TRITON_INTERPRET=1", "GPU")
    assert _run_dirs(res) == [] and not (tmp_path / "cfg").exists()
