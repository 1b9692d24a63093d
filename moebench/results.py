"""One result-row type that every export, table and plot reads, and the run folder that holds them.

Rows are appended to `rows.jsonl` as they are measured (flushed and fsynced), so an interrupted
run loses no finished row; `moebench.report.write_exports` writes CSV / JSON / Markdown / Parquet
through atomic renames.
A run folder can be reopened to resume: rows already there are skipped by key.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import secrets
import shlex
import subprocess
import tempfile
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from moebench.errors import MoebenchError, WriteError
from moebench.fileio import append_line, line_landed, writing
from moebench.fileio import atomic_write_bytes, atomic_write_text, atomic_write_with  # noqa: F401  (re-exported)

# The columns of design.md, in order; these names stay. Extra columns follow.
CORE_COLUMNS = [
    "model", "num_experts", "topk", "hidden", "intermediate", "tokens", "tp", "dp", "ep", "world_size",
    "prepare_finalize", "experts", "activation_format", "dtype", "device", "routing", "modeled",
    "latency_us", "p10_us", "p90_us", "tflops", "gbps", "roofline_frac", "max_rel_err", "correct",
    "status", "reason",
]


@dataclass
class ResultRow:
    model: str
    num_experts: int
    topk: int
    hidden: int
    intermediate: int
    tokens: int
    tp: int
    dp: int
    ep: int
    world_size: int
    prepare_finalize: str
    experts: str
    activation_format: str
    dtype: str
    device: str
    routing: str
    modeled: bool = False
    latency_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    roofline_frac: float | None = None
    max_rel_err: float | None = None
    correct: bool | None = None
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    # extras
    timing_method: str = ""
    floor_us: float | None = None
    ceilings_source: str = ""
    imbalance: float | None = None
    dispatch_us: float | None = None
    experts_us: float | None = None
    combine_us: float | None = None
    allreduce_us: float | None = None
    rank_tokens: str = ""
    rank_imbalance: float | None = None
    config_source: str = ""
    #: fp8 scheme ("per-tensor", "per-token", "block[128,128]"; "" unquantised); dtype says fp8_w8a8
    quant: str = ""
    #: fp8 rows: ||out - ref|| / ||ref|| against the float64 reference of the unquantised weights
    #: and activations (what fp8 costs in accuracy; max_rel_err checks the kernel itself)
    err_vs_unquantized: float | None = None
    #: the experts' activation (moebench.activation: silu, gelu, swigluoai) and whether they add biases
    activation: str = "silu"
    expert_bias: bool = False
    #: how the layer's shared experts ran: "none" (not part of the timed layer), "fused" (extra
    #: experts every token is routed to), "separate" (a dense MLP added to the routed output)
    shared_experts: str = "none"
    #: TP's all-reduce: "nccl" or "custom" (modeled runs price both), "gloo" on CPU ranks; "" none
    allreduce: str = ""
    #: what was timed: "" the whole layer; else a registered variant's name (moebench.sweep.variants:
    #: a part of the layer, or another way to run it, that a benchmark times beside it)
    variant: str = ""
    #: a correctness check, not a result: compare tp-vs-ep's run on this machine's real ranks of
    #: what its modeled rows compute, at a stand-in shape (moebench.sweep.simulated.check_spec_for).
    #: Reports leave such rows out and never rank them.
    check_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        """Identity of a measurement, used to skip work on resume."""
        return (self.model, self.num_experts, self.topk, self.hidden, self.intermediate, self.tokens,
                self.tp, self.dp, self.ep, self.prepare_finalize, self.experts, self.dtype, self.device,
                self.routing, self.modeled, self.quant, self.activation, self.expert_bias, self.shared_experts,
                self.allreduce or "", self.variant or "")

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        d.update({f"x_{k}": v for k, v in extra.items()})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ResultRow":
        names = {f.name for f in dataclasses.fields(cls)}
        extra = {k[2:]: v for k, v in d.items() if k.startswith("x_")}
        kw = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items() if k in names}
        kw["extra"] = extra
        return cls(**kw)


#: The columns a results file must hold: ResultRow's fields without a default.
_REQUIRED_COLUMNS = [f.name for f in dataclasses.fields(ResultRow)
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def precision_labels(df: pd.DataFrame) -> pd.Series:
    """Per row 'bf16', 'fp32', ... or 'fp8_w8a8 block[128,128]': the dtype plus the fp8 scheme
    (files written before the `quant` column read as unquantised)."""
    quant = df["quant"].fillna("").astype(str) if "quant" in df else pd.Series("", index=df.index)
    return df["dtype"].astype(str) + quant.map(lambda q: f" {q}" if q else "")


def rows_to_frame(rows: Iterable[ResultRow]) -> pd.DataFrame:
    df = pd.DataFrame([r.as_dict() for r in rows])
    if df.empty:
        return pd.DataFrame(columns=CORE_COLUMNS)
    return df


def git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def ensure_writable_dir(path: Path) -> Path:
    """Create `path` (and parents) and check that a file can be written there."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".moebench-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        err = WriteError.from_os(e, path)
        if err is not None:
            raise err from None
        raise MoebenchError(
            f"cannot write to output folder '{path}' ({e.strerror or e}); pass --out with a writable folder"
        ) from None
    return path


