"""Tuning candidates as cases of the sweep's loop (moebench.sweep.cases.run_cases).

A candidate is one tile config at one token count in one stage of a search. It runs as a case of
the sweep loop: the pair `no-dpep + <experts>` (`triton` for moebench's kernel, an engine's
experts for its kernel), the candidate's name in the row's `variant` column (`"<stage>
<config>"`, e.g. `halving-r0 M16,N64,K64,G1,w4,s2`), checked and timed by the one measure step
(moebench.sweep.measure.measure), its record a ResultRow in the tune's run folder. The row's extra
holds the config, the stage, the repetitions, whether this measurement ran the check, what it cost
(elapsed_s) and the worker.

The layer a candidate runs is rank 0's share of the layout on this device (TP: the 1/tp shard of
every expert; EP: rank 0's whole experts, through the expert map), on fixed weights and tokens.
On CUDA the default timer captures `GRAPH_CALLS` calls in one CUDA graph, each on the next of as
many pre-drawn routings (fresh routing per call, as vLLM's tuner does); the check runs on the
first routing against the float64 reference (fp8: the reference emulates the scheme). A candidate
above the tolerance is not timed (`correct = false`); a compile error or out-of-resources is a
`failed` row; neither is ever ranked.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import torch

from moebench.backends import experts_class, make_kernel, prepare_finalize_class
from moebench.bench.timing import Timing, time_cpu, time_cuda
from moebench.errors import WRITE_ERRNOS, MoebenchError, WriteError, one_line
from moebench.inputs import make_tokens, make_weights
from moebench.kernels.engine_configs import engine_experts
from moebench.kernels.reference import reference_moe
from moebench.kernels.tuned_files import TILE_KEYS, validate_tile_config
from moebench.kernels.vllm_triton import VllmTritonOptions
from moebench.layout import ParallelLayout
from moebench.results import ResultRow
from moebench.routing import make_routing
from moebench.sweep.cases import CaseRunner
from moebench.sweep.measure import measure
from moebench.sweep.spec import SweepSpec
from moebench.tuning.space import key_str
from moebench.tuning.spec import gemm1_config

#: (fn, reps) -> Timing of one call of fn.
Timer = Callable[[Callable[[], object], int], Timing]
GRAPH_CALLS = 8  # calls (and routings) per CUDA graph replay
#: The prepare/finalize of every candidate: the experts alone, tokens where they are.
PREPARE_FINALIZE = "no-dpep"


def default_timer(device: str, graph_calls: int = GRAPH_CALLS) -> Timer:
    """CUDA: `time_cuda` with a CUDA graph of `graph_calls` calls; CPU: `time_cpu`."""
    if torch.device(device).type == "cuda":
        return lambda fn, reps: time_cuda(fn, warmup=2, reps=reps, use_graph=True, graph_calls=graph_calls)
    return lambda fn, reps: time_cpu(fn, warmup=1, reps=reps)


# ---------------------------------------------------------------------------------------------
# A candidate's record


def candidate_name(cfg: Mapping[str, int], stage: str) -> str:
    """The `variant` column of a candidate: '<stage> <config>'."""
    return f"{stage} {key_str(cfg)}"


def config_of(row: ResultRow) -> dict[str, int]:
    """The tile config a candidate row measured."""
    cfg = row.extra["config"]
    return {k: int(cfg[k]) for k in TILE_KEYS}


def stage_of(row: ResultRow) -> str:
    return str(row.extra.get("stage", ""))


def verdict(row: ResultRow) -> str:
    """'ok' (checked, or checked before at this token count, and timed), 'wrong' (above the
    tolerance) or 'failed' (compile error, out of resources, runtime error)."""
    if row.status == "failed":
        return "failed"
    return "wrong" if row.correct is False else "ok"


def is_ok(row: ResultRow) -> bool:
    """A candidate that can be ranked: it worked and was timed."""
    return verdict(row) == "ok" and row.latency_us is not None


def answered(bad: ResultRow, cfg: Mapping[str, int], stage: str) -> ResultRow:
    """A later stage's ask of a candidate that failed or was wrong before at this token count: the
    earlier verdict, not measured again (and not recorded)."""
    row = ResultRow.from_dict(bad.as_dict())
    row.variant = candidate_name(cfg, stage)
    row.latency_us = row.p10_us = row.p90_us = None
    row.extra.update(stage=stage, reps=0, checked=False, elapsed_s=0.0)
    return row


def sweep_spec(spec, tokens: int, variants: list[str]) -> SweepSpec:
    """The sweep spec of a batch of candidates of the tune `spec` (a TuneSpec) at `tokens`: one
    pair, one process (the layout's rank 0 share is the runner's to build), one variant each."""
    return SweepSpec(shape=spec.shape, tokens=[int(tokens)], layout=ParallelLayout(), experts=[spec.experts],
                     prepare_finalize=[PREPARE_FINALIZE], dtype=spec.dtype, device=torch.device(spec.device).type,
                     routing=spec.routing, seed=spec.seed, quant=spec.quant, variants=list(variants))


class Fatal(BaseException):
    """A host out-of-memory inside a candidate: ends the tune (the sweep loop makes rows of
    ordinary errors only); `error` is the original exception."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


