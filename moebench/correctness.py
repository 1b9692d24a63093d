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
    """quant: the QuantScheme of a quantised row, else None. fp8 rows: FP8_TOLERANCE; weight-only
    rows (int8_w8a16, int4_w4a16, mxfp4) the activation dtype's: the reference runs on the very
    weights the kernel dots (moebench.quant), so only the kernel's own rounding remains."""
    fp8 = quant is not None and not quant.weight_only
    return bool(err <= (FP8_TOLERANCE if fp8 else TOLERANCE[dtype]))
