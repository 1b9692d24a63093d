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
from moebench.errors import MoebenchError, Terminated, interrupt_status


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moebench")
def cli():
    """moebench: benchmark and tune Mixture-of-Experts kernels (TP vs EP, backends, Triton configs)."""


for command in (run_commands.env, run_commands.models, run_commands.sweep, compare_commands.compare,
                report_commands.report, tune_commands.tune, tune_commands.configs, comm_commands.comm,
                demo_commands.demo, vendor_commands.vendor):
    cli.add_command(command)


def _on_sigterm(signum, frame):
    """SIGTERM stops a run as Ctrl-C does (its finished rows kept, spawned ranks stopped, the
    --resume line printed); a second SIGTERM ends the process at once."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated()


def main() -> None:
    """Entry point: bad input -> one line on stderr, exit status 2, no traceback."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if on_main_thread else None
    try:
        _run()
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run() -> None:
    try:
        cli.main(prog_name="moebench", standalone_mode=False)
    except MoebenchError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except torch.OutOfMemoryError as e:
        err_console.print(f"error: out of GPU memory ({oom_text(e)}); free the GPU, or run fewer or smaller shapes",
                          markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Abort as e:
        status = interrupt_status(e)
        err_console.print("terminated" if status == 143 else "aborted")
        sys.exit(status)
    except click.ClickException as e:
        err_console.print(f"error: {e.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
