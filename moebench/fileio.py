"""Files that appear whole or not at all: write a temporary file beside the target, then rename it.

Every file moebench writes in place (run exports, metadata, tuned configs, plots, caches) goes
through `atomic_write_text`, `atomic_write_bytes` or `atomic_write_with`. The temporary file is
created as a plain `open()` would create it (mode 0o666 less the umask, not tempfile's 0600), so a
tuned config put in a shared folder is readable by whoever serves the model; a file that is
rewritten keeps the permissions it had.

A disk fault (full, over quota, read-only, not writable: moebench.errors.WRITE_ERRNOS) becomes a
one-line `WriteError` naming the file (`writing`), and the temporary file is removed: the file in
place stays the whole one it was, or stays absent.
"""

from __future__ import annotations

import os
import secrets
import stat
import contextlib
from pathlib import Path
from typing import Callable, Iterator

from moebench.errors import WriteError


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Inside: an OSError of a disk fault becomes a WriteError naming `path` (others pass)."""
    try:
        yield
    except OSError as e:
        err = WriteError.from_os(e, path)
        if err is None:
            raise
        raise err from None


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new empty file `.<name>.<random>.tmp` beside `path`, open for writing; mode 0o666 & ~umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def atomic_write_with(path: str | os.PathLike, writer: Callable[[str], object]) -> None:
    """writer(tmp_path) writes the content to a temporary file, which is then renamed onto `path`."""
    path = Path(path)
    with writing(path):
        _atomic_write_with(path, writer)


def _atomic_write_with(path: Path, writer: Callable[[str], object]) -> None:
    fd, tmp = _create_temp(path)
    os.close(fd)
    try:
        try:  # a file rewritten keeps its permissions (a shared folder's 664 stays 664)
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        except FileNotFoundError:
            pass
        writer(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` through a temporary file in the same folder and rename it into place."""
    atomic_write_with(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Binary twin of atomic_write_text."""
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` (and a line end) to the file at `path`, flushed and fsynced. Whole or not at
    all: a write cut short (a full disk, a signal) is cut off again, so the file keeps only whole
    lines, and a line written whole stays when a signal lands after it (during the fsync); a disk
    fault is a WriteError naming the file. `line_landed(path, line)` says which happened."""
    data = (line + "\n").encode()
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    if os.fstat(fd).st_size != size + len(data):  # cut short: not a whole line
                        os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


def line_landed(path: str | os.PathLike, line: str) -> bool:
    """Whether the file at `path` ends with `line` and its line end (after an append_line that raised)."""
    data = (line + "\n").encode()
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < len(data):
                return False
            f.seek(-len(data), os.SEEK_END)
            return f.read() == data
    except OSError:
        return False
