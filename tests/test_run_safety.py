"""Run folders through interruption, resume and a second writer, end to end through the CLI: a
resumed sweep continues with its saved settings, --resume refuses what is not a run folder, a torn
last row is dropped, one writer per folder (a killed holder's lock is taken over), spawned ranks die
with their parent, and written files get the permissions the umask gives."""

import json
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moebench.backends import prepare_finalize_names
from test_cli import ROOT, assert_bad_input, moebench_inproc

SHAPE = ["--num-experts", "6", "--topk", "2", "--hidden", "24", "--intermediate", "16"]
TOKENS = [1, 2, 3, 4]
CUSTOM = [*SHAPE, "--tokens", "1,2,3,4", "--experts", "torch,reference", "--device", "cpu"]
# every (tokens, prepare/finalize, experts) the custom sweep has a row for (run or skipped)
CUSTOM_KEYS = {(t, pf, ex) for t in TOKENS for pf in prepare_finalize_names() for ex in ("torch", "reference")}


def _env(**extra):
    return dict(os.environ, COLUMNS="200", **extra)


def _here(*args):
    """`moebench *args` through the CLI's entry point in this process, its console 200 columns wide
    as `_env` gives a subprocess's: the commands that need no process of their own (the folder's
    holder, the interrupted and the killed runs have theirs)."""
    return moebench_inproc(*args, env={"COLUMNS": "200"})


