"""What a new user meets first, end to end through the CLI: run ids that never collide, refused
input that writes nothing, files that keep their permissions, a clean end on SIGTERM, tables that
fit their width, named custom shapes, honest remainders, no quiet acceptance of odd input, a tune
plan on any machine and `python -m moebench`."""

import json
import os
import subprocess
import sys
from pathlib import Path

from test_cli import ROOT, assert_bad_input, moebench, moebench_inproc

TINY = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "64"]
TINY_SWEEP = [*TINY, "--tokens", "1", "--experts", "torch", "--prepare-finalize", "no-dpep", "--device", "cpu"]


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200", **extra)


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
    ver = subprocess.run([sys.executable, "-m", "moebench", "--version"], capture_output=True, text=True, env=_env(),
                         timeout=120)
    assert ver.returncode == 0 and ver.stdout.startswith("moebench, version"), ver.stdout + ver.stderr
