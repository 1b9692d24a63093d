"""The strategies that pick which tile configs a token count's search measures.

A strategy only asks `measure(configs, stage, reps)` for one row per config
(moebench.tuning.candidates: each a case of the sweep's loop, checked then timed, or answered
from the run folder of a resumed run); a row that failed or was wrong is never ranked.

    grid      every config of the (pruned) space
    random    `budget` configs drawn without replacement
    halving   successive halving over a pool of 3/4 of `budget` configs: the seeds first
              (winners of the neighbouring token count, the default heuristic's config), then
              their neighbours in the space, then random configs; each round keeps the faster
              half and doubles the repetitions; the last quarter of the budget then times the
              round winner's untried neighbours (one refinement step)

Every strategy ends with a `final` stage: the best few re-timed with `final_reps`, plus the
default heuristic's config timed the same way, so that winner, runner-up and default are
compared on equal terms.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from moebench.errors import MoebenchError
from moebench.kernels.tuned_files import TILE_KEYS, TileConfig
from moebench.results import ResultRow
from moebench.tuning.candidates import config_of, is_ok
from moebench.tuning.space import config_key, neighbours

#: (configs, stage, reps) -> one candidate row each (moebench.tuning.candidates), in order; the
#: strategies' only way to measure.
MeasureFn = Callable[[Sequence[TileConfig], str, int], list[ResultRow]]
#: Called with each batch of configs before they are measured (e.g. to compile them in parallel).
PrepareFn = Callable[[Sequence[TileConfig]], None]
#: Configs handed to a PrepareFn (and measured) at once (bounded, so what it compiles is used
#: before Triton's on-disk cache can be pruned).
PREPARE_CHUNK = 64

STRATEGIES = ("grid", "random", "halving")
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


# ---------------------------------------------------------------------------------------------
# Strategies


def ranked(ms: Iterable[ResultRow]) -> list[ResultRow]:
    """The candidates that worked, fastest first (ties: config order)."""
    return sorted((m for m in ms if is_ok(m)), key=lambda m: (m.latency_us, config_key(config_of(m))))


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

    measurements: list[ResultRow] = field(default_factory=list)
    final: list[ResultRow] = field(default_factory=list)

    @property
    def winner(self) -> ResultRow | None:
        return self.final[0] if self.final else None

    @property
    def runner_up(self) -> ResultRow | None:
        return self.final[1] if len(self.final) > 1 else None


def measure_batch(cfgs: Sequence[TileConfig], measure: MeasureFn, stage: str, reps: int,
                  prepare: PrepareFn | None = None) -> list[ResultRow]:
    """`measure` the configs in order, PREPARE_CHUNK at a time; `prepare` sees each chunk first."""
    out: list[ResultRow] = []
    for i in range(0, len(cfgs), PREPARE_CHUNK):
        chunk = list(cfgs[i : i + PREPARE_CHUNK])
        if prepare is not None:
            prepare(chunk)
        out += measure(chunk, stage, reps)
    return out


def search_grid(space: Sequence[TileConfig], measure: MeasureFn, reps: int,
                prepare: PrepareFn | None = None) -> list[ResultRow]:
    """Every config of `space`, `reps` repetitions each."""
    return measure_batch(space, measure, "grid", reps, prepare)


def search_random(space: Sequence[TileConfig], measure: MeasureFn, budget: int, reps: int, rng: random.Random,
                  prepare: PrepareFn | None = None) -> list[ResultRow]:
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
) -> list[ResultRow]:
    """Successive halving, then one refinement step.

    A quarter of the budget (none below 4) is kept for the refinement; the rest is the pool
    (`halving_pool`). Round r times the survivors with reps0 * eta**r repetitions (at most
    reps_max) and keeps the fastest 1/eta (at least 2) until 2 are left. Refinement: the
    round winner's neighbours not yet measured (shuffled), timed like the last round, so an
    optimum one step away from every pooled config is still found.
    """
    refine = budget // 4 if budget >= 4 else 0
    alive = halving_pool(space, seeds, budget - refine, rng)
    out: list[ResultRow] = []
    last: list[ResultRow] = []
    r, reps = 0, reps0
    while alive:
        last = measure_batch(alive, measure, f"halving-r{r}", reps, prepare)
        out += last
        ok = ranked(last)
        if len(ok) <= 2:
            break
        alive = [TileConfig(**config_of(m)) for m in ok[: max(2, math.ceil(len(ok) / eta))]]  # type: ignore[typeddict-item]
        r, reps = r + 1, min(reps * eta, reps_max)
    top = ranked(last)
    if refine and top:
        in_space = {config_key(c) for c in space}
        tried = {config_key(config_of(m)) for m in out}
        nb = [n for n in neighbours(config_of(top[0])) if config_key(n) in in_space and config_key(n) not in tried]
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
    best: dict[tuple, ResultRow] = {}
    for m in ms:  # the last (most repeated) stage of each config counts
        if is_ok(m):
            best[config_key(config_of(m))] = m
        else:
            best.pop(config_key(config_of(m)), None)
    top = [TileConfig(**config_of(m)) for m in ranked(best.values())[:final_top]]  # type: ignore[typeddict-item]
    final = measure_batch(_dedup([*top, default, *rivals]), measure, "final", final_reps, prepare)
    return SearchResult(measurements=ms + final, final=ranked(final))
