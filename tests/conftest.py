"""Test setup: without a GPU, Triton kernels run under the interpreter (must be set before any
@triton.jit function executes). GPU tests carry the `gpu` marker and skip without CUDA."""

import os
import tempfile

import pytest
import torch

# Ceiling caches and the like go to a throwaway folder, never the user's home (subprocesses inherit it).
os.environ.setdefault("MOEBENCH_CACHE_DIR", tempfile.mkdtemp(prefix="moebench-test-cache-"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
