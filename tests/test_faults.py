"""Faults injected the way they happen, end to end through the CLI: a disk that fills up (a small
tmpfs; RLIMIT_FSIZE where none can be mounted), a read-only or unwritable folder (a read-only tmpfs;
a user other than root), SIGKILL / SIGTERM / SIGHUP of a sweep of one process and of two ranks at
a random point, two tunes writing one config folder at once, SIGKILL between the files of
`configs commit`, and `report` over damaged folders. Each case checks what the user sees (one line,
the exit status) and what is on disk (whole files, every row once after --resume).

A mechanism this machine lacks (mounting, a second user, tmpfs quotas) skips its cases with the
reason; no case waits on a wall-clock time except as a hang limit, which fails naming what ran."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import pickle
import random
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import pytest

from test_cli import ROOT, assert_bad_input, moebench_inproc
from moebench.kernels import tuned_files as TF

SHAPE = ["--num-experts", "6", "--topk", "2", "--hidden", "24", "--intermediate", "16"]
ONE_PAIR = [*SHAPE, "--experts", "torch", "--prepare-finalize", "no-dpep", "--device", "cpu"]
TEN = ",".join(map(str, range(1, 11)))
NOBODY = 65534
HANG_S = 120  # a hang limit, never a speed claim: a case past it fails naming what was running


# -- mechanisms ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _tmpfs_unavailable() -> str | None:
    """None where a tmpfs can be mounted here, else why not."""
    if os.geteuid() != 0:
        return f"mounting a tmpfs needs root (the suite runs as uid {os.geteuid()})"
    if shutil.which("mount") is None:
        return "no mount command"
    probe = tempfile.mkdtemp(prefix="moebench-tmpfs-probe-")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True, text=True)
        if r.returncode != 0:
            return f"mount -t tmpfs failed here: {r.stderr.strip() or r.returncode}"
        subprocess.run(["umount", probe], check=True)
        return None
    finally:
        os.rmdir(probe)


@functools.lru_cache(maxsize=None)
def _other_user_unavailable() -> str | None:
    """None where a forked child can become the unprivileged user `nobody`, else why not."""
    if os.geteuid() != 0:
        return None  # already not root: the test's own process cannot write a root folder
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            if os.geteuid() != NOBODY:
                os._exit(1)
            os._exit(0 if os.access(ROOT, os.R_OK | os.X_OK) else 2)  # the CLI runs from the checkout
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 2:
        return f"uid 65534 cannot read this checkout ({ROOT}): a folder above it is closed to other users"
    return None if code == 0 else "cannot switch a child process to uid 65534"


class Disk:
    """tmpfs mounts below a test's folder, unmounted when the test ends."""

    def __init__(self, root: Path):
        self.root, self.mounts = root, []

    def mount(self, name: str, size_kb: int, read_only: bool = False) -> Path:
        path = self.root / name
        path.mkdir(parents=True)
        opts = f"size={size_kb}k,mode=0755" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
        self.mounts.append(path)
        return path

    def remount(self, path: Path, opts: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{opts}", str(path)], check=True)

    def close(self) -> None:
        for path in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def disk(tmp_path):
    reason = _tmpfs_unavailable()
    if reason:
        pytest.skip(reason)
    d = Disk(tmp_path)
    try:
        yield d
    finally:
        d.close()


def _as_nobody(fn, *args):
    """fn(*args) in a forked child that runs as uid/gid 65534 (nobody): its return value, or the
    child's traceback as a failure. The child computes nothing heavy (one torch thread)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            import torch

            torch.set_num_threads(1)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            data = pickle.dumps(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - everything goes to the parent
            data = pickle.dumps(("error", traceback.format_exc()))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + HANG_S
    with os.fdopen(r, "rb") as f:
        while True:
            ready, _, _ = select.select([f], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"{fn.__name__}{args} as nobody still running after {HANG_S} s")
            chunk = os.read(f.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    kind, value = pickle.loads(b"".join(chunks))
    assert kind == "ok", value
    return value


def _env(**extra):
    # one torch thread: the shapes are tiny, and idle threads spinning would only cost CPU
    return dict(os.environ, COLUMNS="200", OMP_NUM_THREADS="1", **extra)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread while a resume runs in this process (the shapes are tiny; idle threads
    would spin)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _resume(run: Path):
    with _one_thread():
        return moebench_inproc("sweep", "--resume", str(run))


def _one_line(res, returncode: int, *needles: str) -> str:
    """The run ended with `returncode` and said one line on stderr holding `needles` (and no
    traceback); returns the line."""
    assert res.returncode == returncode, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _only_run(out: Path) -> Path:
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def _rows(run: Path) -> list[dict]:
    """rows.jsonl, every line a whole row."""
    return [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines()]


def _keys(rows: list[dict]) -> list[tuple]:
    return [(r["tokens"], r["prepare_finalize"], r["experts"], r["tp"], r.get("allreduce", "")) for r in rows]


def _no_temporaries(folder: Path) -> None:
    assert not [p for p in folder.rglob(".*.tmp")], list(folder.rglob(".*.tmp"))


def _assert_exports_whole(run: Path, n_rows: int) -> None:
    import pandas as pd

    assert len(pd.read_csv(run / "results.csv")) == n_rows
    assert len(json.loads((run / "results.json").read_text())) == n_rows
    assert (run / "results.md").read_text().strip()


# -- a full disk ---------------------------------------------------------------------------------

def _sweep_on_a_full_disk(out: Path, fsize: int | None = None, ranks: int = 1):
    args = ["sweep", *ONE_PAIR, "--tokens", TEN, "--reps", "1", "--out", str(out)]
    if ranks > 1:  # rank 0 writes the rows; the fault reaches the parent as what it is
        args += ["--world-size", str(ranks), "--tp", str(ranks)]
    if fsize is None:
        with _one_thread():
            return moebench_inproc(*args)

    def limit():  # a write past the limit fails with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "moebench.cli", *args], capture_output=True, text=True,
                          env=_env(), preexec_fn=limit, timeout=HANG_S)


@pytest.mark.parametrize("fills_at,size_kb,ranks", [("rows.jsonl", 12, 1), ("results.json", 20, 1), ("rows.jsonl", 12, 2)],
                         ids=["while-measuring", "while-exporting", "two-ranks"])
def test_a_sweep_on_a_full_disk_says_one_line_and_resumes_whole(tmp_path, fills_at, size_kb, ranks):
    if _tmpfs_unavailable() is None:
        d = Disk(tmp_path)
        try:
            out = d.mount("disk", size_kb) / "out"
            res = _sweep_on_a_full_disk(out, ranks=ranks)
            _check_full_disk_run(res, out, fills_at)
            d.remount(out.parent, "size=4m")  # the user frees space
            _check_resumed_after_a_full_disk(_only_run(out))
        finally:
            d.close()
    elif fills_at == "rows.jsonl" and ranks == 1:  # no tmpfs here: a file size limit fails the rows file's writes
        out = tmp_path / "out"
        res = _sweep_on_a_full_disk(out, fsize=4096)
        _check_full_disk_run(res, out, fills_at, "file size limit exceeded")
        _check_resumed_after_a_full_disk(_only_run(out))
    else:
        pytest.skip(f"{_tmpfs_unavailable()}; a file size limit in this process would limit the suite's own files")


def _check_full_disk_run(res, out: Path, fills_at: str, reason: str = "no space left on the device") -> None:
    run = _only_run(out)
    line = _one_line(res, 2, f"{run / fills_at}", reason, f"moebench sweep --resume {run}")
    assert line.startswith("error: cannot write"), line
    rows = _rows(run)  # whole lines only: a row cut short by the full disk was cut off again
    assert len({k for k in _keys(rows)}) == len(rows)
    assert len(rows) == 10 if fills_at != "rows.jsonl" else len(rows) < 10
    _no_temporaries(run)
    for name in ("results.csv", "results.json", "results.md"):  # absent, or whole
        if (run / name).exists() and name != fills_at:
            assert (run / name).stat().st_size > 0
    assert not (run / fills_at).exists() or fills_at == "rows.jsonl"


def _check_resumed_after_a_full_disk(run: Path) -> None:
    kept = _rows(run)
    res = _resume(run)
    assert res.returncode == 0, res.stderr
    rows = _rows(run)
    assert rows[: len(kept)] == kept  # no finished row lost or measured again
    assert sorted(r["tokens"] for r in rows) == list(range(1, 11))  # each once
    assert all(r["status"] == "ok" and r["correct"] for r in rows)
    _assert_exports_whole(run, 10)
    _no_temporaries(run)


def test_a_tune_on_a_full_disk_says_one_line_and_resumes(disk, tmp_path):
    results = disk.mount("disk", 8) / "tune"  # its settings fit, not all that follows
    args = ["tune", "--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--device", "cpu",
            "--tokens", "1", "--budget", "2", "--reps", "1", "--final-reps", "1", "--out", str(tmp_path / "configs")]
    with _one_thread():
        res = moebench_inproc(*args, "--results-dir", str(results))
    run = _only_run(results)
    _one_line(res, 2, "error: cannot write", str(run), "no space left on the device",
              f"moebench tune --resume {run}")
    for p in run.glob("measurements*.jsonl"):  # the journal holds whole lines (a torn last one is skipped)
        lines = p.read_text().splitlines()
        for line in lines[:-1]:
            json.loads(line)
    disk.remount(results.parent, "size=4m")
    with _one_thread():
        res = moebench_inproc("tune", "--resume", str(run))
    assert res.returncode == 0, res.stderr
    table = json.loads((tmp_path / "configs" / "E=4,N=32,device_name=cpu.json").read_text())
    assert set(table) == {"1", "triton_version"}
    _no_temporaries(run)


def test_report_and_plot_on_a_full_disk(disk, tmp_path):
    out = tmp_path / "out"
    assert moebench_inproc("sweep", *ONE_PAIR, "--tokens", "1,2", "--reps", "1", "--out", str(out)).returncode == 0
    run = _only_run(out)
    full = disk.mount("full", 4)
    (full / "filler").write_bytes(b"\0" * 4096)  # not one byte free
    before = sorted(full.iterdir())
    _one_line(moebench_inproc("report", str(run), "--out", str(full / "report.md")), 2,
              f"cannot write {full / 'report.md'}", "no space left", "then run the command again")
    _one_line(moebench_inproc("report", str(run), "--out", str(tmp_path / "r.md"), "--plot", str(full / "l.png")), 2,
              f"cannot write {full / 'l.png'}", "no space left")
    assert sorted(full.iterdir()) == before  # no half-written report or figure, no temporary


def test_a_quota_exceeded_is_one_line_too(tmp_path):
    """EDQUOT from a write, as a quota'd file system gives it, reads as a full disk does."""
    from moebench.errors import WriteError

    err = WriteError.from_os(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), tmp_path / "rows.jsonl")
    assert str(err.then("continue")) == (f"cannot write {tmp_path / 'rows.jsonl'}: disk quota exceeded; free space "
                                         f"or raise the quota, then continue")
    assert WriteError.from_os(OSError(errno.EIO, "I/O error")) is None  # not a disk fault: passes as it was


