"""Command line: parses, calls the Python API, prints. No logic a script could not reach.

One module per command group (run: env, models, sweep; compare; report; tune: tune, configs);
what they share (option blocks, parsing, consoles) is moebench.cli.options."""

from __future__ import annotations

import sys

import click
import torch

from moebench.cli import compare as compare_commands
from moebench.cli import report as report_commands
from moebench.cli import run as run_commands
from moebench.cli import tune as tune_commands
from moebench.cli.options import err_console, oom_text
from moebench.errors import MoebenchError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moebench")
def cli():
    """moebench: benchmark and tune Mixture-of-Experts kernels (TP vs EP, backends, Triton configs)."""


for command in (run_commands.env, run_commands.models, run_commands.sweep, compare_commands.compare,
                report_commands.report, tune_commands.tune, tune_commands.configs):
    cli.add_command(command)


def main() -> None:
    """Entry point: bad input -> one line on stderr, exit status 2, no traceback."""
    try:
        cli.main(prog_name="moebench", standalone_mode=False)
    except MoebenchError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except torch.OutOfMemoryError as e:
        err_console.print(f"error: out of GPU memory ({oom_text(e)}); free the GPU, or run fewer or smaller shapes",
                          markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        err_console.print(f"error: {e.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