def check_output_file(path: Path, option_name: str) -> Path:
    """Before any work: check that the file `path` (given with `option_name`, e.g. "--plot") can be
    written: its folder exists and takes a new file, and `path` is not a folder. Creates nothing;
    a one-line MoebenchError naming the option and the path otherwise."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise MoebenchError(f"{option_name} '{path}' is a folder; give a file path")
    if not folder.exists():
        raise MoebenchError(f"{option_name} '{path}': folder '{folder}' does not exist")
    if not folder.is_dir():
        raise MoebenchError(f"{option_name} '{path}': '{folder}' is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".write-test")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise MoebenchError(f"{option_name} '{path}': cannot write in '{folder}' ({e.strerror or e})") from None
    return path


def new_run_id(command: str, label: str) -> str:
    """`<date>-<time to the microsecond>-<6 random hex>-<command>-<label>`: sorts by start time, and
    runs started at the same moment (job arrays, parallel scripts, other hosts on a shared folder)
    still get folders of their own."""
    now = _dt.datetime.now()
    stamp = now.strftime("%Y%m%d-%H%M%S-") + f"{now.microsecond:06d}-{secrets.token_hex(3)}"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
    return f"{stamp}-{command}-{safe}"


LOCK_FILE = ".moebench.lock"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except (OSError, OverflowError, TypeError):
        return False
    return True


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 65536, 0)
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return holder if isinstance(holder, dict) else {"unreadable": True}


def _describe_holder(h: dict[str, Any]) -> str:
    if not h:
        return "another process (it has not written its name yet)"
    if h.get("unreadable"):
        return "another process (its lock file is unreadable)"
    return f"pid {h.get('pid')} on {h.get('host')} ({h.get('command')}, since {h.get('since')})"


def _release_lock(fd: int) -> None:
    import fcntl

    try:
        os.ftruncate(fd, 0)  # a clean end leaves no name behind
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


class RunLock:
    """One writer per run folder: an exclusive `fcntl.flock` on `<folder>/.moebench.lock`, held from
    `acquire()` until `release()` or the end of the process (the system drops the lock of a process
    that is killed). The file names the holder (pid, host, command, since): a second writer gets an
    error naming it. A holder that was killed leaves its name behind; the next writer takes the
    lock over and says so in `taken_over`."""

    def __init__(self, folder: str | os.PathLike, command: str | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.command = command or shlex.join(sys.argv)
        self.taken_over: str | None = None
        self._finalizer: weakref.finalize | None = None

    def acquire(self) -> "RunLock":
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            err = WriteError.from_os(e, self.path)
            if err is not None:
                raise err from None
            raise MoebenchError(f"cannot open the lock file {self.path} ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise MoebenchError(f"run folder {self.folder} is in use: {_describe_holder(holder)} is writing it; "
                                f"wait for it to end, or stop it, then resume") from None
        except OSError as e:
            os.close(fd)
            raise MoebenchError(f"cannot lock run folder {self.folder} ({e.strerror or e})") from None
        previous = _read_holder(fd)
        if previous:
            gone = ("is no longer running" if not pid_alive(previous.get("pid"))
                    else "no longer holds it") if previous.get("host") == platform.node() else "ended without releasing it"
            self.taken_over = f"took over the stale lock of {self.folder}: {_describe_holder(previous)} {gone}"
        me = {"pid": os.getpid(), "host": platform.node(), "command": self.command,
              "since": _dt.datetime.now().isoformat(timespec="seconds")}
        try:
            with writing(self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
                os.fsync(fd)
        except BaseException:
            _release_lock(fd)
            raise
        self._finalizer = weakref.finalize(self, _release_lock, fd)
        return self

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # once; also at exit or when the lock is dropped


def _repair_tail(path: Path) -> tuple[bytes, str | None]:
    """rows.jsonl's content, its torn last line (a write cut short: no line end) removed from the
    file, or completed when it holds a whole row; plus a sentence saying what was done."""
    with writing(path), open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return data, None
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        try:
            ResultRow.from_dict(json.loads(tail))
            whole = True
        except (ValueError, TypeError, AttributeError):
            whole = False
        if whole:
            f.write(b"\n")
            data += b"\n"
            what = f"completed the last row of {path}, which lacked its line end"
        else:
            f.truncate(cut)
            data = data[:cut]
            what = f"dropped a torn last line of {path} ({len(tail)} bytes of an interrupted write)"
        f.flush()
        os.fsync(f.fileno())
    return data, what


def read_run_metadata(folder: str | os.PathLike, command: str) -> dict[str, Any]:
    """metadata.json of an earlier `moebench <command>` run folder (for --resume); refuses a
    missing folder and one that is not such a run folder."""
    folder = Path(folder)
    again = f"pass the folder of an earlier `moebench {command}` run"
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise MoebenchError(f"--resume {folder}: {what}; {again}")
    p = folder / "metadata.json"
    if not p.is_file():
        raise MoebenchError(f"--resume {folder}: not a moebench run folder (no metadata.json); {again}")
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise MoebenchError(f"--resume {folder}: metadata.json is not readable ({e})") from None
    if not isinstance(meta, dict) or meta.get("command") != command:
        other = meta.get("command") if isinstance(meta, dict) else None
        raise MoebenchError(f"--resume {folder}: a `moebench {other}` run folder, not a `moebench {command}` one; {again}")
    return meta


class RunStore:
    """A run folder: metadata.json, rows.jsonl (incremental); moebench.report.write_exports writes
    its exports.

    Opening a folder with rows reads them (resume); a torn last line left by an interrupted write is
    dropped from the file first, so the next row starts on a line of its own (`notices` says so).
    lock: hold the folder's RunLock, one writer at a time, until `close()` or the end of the
    process; `command` names the holder (default: this process's command line).
    rows_file: the file rows are appended to. A run whose worker processes write beside one another
    (a tune's) gives each its own, `<stem>.jsonl` and `<stem>.w<N>.jsonl`: each store reads them all
    (another writer's torn last line is only skipped) and writes its own.
    """

    def __init__(self, folder: Path, metadata: dict[str, Any] | None = None, write: bool = True,
                 lock: bool = False, command: str | None = None, rows_file: str = "rows.jsonl"):
        self.folder = Path(folder)
        self.write = write
        self.path = self.folder / rows_file
        self.rows: list[ResultRow] = []
        self._keys: set[tuple] = set()
        self.notices: list[str] = []
        self.lock: RunLock | None = None
        if not write:
            return
        ensure_writable_dir(self.folder)
        if lock:
            self.lock = RunLock(self.folder, command).acquire()
            if self.lock.taken_over:
                self.notices.append(self.lock.taken_over)
        stem = rows_file.split(".")[0]
        for jl in [self.folder / f"{stem}.jsonl", *sorted(self.folder.glob(f"{stem}.w*.jsonl"))]:
            if jl.exists():  # resume: keep what is there
                self._read(jl, own=jl == self.path)
        if metadata is not None:
            meta = dict(metadata)
            meta.setdefault("git_revision", git_revision())
            meta.setdefault("python", platform.python_version())
            meta.setdefault("host", platform.node())
            meta.setdefault("started", _dt.datetime.now().isoformat(timespec="seconds"))
            atomic_write_text(self.folder / "metadata.json", json.dumps(meta, indent=2, default=str))

    def _read(self, jl: Path, own: bool) -> None:
        if own:
            data, repaired = _repair_tail(jl)
            if repaired:
                self.notices.append(repaired)
        else:
            data = jl.read_bytes()
            if not data.endswith(b"\n"):  # another writer's line in the making
                data = data[: data.rfind(b"\n") + 1]
        garbled = []
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    row = ResultRow.from_dict(json.loads(line))
                except (ValueError, TypeError, AttributeError):
                    garbled.append(number)  # a line garbled otherwise: its row is measured again
                    continue
                self.rows.append(row)
                self._keys.add(row.key())
        if garbled:
            where = ", ".join(map(str, garbled[:5])) + (", ..." if len(garbled) > 5 else "")
            self.notices.append(f"skipped {len(garbled)} garbled line{'s' if len(garbled) > 1 else ''} of {jl} "
                                f"(line {where}): not a result row; {'their rows are' if len(garbled) > 1 else 'its row is'} "
                                f"measured again")

    def close(self) -> None:
        """Release the folder's lock (if this store holds it)."""
        if self.lock is not None:
            self.lock.release()

    def record_resume(self, argv: Iterable[str]) -> None:
        """Note a resume in metadata.json ("resumed": when, argv, revision, host); the run's settings
        stay as they were written."""
        p = self.folder / "metadata.json"
        meta = json.loads(p.read_text())
        meta.setdefault("resumed", []).append({
            "at": _dt.datetime.now().isoformat(timespec="seconds"), "argv": list(argv),
            "git_revision": git_revision(), "host": platform.node()})
        atomic_write_text(p, json.dumps(meta, indent=2, default=str))

    def keys(self) -> set[tuple]:
        """The keys of the rows the run holds."""
        return set(self._keys)

    def has(self, row_key: tuple) -> bool:
        return row_key in self._keys

    def add(self, row: ResultRow) -> None:
        self.rows.append(row)
        self._keys.add(row.key())
        if not self.write:
            return
        line = json.dumps(row.as_dict(), default=str)
        try:  # whole lines only: a row cut short by a full disk is cut off again
            append_line(self.path, line)
        except BaseException:
            if not line_landed(self.path, line):  # a signal after the whole line keeps the row
                self.rows.pop()
                self._keys.discard(row.key())
            raise


#: files that make a folder a run folder (its subfolders, such as a tune's Triton cache, are its own)
_RUN_MARKERS = ("rows.jsonl", "results.json", "metadata.json", "tune.json")


def run_files(folder: Path, problems: list[str] | None = None) -> list[Path]:
    """The rows file of each run folder at or below `folder` (rows.jsonl, else results.json), so
    that a folder of run folders (`results/`) reads as all of them. With `problems`, a run folder
    that holds no rows (a run stopped before its first, a tune's folder) and an empty folder each
    add a line to it."""
    found: list[Path] = []

    def walk(d: Path) -> None:
        names = {c.name for c in d.iterdir()} if d.is_dir() else set()
        f = next((d / n for n in ("rows.jsonl", "results.json") if (d / n).is_file()), None)
        if f is not None:
            found.append(f)
            return
        if any(n in names for n in _RUN_MARKERS):
            if problems is not None:
                what = "a tune's run folder (its report.md holds the results)" if "tune.json" in names \
                    else "a run folder with no rows yet (stopped before its first row)"
                problems.append(f"skipped {d}: {what}")
            return
        if not names and problems is not None:
            problems.append(f"skipped {d}: an empty folder")
        for sub in sorted(p for p in d.iterdir() if p.is_dir()):
            walk(sub)

    walk(Path(folder))
    return found


def _folder_meta(folder: Path) -> dict[str, Any]:
    """The run folder's metadata.json ({} where there is none to read)."""
    try:
        meta = json.loads((folder / "metadata.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _from_folder(rows: list[ResultRow], folder: Path) -> None:
    """What a row's folder says of it: the GPU a `cuda` row ran on (x_device_name, so rows of
    different GPUs stay apart in reports), and, in a compare folder written before `check_only`,
    that its measured rows are checks."""
    meta = _folder_meta(folder)
    summary = meta.get("device_summary")
    gpu = summary.get("name") if isinstance(summary, dict) and meta.get("device") == "cuda" else None
    compare = str(meta.get("command") or "").startswith("compare")
    for r in rows:
        if isinstance(gpu, str) and gpu and r.device.startswith("cuda"):
            r.extra.setdefault("device_name", gpu)
        if compare:
            r.check_only = r.check_only or not r.modeled


def _read_rows_file(p: Path) -> list[ResultRow]:
    """The rows of one results file (.jsonl, .json, .csv), with what their folder says of them; a
    one-line MoebenchError for a file that is not one."""
    if not p.exists():
        raise MoebenchError(f"results path '{p}' does not exist")
    try:
        if p.suffix == ".jsonl":
            recs = []
            for number, line in enumerate(p.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        recs.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise MoebenchError(f"'{p}' line {number} is not a result row ({e.msg}); the rows of a "
                                            f"run folder continued with --resume are measured again") from None
        elif p.suffix == ".json":
            recs = json.loads(p.read_text())
        elif p.suffix == ".csv":
            recs = pd.read_csv(p).to_dict("records")
        else:
            raise MoebenchError(f"cannot read results from '{p}': expected a folder, .jsonl, .json or .csv")
        if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
            raise MoebenchError(f"'{p}' is not a moebench results file: expected a list of result rows")
        missing = sorted({c for r in recs for c in _REQUIRED_COLUMNS if c not in r})
        if missing:
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise MoebenchError(f"'{p}' is not a moebench results file: it has no {shown} column"
                                f"{'s' if len(missing) > 1 else ''} (pass a sweep's or compare's results)")
        found = [ResultRow.from_dict(r) for r in recs]
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise MoebenchError(f"'{p}' is not a moebench results file ({e})") from None
    _from_folder(found, p.parent)
    return found


def load_rows(paths: Iterable[Path], problems: list[str] | None = None) -> list[ResultRow]:
    """Rows from run folders (rows.jsonl, else results.json), folders holding run folders, or
    single result files. Without `problems` the first file that is not a results file is a
    MoebenchError; with it, each such file, each run folder without rows and each empty folder
    below the folders given is one line there, and the others' rows are returned."""
    rows: list[ResultRow] = []
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = run_files(p, problems)
            if not found and problems is None:
                raise MoebenchError(f"no rows.jsonl or results.json in '{p}' or the folders below it; "
                                    f"pass a moebench results folder")
            files += found
        else:
            files.append(p)
    for p in files:
        try:
            rows.extend(_read_rows_file(p))
        except MoebenchError as e:
            if problems is None or not p.exists():
                raise
            problems.append(f"skipped {p.parent if p.name in ('rows.jsonl', 'results.json') else p}: {e}")
    return rows



#: A few words for each kind of skip reason (tables and errors count the pairs by kind).
_SKIP_KINDS = (
    (r"^format mismatch", "format mismatch"),
    (r"does not run on (\w+)", r"not on \1"),
    (r"needs at least (\d+) ranks", r"needs \1+ ranks"),
    (r"runs on at most 1 rank", "single rank only"),
    (r"runs on at most (\d+) rank", r"at most \1 ranks"),
    (r"needs expert parallelism", "needs --ep"),
    (r"^Triton kernels need a GPU", "Triton needs a GPU"),
    (r"keeps tokens where they are", "no token exchange (dp > 1)"),
    (r"cannot quantise activations", "cannot quantise activations"),
    (r"do(es)? not support", "precision not supported"),
)


def skip_kind(reason: str) -> str:
    """A few words for a skip reason ('format mismatch', 'not on cpu', 'needs 2+ ranks', ...)."""
    for pattern, label in _SKIP_KINDS:
        m = re.search(pattern, reason)
        if m:
            return m.expand(label)
    text = re.sub(r"^(experts|prepare/finalize) '[^']*' ", "", reason)
    return re.split(r"[;:(]", text, maxsplit=1)[0].strip() or reason