# -- a read-only or unwritable folder ------------------------------------------------------------

def test_read_only_folders(disk, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert moebench_inproc("sweep", *ONE_PAIR, "--tokens", "1,2", "--reps", "1", "--out", str(out)).returncode == 0
    ro = disk.mount("ro", 64)
    shutil.copytree(_only_run(out), ro / "run")
    (ro / "E=4,N=32,device_name=cpu.json").write_text("{}")
    disk.remount(ro, "ro")
    before = {p: p.read_bytes() for p in ro.rglob("*") if p.is_file()}
    _one_line(moebench_inproc("sweep", *ONE_PAIR, "--tokens", "1", "--out", str(ro / "new")), 2,
              f"cannot write {ro / 'new'}", "read-only file system", "then run the command again")
    _one_line(moebench_inproc("sweep", "--resume", str(ro / "run")), 2,
              f"cannot write {ro / 'run'}", "read-only file system")
    _one_line(moebench_inproc("tune", "--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32",
                              "--device", "cpu", "--tokens", "1", "--out", str(ro), "--results-dir",
                              str(tmp_path / "tune")), 2, str(ro), "read-only file system")
    tuned = _tuned_files(tmp_path / "tuned", 1)
    monkeypatch.setattr(TF, "PACKAGE_CONFIG_DIR", ro)
    _one_line(moebench_inproc("configs", "commit", "--allow-cpu", *map(str, tuned)), 2,
              f"cannot write {ro}", "read-only file system")
    assert {p: p.read_bytes() for p in ro.rglob("*") if p.is_file()} == before


def test_unwritable_folders_as_a_user(tmp_path):
    """A folder of another user (here root's, 0755) is refused in one line by sweep, tune and
    configs commit run as a user (nobody), with nothing written."""
    reason = _other_user_unavailable()
    if reason:
        pytest.skip(reason)
    shared = Path(tempfile.mkdtemp(prefix="moebench-faults-"))  # below /tmp: a path any user can walk
    try:
        shared.chmod(0o755)
        theirs = shared / "theirs"
        theirs.mkdir(mode=0o755)
        tuned = _tuned_files(shared / "tuned", 1)
        cache = shared / "cache"
        cache.mkdir(mode=0o777)
        if os.geteuid() != 0:  # not root already: a folder without write permission does the same
            theirs.chmod(0o555)

        def as_user(*args):
            TF.PACKAGE_CONFIG_DIR = theirs
            return moebench_inproc(*args, env={"MOEBENCH_CACHE_DIR": str(cache)}, cwd=shared)

        run = functools.partial(_as_nobody, as_user) if os.geteuid() == 0 else as_user
        _one_line(run("sweep", *ONE_PAIR, "--tokens", "1", "--out", str(theirs / "out")), 2,
                  f"cannot write {theirs / 'out'}", "permission denied", "make the folder writable")
        _one_line(run("tune", "--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32",
                      "--device", "cpu", "--tokens", "1", "--out", str(theirs), "--results-dir", str(theirs / "t")),
                  2, str(theirs), "permission denied")
        _one_line(run("configs", "commit", "--allow-cpu", str(tuned[0])), 2,
                  f"cannot write {theirs}", "permission denied", "then run the command again")
        assert list(theirs.iterdir()) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# -- SIGKILL / SIGTERM / SIGHUP of a running sweep ----------------------------------------------

def _tagged(tag: str) -> list[tuple[int, str]]:
    """Live processes whose environment holds MOEBENCH_FAULT_TAG=tag: a sweep and all it started."""
    found = []
    needle = f"MOEBENCH_FAULT_TAG={tag}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            found.append((int(d.name), cmd[:120]))
    return found


def _wait(pred, what: str, proc) -> None:
    deadline = time.monotonic() + HANG_S
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the sweep ended first (rc {proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for {what} after {HANG_S} s: {proc.args}")
        time.sleep(0.02)


def _n_rows(out: Path) -> int:
    runs = [p for p in out.iterdir() if p.is_dir()] if out.exists() else []
    return sum((r / "rows.jsonl").read_bytes().count(b"\n") for r in runs if (r / "rows.jsonl").exists())


SIGNALS = {"kill": (signal.SIGKILL, -9), "term": (signal.SIGTERM, 143), "hup": (signal.SIGHUP, 129)}
# four rows of some hundredths of a second each (one torch thread)
WORLDS = {1: ["--tokens", "1,2,3,4", "--reps", "400"],
          2: ["--tokens", "1,2,3,4", "--reps", "100", "--world-size", "2", "--tp", "2"]}


def _random_point(out: Path, proc, rng: random.Random) -> str:
    """Wait for a random point of the sweep writing `out`: after 0, 1 or 2 of its 4 rows (0: the
    folder just made, ranks maybe still starting), then a random part of a row's time; a point
    found by progress, not by the clock, so that rows are left on a fast machine too."""
    after = rng.choice([0, 1, 2])
    _wait(lambda: out.exists() and any((r / "metadata.json").exists() for r in out.iterdir()), "the run folder", proc)
    seen = [time.monotonic()]
    while len(seen) <= after:
        _wait(lambda: _n_rows(out) >= len(seen), f"{len(seen)} finished rows", proc)
        seen.append(time.monotonic())
    row_s = seen[-1] - seen[-2] if after == 2 else 0.03  # the second row's time (the first pays the start-up)
    pause = rng.uniform(0, 0.8) * row_s
    time.sleep(pause)
    return f"after {after} rows and {pause * 1e3:.0f} ms"


@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "two-ranks"])
@pytest.mark.parametrize("how", list(SIGNALS))
def test_a_signal_at_a_random_point_loses_no_row(tmp_path, how, world):
    sig, status = SIGNALS[how]
    seed = random.randrange(1 << 30)
    out, tag = tmp_path / "out", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "moebench.cli", "sweep", *ONE_PAIR, *WORLDS[world], "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(MOEBENCH_FAULT_TAG=tag))
    try:
        point = _random_point(out, proc, random.Random(seed))
        where = f"seed {seed}, {how} {point}"
        assert proc.poll() is None, f"{where}: the sweep finished before the signal"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = _only_run(out)
    assert proc.returncode == status, (where, proc.returncode, err[-2000:])
    if sig != signal.SIGKILL:  # stopped as on Ctrl-C: the rows so far exported, the way on said
        assert "Traceback" not in err, err
        assert f"--resume {run}" in " ".join(err.split()), err
        assert f"interrupted by {sig.name}:" in err, err
        assert (run / "results.csv").exists()
    deadline = time.monotonic() + 30  # ranks and the fork server go with the sweep (die_with_parent)
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _tagged(tag), f"{where}: processes outlived the {how}ed sweep: {_tagged(tag)}"
    data = (run / "rows.jsonl").read_bytes() if (run / "rows.jsonl").exists() else b""
    kept = [json.loads(line) for line in data.splitlines(keepends=True) if line.endswith(b"\n")]
    res = _resume(run)
    assert res.returncode == 0, (where, res.stderr)
    rows = _rows(run)
    assert len(set(_keys(rows))) == len(rows), f"{where}: a row twice"
    assert sorted(r["tokens"] for r in rows) == [1, 2, 3, 4], f"{where}"
    assert all(r in rows for r in kept), f"{where}: a finished row was lost or changed"
    assert all(r["status"] == "ok" and r["correct"] for r in rows)
    _assert_exports_whole(run, 4)


# -- two tunes writing one config folder at once -------------------------------------------------

def _flock_waiters(path: Path) -> set[int]:
    """pids blocked waiting for an flock on `path` (/proc/locks' "->" lines for its inode)."""
    ino = f":{path.stat().st_ino} "
    waiting = set()
    for line in Path("/proc/locks").read_text().splitlines():
        if "->" in line and "FLOCK" in line and ino in line:
            waiting.add(int(line.split("->", 1)[1].split()[3]))
    return waiting


def test_two_tunes_into_one_folder_at_once_keep_both(tmp_path):
    """Two tunes of one file (other token counts) into one --out and one --results-dir at once:
    both finish, the file holds both's entries, and a third writer of either run folder is refused."""
    import fcntl

    from moebench.tuning import tuner

    CONFIG_LOCK = getattr(tuner, "CONFIG_LOCK", ".moebench-configs.lock")  # the name the tunes lock
    configs, results = tmp_path / "configs", tmp_path / "tune"
    configs.mkdir()
    base = [sys.executable, "-m", "moebench.cli", "tune", "--num-experts", "4", "--topk", "2", "--hidden", "64",
            "--intermediate", "32", "--device", "cpu", "--budget", "2", "--reps", "1", "--final-reps", "1",
            "--out", str(configs), "--results-dir", str(results)]
    # the test holds the folder's lock first, so both tunes reach their write at the same moment
    lock = open(configs / CONFIG_LOCK, "a")
    fcntl.flock(lock, fcntl.LOCK_EX)
    procs = [subprocess.Popen([*base, "--tokens", t], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for t in ("1", "4")]
    try:
        deadline = time.monotonic() + HANG_S
        while _flock_waiters(configs / CONFIG_LOCK) != {p.pid for p in procs}:
            ended = [p for p in procs if p.poll() is not None]
            assert not ended, (f"tune {ended[0].args[-1]} wrote {configs} without waiting for the other writer: "
                               f"rc {ended[0].returncode}, {ended[0].stderr.read()[-1500:]}")
            assert time.monotonic() < deadline, f"the tunes never reached their write in {HANG_S} s"
            time.sleep(0.05)
        assert configs.joinpath("E=4,N=32,device_name=cpu.json").exists() is False
        runs = sorted(p for p in results.iterdir() if p.is_dir())
        assert len(runs) == 2
        assert_bad_input(moebench_inproc("tune", "--resume", str(runs[0])), "in use", "wait for it to end")
        fcntl.flock(lock, fcntl.LOCK_UN)
        for p in procs:
            _, err = p.communicate(timeout=HANG_S)
            assert p.returncode == 0, err[-2000:]
    finally:
        lock.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    table = json.loads((configs / "E=4,N=32,device_name=cpu.json").read_text())
    assert {"1", "4"} <= set(table), table
    assert json.loads((configs / "tuned_routing.json").read_text())
    _no_temporaries(configs)


# -- SIGKILL between the files of `configs commit` ----------------------------------------------

GOOD = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2}


def _tuned_files(folder: Path, n: int, m: int = 1) -> list[Path]:
    paths = []
    for i in range(n):
        p = TF.write_config_file(folder / f"E={4 + i},N=32,device_name=cpu.json", {m: GOOD}, triton_version="3.6.0")
        TF.write_tuned_routing(p, (4 + i, 2))
        paths.append(p)
    return paths


def _commit_killed_after(pkg: str, files: list[str], renames: int) -> None:
    """In a forked child: `configs commit` into `pkg`, killed with SIGKILL right after its
    `renames`-th file was renamed into place."""
    TF.PACKAGE_CONFIG_DIR = Path(pkg)
    real, done = os.replace, [0]

    def replace(src, dst, *a, **kw):
        real(src, dst, *a, **kw)
        done[0] += 1
        if done[0] == renames:
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace
    moebench_inproc("configs", "commit", "--allow-cpu", *files)


def test_configs_commit_killed_between_its_files_leaves_whole_files(tmp_path, monkeypatch):
    new = _tuned_files(tmp_path / "tuned", 3, m=8)
    pkg = tmp_path / "pkg"
    shipped = pkg / "moebench"  # the package's folder of moebench's kernel
    old = _tuned_files(shipped, 1, m=1)[0]  # an older file of the first one, replaced by the commit
    before = {p.name: p.read_bytes() for p in shipped.iterdir()}
    renames = random.Random().randint(1, 5)  # each file: itself, then tuned_routing.json
    pid = os.fork()
    if pid == 0:
        try:
            _commit_killed_after(str(pkg), [str(p) for p in new], renames)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL, f"the commit was not killed after {renames} renames"
    for p in shipped.iterdir():  # each file whole: the old one or the new one, nothing cut short
        src = tmp_path / "tuned" / p.name
        whole = {before.get(p.name), src.read_bytes() if src.exists() else None} - {None}
        if p.name == "tuned_routing.json":
            json.loads(p.read_text())
        else:
            assert p.read_bytes() in whole, p.name
    _no_temporaries(shipped)
    assert old.exists()
    monkeypatch.setattr(TF, "PACKAGE_CONFIG_DIR", pkg)  # the commit again: every file in
    res = moebench_inproc("configs", "commit", "--allow-cpu", *map(str, new))
    assert res.returncode == 0, res.stderr
    for p in new:
        assert (shipped / p.name).read_bytes() == p.read_bytes()
    assert set(json.loads((shipped / "tuned_routing.json").read_text())) == {p.name for p in new}


# -- report over damaged folders ----------------------------------------------------------------

def test_report_names_each_damaged_folder_and_reports_the_rest(tmp_path):
    results = tmp_path / "results"
    assert moebench_inproc("sweep", *ONE_PAIR, "--tokens", "1,2", "--reps", "1", "--out", str(results)).returncode == 0
    good = _only_run(results)
    garbled = results / "garbled"
    shutil.copytree(good, garbled)
    lines = (garbled / "rows.jsonl").read_text().splitlines(keepends=True)
    (garbled / "rows.jsonl").write_text(lines[0][:40] + "\n" + "".join(lines[1:]))  # a line in the middle
    (results / "empty").mkdir()
    (results / "no-rows").mkdir()
    shutil.copy(good / "metadata.json", results / "no-rows" / "metadata.json")
    res = moebench_inproc("report", str(results), "--out", str(tmp_path / "report.md"))
    assert res.returncode == 0, res.stderr
    notes = res.stderr.strip().splitlines()
    assert len(notes) == 3, notes
    for folder, why in ((garbled, "line 1 is not a result row"), (results / "empty", "an empty folder"),
                        (results / "no-rows", "no rows yet")):
        assert sum(f"skipped {folder}:" in n and why in n for n in notes) == 1, (folder, notes)
    assert "moebench report" in res.stdout and (tmp_path / "report.md").read_text().count("\n") > 3
    # nothing left to report: the one problem is the error
    assert_bad_input(moebench_inproc("report", str(garbled)), "line 1 is not a result row")
