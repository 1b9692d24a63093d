"""The one-process runner: every expert on this device, each token count's inputs and float64
reference made once and shared by the pairs."""

from __future__ import annotations

from moebench.backends import make_kernel
from moebench.bench.hardware import get_ceilings
from moebench.bench.timing import time_fn
from moebench.inputs import check_fits, make_tokens
from moebench.kernels.layer import MoELayer
from moebench.results import ResultRow
from moebench.routing import load_imbalance, make_routing
from moebench.sweep.cases import CaseRunner
from moebench.sweep.layer import fill_metrics, layer_args, layer_reference, layer_work, rank_layer, shared_gate
from moebench.sweep.measure import cycling, measure
from moebench.sweep.spec import SweepSpec
from moebench.sweep.variants import Case, measure_variant


class LocalRunner(CaseRunner):
    """One process holds every expert: each token count's inputs and float64 reference are made
    once and shared by the pairs (and their variants)."""

    runs_variants = True

    def start(self, spec: SweepSpec, runnable: list[tuple[str, str]]) -> None:
        self.spec = spec
        self.ceilings = get_ceilings(spec.device)
        self.lw = None
        self.m = None
        if runnable:
            s = spec.shape
            check_fits(s.num_experts, s.hidden, s.intermediate, max(spec.tokens, default=0), s.topk, spec.dtype,
                       spec.device)
            # fp8: the kernels run on the quantised weights; the unquantised ones stay for err_vs_unquantized.
            self.lw = rank_layer(spec, range(s.num_experts))

    def inputs(self, m: int, pf: str) -> None:
        """The inputs of token count `m`, shared by its pairs (made on its first case)."""
        if self.m == m:
            return
        spec, s, lw = self.spec, self.spec.shape, self.lw
        x = make_tokens(m, s.hidden, spec.dtype, spec.device, spec.seed + m)
        topk_weights, topk_ids = make_routing(spec.routing, m, s.num_experts, s.topk, seed=spec.seed + m,
                                              device=spec.device, groups=s.router_groups)
        self.m = m
        self.imbalance = load_imbalance(topk_ids, s.num_experts)
        self.gate = gate = shared_gate(spec, x, m)
        self.args = args = layer_args(lw, x, topk_weights, topk_ids, s.num_experts, gate)
        self.flops, self.nbytes = layer_work(spec, lw, args, m)
        self.variants = routing_variants(spec, m, x, lw, gate)
        self.ref = self.ref_unquantized = None
        if spec.check:
            self.ref = layer_reference(lw, args, spec.activation, gate)
            if lw.unquantized is not None:
                self.ref_unquantized = layer_reference(
                    lw.unquantized, (x, lw.unquantized.w13, lw.unquantized.w2, *args[3:]), spec.activation, gate)

    def run_case(self, row: ResultRow, m: int, pf: str, ex: str, inputs) -> None:
        spec, lw = self.spec, self.lw
        row.imbalance = self.imbalance
        kernel = MoELayer(make_kernel(spec.experts_classes[ex], spec.pf_classes[pf]), spec.activation, lw.bias,
                          lw.shared_w13, lw.shared_w2, self.gate)
        if row.variant:
            self.run_variant(row, m, kernel)
            return
        timed = kernel.experts.timed
        calls = [self.args, *self.variants]
        outcome = measure(
            lambda: kernel.apply(*self.args),
            (lambda: time_fn(cycling(kernel, calls), spec.device, **spec.timing_kwargs())) if timed else None,
            dtype=spec.dtype, quant=spec.quant, **self.references())
        outcome.fill(row)
        # Backends that pick a tile config say where it came from (tuned file or default heuristic).
        row.config_source = kernel.experts.last_config_source or ""
        if not timed:
            row.reason = "correctness only (not timed)"
            return
        t = outcome.timing
        row.latency_us, row.p10_us, row.p90_us, row.timing_method = t.median_us, t.p10_us, t.p90_us, t.method
        if self.variants:
            row.timing_method += f", {len(calls)} routings cycled"
            row.extra["routings"] = len(calls)
        fill_metrics(row, self.flops, self.nbytes, self.ceilings)

    def run_variant(self, row: ResultRow, m: int, kernel: MoELayer) -> None:
        """A registered variant of the case (moebench.sweep.variants): its call, checked where its
        output is the layer's, timed on the checked routing; its notes go to the row's extra."""
        spec = self.spec
        outcome, notes = measure_variant(row.variant, Case(spec, m, kernel, self.args, self.lw), self.references())
        outcome.fill(row)
        t = outcome.timing
        row.latency_us, row.p10_us, row.p90_us, row.timing_method = t.median_us, t.p10_us, t.p90_us, t.method
        row.config_source = kernel.experts.last_config_source or ""
        row.extra.update(notes)
        fill_metrics(row, self.flops, self.nbytes, self.ceilings)

    def references(self) -> dict:
        """measure()'s reference arguments of the current token count ({} when unchecked)."""
        refs = {}
        if self.ref is not None:
            refs["reference"] = lambda: self.ref
        if self.ref_unquantized is not None:
            refs["unquantized_reference"] = lambda: self.ref_unquantized
        return refs


def routing_variants(spec: SweepSpec, m: int, x, lw, gate=None) -> list[tuple]:
    """Argument tuples with `spec.routings - 1` extra routings of the same distribution (the first
    routing, the checked one, is the caller's)."""
    s = spec.shape
    out = []
    for j in range(1, spec.routings):
        w, ids = make_routing(spec.routing, m, s.num_experts, s.topk, seed=spec.seed + m + 7919 * j, device=spec.device,
                              groups=s.router_groups)
        out.append(layer_args(lw, x, w, ids, s.num_experts, gate))
    return out