# ---------------------------------------------------------------------------------------------
# The runner


class TuneRunner(CaseRunner):
    """The tuner's case runner: rank 0's weights of `spec` (built on the first candidate that is
    measured, kept for the whole run), each token count's inputs (tokens, `n_routings` routings,
    the float64 reference of the first, on first use), a kernel per candidate config.

    `batch` maps the variant names of the next run_cases call to (config, stage, reps, check); the
    tuner fills it. Rows already recorded are the tuner's to answer (done_keys is empty)."""

    runs_variants = True

    def __init__(self, spec, device: str | None = None, timer: Timer | None = None, worker: int = 0,
                 n_routings: int = GRAPH_CALLS):
        self.spec = spec
        self.device = device or spec.device
        self.timer = timer or default_timer(self.device, n_routings)
        self.worker = worker
        self.n_routings = max(1, n_routings)
        self.batch: dict[str, tuple[dict[str, int], str, int, bool]] = {}
        # the experts an engine's kernel is timed with where it runs here, else its structure
        name = "triton" if spec.kernel == "moebench" else engine_experts(spec.kernel, self.device)
        self.experts_cls, self.pf_cls = experts_class(name), prepare_finalize_class(PREPARE_FINALIZE)
        self._weights: tuple | None = None
        self._tokens: int | None = None

    # CaseRunner
    def done_keys(self, store) -> set[tuple]:
        return set()

    def inputs(self, m: int, pf: str) -> None:
        """The weights and the inputs of `m` tokens, outside the case: an error here (out of
        memory) ends the tune."""
        self.at(m)

    def run_case(self, row: ResultRow, m: int, pf: str, ex: str, inputs) -> None:
        cfg, stage, reps, check = self.batch[row.variant]
        row.extra.update(config=dict(cfg), stage=stage, reps=reps, checked=False, worker=self.worker)
        cfg = validate_tile_config(dict(cfg), "candidate config")
        t0 = time.perf_counter()
        try:
            self._measure(row, cfg, reps, check)
        except (KeyboardInterrupt, SystemExit, WriteError):
            raise  # (the sweep loop stops on a WriteError: a full disk is no config's failure)
        except MemoryError as e:
            raise Fatal(e) from e
        except Exception as e:  # noqa: BLE001 - compile errors, OutOfResources, launch failures
            if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:  # Triton's cache on a full disk
                raise WriteError.from_os(e) from None
            if torch.device(self.device).type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - a broken context is reported by the next call
                    pass
            row.status, row.reason = "failed", one_line(e)
        finally:
            row.extra["elapsed_s"] = time.perf_counter() - t0

    def _measure(self, row: ResultRow, cfg: dict[str, int], reps: int, check: bool) -> None:
        kernel = self.kernel(cfg)
        counter = [0]

        def fn() -> torch.Tensor:
            counter[0] += 1
            return self.call(kernel, counter[0])

        outcome = measure(lambda: self.call(kernel, 0), lambda: self.timer(fn, reps), dtype=self.spec.dtype,
                          quant=self.spec.quant, reference=self.reference if check else None, stop_if_wrong=True)
        if check:
            outcome.fill(row)
            row.extra["checked"] = True
            if not outcome.correct:
                row.reason = f"max_rel_err {row.max_rel_err:.3g} above tolerance"
                return
        t = outcome.timing
        row.latency_us, row.p10_us, row.p90_us, row.timing_method = t.median_us, t.p10_us, t.p90_us, t.method

    # The layer
    def weights(self) -> tuple:
        """(w13, w2, expert_map) of rank 0 of the layout: TP the 1/tp shard of every expert, EP rank
        0's whole experts (quantised with the spec's scheme, `dtype` the activation dtype)."""
        if self._weights is None:
            s, layout = self.spec.shape, self.spec.layout
            experts = layout.local_experts(0, s.num_experts) if layout.enable_ep else range(s.num_experts)
            w13, w2 = make_weights(experts, s.hidden, s.intermediate, self.spec.dtype, self.device, self.spec.seed,
                                   tp_rank=0, tp_size=layout.moe_tp_size, quant=self.spec.quant)
            emap = layout.expert_map(0, s.num_experts)
            self._weights = (w13, w2, emap.to(self.device) if emap is not None else None)
        return self._weights

    def at(self, tokens: int) -> None:
        """Make the inputs of `tokens` the current ones (tokens, routings; the reference on first use)."""
        if self._tokens == tokens:
            return
        if tokens < 1:
            raise MoebenchError(f"token count {tokens} cannot be tuned; give counts >= 1")
        spec, s = self.spec, self.spec.shape
        self.weights()
        self.x = make_tokens(tokens, s.hidden, spec.dtype, self.device, spec.seed + tokens)
        self.routings = [
            make_routing(spec.routing, tokens, s.num_experts, s.topk, seed=spec.seed * 7919 + tokens * 31 + i,
                         device=self.device)
            for i in range(self.n_routings)
        ]
        self._ref = None
        self._gemm1 = gemm1_config(spec, tokens)[0] if spec.down else None  # a `--down` tune: GEMM1's, fixed
        self._tokens = tokens

    def release(self) -> None:
        """Drop the current token count's inputs (the weights stay)."""
        self._tokens = None
        self.x = self.routings = self._ref = None

    def kernel(self, cfg: Mapping[str, int]):
        """The no-dpep kernel of the tune's experts with `cfg` (a `--down` tune: GEMM2's config,
        GEMM1's fixed)."""
        if self.spec.kernel != "moebench":
            kw: dict[str, Any] = {"config": dict(cfg)}
            if self.experts_cls.name == "vllm-triton":
                kw["options"] = VllmTritonOptions(engine=self.spec.kernel)
        else:
            kw = {"config": dict(cfg)} if self._gemm1 is None else {"config": self._gemm1, "down_config": dict(cfg)}
        return make_kernel(self.experts_cls, self.pf_cls, experts_kwargs=kw)

    def call(self, kernel, i: int) -> torch.Tensor:
        w13, w2, emap = self.weights()
        tw, ids = self.routings[i % len(self.routings)]
        return kernel.apply(self.x, w13, w2, tw, ids, emap, self.spec.shape.num_experts)

    def run_once(self, tokens: int, cfg: Mapping[str, int]) -> torch.Tensor:
        """One layer call with `cfg` at `tokens` on the first routing (unchecked, untimed): what
        compiles its kernels."""
        self.at(tokens)
        return self.call(self.kernel(cfg), 0)

    def reference(self) -> torch.Tensor:
        """(M, H) float64 reference of the current token count on the first routing."""
        if self._ref is None:
            w13, w2, emap = self.weights()
            tw, ids = self.routings[0]
            self._ref = reference_moe(self.x, w13, w2, tw, ids, emap)
        return self._ref
