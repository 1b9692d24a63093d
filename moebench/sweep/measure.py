"""The one measure step: check a layer call against its float64 reference, then time it.

Every runner (one process, real ranks, simulated ranks) and the tuner measure through `measure`;
they differ only in what they hand it: the call, the reference, how an error is reduced (over the
ranks, for real ranks) and the timer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moebench.correctness import is_correct, relative_error
from moebench.kernels.modular import poisoned_outputs
from moebench.quant import QuantScheme
from moebench.results import ResultRow

Tensor = torch.Tensor


@dataclass
class Outcome:
    """What one measure step found. `timing` is whatever the timer returned (a Timing, or a
    runner's phase record); None when the check failed and `stop_if_wrong`, or nothing was timed."""

    max_rel_err: float | None = None
    correct: bool | None = None
    err_vs_unquantized: float | None = None
    timing: Any = None

    def fill(self, row: ResultRow) -> None:
        """The check's columns of `row` (the timing is the runner's to place)."""
        if self.max_rel_err is not None:
            row.max_rel_err, row.correct = self.max_rel_err, self.correct
        if self.err_vs_unquantized is not None:
            row.err_vs_unquantized = self.err_vs_unquantized


def measure(run: Callable[[], Tensor], time: Callable[[], Any] | None, *, dtype: torch.dtype,
            quant: QuantScheme | None = None,
            reference: Callable[[], Tensor] | None = None,
            unquantized_reference: Callable[[], Tensor] | None = None,
            error: Callable[[Tensor, Tensor], float] = relative_error,
            stop_if_wrong: bool = False) -> Outcome:
    """Check, then time.

    run: one call of the layer (its output is checked); it runs with poisoned output buffers, so a
    kernel that leaves rows unwritten fails the check. reference: the float64 output the call must
    match (None = unchecked); unquantized_reference: the same layer without weight quantisation,
    for err_vs_unquantized. error(out, ref) -> the relative error (real ranks reduce it over the
    ranks). time: the timer of the call (None = not timed). stop_if_wrong: a call above the
    tolerance is not timed (the tuner's candidates)."""
    outcome = Outcome()
    if reference is not None:
        with poisoned_outputs():
            out = run()
        outcome.max_rel_err = error(out, reference())
        outcome.correct = is_correct(outcome.max_rel_err, dtype, quant)
        if unquantized_reference is not None:
            outcome.err_vs_unquantized = error(out, unquantized_reference())
        if stop_if_wrong and not outcome.correct:
            return outcome
    if time is not None:
        outcome.timing = time()
    return outcome


def cycling(kernel, variants: list[tuple]) -> Callable[[], object]:
    """A call that applies `kernel` to the next argument tuple each time (captured into a CUDA
    graph, each captured call keeps its own routing)."""
    state = {"i": 0}

    def call():
        args = variants[state["i"] % len(variants)]
        state["i"] += 1
        return kernel.apply(*args)

    return call
