"""Test setup: without a GPU, Triton kernels run under the interpreter (must be set before any
@triton.jit function executes). GPU tests carry the `gpu` marker and skip without CUDA."""

import os
import sys
import tempfile

import pytest
import torch

# Ceiling caches and the like go to a throwaway folder, never the user's home (subprocesses inherit it).
os.environ.setdefault("MOEBENCH_CACHE_DIR", tempfile.mkdtemp(prefix="moebench-test-cache-"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Every process the suite starts (CLI runs, ranks, the fork server and its workers) imports
# tests/site/sitecustomize.py first: the interpreter speed-ups below, there installed on the first
# kernel launch. A test that sets PYTHONPATH for a subprocess keeps this value's folders.
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([SITE, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and p not in (SITE, ROOT)])
sys.path.insert(0, SITE)
from interpreter_speedup import install  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    install()


def pytest_collection_modifyitems(config, items):
    # tests marked slow first: with two workers the longest ones then never start last and leave
    # one worker running them alone at the end
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
