"""Errors that reach the user as one line (the CLI prints them and exits with status 2)."""


class MoebenchError(Exception):
    """Bad input or an impossible request. The message says what is wrong and what to do."""


class FormatMismatchError(MoebenchError):
    """A prepare/finalize and an experts backend disagree on the activation format."""


class UnsupportedError(MoebenchError):
    """A backend cannot run here (package missing, wrong device, too few GPUs...)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what slurm, `timeout` and `kill` send) received: a run stops as on Ctrl-C (finished
    rows kept, the --resume line printed), with exit status 143."""


def interrupt_status(e: BaseException) -> int:
    """The exit status of a run stopped by `e`: 143 for SIGTERM, 130 for Ctrl-C."""
    return 143 if isinstance(e, Terminated) or isinstance(e.__cause__, Terminated) else 130


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