def _start(*args, umask=None):
    # Ctrl-C as in a terminal: a suite started in the background (a non-interactive shell's `&`)
    # passes SIGINT on ignored, and Python then never raises KeyboardInterrupt
    return subprocess.Popen([sys.executable, "-m", "moebench.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), umask=-1 if umask is None else umask,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]


def _n_lines(run: Path) -> int:
    p = run / "rows.jsonl"
    return p.read_bytes().count(b"\n") if p.exists() else 0


def _only_run(out: Path) -> Path:
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def _wait_for(pred, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended first (rc {proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _settings(run: Path) -> dict:
    meta = json.loads((run / "metadata.json").read_text())
    meta.pop("resumed", None)
    return meta


def _assert_whole_custom_sweep(run: Path) -> None:
    rows = _rows(run)
    keys = [(r["tokens"], r["prepare_finalize"], r["experts"]) for r in rows]
    assert len(keys) == len(set(keys)), "duplicated rows"
    assert set(keys) == CUSTOM_KEYS
    assert {(r["num_experts"], r["topk"], r["hidden"], r["intermediate"]) for r in rows} == {(6, 2, 24, 16)}
    assert sorted({r["tokens"] for r in rows}) == TOKENS
    assert all(r["correct"] for r in rows if r["status"] == "ok")


def _cut_to(run: Path, n_rows: int, extra: bytes = b"") -> None:
    lines = (run / "rows.jsonl").read_bytes().splitlines(keepends=True)
    (run / "rows.jsonl").write_bytes(b"".join(lines[:n_rows]) + extra)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def custom_sweep(tmp_path_factory):
    """One finished custom sweep (its --out folder holds the run folder alone) and that folder's
    files: the tests resume copies of the run folder, never the run itself."""
    out = tmp_path_factory.mktemp("custom") / "out"
    res = _here("sweep", *CUSTOM, "--out", str(out))
    assert res.returncode == 0, res.stderr
    run = _only_run(out)
    _assert_whole_custom_sweep(run)
    return run, _files(out)


def _finished_custom_run(out: Path, custom_sweep) -> Path:
    """A copy of the finished custom sweep's run folder in `out` (its saved --out stays the
    original's folder, which `_assert_saved_out_untouched` checks)."""
    run, _ = custom_sweep
    copy = out / run.name
    shutil.copytree(run, copy)
    return copy


def _assert_saved_out_untouched(custom_sweep) -> None:
    run, files = custom_sweep
    assert _files(run.parent) == files  # nothing was written into the run's saved --out folder


# -- item 1: a resumed sweep continues with the settings it was started with -----------------------

def test_resume_alone_finishes_the_saved_custom_sweep(tmp_path, custom_sweep):
    run = _finished_custom_run(tmp_path / "out", custom_sweep)
    settings = _settings(run)
    _cut_to(run, 7)  # an interruption after the first rows
    res = _here("sweep", "--resume", str(run))
    assert res.returncode == 0, res.stderr
    _assert_whole_custom_sweep(run)
    assert _settings(run) == settings  # metadata.json keeps the run's settings
    resumed = json.loads((run / "metadata.json").read_text())["resumed"]
    assert [r["argv"] for r in resumed] == [["sweep", "--resume", str(run)]]
    assert list((tmp_path / "out").iterdir()) == [run]  # nothing else was written
    _assert_saved_out_untouched(custom_sweep)


def test_resume_after_a_real_ctrl_c(tmp_path):
    out = tmp_path / "out"
    # torch rows with many repetitions take a while each: the interrupt lands part-way
    proc = _start("sweep", *CUSTOM, "--reps", "1000", "--out", str(out))
    try:
        _wait_for(lambda: out.exists() and any(_n_lines(r) >= 1 for r in out.iterdir()), 120, "a first row", proc)
        proc.send_signal(signal.SIGSTOP)
        run = _only_run(out)
        assert _n_lines(run) < len(CUSTOM_KEYS)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert f"--resume {run}" in " ".join(err.split())  # the console may wrap the line
    kept = _rows(run)
    assert 1 <= len(kept) < len(CUSTOM_KEYS)
    settings = _settings(run)
    res = _here("sweep", "--resume", str(run))
    assert res.returncode == 0, res.stderr
    _assert_whole_custom_sweep(run)
    assert _rows(run)[: len(kept)] == kept
    assert _settings(run) == settings
    assert json.loads((run / "metadata.json").read_text())["argv"][0] == "sweep"


def test_resume_flags_must_repeat_the_saved_ones(tmp_path, custom_sweep):
    run = _finished_custom_run(tmp_path / "out", custom_sweep)
    _cut_to(run, 3)
    before = (run / "rows.jsonl").read_bytes()
    assert_bad_input(moebench_inproc("sweep", "--resume", str(run), "--tokens", "9"), "--tokens 9", "1,2,3,4")
    assert_bad_input(moebench_inproc("sweep", "--resume", str(run), "--experts", "torch", "--no-check"),
                     "--experts torch", "--no-check")
    assert (run / "rows.jsonl").read_bytes() == before  # refused before anything was written
    res = _here("sweep", "--resume", str(run), "--tokens", "1,2,3,4", "--experts", "torch,reference",
                   "--num-experts", "6", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    _assert_whole_custom_sweep(run)


def test_resume_of_a_folder_from_before_options_were_saved(tmp_path, custom_sweep):
    # folders written before "options" was saved: the saved argv is read instead
    run = _finished_custom_run(tmp_path / "out", custom_sweep)
    meta = json.loads((run / "metadata.json").read_text())
    del meta["options"]
    (run / "metadata.json").write_text(json.dumps(meta))
    _cut_to(run, 5)
    res = _here("sweep", "--resume", str(run))
    assert res.returncode == 0, res.stderr
    _assert_whole_custom_sweep(run)


# -- item 2: --resume refuses a missing folder and one that is not a sweep's run folder ----------

def test_resume_refuses_missing_and_foreign_folders(tmp_path):
    # refused before anything runs: through the CLI's entry point in this process
    missing = tmp_path / "nowhere"
    assert_bad_input(moebench_inproc("sweep", *CUSTOM, "--resume", str(missing)), "does not exist")
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_bad_input(moebench_inproc("sweep", *CUSTOM, "--resume", str(empty)), "not a moebench run folder")
    assert list(empty.iterdir()) == []
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert_bad_input(moebench_inproc("sweep", "--resume", str(a_file)), "is not a folder")
    tune_like = tmp_path / "other"
    tune_like.mkdir()
    (tune_like / "metadata.json").write_text(json.dumps({"command": "compare tp-vs-ep", "argv": []}))
    assert_bad_input(moebench_inproc("sweep", "--resume", str(tune_like)), "compare tp-vs-ep")
    assert sorted(p.name for p in tune_like.iterdir()) == ["metadata.json"]


# -- item 4: a torn last line is dropped before the resume appends --------------------------------

def test_resume_drops_a_torn_last_line(tmp_path, custom_sweep):
    run = _finished_custom_run(tmp_path / "out", custom_sweep)
    lines = (run / "rows.jsonl").read_bytes().splitlines(keepends=True)
    _cut_to(run, 6, extra=lines[6][: len(lines[6]) // 2])  # power loss in the middle of a write
    # the options repeated: the resume runs the same sweep, only the torn line is in the way
    res = _here("sweep", *CUSTOM, "--resume", str(run))
    assert res.returncode == 0, res.stderr
    assert "dropped a torn last line" in res.stderr and "rows.jsonl" in res.stderr
    _assert_whole_custom_sweep(run)  # every line parses
    rep = moebench_inproc("report", str(run))
    assert rep.returncode == 0, rep.stderr


# -- item 3: one writer per run folder; a killed holder's lock is taken over ----------------------

def test_a_second_writer_is_refused_and_a_killed_holders_lock_taken_over(tmp_path):
    out = tmp_path / "out"
    args = [*SHAPE, "--tokens", "1,2,3,4", "--experts", "torch", "--prepare-finalize", "no-dpep",
            "--reps", "1000", "--device", "cpu"]  # rows slow enough to stop it part-way
    holder = _start("sweep", *args, "--out", str(out))
    try:
        _wait_for(lambda: out.exists() and any(_n_lines(r) >= 1 for r in out.iterdir()), 120, "a first row", holder)
        holder.send_signal(signal.SIGSTOP)  # frozen while it holds the folder
        run = _only_run(out)
        assert _n_lines(run) < 4
        before = (run / "rows.jsonl").read_bytes()
        second = moebench_inproc("sweep", "--resume", str(run))  # this process: a second writer
        assert_bad_input(second, "in use", f"pid {holder.pid}", platform.node(), "moebench sweep")
        assert (run / "rows.jsonl").read_bytes() == before
        holder.kill()  # kill -9: the lock file still names it
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    res = _here("sweep", "--resume", str(run))
    assert res.returncode == 0, res.stderr
    assert "took over the stale lock" in res.stderr and f"pid {holder.pid}" in res.stderr
    assert "no longer running" in res.stderr
    rows = _rows(run)
    assert sorted(r["tokens"] for r in rows) == TOKENS  # each once
    # a clean end leaves no stale lock behind: the next resume says nothing about one
    again = moebench_inproc("sweep", "--resume", str(run))
    assert again.returncode == 0 and "stale" not in again.stderr, again.stderr


# -- item 3: spawned ranks die with their parent -------------------------------------------------

def _children(pid: int) -> list[int]:
    """Rank processes of `pid`, from /proc: the children of its fork server (multiprocessing's
    forkserver, a child of `pid`), or its spawn children where ranks start that way."""
    procs = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        procs[int(d.name)] = (ppid, cmd)
    servers = {p for p, (pp, cmd) in procs.items() if pp == pid and b"forkserver" in cmd}
    return [p for p, (pp, cmd) in procs.items() if pp in servers or (pp == pid and b"spawn_main" in cmd)]


def _stop_all(parent, ranks: list[int]) -> None:
    """A test's clean-up: the parent and every rank it spawned gone, whatever the test left."""
    if parent.poll() is None:
        parent.kill()
        parent.wait()
    for r in ranks:
        if _running(r):
            os.kill(r, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_ranks_die_with_a_killed_parent(tmp_path):
    out = tmp_path / "out"
    # 2 real ranks; every row takes seconds, so the ranks would run on long after the kill
    parent = _start("sweep", *SHAPE, "--tokens", "1,2,3,4,5,6,7,8", "--experts", "torch", "--prepare-finalize",
                    "no-dpep", "--world-size", "2", "--tp", "2", "--reps", "400", "--device", "cpu", "--out", str(out))
    ranks: list[int] = []
    try:
        _wait_for(lambda: len(_children(parent.pid)) == 2, 120, "two rank processes", parent)
        ranks = _children(parent.pid)
        _wait_for(lambda: out.exists() and any(_n_lines(r) >= 1 for r in out.iterdir()), 120, "a first row", parent)
        run = _only_run(out)
        parent.kill()
        parent.wait(timeout=30)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5 and any(_running(r) for r in ranks):
            time.sleep(0.05)
        assert not [r for r in ranks if _running(r)], "rank processes outlived their parent"
        n = _n_lines(run)
        assert n < 8
        time.sleep(1.0)
        assert _n_lines(run) == n  # nobody appends any more
    finally:
        _stop_all(parent, ranks)


# -- item 6: files written through the atomic helper honour the umask ------------------------------

def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_written_files_get_the_umask_permissions(tmp_path, monkeypatch):
    # through the CLI's entry point in this process, under umask 027 while each command runs
    monkeypatch.setenv("MOEBENCH_CACHE_DIR", str(tmp_path / "cache"))

    def run(*args):
        old = os.umask(0o027)
        try:
            res = moebench_inproc(*args, cwd=tmp_path)
        finally:
            os.umask(old)
        assert res.returncode == 0, res.stderr
        return res

    run("sweep", *SHAPE, "--tokens", "3", "--experts", "torch", "--prepare-finalize", "no-dpep", "--device", "cpu",
        "--out", str(tmp_path / "out"), "--format", "csv,json,md,html")
    folder = _only_run(tmp_path / "out")
    run("report", str(folder), "--plot", str(tmp_path / "latency.png"))
    run("tune", "--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--device", "cpu",
        "--tokens", "1", "--budget", "2", "--reps", "1", "--final-reps", "1",
        "--out", str(tmp_path / "configs"), "--results-dir", str(tmp_path / "tune"))
    run("env", "--calibrate", "--device", "cpu")
    files = [folder / f"results.{x}" for x in ("csv", "json", "md", "html")] + [
        folder / "metadata.json", folder / "report.md", tmp_path / "latency.png",
        tmp_path / "configs" / "E=4,N=32,device_name=cpu.json", tmp_path / "cache" / "ceilings.json"]
    tune_run = _only_run(tmp_path / "tune")
    files += [tune_run / "tune.json", tune_run / "report.md"]
    assert {str(p.relative_to(tmp_path)): oct(_mode(p)) for p in files} == {
        str(p.relative_to(tmp_path)): oct(0o640) for p in files}
