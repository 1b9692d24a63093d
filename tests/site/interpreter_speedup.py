"""Three speed-ups of Triton's interpreter for the test suite, installed by `install()` in every
process the suite starts (the pytest processes through tests/conftest.py; CLI runs, ranks, fork
servers and workers through this folder's sitecustomize.py, which conftest puts first on
PYTHONPATH): helpers skip re-patching triton.language, integer arithmetic is not checked for
32-bit overflow (as on a GPU), and the numpy type of a Triton type is looked up in a table made
once. The suite's CPU time on a 2-core CI machine went from about 690 to 490 CPU-s with them
(DEVELOPERS.md, "Testing on a CPU")."""

import dataclasses


def install() -> None:
    _no_overflow_assertions()
    _numpy_types_once()
    _patches_once_per_launch()


def _numpy_types_once() -> None:
    """The interpreter's `_get_np_dtype` builds its table of Triton -> numpy types at every call
    (hundreds of thousands of calls in a GEMM); the same answers, from the table built once for
    each type asked. Installed only where the function gives the answers checked here."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
        built = interp._get_np_dtype
        if built(tl.bfloat16) != np.dtype(np.uint16) or built(tl.pointer_type(tl.float32)) != np.dtype(np.uint64):
            return
    except (ImportError, AttributeError, TypeError, KeyError):
        return
    table: dict = {}
    address = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):  # a block: its element's type, as the original does
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return address
        try:
            return table[tt_dtype]
        except KeyError:
            table[tt_dtype] = found = built(tt_dtype)
            return found

    interp._get_np_dtype = get_np_dtype


def _no_overflow_assertions() -> None:
    """The interpreter asserts after every 32-bit integer add, sub and mul that it did not overflow
    (InterpreterOptions.sanitize_overflow; about a third of an interpreted GEMM's time). A GPU build
    does so only in debug mode, and at the suite's shapes no index comes near 2^31: the kernels run
    here as the GPU runs them, without that assertion."""
    try:
        from triton.runtime import interpreter as interp
        options = interp.interpreter_builder.options
        interp.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):  # another interpreter: nothing changes
        return


def _patches_once_per_launch() -> None:
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
