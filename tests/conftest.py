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


def _interpreter_patches_once_per_launch() -> None:
    """Speed only (about a quarter of an interpreted kernel's time): Triton's interpreter patches
    triton.language for a kernel's whole grid run (GridExecutor), then again at every call of a
    @triton.jit helper inside it (InterpretedFunction.__call__), which walks the modules' members
    each time and finds them already patched: by the grid run, or (triton.language.core, which
    tl.zeros and the like see) by the first helper call that patched it, whose patches are never
    undone. Here a helper whose language modules have been patched so during the running grid
    skips that walk; it runs exactly as before. Installed only on the interpreter whose code is
    the one this was written against (else nothing changes)."""
    import inspect
    import threading

    try:
        from triton.runtime import interpreter as interp
        call_src = inspect.getsource(interp.InterpretedFunction.__call__)
        grid_src = inspect.getsource(interp.GridExecutor.__call__)
    except (ImportError, AttributeError, OSError, TypeError):
        return
    body = [line.strip() for line in call_src.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    if body != ["_patch_lang(self.fn)", "fn = self.rewrite()", "try:", "return fn(*args, **kwargs)",
                "except Exception as e:", "raise InterpreterError(repr(e)) from e"] \
            or "patch_scope = _patch_lang(self.fn)" not in grid_src or "patch_scope.restore()" not in grid_src:
        return
    import triton.language as tl

    langs_of = lambda fn: frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)  # noqa: E731
    running = threading.local()
    grid_call, device_call = interp.GridExecutor.__call__, interp.InterpretedFunction.__call__

    def grid(self, *args, **kwargs):
        stack = running.__dict__.setdefault("langs", [])
        stack.append(set(langs_of(self.fn)))  # what _patch_lang(self.fn) patches for this grid run
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            stack.pop()

    def device(self, *args, **kwargs):
        stack = getattr(running, "langs", None)
        langs = langs_of(self.fn)
        if not stack or not langs or not langs <= stack[-1]:  # (none: the interpreter's own assertion)
            if stack:
                stack[-1] |= langs  # device_call patches them first thing, for the rest of the run
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.GridExecutor.__call__, interp.InterpretedFunction.__call__ = grid, device


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_once_per_launch()


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
