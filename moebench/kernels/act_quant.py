"""prepare()'s activation quantisation step: on a GPU through the one-launch Triton kernel, on
the CPU through moebench.quant (the two are bit for bit equal)."""

from __future__ import annotations

import torch

from moebench.quant import ActQuant, quantize_activation


def maybe_quantize(x: torch.Tensor, quant: ActQuant | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prepare()'s quantisation step: (x, None) without quant, else (fp8 x, scales (M, G)).
    On a GPU through the one-launch Triton kernel the experts use for their intermediate
    (moebench.kernels.triton.quant.quantize_rows, bit for bit equal to `quantize_activation`)."""
    if quant is None:
        return x, None
    if x.is_cuda:
        from moebench.kernels.triton.quant import quantize_rows  # Triton: imported only where it runs

        return quantize_rows(x, quant.scheme, quant.static_scale)
    return quantize_activation(x, quant.scheme, quant.static_scale)
