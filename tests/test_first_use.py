"""What a new user meets first, end to end through the CLI: run ids that never collide, refused
input that writes nothing, files that keep their permissions, a clean end on SIGTERM, tables that
fit their width, named custom shapes, honest remainders, no quiet acceptance of odd input, a tune
plan on any machine and `python -m moebench`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from test_cli import ROOT, assert_bad_input, moebench, moebench_inproc
from moebench.kernels import tuned_files as TF

TINY = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "64"]
TINY_SWEEP = [*TINY, "--tokens", "1", "--experts", "torch", "--prepare-finalize", "no-dpep", "--device", "cpu"]


def _env(**extra):
    return dict(os.environ, COLUMNS="200", **extra)


def _tree(folder: Path) -> dict:
    """Every path below `folder` with its bytes (None for folders): what a command left there."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


# -- python -m moebench --------------------------------------------------------------------------

def test_python_dash_m_moebench_runs_the_cli():
    res = subprocess.run([sys.executable, "-m", "moebench", "models"], capture_output=True, text=True, env=_env(),
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "qwen3-30b-a3b" in res.stdout
    ver = moebench_inproc("--version")  # (the same entry point: in this process)
    assert ver.returncode == 0 and ver.stdout.startswith("moebench, version"), ver.stdout + ver.stderr


# -- run ids: unique and sortable by time --------------------------------------------------------

# A sweep that imports everything first, then waits for the file `go` to appear: started together,
# the two processes reach their run folders within milliseconds of each other.
_HELD_SWEEP = """
import os, sys, time
import moebench.cli, moebench.sweep, moebench.report, moebench.backends
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.001)
sys.argv = ["moebench", *sys.argv[2:]]
moebench.cli.main()
"""


def test_two_sweeps_started_together_into_one_out_get_their_own_folders(tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _HELD_SWEEP, str(go), "sweep", *TINY_SWEEP, "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for _ in range(2)]
    try:
        time.sleep(4)  # both imported and waiting
        go.write_text("")
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    runs = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(runs) == 2, runs
    for run in runs:
        rows = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]
        assert [(r["tokens"], r["experts"], r["status"]) for r in rows] == [(1, "torch", "ok")]


def test_run_ids_sort_by_start_time():
    from moebench.results import new_run_id

    ids = [new_run_id("sweep", "custom") for _ in range(50)]
    assert len(set(ids)) == 50
    assert ids == sorted(ids)


# -- refused input writes nothing ----------------------------------------------------------------

def _refusals(tmp_path: Path) -> list[tuple[list[str], str]]:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    pickled = tmp_path / "ids.pt"
    import pickle
    pickled.write_bytes(pickle.dumps(Path("not ids")))
    return [
        (["--tokens", "100000000"], "needs about"),
        (["--num-experts", "1000000000000"], "needs about"),
        (["--routing", "file:" + str(tmp_path / "missing.pt")], "does not exist"),
        (["--routing", "file:" + str(folder)], "is a folder"),
        (["--routing", "file:" + str(pickled)], "weights_only"),
    ]


def _override(args: list[str], extra: list[str]) -> list[str]:
    """`args` with the flags of `extra` replaced by extra's values."""
    out, given = [], {extra[i] for i in range(0, len(extra), 2)}
    i = 0
    while i < len(args):
        if args[i] in given:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out + extra


def test_refused_sweep_and_tune_leave_the_out_folder_unchanged(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("an earlier run's file")
    before = _tree(out)
    tune = [*TINY, "--tokens", "1", "--device", "cpu", "--budget", "2", "--reps", "1", "--final-reps", "1"]
    for extra, needle in _refusals(tmp_path):
        assert_bad_input(moebench_inproc("sweep", *_override(TINY_SWEEP, extra), "--out", out), needle)
        assert _tree(out) == before, extra
        assert_bad_input(moebench_inproc("tune", *_override(tune, extra), "--out", out / "cfg",
                                         "--results-dir", out / "res"), needle)
        assert _tree(out) == before, extra
    fresh = tmp_path / "fresh"
    assert_bad_input(moebench_inproc("sweep", *_override(TINY_SWEEP, ["--tokens", "100000000"]), "--out", fresh),
                     "needs about")
    assert not fresh.exists()


# -- a rewritten tuned file keeps its permissions; a garbled row is reported -----------------------

def test_retuning_keeps_the_tuned_files_permissions(tmp_path):
    import stat

    args = ["tune", *TINY, "--device", "cpu", "--budget", "1", "--reps", "1", "--final-reps", "1",
            "--out", tmp_path / "cfg", "--results-dir", tmp_path / "res"]
    first = moebench_inproc(*args, "--tokens", "1")
    assert first.returncode == 0, first.stderr
    (path,) = (tmp_path / "cfg").glob("E=*.json")
    path.chmod(0o664)  # a folder shared by a group
    again = moebench_inproc(*args, "--tokens", "2")
    assert again.returncode == 0, again.stderr
    assert sorted(json.loads(path.read_text())) == ["1", "2", "triton_version"]  # rewritten with both counts
    assert stat.S_IMODE(path.stat().st_mode) == 0o664


def test_a_garbled_middle_row_is_reported_on_resume(tmp_path):
    res = moebench_inproc("sweep", *_override(TINY_SWEEP, ["--tokens", "1,2,3"]), "--out", tmp_path)
    assert res.returncode == 0, res.stderr
    (run,) = tmp_path.iterdir()
    lines = (run / "rows.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 3
    lines[1] = '{"model": "custom", "tok' + "\x00" * 8 + '\n'  # a disk error in the middle of the file
    (run / "rows.jsonl").write_text("".join(lines))
    again = moebench_inproc("sweep", "--resume", run)
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stderr.split())
    assert "garbled line of" in said and "rows.jsonl (line 2)" in said and "measured again" in said, again.stderr
    rows = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines() if line.startswith('{"model": "custom", "num')]
    assert sorted(r["tokens"] for r in rows) == [1, 2, 3]  # the lost row measured again


# -- SIGTERM stops a run as Ctrl-C does ------------------------------------------------------------

def test_sigterm_to_a_two_rank_sweep_keeps_rows_and_says_how_to_resume(tmp_path):
    import signal

    from test_run_safety import _children, _n_lines, _only_run, _running, _stop_all, _wait_for

    out = tmp_path / "out"
    # 2 real ranks; every row takes seconds, so the run is still going when the signal comes
    parent = subprocess.Popen([sys.executable, "-m", "moebench", "sweep", *TINY, "--tokens", "1,2,3,4,5,6,7,8",
                               "--experts", "torch", "--prepare-finalize", "no-dpep", "--world-size", "2", "--tp", "2",
                               "--reps", "400", "--device", "cpu", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    ranks: list[int] = []
    try:
        _wait_for(lambda: len(_children(parent.pid)) == 2, 120, "two rank processes", parent)
        ranks = _children(parent.pid)
        _wait_for(lambda: out.exists() and any(_n_lines(r) >= 1 for r in out.iterdir()), 120, "a first row", parent)
        run = _only_run(out)
        parent.send_signal(signal.SIGTERM)  # what slurm and `timeout` send
        _, err = parent.communicate(timeout=60)
    finally:
        _stop_all(parent, ranks)
    assert parent.returncode == 143, err
    said = " ".join(err.split())
    assert "interrupted by SIGTERM:" in said and f"--resume {run}" in said, err
    assert "leaked" not in err and "Traceback" not in err, err
    kept = _n_lines(run)
    assert 1 <= kept < 8
    assert not [r for r in ranks if _running(r)], "rank processes outlived the run"
    assert (run / "results.csv").exists()  # the finished rows are exported, as after Ctrl-C


# -- tables fit their width; prose never breaks a path --------------------------------------------

def _at_80(*args, cwd=None, **env):
    """moebench *args writing to a log 80 columns wide (what a terminal of 80 and a CI log get):
    through the entry point in this process, stdout not a terminal (plain text, as in a pipe)."""
    from moebench.cli.options import console

    res = moebench_inproc(*map(str, args), cwd=cwd, env={"COLUMNS": "80", **env})
    assert not console.is_terminal  # (a FORCE_COLOR or TTY_COMPATIBLE at import would make it one)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _table_at(lines: list[str]) -> list[str]:
    """The header, rule and rows of the first plain-text table in `lines` (up to a blank line or
    the note on left-out columns)."""
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    start = rule - 1 if lines[rule - 2].strip() == "" or lines[rule - 2].startswith(("tuned", "backends")) else rule - 2
    end = next((i for i in range(rule + 1, len(lines)) if not lines[i].strip() or lines[i].startswith("not shown")),
               len(lines))
    return lines[start:end]


def test_configs_show_and_list_fit_80_columns_with_short_headers(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    entry = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    (cfg / "E=8,N=1792,device_name=NVIDIA_H200.json").write_text(json.dumps({"1": entry, "4096": {**entry, "BLOCK_SIZE_M": 128}}))
    show = _at_80("configs", "show", cfg / "E=8,N=1792,device_name=NVIDIA_H200.json")
    assert "…" not in show
    header = next(line for line in show.splitlines() if line.split()[:1] == ["tokens"])
    assert header.split() == ["tokens", "BM", "BN", "BK", "GM", "warps", "stages"]
    assert ["4096", "128", "64", "128", "8", "4", "3"] in [line.split() for line in show.splitlines()]
    assert "BM = BLOCK_SIZE_M" in show
    listed = _at_80("configs", "list", MOEBENCH_CONFIG_DIR=str(cfg))
    assert "…" not in listed
    lines = listed.splitlines()
    table = _table_at(lines)
    assert len(table) > 3 and all(len(line) <= 80 for line in table), table
    assert any(line.startswith("[1]") and "2: 1-4096" in line for line in lines), listed  # token counts, whole
    said = " ".join(listed.split())
    assert "not shown at 80 columns:" in said and "kernel" in said.split("not shown at 80 columns:")[1]


def test_env_backends_table_fits_and_keeps_the_interpreter_hint():
    env = {k: v for k, v in {**_env(), "COLUMNS": "80"}.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "moebench", "env", "--device", "cpu"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "…" not in out
    table = _table_at(out.splitlines())
    assert len(table) > 10 and all(len(line) <= 80 for line in table), table
    said = " ".join(out.split())
    assert "set TRITON_INTERPRET=1 to run them" in said  # the hint, whole
    assert "not shown at 80 columns: dtypes" in said


def test_tune_report_fits_80_columns_and_names_what_it_left_out(tmp_path):
    out = _at_80("tune", *TINY, "--device", "cpu", "--tokens", "1", "--budget", "2", "--reps", "1",
                 "--final-reps", "1", "--out", tmp_path / "cfg", "--results-dir", tmp_path / "res")
    assert "…" not in out
    (run,) = (tmp_path / "res").iterdir()
    import csv
    (row,) = list(csv.DictReader((run / "report.csv").open()))
    line = next(line for line in out.splitlines() if line.split()[:2] == ["1", row["winner"]])
    assert row["winner_us"] in line.split() and len(line) <= 80
    said = " ".join(out.split())
    assert "not shown at 80 columns: runner-up" in said and f"{run / 'report.md'} has every column" in said


def test_prose_never_breaks_a_path(tmp_path):
    deep = tmp_path / ("a-folder-with-a-long-name-" * 3) / "results"
    out = _at_80("sweep", *TINY_SWEEP, "--out", deep, "--format", "csv", cwd=tmp_path)
    (run,) = deep.iterdir()
    assert len(str(run)) > 80
    lines = out.splitlines()
    assert str(run) in lines  # on a line of its own, whole, where it is longer than the width
    assert str(run / "results.csv") in lines


# -- the breakdown's remainder is never negative ---------------------------------------------------

def test_other_is_never_negative_where_the_parts_add_up_to_more_than_the_layer(tmp_path):
    res = moebench_inproc("sweep", *_override(TINY_SWEEP, ["--tokens", "1,2"]), "--out", tmp_path)
    assert res.returncode == 0, res.stderr
    (run,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]
    # as real EP ranks report them: each part timed alone between barriers on its slowest rank
    rows[0].update(latency_us=1000.0, dispatch_us=400.0, experts_us=500.0, combine_us=300.0)
    rows[1].update(latency_us=1000.0, dispatch_us=200.0, experts_us=500.0, combine_us=200.0)
    (run / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shown = moebench_inproc("sweep", "--resume", str(run), env={"COLUMNS": "200"})  # nothing left to run: the table
    assert shown.returncode == 0, shown.stderr
    from test_output import parse_table

    heads, cells = parse_table(shown.stdout)
    col = next(i for i, h in enumerate(heads) if h.split()[0] == "other")
    unit = {"us": 1.0, "ms": 1000.0}[heads[col].split()[1]]
    other = {r[heads.index("tokens")]: r[col] for r in cells}
    assert other["1"] == "-" and float(other["2"]) * unit == 100.0, (heads, cells)
    assert "other is blank at 1 row:" in " ".join(shown.stdout.split())


# -- a --model config.json run is named after its file or model_type -------------------------------

def _mixtral_like(path: Path, **over) -> Path:
    cfg = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_size": 64,
           "intermediate_size": 64, **over}
    path.write_text(json.dumps(cfg))
    return path


def test_config_json_runs_are_named_after_the_file_or_its_model_type(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    files = [_mixtral_like(cfg / "a.json"), _mixtral_like(cfg / "b.json", intermediate_size=32),
             _mixtral_like(cfg / "config.json", hidden_size=32)]
    out = tmp_path / "out"
    sweep = ["--tokens", "1", "--experts", "torch", "--prepare-finalize", "no-dpep", "--device", "cpu"]
    for f in files:
        res = moebench_inproc("sweep", "--model", f, *sweep, "--out", out)
        assert res.returncode == 0, res.stderr
    names = sorted(p.name.split("-sweep-", 1)[1] for p in out.iterdir())
    assert names == ["a", "b", "mixtral"]
    models = {json.loads((p / "rows.jsonl").read_text().splitlines()[0])["model"] for p in out.iterdir()}
    assert models == {"a", "b", "mixtral"}
    bad = _mixtral_like(cfg / "bad.json", num_experts_per_tok=9)
    assert_bad_input(moebench_inproc("sweep", "--model", bad, *sweep, "--out", out),
                     f"model shape 'bad' (read from {bad})", "topk")


# -- tune --dry-run plans a tune on any machine ---------------------------------------------------

def test_tune_dry_run_plans_on_a_cpu_for_the_cpu_and_for_a_gpu(tmp_path, monkeypatch):
    def tune(*args):
        with monkeypatch.context() as m:  # a CPU user's shell (in this process: a plan launches no kernel)
            m.delenv("TRITON_INTERPRET", raising=False)
            return moebench_inproc("tune", "--model", "mixtral-8x7b", "--tp", "8", "--tokens", "1,64", "--dry-run",
                                   *args, cwd=tmp_path, env={"COLUMNS": "200"})

    results = [tune(), tune("--device", "cuda")]
    for res in results:
        assert res.returncode == 0, res.stderr
        assert "search space after pruning" in res.stdout and "/ 1920" in res.stdout
    said, gpu = (" ".join(res.stdout.split()) for res in results)
    assert "notice: cannot tune the triton experts" in said and "a dry run only plans the search" in said
    assert "device_name=GPU_NAME.json on cuda" in gpu and "KiB of shared memory per block" in gpu
    assert list(tmp_path.iterdir()) == []  # a plan writes nothing
    if not __import__("torch").cuda.is_available():  # without --dry-run a GPU tune still needs the GPU
        assert_bad_input(moebench_inproc("tune", "--model", "mixtral-8x7b", "--tp", "8", "--device", "cuda",
                                         "--tokens", "1", cwd=tmp_path), "no CUDA GPU")


# -- nothing odd is accepted quietly ---------------------------------------------------------------

def test_odd_sweep_input_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    out = tmp_path / "out"
    for extra, needles in (
            (["--tokens", "1,1,1"], ["--tokens: 1 is given more than once"]),
            (["--experts", ""], ["--experts is empty"]),
            (["--prepare-finalize", " , "], ["--prepare-finalize is empty"]),
            (["--experts", "deepgemm"], ["no pair of --experts and --prepare-finalize can run here", "not on cpu"])):
        assert_bad_input(moebench_inproc("sweep", *_override(TINY_SWEEP, extra), "--out", out), *needles)
        assert not out.exists(), extra
    for where, what in ((tmp_path / "missing", "does not exist"), (tmp_path / "a-file.json", "is a file")):
        if what == "is a file":
            where.write_text("{}")
        monkeypatch.setenv("MOEBENCH_CONFIG_DIR", str(where))
        assert_bad_input(moebench_inproc("sweep", *TINY_SWEEP, "--out", out), f"MOEBENCH_CONFIG_DIR={where} {what}")
        assert not out.exists()
        assert_bad_input(moebench_inproc("configs", "list"), "MOEBENCH_CONFIG_DIR")


def test_a_sweep_where_every_case_failed_exits_non_zero(tmp_path, monkeypatch):
    import moebench.sweep.local

    def broken(*args, **kw):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(moebench.sweep.local, "make_kernel", broken)  # the pair may run here, but every case fails
    res = moebench_inproc("sweep", *TINY_SWEEP, "--out", tmp_path)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "kernel launch failed" in res.stdout and "no pair could run here" in " ".join(res.stdout.split())
    (run,) = tmp_path.iterdir()
    assert json.loads((run / "rows.jsonl").read_text())["status"] == "failed"  # the failure is kept


def test_report_plot_must_be_a_png_and_a_csv_must_be_a_results_file(tmp_path):
    res = moebench_inproc("sweep", *TINY_SWEEP, "--out", tmp_path / "out", "--format", "csv")
    assert res.returncode == 0, res.stderr
    (run,) = (tmp_path / "out").iterdir()
    assert_bad_input(moebench_inproc("report", run, "--plot", tmp_path / "x.txt"), "x.txt", "ending in .png")
    assert not (tmp_path / "x.txt").exists()
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    assert_bad_input(moebench_inproc("report", other), "other.csv", "not a moebench results file", "has no")
    assert "ResultRow" not in moebench_inproc("report", other).stderr


def test_configs_commit_refuses_a_cpu_tuned_file(tmp_path, monkeypatch):
    monkeypatch.setattr(TF, "PACKAGE_CONFIG_DIR", tmp_path / "pkg")
    entry = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)
    cpu = TF.write_config_file(tmp_path / "E=4,N=64,device_name=cpu.json", {1: entry})
    assert_bad_input(moebench_inproc("configs", "commit", cpu), "tuned on a CPU", "--allow-cpu")
    assert not (tmp_path / "pkg").exists()
    res = moebench_inproc("configs", "commit", "--allow-cpu", cpu)
    assert res.returncode == 0 and (tmp_path / "pkg" / "moebench" / cpu.name).is_file(), res.stderr


# -- setup.sh says what it is doing ---------------------------------------------------------------

_FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python: records each call; `-m venv DIR` makes DIR/bin/python (this script) and a
# DIR/bin/moebench that echoes; `-c ...` (the torch and setuptools probes) fails: none installed
echo "$*" >> "$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = venv ]; then
  d="${@: -1}"; mkdir -p "$d/bin"; cp "$0" "$d/bin/python"
  printf '#!/usr/bin/env bash\\necho "moebench $*"\\n' > "$d/bin/moebench"; chmod +x "$d/bin/moebench"
fi
[ "$1" = -c ] && exit 1
exit 0
"""


def test_setup_sh_says_what_it_installs(tmp_path):
    import shutil

    for name in ("setup.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    fake = tmp_path / "fake-python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    env = {**_env(), "PYTHON": str(fake), "FAKE_LOG": str(tmp_path / "calls.log")}
    first = subprocess.run(["bash", "setup.sh", "--version"], capture_output=True, text=True, cwd=tmp_path, env=env,
                           timeout=60)
    assert first.returncode == 0, first.stderr
    steps = [line for line in first.stderr.splitlines() if line.startswith("setup: ")]
    assert [s.split()[1] for s in steps] == ["creating", "installing", "installing", "installed"], first.stderr
    assert "torch==2.13.0" in steps[1] and "moebench" in steps[2] and ".venv is ready" in steps[3]
    assert first.stdout.strip() == "moebench --version"  # then the command itself runs
    calls = (tmp_path / "calls.log").read_text()
    assert "pip install" in calls and "torch==2.13.0" in calls and "-e .[test]" in calls
    again = subprocess.run(["bash", "setup.sh", "--version"], capture_output=True, text=True, cwd=tmp_path, env=env,
                           timeout=60)
    assert again.returncode == 0 and "setup:" not in again.stderr  # installed: nothing to do, nothing said
