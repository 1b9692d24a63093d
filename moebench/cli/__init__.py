"""Command line: parses, calls the Python API, prints. No logic a script could not reach.

One module per command group (run: env, models, sweep; compare; report; tune: tune, configs);
what they share (option blocks, parsing, consoles) is moebench.cli.options."""

from __future__ import annotations

import signal
import sys
import threading

import click
import torch

from moebench.cli import comm as comm_commands
from moebench.cli import compare as compare_commands
from moebench.cli import demo as demo_commands
from moebench.cli import report as report_commands
from moebench.cli import run as run_commands
from moebench.cli import tune as tune_commands
from moebench.cli import vendor as vendor_commands
from moebench.cli.options import err_console, oom_text
from moebench.errors import HungUp, MoebenchError, Terminated, WriteError, interrupt_status, interrupt_word


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moebench")
def cli():
    """moebench: benchmark and tune Mixture-of-Experts kernels (TP vs EP, backends, Triton configs)."""


for command in (run_commands.env, run_commands.models, run_commands.sweep, compare_commands.compare,
                report_commands.report, tune_commands.tune, tune_commands.configs, comm_commands.comm,
                demo_commands.demo, vendor_commands.vendor):
    cli.add_command(command)


def _on_stop(signum, frame):
    """SIGTERM or SIGHUP stops a run as Ctrl-C does (its finished rows kept, exports written,
    spawned ranks stopped, the --resume line printed); a second one ends the process at once."""
    signal.signal(signum, signal.SIG_DFL)
    raise HungUp() if signum == signal.SIGHUP else Terminated()


def main() -> None:
    """Entry point: bad input -> one line on stderr, exit status 2, no traceback."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if on_main_thread:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # nohup: a hang-up stays ignored
            previous[sig] = signal.signal(sig, _on_stop)
    try:
        _run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say_error(text: str) -> None:
    err_console.print(f"error: {text}", markup=False, highlight=False, soft_wrap=True)


def _run() -> None:
    try:
        cli.main(prog_name="moebench", standalone_mode=False)
    except WriteError as e:  # a disk fault no run folder's --resume continues
        _say_error(str(e.then("run the command again")))
        sys.exit(2)
    except MoebenchError as e:
        _say_error(str(e))
        sys.exit(2)
    except torch.OutOfMemoryError as e:
        err_console.print(f"error: out of GPU memory ({oom_text(e)}); free the GPU, or run fewer or smaller shapes",
                          markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Abort as e:
        err_console.print(interrupt_word(e))
        sys.exit(interrupt_status(e))
    except OSError as e:  # a disk fault no command worded (full, read-only, not writable): still one line
        err = WriteError.from_os(e)
        if err is None:
            raise
        _say_error(str(err.then("run the command again")))
        sys.exit(2)
    except click.ClickException as e:
        err_console.print(f"error: {e.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
