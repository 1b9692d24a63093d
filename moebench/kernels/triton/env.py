"""Where the Triton kernels run: the CPU interpreter or a GPU, and what the device offers.

    interpreting()                 TRITON_INTERPRET=1: kernels run on the CPU interpreter
    interpreter_compat()           fixes for Triton's interpreter (NumPy >= 2.3, constexprs in
                                   argument groups); every launcher calls it before its first
                                   launch (never at import)
    triton_unavailable_reason(d)   why the Triton experts cannot run on device d, or None
    num_sms(device)                streaming multiprocessors (1 off CUDA)
    tma_ok(t)                      whether t can be read through a TMA descriptor
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason(device: str) -> str | None:
    """Why moebench's Triton kernels cannot run on `device`, or None. On a CPU they run only
    under the interpreter (slow; correctness, not speed)."""
    if device == "cpu" and not interpreting():
        return "Triton kernels need a GPU; on CPU set TRITON_INTERPRET=1 to run them (slowly) under the interpreter"
    return None


def interpreter_compat() -> None:
    """Work around Triton 3.6's interpreter with NumPy >= 2.3: a scalar kernel argument is a
    1-element array, and `int()` of it (what `range(0, n, BLOCK)` calls through `__index__`) raises
    "only 0-dimensional arrays can be converted to Python scalars". Re-patches `__index__` to take
    the single element. And a named-tuple argument (an argument group, moebench.kernels.triton.common)
    reaches the kernel with its `tl.constexpr` fields as plain values, as the compiler and the
    interpreter's own constexpr arguments have them (the interpreter would keep the wrappers, whose
    arithmetic with tensors fails). Idempotent; does nothing unless interpreting, so launchers call
    it before every launch."""
    if not interpreting():
        return
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_moebench_compat", False):
        return

    def _patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patched._moebench_compat = True  # type: ignore[attr-defined]
    _interp._patch_lang_tensor = _patched

    import triton.language as tl

    cvt = _interp._implicit_cvt

    def _cvt(arg):
        if isinstance(arg, tuple) and hasattr(arg, "_fields"):
            return type(arg)(*(v.value if isinstance(v, tl.constexpr) else _cvt(v) for v in arg))
        return cvt(arg)

    _interp._implicit_cvt = _cvt


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs programs one at
    a time)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def tma_ok(t: torch.Tensor) -> bool:
    """Hopper or newer (or the interpreter, which emulates descriptors), and rows of the 2-D
    weight view 16-byte aligned (TMA's rules)."""
    if t.device.type == "cuda":
        hw = torch.cuda.get_device_capability(t.device)[0] >= 9
    else:
        hw = interpreting()
    return (
        hw
        and t.is_contiguous()
        and (t.shape[-1] * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
    )
