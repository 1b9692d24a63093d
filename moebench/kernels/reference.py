"""Float64 reference: a plain loop over experts. Correctness only; never timed as a contender."""

from __future__ import annotations

import torch

from moebench.activation import ACTIVATIONS, SILU, Activation
from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    ExpertBias,
    PrepareResult,
    TopKWeightAndReduceNoOp,
)
from moebench.kernels.token_layout import local_topk_ids
from moebench.quant import QUANT_KINDS, as_float, fake_quant, scheme_of


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I) = [gate | up] -> (..., I) = silu(gate) * up."""
    i = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:]


def act_and_mul(gate_up: torch.Tensor, activation: Activation = SILU) -> torch.Tensor:
    """(..., 2I) -> (..., I) with `activation` (moebench.activation): silu / gelu (exact) on the
    [gate | up] halves; swigluoai on interleaved columns (even gate, odd up): gate clamped above
    at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    if activation.interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = gate.clamp(max=activation.limit)
        up = up.clamp(min=-activation.limit, max=activation.limit)
        return (up + 1) * gate * torch.sigmoid(activation.alpha * gate)
    if activation.name == "gelu":
        i = gate_up.shape[-1] // 2
        return torch.nn.functional.gelu(gate_up[..., :i]) * gate_up[..., i:]
    return silu_and_mul(gate_up)


def reference_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    *,
    activation: Activation = SILU,
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]), in float64, act the
    `activation`'s gated function (`act_and_mul`; silu(gate) * up by default); bias None = no biases.

    x (M, H), w13 (E_local, 2I, H), w2 (E_local, H, I), topk_* (M, K) with global ids;
    expert_map (E,) global -> local (-1: remote, contributes zero). Returns (M, H) float64 on x's device.

    Quantised weights (moebench.quant.QuantWeight) are dequantised, and the activations go through
    the scheme's rounding points exactly as the kernels see them (x quantised; the intermediate
    stored in x's dtype, then quantised), so the check measures the kernel, not fp8 itself.
    Weight-only schemes quantise no activation: the reference runs on x and the dequantised
    weights (`QuantWeight.dequantize`: the values the kernels dot).
    """
    quant = scheme_of(w13)
    if quant is not None and quant.weight_only:
        quant = None  # activations unquantised; as_float dequantises the weights
    xd = x.double() if quant is None else fake_quant(x, quant, x.dtype, w13.input_scale)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    local = local_topk_ids(topk_ids, expert_map)
    w = topk_weights.double()
    for e in torch.unique(local).tolist():
        if e < 0:
            continue
        tok, kk = torch.nonzero(local == e, as_tuple=True)
        gu = xd[tok] @ as_float(w13[e : e + 1])[0].t()
        if bias is not None:
            gu = gu + bias.b13[e].double()
        h = act_and_mul(gu, activation)
        if quant is not None:
            h = fake_quant(h, quant, x.dtype, w2.input_scale)
        y = h @ as_float(w2[e : e + 1])[0].t()
        if bias is not None:
            y = y + bias.b2[e].double()
        out.index_add_(0, tok, y * w[tok, kk].unsqueeze(-1))
    return out


class ReferenceExperts(Experts):
    """float64 loop over experts (Standard); output (M, H) already weighted and summed."""

    name = "reference"
    activation_format = ActivationFormat.STANDARD
    timed = False
    supported_quant = QUANT_KINDS
    quantizes_input = True  # takes x unquantised and emulates the scheme itself
    supported_activations = ACTIVATIONS
    supports_bias = True

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor, *, activation: Activation = SILU,
              bias: ExpertBias | None = None) -> torch.Tensor:
        out = reference_moe(prep.a, w13, w2, prep.topk_weights, prep.topk_ids, prep.expert_map,
                            activation=activation, bias=bias)
        return out.to(prep.a.dtype)
