"""Variants: other calls a case can time beside the whole layer.

A benchmark that wants more than the layer's time (its GEMMs alone, its alignment alone, a library's
GEMMs on the same shapes) registers each of those calls here as a `Variant`, and names them in
the spec (`SweepSpec.variants`). The sweep loop runs them like pairs: one row per (tokens, pair,
variant), with the variant's name in the row's `variant` column ("" is the layer itself), written
by the same run folder, checked where the variant's output is the layer's, timed by the same
measure step (`measure_variant`). The one-process runner and the simulated runner (on the busiest
rank's share) time variants; the real-rank runner skips them with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moebench.bench.timing import time_fn
from moebench.errors import MoebenchError
from moebench.kernels.layer import MoELayer
from moebench.kernels.modular import FusedMoEKernel
from moebench.sweep.measure import Outcome, measure


@dataclass
class Case:
    """What a variant builds its call from: the spec, the token count, the layer (MoELayer around
    the pair's FusedMoEKernel), the kernel's arguments (x, w13, w2, topk_weights, topk_ids,
    expert_map, num_experts) and the rank layer `lw` (weights, biases, shared MLP)."""

    spec: Any
    tokens: int
    layer: Any
    args: tuple
    lw: Any
    #: what a variant's build may keep for its columns (written to the row's extra)
    notes: dict = field(default_factory=dict)

    def rebuilt(self, **experts_kwargs) -> MoELayer:
        """The case's layer with its experts made again from `experts_kwargs` (the same class,
        prepare/finalize, activation, biases and shared MLP): a variant that changes a backend's
        options."""
        lay = self.layer
        kernel = FusedMoEKernel(lay.prepare_finalize, type(lay.experts)(**experts_kwargs))
        return MoELayer(kernel, lay.activation, lay.bias, lay.shared_w13, lay.shared_w2, lay.shared_gate,
                        lay.shared_rows)


@dataclass(frozen=True)
class Variant:
    """name: the `variant` column; build(case) -> the call to time (no arguments); checked: its
    output is the layer's output (then checked against the reference like the layer); about: one
    line for listings."""

    name: str
    build: Callable[[Case], Callable[[], torch.Tensor | object]]
    checked: bool = False
    about: str = ""


_VARIANTS: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    """Add `variant` (a later registration of the same name replaces it)."""
    if not variant.name:
        raise ValueError("a variant needs a name ('' is the layer itself)")
    _VARIANTS[variant.name] = variant
    return variant


def get_variant(name: str) -> Variant:
    try:
        return _VARIANTS[name]
    except KeyError:
        valid = ", ".join(sorted(_VARIANTS)) or "none registered"
        raise MoebenchError(f"unknown variant '{name}'; registered: {valid}") from None


def variant_names() -> list[str]:
    return sorted(_VARIANTS)


def measure_variant(name: str, case: Case, references: dict) -> tuple[Outcome, dict]:
    """The registered variant `name` built from `case`, checked against `references` (measure()'s
    reference arguments) where its output is the layer's, and timed: the outcome and the notes
    its build kept."""
    variant = get_variant(name)
    call = variant.build(case)
    spec = case.spec
    outcome = measure(call, lambda: time_fn(call, spec.device, **spec.timing_kwargs()), dtype=spec.dtype,
                      quant=spec.quant, **(references if variant.checked else {}))
    return outcome, case.notes
