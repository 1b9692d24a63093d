"""Set-up shared by the device scripts in benchmarks/ (importable because Python puts a script's
own folder on sys.path)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import triton


def script_setup(what: str) -> tuple[Path, torch.device, str]:
    """(output folder $OUT or ./bench-out, created; the device; a header line naming the GPU,
    torch and triton versions and `what`). On a CPU (smoke runs) the header says the times mean
    nothing."""
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if on_gpu else "cpu (smoke: times mean nothing)"
    return out_dir, torch.device("cuda" if on_gpu else "cpu"), f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, {what}"
