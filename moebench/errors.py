"""Errors that reach the user as one line (the CLI prints them and exits with status 2)."""

import errno as _errno
import os as _os


class MoebenchError(Exception):
    """Bad input or an impossible request. The message says what is wrong and what to do."""


class FormatMismatchError(MoebenchError):
    """A prepare/finalize and an experts backend disagree on the activation format."""


class UnsupportedError(MoebenchError):
    """A backend cannot run here (package missing, wrong device, too few GPUs...)."""


#: errno -> (what went wrong, the way on); the disk faults a write turns into a WriteError
_WRITE_FAULTS = {
    _errno.ENOSPC: ("no space left on the device", "free space there"),
    _errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    _errno.EFBIG: ("file size limit exceeded", "raise the limit (ulimit -f)"),
    _errno.EROFS: ("read-only file system", "remount it read-write or write elsewhere"),
    _errno.EACCES: ("permission denied", "make the folder writable for you or write elsewhere"),
    _errno.EPERM: ("operation not permitted", "make the folder writable for you or write elsewhere"),
}
WRITE_ERRNOS = frozenset(_WRITE_FAULTS)


class WriteError(MoebenchError):
    """A file or folder could not be written: the disk is full or over quota, the file system is
    read-only, or the folder is not writable for this user. One line naming the path, what went
    wrong and the way on; `then(...)` adds what to run afterwards (a run's --resume line)."""

    def __init__(self, path: "str | _os.PathLike", errno: int, after: str = ""):
        self.path, self.errno, self.after = str(path), errno, after
        self.reason, self.way = _WRITE_FAULTS.get(errno, (_os.strerror(errno), "check the folder"))
        super().__init__(f"cannot write {self.path}: {self.reason}; {self.way}" + (f", then {after}" if after else ""))

    def then(self, after: str) -> "WriteError":
        """The same error, its way on ending with `after` (e.g. "continue with `moebench sweep
        --resume RUN`"); one already given a way on keeps it."""
        return self if self.after else WriteError(self.path, self.errno, after)

    @classmethod
    def from_os(cls, e: OSError, path: "str | _os.PathLike | None" = None) -> "WriteError | None":
        """`e` as a WriteError naming `path` (else the file the error names), or None where `e` is
        not a disk fault (WRITE_ERRNOS)."""
        if e.errno not in WRITE_ERRNOS:
            return None
        return cls(path if path is not None else (e.filename or "a file"), e.errno)


class Terminated(KeyboardInterrupt):
    """SIGTERM (what slurm, `timeout` and `kill` send) or SIGHUP (the terminal closed, an ssh
    session dropped) received: a run stops as on Ctrl-C (finished rows kept, exports written, the
    --resume line printed), with exit status 128 + the signal (143 for SIGTERM, 129 for SIGHUP)."""

    status = 143
    word = "terminated"
    signame = "SIGTERM"


class HungUp(Terminated):
    """SIGHUP received (see Terminated): exit status 129."""

    status = 129
    word = "hung up"
    signame = "SIGHUP"


def _stop(e: BaseException) -> "Terminated | None":
    for x in (e, e.__cause__):
        if isinstance(x, Terminated):
            return x
    return None


def interrupt_status(e: BaseException) -> int:
    """The exit status of a run stopped by `e`: 143 for SIGTERM, 129 for SIGHUP, 130 for Ctrl-C."""
    stop = _stop(e)
    return stop.status if stop is not None else 130


def interrupted_by(e: BaseException) -> str:
    """"interrupted", or "interrupted by SIGTERM" / "by SIGHUP": how a run's last line names its stop."""
    stop = _stop(e)
    return "interrupted" if stop is None else f"interrupted by {stop.signame}"


def interrupt_word(e: BaseException) -> str:
    """What stopped a run, as the CLI's last line says it: terminated, hung up, aborted (Ctrl-C)."""
    stop = _stop(e)
    return stop.word if stop is not None else "aborted"


def one_line(e: BaseException, where: bool = False) -> str:
    """`Type: first line of the message` (at most 300 characters): how an exception that is not a
    MoebenchError reaches a row's reason or a one-line error. where: add the place it was raised
    (`(at file.py:LINE in function)`), for errors that come back from another process."""
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
    if where:
        import os
        import traceback

        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            text += f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name})"
    return text
