"""Correctness against the float64 reference (design.md "Correctness")."""

from __future__ import annotations

import torch

#: ||out - ref|| / ||ref|| must stay below this for a row to be correct.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
#: fp8 rows, against the reference of the dequantised weights and activations (the scheme's own
#: rounding is emulated there, so this bounds the kernel's error, not fp8's).
FP8_TOLERANCE = 3e-2


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere in out gives inf."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    denom = ref.norm().item()
    num = (o - ref.to(o.device)).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def is_correct(err: float, dtype: torch.dtype, quant=None) -> bool:
    """quant: the QuantScheme of an fp8 row (then FP8_TOLERANCE), else None."""
    return bool(err <= (FP8_TOLERANCE if quant is not None else TOLERANCE[dtype]))
