"""Measuring candidate tile configs for one token count, and the strategies that pick them.

A candidate is measured the way the sweep times the layer: the whole `no-dpep + triton` layer
(routing alignment and both GEMMs) on fixed weights and tokens. On CUDA, `time_cuda` captures
`graph_calls` calls in one CUDA graph and each call uses the next of `graph_calls` pre-drawn
routings, so every replay walks several different routings (as vLLM's tuner does with fresh
routing per call); a config is checked once per token count against the float64
`moebench.reference_moe` (a wrong config is recorded as `wrong` and never ranked; fp8 weights:
the reference emulates the scheme, tolerance moebench.correctness.FP8_TOLERANCE). Compile
failures and out-of-resources are recorded as `failed` and skipped.

Strategies (each calls `measure(config, stage, reps)`, which may answer from a journal):

    grid      every config of the (pruned) space
    random    `budget` configs drawn without replacement
    halving   successive halving over a pool of 3/4 of `budget` configs: the seeds first
              (winners of the neighbouring token count, the default heuristic's config), then
              their neighbours in the space, then random configs; each round keeps the faster
              half and doubles the repetitions; the last quarter of the budget then times the
              round winner's untried neighbours (one refinement step)

Every strategy ends with a `final` stage: the best few re-timed with `final_reps`, plus the
default heuristic's config timed the same way, so that winner, runner-up and default are
compared on equal terms. The timer is injectable (`Timer`): tests pass a CPU timer and run the
kernel under the Triton interpreter.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from moebench.bench.timing import Timing, time_cpu, time_cuda
from moebench.errors import MoebenchError, one_line
from moebench.inputs import make_tokens, make_weights
from moebench.kernels.reference import reference_moe
from moebench.backends import make_kernel
from moebench.layout import ParallelLayout
from moebench.models import MoEShape
from moebench.quant import QuantScheme
from moebench.routing import make_routing
from moebench.sweep.measure import measure
from moebench.kernels.triton.configs import TILE_KEYS, TileConfig, validate_tile_config
from moebench.tuning.space import config_key, key_str, neighbours

#: (fn, reps) -> Timing of one call of fn.
Timer = Callable[[Callable[[], object], int], Timing]
#: (config, stage, reps) -> Measurement; the strategies' only way to measure.
MeasureFn = Callable[[TileConfig, str, int], "Measurement"]
#: Called with each batch of configs before they are measured (e.g. to compile them in parallel).
PrepareFn = Callable[[Sequence[TileConfig]], None]
#: Configs handed to a PrepareFn at once (bounded, so what it compiles is used before Triton's
#: on-disk cache can be pruned).
PREPARE_CHUNK = 64

STRATEGIES = ("grid", "random", "halving")
GRAPH_CALLS = 8  # calls (and routings) per CUDA graph replay
#: Without --budget, halving / random measure this share of the pruned space, within
#: [MIN_BUDGET, MAX_BUDGET] configs per token count. A grid costs about the same per config
#: (compile + a few reps) as halving's screening rounds, and halving re-times its survivors, so a
#: 5% pool keeps the search under a tenth of the grid's time (PERF.md section 2).
DEFAULT_BUDGET_SHARE = 0.05
MIN_BUDGET, MAX_BUDGET = 6, 48
DEFAULT_BUDGET = "auto"


def default_budget(space_size: int) -> int:
    """Configs per token count when no --budget is given: 5% of the pruned space, 6..48."""
    return max(MIN_BUDGET, min(MAX_BUDGET, int(space_size * DEFAULT_BUDGET_SHARE)))


@dataclass
class Measurement:
    """One timed (or failed) candidate.

    status: "ok" (checked or already checked, and timed), "wrong" (failed the correctness check),
    "failed" (compile error, out of resources, runtime error). latency_us etc. are the timer's
    median / p10 / p90 of one layer call. elapsed_s: wall time this measurement cost (compile
    included). checked: the correctness check ran in this measurement.
    """

    tokens: int
    config: dict[str, int]
    stage: str
    status: str
    reps: int = 0
    latency_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    max_rel_err: float | None = None
    checked: bool = False
    reason: str = ""
    method: str = ""
    elapsed_s: float = 0.0
    worker: int = 0
    reused: bool = False  # answered from the journal (not persisted)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.latency_us is not None

    def key(self) -> tuple[int, str, str]:
        return (int(self.tokens), key_str(self.config), self.stage)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("reused")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Measurement":
        names = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in names}
        kw["config"] = {k: int(kw["config"][k]) for k in TILE_KEYS}
        return cls(**kw)


def default_timer(device: str, graph_calls: int = GRAPH_CALLS) -> Timer:
    """CUDA: `time_cuda` with a CUDA graph of `graph_calls` calls; CPU: `time_cpu`."""
    if torch.device(device).type == "cuda":
        return lambda fn, reps: time_cuda(fn, warmup=2, reps=reps, use_graph=True, graph_calls=graph_calls)
    return lambda fn, reps: time_cpu(fn, warmup=1, reps=reps)


@dataclass
class LayerWeights:
    """This rank's weights: w13 (E_local, 2I', H), w2 (E_local, H, I') of rank 0 of `layout`
    (TP: the 1/tp shard of every expert; EP: rank 0's whole experts), and expert_map (E,) or None.
    With an fp8 scheme, w13 / w2 are moebench.quant.QuantWeight (quantised from the `dtype` weights
    by moebench.quant.quantize_weights, with `dtype` as the activation dtype)."""

    w13: torch.Tensor
    w2: torch.Tensor
    expert_map: torch.Tensor | None

    @classmethod
    def build(cls, shape: MoEShape, layout: ParallelLayout, dtype: torch.dtype, device: str, seed: int = 0,
              quant: QuantScheme | None = None) -> "LayerWeights":
        experts = layout.local_experts(0, shape.num_experts) if layout.enable_ep else range(shape.num_experts)
        w13, w2 = make_weights(experts, shape.hidden, shape.intermediate, dtype, device, seed,
                               tp_rank=0, tp_size=layout.moe_tp_size, quant=quant)
        emap = layout.expert_map(0, shape.num_experts)
        return cls(w13, w2, emap.to(device) if emap is not None else None)


class LayerBench:
    """Inputs for one token count and the measurement of one config on them.

    x (M, H); `n_routings` routings (topk_weights (M, K) float32, topk_ids (M, K) int32) drawn
    from `routing`; the float64 reference of the first routing, computed on first use.
    quant: the fp8 scheme of the weights (None = unquantised); it picks the check's tolerance.
    gemm1: GEMM1's config, fixed: the measured config is then GEMM2's own (a `--down` tune).
    kernel: "moebench" (the `triton` experts) or an engine ("vllm", "sglang": the engine's own
    kernel where it runs here, else the `vllm-triton` experts with that engine's code paths;
    moebench.kernels.engine_configs.engine_experts).
    """

    def __init__(
        self,
        shape: MoEShape,
        weights: LayerWeights,
        tokens: int,
        dtype: torch.dtype,
        device: str,
        seed: int = 0,
        routing: str = "uniform",
        timer: Timer | None = None,
        n_routings: int = GRAPH_CALLS,
        worker: int = 0,
        quant: QuantScheme | None = None,
        gemm1: Mapping[str, int] | None = None,
        kernel: str = "moebench",
    ):
        if tokens < 1:
            raise MoebenchError(f"token count {tokens} cannot be tuned; give counts >= 1")
        self.shape, self.w, self.tokens, self.dtype, self.device = shape, weights, tokens, dtype, device
        self.timer = timer or default_timer(device, n_routings)
        self.worker = worker
        self.quant = quant
        self.gemm1 = dict(gemm1) if gemm1 is not None else None
        self.kernel = kernel
        self.x = make_tokens(tokens, shape.hidden, dtype, device, seed + tokens)
        self.routings = [
            make_routing(routing, tokens, shape.num_experts, shape.topk, seed=seed * 7919 + tokens * 31 + i, device=device)
            for i in range(max(1, n_routings))
        ]
        self._ref: torch.Tensor | None = None

    def _kernel(self, cfg: Mapping[str, int]):
        if self.kernel != "moebench":  # the engine's own kernel where it runs here, else its structure
            from moebench.kernels.engine_configs import engine_experts
            from moebench.kernels.vllm_triton import VllmTritonOptions

            experts = engine_experts(self.kernel, self.device)
            kw = {"config": dict(cfg)}
            if experts == "vllm-triton":
                kw["options"] = VllmTritonOptions(engine=self.kernel)
            return make_kernel(experts=experts, prepare_finalize="no-dpep", experts_kwargs=kw)
        kw = {"config": dict(cfg)} if self.gemm1 is None else {"config": self.gemm1, "down_config": dict(cfg)}
        return make_kernel(experts="triton", prepare_finalize="no-dpep", experts_kwargs=kw)

    def _call(self, kernel, i: int) -> torch.Tensor:
        tw, ids = self.routings[i % len(self.routings)]
        return kernel.apply(self.x, self.w.w13, self.w.w2, tw, ids, self.w.expert_map, self.shape.num_experts)

    def run_once(self, cfg: Mapping[str, int]) -> torch.Tensor:
        """One layer call with `cfg` on the first routing (unchecked, untimed): what compiles its
        kernels."""
        return self._call(self._kernel(cfg), 0)

    def reference(self) -> torch.Tensor:
        """(M, H) float64 reference on the first routing."""
        if self._ref is None:
            tw, ids = self.routings[0]
            self._ref = reference_moe(self.x, self.w.w13, self.w.w2, tw, ids, self.w.expert_map)
        return self._ref

    def measure(self, cfg: Mapping[str, int], stage: str, reps: int, check: bool = True) -> Measurement:
        """Check (when `check`) then time `cfg`; never raises for a config that does not work."""
        cfg = validate_tile_config(dict(cfg), "candidate config")
        m = Measurement(tokens=self.tokens, config=dict(cfg), stage=stage, status="ok", reps=reps, worker=self.worker)
        t0 = time.perf_counter()
        try:
            kernel = self._kernel(cfg)
            counter = [0]

            def fn() -> torch.Tensor:
                counter[0] += 1
                return self._call(kernel, counter[0])

            outcome = measure(lambda: self._call(kernel, 0), lambda: self.timer(fn, reps), dtype=self.dtype,
                              quant=self.quant, reference=self.reference if check else None, stop_if_wrong=True)
            if check:
                m.max_rel_err, m.checked = outcome.max_rel_err, True
                if not outcome.correct:
                    m.status, m.reason = "wrong", f"max_rel_err {m.max_rel_err:.3g} above tolerance"
                    return m
            t = outcome.timing
            m.latency_us, m.p10_us, m.p90_us, m.method = t.median_us, t.p10_us, t.p90_us, t.method
        except (KeyboardInterrupt, SystemExit, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - compile errors, OutOfResources, launch failures
            if torch.device(self.device).type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - a broken context is reported by the next call
                    pass
            m.status, m.reason = "failed", one_line(e)
        finally:
            m.elapsed_s = time.perf_counter() - t0
        return m


# ---------------------------------------------------------------------------------------------
# Strategies


def ranked(ms: Iterable[Measurement]) -> list[Measurement]:
    """The ok measurements, fastest first (ties: config order)."""
    return sorted((m for m in ms if m.ok), key=lambda m: (m.latency_us, config_key(m.config)))


def _dedup(cfgs: Iterable[Mapping[str, int]]) -> list[TileConfig]:
    seen: set = set()
    out: list[TileConfig] = []
    for c in cfgs:
        k = config_key(c)
        if k not in seen:
            seen.add(k)
            out.append(TileConfig(**{kk: int(c[kk]) for kk in TILE_KEYS}))  # type: ignore[typeddict-item]
    return out


@dataclass
class SearchResult:
    """All measurements of one token count's search and the final ranking.

    final: the `final`-stage measurements (best candidates and the default), fastest first.
    """

    measurements: list[Measurement] = field(default_factory=list)
    final: list[Measurement] = field(default_factory=list)

    @property
    def winner(self) -> Measurement | None:
        return self.final[0] if self.final else None

    @property
    def runner_up(self) -> Measurement | None:
        return self.final[1] if len(self.final) > 1 else None


def measure_batch(cfgs: Sequence[TileConfig], measure: MeasureFn, stage: str, reps: int,
                  prepare: PrepareFn | None = None) -> list[Measurement]:
    """`measure` each config in order; `prepare` sees them first, PREPARE_CHUNK at a time."""
    out: list[Measurement] = []
    for i in range(0, len(cfgs), PREPARE_CHUNK):
        chunk = list(cfgs[i : i + PREPARE_CHUNK])
        if prepare is not None:
            prepare(chunk)
        out += [measure(c, stage, reps) for c in chunk]
    return out


def search_grid(space: Sequence[TileConfig], measure: MeasureFn, reps: int,
                prepare: PrepareFn | None = None) -> list[Measurement]:
    """Every config of `space`, `reps` repetitions each."""
    return measure_batch(space, measure, "grid", reps, prepare)


def search_random(space: Sequence[TileConfig], measure: MeasureFn, budget: int, reps: int, rng: random.Random,
                  prepare: PrepareFn | None = None) -> list[Measurement]:
    """`budget` configs of `space`, drawn without replacement (deterministic for rng's seed)."""
    pick = rng.sample(list(space), min(budget, len(space)))
    return measure_batch(pick, measure, "random", reps, prepare)


def halving_pool(space: Sequence[TileConfig], seeds: Sequence[Mapping[str, int]], budget: int, rng: random.Random) -> list[TileConfig]:
    """`budget` configs: the seeds that are in the space first, then their neighbours in the
    space (each seed's in a shuffled order, so that no parameter is favoured; seeds plus
    neighbours at most half the budget), then random configs of the space."""
    in_space = {config_key(c): c for c in space}
    seeds = _dedup(seeds)
    pool = [in_space[config_key(s)] for s in seeds if config_key(s) in in_space]
    near: list[TileConfig] = []
    for s in seeds:
        nb = [in_space[config_key(n)] for n in neighbours(s) if config_key(n) in in_space]
        rng.shuffle(nb)
        near += nb
    pool = _dedup(pool + near)[: max(len(pool), budget // 2)][:budget]
    taken = {config_key(p) for p in pool}
    rest = [c for c in space if config_key(c) not in taken]
    pool += rng.sample(rest, min(len(rest), budget - len(pool)))
    return pool


def search_halving(
    space: Sequence[TileConfig],
    measure: MeasureFn,
    budget: int,
    seeds: Sequence[Mapping[str, int]],
    rng: random.Random,
    reps0: int = 3,
    eta: int = 2,
    reps_max: int = 40,
    prepare: PrepareFn | None = None,
) -> list[Measurement]:
    """Successive halving, then one refinement step.

    A quarter of the budget (none below 4) is kept for the refinement; the rest is the pool
    (`halving_pool`). Round r times the survivors with reps0 * eta**r repetitions (at most
    reps_max) and keeps the fastest 1/eta (at least 2) until 2 are left. Refinement: the
    round winner's neighbours not yet measured (shuffled), timed like the last round, so an
    optimum one step away from every pooled config is still found.
    """
    refine = budget // 4 if budget >= 4 else 0
    alive = halving_pool(space, seeds, budget - refine, rng)
    out: list[Measurement] = []
    last: list[Measurement] = []
    r, reps = 0, reps0
    while alive:
        last = measure_batch(alive, measure, f"halving-r{r}", reps, prepare)
        out += last
        ok = ranked(last)
        if len(ok) <= 2:
            break
        alive = [TileConfig(**m.config) for m in ok[: max(2, math.ceil(len(ok) / eta))]]  # type: ignore[typeddict-item]
        r, reps = r + 1, min(reps * eta, reps_max)
    top = ranked(last)
    if refine and top:
        in_space = {config_key(c) for c in space}
        tried = {config_key(m.config) for m in out}
        nb = [n for n in neighbours(top[0].config) if config_key(n) in in_space and config_key(n) not in tried]
        rng.shuffle(nb)
        out += measure_batch(nb[:refine], measure, "halving-refine", reps, prepare)
    return out


def run_search(
    strategy: str,
    space: Sequence[TileConfig],
    measure: MeasureFn,
    *,
    default: Mapping[str, int],
    seeds: Sequence[Mapping[str, int]] = (),
    budget: int | None = None,
    rng: random.Random | None = None,
    reps: int = 10,
    final_reps: int = 20,
    final_top: int = 3,
    prepare: PrepareFn | None = None,
    rivals: Sequence[Mapping[str, int]] = (),
) -> SearchResult:
    """Run `strategy` over `space`, then the final stage: the `final_top` best configs, the
    default heuristic's config and the `rivals` (configs to beat, e.g. an engine's shipped entry;
    they also seed halving), each timed with `final_reps`. Returns every measurement and the
    final ranking (the default and the rivals compete: a search never returns something slower
    than them). prepare: see PrepareFn (called before each batch of measurements)."""
    if strategy not in STRATEGIES:
        raise MoebenchError(f"unknown search strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    rng = rng or random.Random(0)
    budget = default_budget(len(space)) if budget is None else int(budget)
    if budget < 1:
        raise MoebenchError(f"--budget must be >= 1, got {budget}")
    if strategy == "grid":
        ms = search_grid(space, measure, reps, prepare)
    elif strategy == "random":
        ms = search_random(space, measure, budget, reps, rng, prepare)
    else:
        ms = search_halving(space, measure, budget, list(rivals) + list(seeds) + [default], rng, reps0=max(1, reps // 4),
                            reps_max=max(reps, 1), prepare=prepare)
    best: dict[tuple, Measurement] = {}
    for m in ms:  # the last (most repeated) stage of each config counts
        if m.ok:
            best[config_key(m.config)] = m
        else:
            best.pop(config_key(m.config), None)
    top = [TileConfig(**m.config) for m in ranked(best.values())[:final_top]]  # type: ignore[typeddict-item]
    final = measure_batch(_dedup([*top, default, *rivals]), measure, "final", final_reps, prepare)
    return SearchResult(measurements=ms + final, final=ranked(final))
