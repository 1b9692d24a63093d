"""`tune`: search the best tile config per token count and write the vLLM-format file.

Run folder (`results/<run-id>/`, or the folder given to `resume`):

    tune.json                  the run's settings (what `--resume` continues) and environment
    candidates.jsonl           one result row per candidate measured (moebench.tuning.candidates:
                               config and stage in its `variant` column), appended and fsynced as
                               it is made by the sweep loop (other workers: candidates.w<N>.jsonl);
                               a resumed run answers every (tokens, config, stage) already there
    .moebench.lock             one writer per run folder (moebench.results.RunLock)
    triton-cache/w<N>/         TRITON_CACHE_DIR of worker N, deleted whenever it grows over
                               `cache_limit_mb` (compiled kernels stay cached in memory)
    report.md, report.csv      per token count: winner, latency, runner-up, default heuristic's
                               latency, speed-up over the default, cost of the search
    metadata.json              which kernel the file is for (`kernel`), what was timed, the file,
                               Triton / torch versions, device, git revision

`kernel` (TuneSpec.kernel): "moebench" tunes the `triton` experts and writes moebench's file;
"vllm" / "sglang" tune the `vllm-triton` experts (the engines' own kernel structure) and write
the engine's file, by default into results/configs/vllm/ or results/configs/sglang/triton_X_Y_Z/
(the store: moebench.kernels.tuned_files), never next to moebench's files.

The config file goes to `out_dir` (default `results/configs/`, the second folder of the lookup
order; a resumed run keeps the folder saved in its tune.json) as `E={E_local},N={I/tp},device_name=...json`
(fp8: `...,dtype=fp8_w8a8[,block_shape=[bn,bk]].json`, vLLM's names; per-token scales:
`...,dtype=fp8_w8a8,per_channel_quant=True.json`, SGLang's); entries already in that file for other
token counts are kept. The folder is checked before anything is measured, and the file is updated
(merged, atomic rename) as each token count finishes, so an interrupted run keeps its winners.

fp8 (`quant`, a moebench.quant.QuantScheme): the weights are quantised once
(moebench.quant.quantize_weights, bf16 activations), every candidate is checked against the
float64 reference that emulates the scheme (tolerance moebench.correctness.FP8_TOLERANCE), the
space is pruned with 1-byte operands and, for block scales, to BLOCK_SIZE_K | bk and
BLOCK_SIZE_N | bn (as vLLM's tuner prunes), and the default heuristic's config is fitted to the
scale block (configs.fit_to_quant_block).

Work split: token counts are cut into contiguous chunks (so each worker still seeds a count from
its neighbour), one chunk per worker. Workers: one process per GPU of `gpus` (spawned), or under
torchrun (RANK / WORLD_SIZE set) one chunk per rank, gathered on rank 0, which writes the files.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from moebench.errors import MoebenchError
from moebench.layout import ParallelLayout
from moebench.models import MoEShape
from moebench.quant import QuantScheme
from moebench.fileio import writing
from moebench.results import ResultRow, RunLock, RunStore, atomic_write_text, ensure_writable_dir, git_revision, new_run_id
from moebench.runtime.processes import start_worker, worker_context
from moebench.kernels.triton import configs as C
from moebench.tuning.files import TUNE_TOKENS_CUDA
from moebench.tuning.precompile import Precompiler
from moebench.sweep.cases import run_cases
from moebench.tuning.candidates import (
    Fatal,
    Timer,
    TuneRunner,
    answered,
    candidate_name,
    config_of,
    sweep_spec,
    verdict,
)
from moebench.tuning.search import STRATEGIES, run_search
from moebench.tuning.space import SPACE, Problem, PruneReport, full_space, key_str, prune, smem_limit
from moebench.tuning.spec import (  # noqa: F401  (re-exported: the tuner's API, as before)
    TuneSpec,
    file_shape,
    gemm1_config,
    quant_from_json,
    quant_to_json,
)
from moebench.kernels import tuned_files as TF

#: The run folder's candidate rows (worker N: candidates.wN.jsonl), and its settings.
CANDIDATES = "candidates.jsonl"
SETTINGS = "tune.json"
#: the lock a config file's writers take, in the file's folder (one merge at a time)
CONFIG_LOCK = ".moebench-configs.lock"


# ---------------------------------------------------------------------------------------------
# Settings of a run (TuneSpec itself: moebench.tuning.spec)


def _load_settings(run_dir: str | os.PathLike) -> dict[str, Any]:
    p = Path(run_dir) / SETTINGS
    if not p.is_file():
        raise MoebenchError(f"--resume {run_dir}: no {SETTINGS} there; pass the folder of an earlier `moebench tune` run")
    try:
        meta = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise MoebenchError(f"--resume {run_dir}: {SETTINGS} is not readable ({e})") from None
    if not isinstance(meta, dict):
        raise MoebenchError(f"--resume {run_dir}: {SETTINGS} is not readable (not a JSON object)")
    return meta


def load_run_spec(run_dir: str | os.PathLike) -> TuneSpec:
    """The settings of an earlier run folder (for --resume)."""
    try:
        return TuneSpec.from_json(_load_settings(run_dir)["spec"])
    except (KeyError, TypeError) as e:
        raise MoebenchError(f"--resume {run_dir}: {SETTINGS} is not readable ({e})") from None


def load_run_out_dir(run_dir: str | os.PathLike) -> Path | None:
    """The config-file folder (--out) an earlier run folder was started with; None for run folders
    written before it was saved."""
    out = _load_settings(run_dir).get("out_dir")
    return Path(out) if out else None


# ---------------------------------------------------------------------------------------------
# Triton's on-disk cache


class TritonCacheGuard:
    """Points TRITON_CACHE_DIR at `folder` (restored by `close`) and deletes the folder whenever
    it holds more than `limit_mb` (compiled kernels stay cached in the process's memory)."""

    def __init__(self, folder: str | os.PathLike, limit_mb: float = 256.0):
        self.folder = Path(folder)
        self.limit = int(limit_mb * 2**20)
        self.prunes = 0
        self._saved = os.environ.get("TRITON_CACHE_DIR")
        self.folder.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(self.folder)

    def size_bytes(self) -> int:
        total = 0
        for root, _, files in os.walk(self.folder):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
        return total

    def check(self) -> bool:
        """Delete the cache when over the limit; True when it did."""
        if self.size_bytes() <= self.limit:
            return False
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prunes += 1
        return True

    def close(self) -> None:
        if self._saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = self._saved


# ---------------------------------------------------------------------------------------------
# One token count


@dataclass
class TokenResult:
    """The outcome of one token count (a row of the report)."""

    tokens: int
    winner: dict[str, int] | None = None
    winner_us: float | None = None
    runner_up: dict[str, int] | None = None
    runner_up_us: float | None = None
    default: dict[str, int] | None = None
    default_us: float | None = None
    speedup: float | None = None  # default_us / winner_us
    candidates: int = 0  # distinct configs measured
    measured: int = 0  # measurements made by this process (a resumed run counts only its own)
    reused: int = 0  # measurements answered from the journal
    failed: int = 0
    wrong: int = 0
    search_s: float = 0.0  # device time of all measurements (journal included) + precompile_s
    precompiled: int = 0  # configs compiled by the --compile-workers processes before timing
    precompile_s: float = 0.0  # wall time spent waiting for them
    space_total: int = 0
    space_kept: int = 0
    pruned: dict[str, int] = field(default_factory=dict)
    worker: int = 0
    gemm1_source: str = ""  # --down runs: where GEMM1's config (= `default`) came from
    #: --against files: name -> {"config": the file's entry here, "us": its final-stage latency
    #: (None: it failed), "ratio": winner_us / us}
    against: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _space_for(spec: TuneSpec, tokens: int) -> PruneReport:
    space = dict(spec.space or SPACE)
    if spec.down:  # GEMM2 runs on GEMM1's alignment: its BLOCK_SIZE_M is GEMM1's
        space["BLOCK_SIZE_M"] = [gemm1_config(spec, tokens)[0]["BLOCK_SIZE_M"]]
    problem = Problem(
        tokens=tokens, num_experts=spec.shape.num_experts, local_experts=spec.local_experts, topk=spec.shape.topk,
        hidden=spec.shape.hidden, inter=spec.inter_per_rank, elem_bytes=spec.elem_bytes,
        smem_limit=smem_limit(spec.device), quant_block=spec.quant.block_shape if spec.quant else None,
        wq_group=spec.quant.group_size if spec.quant is not None and spec.quant.weight_only else None,
        block_m_fixed=spec.down,
    )
    return prune(full_space(space), problem)


def default_for(spec: TuneSpec, tokens: int) -> dict[str, int]:
    """The config a run without the tuned file uses at `tokens`: the default heuristic's (fitted
    to the fp8 scale block for block-quantised weights); for a `--down` run GEMM1's config, which
    GEMM2 runs with when there is no `_down.json` file; for an engine's kernel vLLM's default config."""
    if spec.down:
        return gemm1_config(spec, tokens)[0]
    if spec.kernel != "moebench":  # what the engine runs without a file
        from moebench.kernels.engine_configs import vllm_default_config

        return dict(vllm_default_config(tokens, spec.local_experts, spec.quant))
    return dict(C.heuristic_config(tokens, spec.shape.num_experts, spec.inter_per_rank, spec.shape.hidden,
                                   spec.shape.topk, spec.dtype, spec.quant))


def prune_counts(spec: TuneSpec) -> dict[int, PruneReport]:
    """The pruning of every token count of `spec` (nothing is measured)."""
    return {m: _space_for(spec, m) for m in spec.tokens}


class Candidates:
    """What a worker knows of the run's candidates: the rows of its run folder (every worker's
    file, read when it starts: a resumed run answers each candidate already there), indexed by
    (tokens, variant), and which configs were checked or failed at each token count."""

    def __init__(self, store: RunStore):
        self.store = store
        self.records: dict[tuple[int, str], ResultRow] = {}
        self._checked: set[tuple[int, str]] = set()
        self._verdict: dict[tuple[int, str], ResultRow] = {}
        for row in store.rows:
            if "config" in row.extra:
                self.index(row)

    def index(self, row: ResultRow) -> None:
        self.records[(int(row.tokens), row.variant)] = row
        ck = (int(row.tokens), key_str(config_of(row)))
        if row.extra.get("checked"):
            self._checked.add(ck)
        if verdict(row) != "ok":
            self._verdict.setdefault(ck, row)

    def get(self, tokens: int, cfg: Mapping[str, int], stage: str) -> ResultRow | None:
        return self.records.get((int(tokens), candidate_name(cfg, stage)))

    def checked(self, tokens: int, cfg: Mapping[str, int]) -> bool:
        return (int(tokens), key_str(cfg)) in self._checked

    def verdict(self, tokens: int, cfg: Mapping[str, int]) -> ResultRow | None:
        """An earlier failed / wrong candidate of this config at this token count."""
        return self._verdict.get((int(tokens), key_str(cfg)))


def candidates_file(worker: int) -> str:
    """The candidate rows file of worker N of a run folder."""
    return CANDIDATES if worker == 0 else CANDIDATES.replace(".jsonl", f".w{worker}.jsonl")


def run_worker(
    spec: TuneSpec,
    tokens: Sequence[int],
    run_dir: str | os.PathLike,
    worker: int = 0,
    device: str | None = None,
    timer: Timer | None = None,
    cache_limit_mb: float = 256.0,
    on_measure: Callable[[ResultRow], None] | None = None,
    on_tokens: Callable[[TokenResult], None] | None = None,
    compile_workers: int = 0,
    *,
    config_path: Path | None = None,
) -> list[TokenResult]:
    """Tune `tokens` (ascending) in this process on `device` (default spec.device): each batch of
    candidates is a run of the sweep loop (moebench.sweep.cases.run_cases) with the tuner's case
    runner (moebench.tuning.candidates.TuneRunner), its rows appended to this worker's file of the
    run folder as they are made. Returns one TokenResult per token count.
    compile_workers > 0: each batch of configs is first compiled by that many processes
    (moebench.tuning.precompile), then timed here. config_path: each token count's winner is
    merged into that file as soon as the count is done (`update_config_file`)."""
    device = device or spec.device
    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
    run_dir = Path(run_dir)
    known = Candidates(RunStore(run_dir, rows_file=candidates_file(worker)))
    guard = TritonCacheGuard(run_dir / "triton-cache" / f"w{worker}", cache_limit_mb)
    # started after the guard has set TRITON_CACHE_DIR, which the spawned workers inherit
    pre = Precompiler(spec, device, compile_workers) if compile_workers > 0 else None
    runner = TuneRunner(spec, device, timer, worker)
    reps, final_reps = spec.screen_reps()
    results: list[TokenResult] = []
    prev_top: list[dict[str, int]] = []
    since_check = 0
    try:
        for m_tokens in sorted(set(int(t) for t in tokens)):
            rep = _space_for(spec, m_tokens)
            default = default_for(spec, m_tokens)
            res = TokenResult(tokens=m_tokens, default=dict(default), space_total=rep.total,
                              space_kept=len(rep.kept), pruned=rep.pruned, worker=worker)
            if spec.down:
                res.gemm1_source = gemm1_config(spec, m_tokens)[1]
            compiled: set[str] = set()  # configs compiled at this token count (here or by `pre`)

            def prepare(cfgs, m_tokens=m_tokens, res=res, compiled=compiled):
                todo = [c for c in cfgs if key_str(c) not in compiled and known.verdict(m_tokens, c) is None]
                if todo:
                    guard.check()  # prune before, never between compiling a batch and timing it
                    t0 = time.perf_counter()
                    pre.compile(m_tokens, todo)
                    res.precompile_s += time.perf_counter() - t0
                    res.precompiled += len(todo)
                    compiled.update(key_str(c) for c in todo)

            def measured(row, res=res):
                nonlocal since_check
                known.index(row)
                res.measured += 1
                since_check += 1
                if since_check >= 16 and pre is None:  # with `pre`, `prepare` checks between batches
                    guard.check()
                    since_check = 0
                if on_measure is not None:
                    on_measure(row)

            def measure(cfgs, stage, n_reps, m_tokens=m_tokens, res=res, compiled=compiled):
                out: list[ResultRow | None] = []
                runner.batch = {}
                for cfg in cfgs:
                    compiled.add(key_str(cfg))
                    old = known.get(m_tokens, cfg, stage)
                    bad = known.verdict(m_tokens, cfg) if old is None else None
                    if old is not None:
                        res.reused += 1
                        out.append(old)
                    elif bad is not None:  # failed / wrong at this token count before: not again
                        out.append(answered(bad, cfg, stage))
                    else:
                        runner.batch[candidate_name(cfg, stage)] = (dict(cfg), stage, n_reps,
                                                                    not known.checked(m_tokens, cfg))
                        out.append(None)
                if runner.batch:
                    try:
                        rows = iter(run_cases(sweep_spec(spec, m_tokens, list(runner.batch)), known.store, runner,
                                              on_progress=measured))
                    except Fatal as f:
                        raise f.error from None
                    out = [r if r is not None else next(rows) for r in out]
                return out

            rng = random.Random(spec.seed * 1_000_003 + m_tokens)
            rivals = spec.rivals(m_tokens)
            sr = run_search(spec.strategy, rep.kept, measure, default=default, seeds=prev_top, budget=spec.budget,
                            rng=rng, reps=reps, final_reps=final_reps, prepare=prepare if pre is not None else None,
                            rivals=list(rivals.values()))
            ms = sr.measurements
            res.candidates = len({key_str(config_of(m)) for m in ms})
            res.failed = len({key_str(config_of(m)) for m in ms if verdict(m) == "failed"})
            res.wrong = len({key_str(config_of(m)) for m in ms if verdict(m) == "wrong"})
            res.search_s = sum(m.extra.get("elapsed_s", 0.0) for m in ms) + res.precompile_s
            if sr.winner is not None:
                res.winner, res.winner_us = config_of(sr.winner), sr.winner.latency_us
                prev_top = [config_of(m) for m in sr.final[:3]]
            if sr.runner_up is not None:
                res.runner_up, res.runner_up_us = config_of(sr.runner_up), sr.runner_up.latency_us
            dm = next((m for m in sr.final if key_str(config_of(m)) == key_str(default)), None)
            if dm is not None:
                res.default_us = dm.latency_us
                if res.winner_us:
                    res.speedup = res.default_us / res.winner_us
            final_us = {key_str(config_of(m)): m.latency_us for m in sr.final}
            for name, cfg in rivals.items():
                us = final_us.get(key_str(cfg))
                res.against[name] = {"config": key_str(cfg), "us": us,
                                     "ratio": round(res.winner_us / us, 4) if us and res.winner_us else None}
            results.append(res)
            if config_path is not None and res.winner is not None:
                update_config_file(spec, config_path, {m_tokens: res.winner}, run_dir)
            guard.check()
            since_check = 0
            if on_tokens is not None:
                on_tokens(res)
            runner.release()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if pre is not None:
            pre.close()
        guard.close()
    return results


def _worker_process(spec_json: dict[str, Any], tokens: list[int], run_dir: str, worker: int, device: str,
                    cache_limit_mb: float, compile_workers: int = 0,
                    config_path: str | None = None) -> list[dict[str, Any]]:
    """Entry point of a worker process (module level, picklable arguments; `start_worker` ran first)."""
    spec = TuneSpec.from_json(spec_json)
    return [r.as_dict() for r in run_worker(spec, tokens, run_dir, worker, device, cache_limit_mb=cache_limit_mb,
                                            compile_workers=compile_workers,
                                            config_path=None if config_path is None else Path(config_path))]


def split_tokens(tokens: Sequence[int], n: int) -> list[list[int]]:
    """Contiguous chunks of the ascending token counts, sizes differing by at most one; never
    more chunks than counts."""
    toks = sorted(set(tokens))
    n = max(1, min(n, len(toks)))
    base, rem = divmod(len(toks), n)
    out, i = [], 0
    for w in range(n):
        size = base + (1 if w < rem else 0)
        out.append(toks[i : i + size])
        i += size
    return out


def resolve_gpus(gpus: str | Sequence[int] | None, device: str) -> list[int]:
    """'all' | '0,1' | [0, 1] | None -> GPU indices (CUDA); on CPU, the list only sets how many
    worker processes run (None or 'all' = one, in this process)."""
    if isinstance(gpus, str):
        text = gpus.strip().lower()
        if text in ("", "all"):
            gpus = None
        else:
            try:
                gpus = [int(g) for g in text.split(",") if g.strip()]
            except ValueError:
                raise MoebenchError(f"--gpus {gpus!r}: give 'all' or a comma list of GPU indices like 0,1") from None
            if not gpus:
                raise MoebenchError("--gpus is empty: give 'all' or a comma list like 0,1")
    if torch.device(device).type == "cuda":
        have = torch.cuda.device_count()
        if gpus is None:
            return list(range(max(have, 1)))
        bad = [g for g in gpus if g < 0 or g >= have]
        if bad:
            raise MoebenchError(f"--gpus: GPU {bad[0]} is not visible here ({have} visible: 0..{have - 1})")
        if len(set(gpus)) != len(gpus):
            raise MoebenchError(f"--gpus lists a GPU twice: {','.join(map(str, gpus))}")
        return list(gpus)
    if gpus is None:
        return [0]
    return list(range(len(gpus)))


# ---------------------------------------------------------------------------------------------
# The whole run


@dataclass
class TuneOutcome:
    run_dir: Path
    config_path: Path | None
    results: list[TokenResult]
    spec: TuneSpec
    files: list[Path] = field(default_factory=list)
    is_main: bool = True  # False on torchrun ranks other than 0 (they write nothing)


def _validate(spec: TuneSpec, plan_only: bool = False) -> str | None:
    """Refuse a spec that cannot be tuned (a one-line MoebenchError). plan_only (a dry run, which
    measures nothing): experts that cannot run on this machine are not an error; the reason is
    returned instead (None: they can run here)."""
    if spec.strategy not in STRATEGIES:
        raise MoebenchError(f"--search {spec.strategy!r}: use one of {', '.join(STRATEGIES)}")
    if spec.budget is not None and spec.budget < 1:
        raise MoebenchError(f"--budget must be >= 1, got {spec.budget}")
    if not spec.tokens or any(t < 1 for t in spec.tokens):
        raise MoebenchError("--tokens: tuning needs token counts >= 1, e.g. 1,16,64")
    spec.layout.validate_shape(spec.shape.num_experts, spec.shape.intermediate)
    if spec.space is not None:
        for k, vals in spec.space.items():
            if k not in SPACE or not vals:
                raise MoebenchError(f"search space: unknown parameter or empty list {k!r}")
    from moebench.kernels.tuned_files import KERNELS
    from moebench.backends import check_combination

    if spec.kernel not in KERNELS:
        raise MoebenchError(f"the tune's kernel '{spec.kernel}' is none of {', '.join(KERNELS)}")
    if spec.down and spec.kernel != "moebench":
        raise MoebenchError(f"--down tunes moebench's own GEMM2 file; --kernel {spec.kernel} runs one config for both GEMMs")
    dev_type = torch.device(spec.device).type
    what = spec.quant.describe() if spec.quant is not None else f"the {spec.experts} experts ({spec.precision})"
    # what the experts declare (dtypes, schemes) holds on any machine, a dry run's included
    declared = check_combination("no-dpep", spec.experts, dev_type, spec.dtype, quant=spec.quant,
                                 experts_modeled=torch.cuda.get_device_name() if torch.cuda.is_available() else "H100")
    if declared is not None:
        raise MoebenchError(f"cannot tune {what} for --kernel {spec.kernel}: {declared}")
    reason = check_combination("no-dpep", spec.experts, dev_type, spec.dtype, quant=spec.quant)
    if reason is not None:  # the reason `sweep` gives for these experts (e.g. no GPU, no interpreter)
        why = f"cannot tune {what} for --kernel {spec.kernel} on {dev_type}: {reason}"
        if plan_only:
            return why
        raise MoebenchError(why)
    return None


def tune(
    spec: TuneSpec,
    *,
    out_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    gpus: str | Sequence[int] | None = None,
    run_dir: str | os.PathLike | None = None,
    results_dir: str | os.PathLike = "results",
    timer: Timer | None = None,
    cache_limit_mb: float = 256.0,
    on_measure: Callable[[ResultRow], None] | None = None,
    on_tokens: Callable[[TokenResult], None] | None = None,
    compile_workers: int = 0,
) -> TuneOutcome:
    """Tune the tile config of the experts `spec` times (TuneSpec: shape, layout, token counts,
    precision, search, kernel) on rank 0 of its layout (N = I/tp, E = local experts under EP) at
    each token count; write the config file and the report.

    resume: an earlier run folder (its settings must match; the candidates it holds are not
    measured again). gpus: 'all', '0,1' or indices; several -> one spawned worker per GPU. timer /
    on_measure (each candidate row measured) / on_tokens only reach an in-process worker.
    compile_workers: processes per tuning worker that compile each batch of configs before it is
    timed (moebench.tuning.precompile; 0 = compile while timing). out_dir None: results/configs
    (engines: results/configs/vllm, results/configs/sglang/triton_X_Y_Z), or on `resume` the folder
    saved in the run's tune.json. The folder is checked before anything is measured and the file
    is updated as each token count finishes. One writer holds the run folder (results.RunLock) for
    the whole run. Returns the run folder, the config file (None on ranks other than 0) and one
    TokenResult per token count.
    """
    spec = dataclasses.replace(spec, tokens=sorted(set(int(t) for t in spec.tokens)))
    shape, device = spec.shape, spec.device
    _validate(spec)
    if resume is not None:
        run_dir = Path(resume)
        saved = load_run_spec(run_dir)
        if saved.identity() != spec.identity():
            diff = [k for k in spec.identity() if spec.identity()[k] != saved.identity()[k]]
            raise MoebenchError(f"--resume {run_dir}: this run differs from the saved one in {', '.join(diff)}; "
                                f"resume with the same settings (or none: they are read from {SETTINGS})")
        if out_dir is None:
            out_dir = load_run_out_dir(run_dir)
    config_path = config_path_for(spec, out_dir)
    from moebench.runtime.distributed import join_torchrun

    ctx = join_torchrun()  # None outside torchrun
    main = ctx is None or ctx.rank == 0
    if main:  # before the first measurement: a folder the file cannot go to fails now, not after the search
        ensure_writable_dir(config_path.parent)
        if spec.kernel == "moebench":  # the routing the file's token keys will mean (configs module docstring)
            TF.claim_tuned_routing(config_path, shape.num_experts, shape.topk)
    if resume is None:
        if run_dir is None and main:
            run_dir = ensure_writable_dir(Path(results_dir)) / new_run_id("tune", shape.name)
        if ctx is not None and ctx.world_size > 1:  # every rank journals into rank 0's folder name
            import torch.distributed as dist

            box = [str(run_dir) if main else None]
            dist.broadcast_object_list(box, src=0, group=ctx.group)
            run_dir = box[0]
        run_dir = Path(run_dir)
    lock = RunLock(ensure_writable_dir(run_dir)).acquire() if main else None  # one writer per run folder
    try:
        return _tune_in(spec, run_dir, config_path, ctx, gpus, timer, cache_limit_mb, on_measure, on_tokens,
                        compile_workers)
    finally:
        if lock is not None:
            lock.release()


def _tune_in(spec: TuneSpec, run_dir: Path, config_path: Path, ctx, gpus, timer, cache_limit_mb, on_measure,
             on_tokens, compile_workers) -> TuneOutcome:
    """The tune of `spec` in its run folder (locked by this process when it writes it)."""
    from moebench.runtime.distributed import leave_torchrun

    device = spec.device
    main = ctx is None or ctx.rank == 0
    if main:
        if not (run_dir / SETTINGS).exists():
            from moebench.bench.hardware import device_summary

            meta = {"spec": spec.to_json(), "kernel": spec.kernel, "timed": spec.timed_text,
                    "out_dir": str(config_path.parent.resolve()), "argv": sys.argv[1:],
                    "git_revision": git_revision(),
                    "device_summary": device_summary(device),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
            atomic_write_text(run_dir / SETTINGS, json.dumps(meta, indent=2, default=str))

    if ctx is not None and ctx.world_size > 1:
        results = _run_torchrun(spec, run_dir, ctx, cache_limit_mb, timer, on_measure, on_tokens, compile_workers,
                                config_path if main else None)
        if not main:
            leave_torchrun(ctx)  # waits for rank 0's files, so no rank exits holding the group
            return TuneOutcome(run_dir, None, results, spec, is_main=False)
    else:
        slots = resolve_gpus(gpus, device)
        chunks = split_tokens(spec.tokens, len(slots))
        if len(chunks) == 1:
            dev = f"cuda:{slots[0]}" if torch.device(device).type == "cuda" else device
            results = run_worker(spec, chunks[0], run_dir, 0, dev, timer, cache_limit_mb, on_measure, on_tokens,
                                 compile_workers, config_path=config_path)
        else:
            results = _run_pool(spec, run_dir, slots, chunks, device, cache_limit_mb, on_tokens, compile_workers,
                                config_path)
    results.sort(key=lambda r: r.tokens)
    config_path = write_results(spec, results, config_path.parent, run_dir)
    files = write_report(run_dir, spec, results, config_path)
    files.append(write_metadata(run_dir, spec, config_path))
    if ctx is not None and ctx.world_size > 1:
        leave_torchrun(ctx)
    return TuneOutcome(run_dir, config_path, results, spec, files)


def _run_pool(spec: TuneSpec, run_dir: Path, slots: list[int], chunks: list[list[int]], device: str,
              cache_limit_mb: float, on_tokens: Callable[[TokenResult], None] | None,
              compile_workers: int = 0, config_path: Path | None = None) -> list[TokenResult]:
    """One worker process per chunk (chunk i on GPU slots[i]); results gathered here."""
    cuda = torch.device(device).type == "cuda"
    results: list[TokenResult] = []
    with ProcessPoolExecutor(max_workers=len(chunks), mp_context=worker_context(__name__), initializer=start_worker,
                             initargs=(dict(os.environ),)) as pool:
        futs = {
            pool.submit(_worker_process, spec.to_json(), chunk, str(run_dir), w,
                        f"cuda:{slots[w]}" if cuda else device, cache_limit_mb, compile_workers,
                        None if config_path is None else str(config_path)): w
            for w, chunk in enumerate(chunks)
        }
        try:
            for fut, w in futs.items():
                try:
                    rows = fut.result()
                except MoebenchError:
                    raise
                except Exception as e:  # noqa: BLE001 - a worker's crash, named
                    raise MoebenchError(f"tuning worker {w} (tokens {chunks[w]}) failed: {type(e).__name__}: {e}; "
                                        f"finished measurements are kept, continue with --resume {run_dir}") from None
                for r in rows:
                    tr = TokenResult(**r)
                    results.append(tr)
                    if on_tokens is not None:
                        on_tokens(tr)
        except BaseException:
            for f in futs:
                f.cancel()
            raise
    return results


def _run_torchrun(spec, run_dir, ctx, cache_limit_mb, timer, on_measure, on_tokens,
                  compile_workers: int = 0, config_path: Path | None = None) -> list[TokenResult]:
    """This rank's chunk of token counts, then every rank's results gathered on rank 0 (config_path:
    rank 0's file, updated as its own token counts finish; the others' land in it at the end)."""
    import torch.distributed as dist

    chunks = split_tokens(spec.tokens, ctx.world_size)
    mine = chunks[ctx.rank] if ctx.rank < len(chunks) else []
    ensure_writable_dir(run_dir)
    rows = [r.as_dict() for r in run_worker(spec, mine, run_dir, ctx.rank, str(ctx.device), timer, cache_limit_mb,
                                            on_measure, on_tokens, compile_workers, config_path=config_path)]
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(rows, gathered, dst=0, group=ctx.group)
    if ctx.rank != 0:
        return [TokenResult(**r) for r in rows]
    return [TokenResult(**r) for part in gathered or [] for r in (part or [])]


# ---------------------------------------------------------------------------------------------
# Outputs


def deploy_layout(name: str) -> tuple[ParallelLayout, str]:
    """'tp8' / 'ep8' / 'tp1' (a preset's `deploy` entry) -> (layout, the `moebench tune` flags)."""
    m = re.fullmatch(r"(tp|ep)(\d+)", name)
    if m is None:
        raise MoebenchError(f"deploy layout {name!r}: expected tpN or epN, e.g. tp8")
    n = int(m[2])
    if m[1] == "ep":
        return ParallelLayout.from_args(None, None, n), f"--ep {n}"
    return ParallelLayout.from_args(n, None, None), "" if n == 1 else f"--tp {n}"


def config_path_for(spec: TuneSpec, out_dir: str | os.PathLike | None = None, device_name: str | None = None) -> Path:
    """Where the tuned file goes: out_dir (default: the kernel's folder under results/configs,
    `tuned_files.default_out_dir`) / the name the kernel's lookup reads (`tuned_files.file_name`:
    moebench's E=..,N=..,device_name=..[,dtype=..][,block_shape=[bn,bk]][,per_channel_quant=True][_down].json,
    an engine's own). device_name: the name's device part (default: the device's own name)."""
    folder = Path(out_dir) if out_dir is not None else TF.default_out_dir(spec.kernel)
    return folder / TF.file_name(spec.kernel, spec.local_experts, spec.inter_per_rank,
                                 device_name or TF.device_name(spec.device), spec.dtype, spec.quant, spec.down)


def update_config_file(spec: TuneSpec, path: Path, entries: Mapping[int, Mapping[str, int]],
                       run_dir: str | os.PathLike | None = None) -> Path:
    """Merge `entries` into the config file at `path` in the kernel's format (`tuned_files.merge`:
    atomic rename; moebench's refused for a file of another scheme). With `run_dir`, under an
    exclusive lock on CONFIG_LOCK in the file's folder, so neither the workers of one run nor two
    runs writing one folder at once drop each other's entries."""
    merge = lambda: TF.merge(spec.kernel, path, entries, spec.dtype, spec.quant)  # noqa: E731
    if run_dir is None:
        return merge()
    import fcntl

    # the lock lives beside the file: two tunes writing into one folder at once never drop each
    # other's entries (nor do the workers of one run)
    with writing(path.parent), open(path.parent / CONFIG_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return merge()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_results(spec: TuneSpec, results: Sequence[TokenResult], out_dir: str | os.PathLike | None = None,
                  run_dir: str | os.PathLike | None = None) -> Path | None:
    """Write the winners as the vLLM file (merged into an existing file's other token counts).
    None when no token count found a working config."""
    table = {r.tokens: r.winner for r in results if r.winner is not None}
    if not table:
        return None
    path = config_path_for(spec, out_dir)
    ensure_writable_dir(path.parent)
    return update_config_file(spec, path, table, run_dir)


REPORT_COLUMNS = ["tokens", "winner", "winner_us", "runner_up", "runner_up_us", "default", "default_us", "speedup",
                  "candidates", "failed", "wrong", "measured", "reused", "search_s", "space_kept", "space_total",
                  "pruned", "worker", "against"]


def _fmt_cfg(cfg: Mapping[str, int] | None) -> str:
    return key_str(cfg) if cfg else "-"


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def report_rows(results: Sequence[TokenResult]) -> list[dict[str, str]]:
    """Text cells of the report, one dict per token count (REPORT_COLUMNS)."""
    rows = []
    for r in results:
        rows.append({
            "tokens": str(r.tokens), "winner": _fmt_cfg(r.winner), "winner_us": _fmt(r.winner_us),
            "runner_up": _fmt_cfg(r.runner_up), "runner_up_us": _fmt(r.runner_up_us), "default": _fmt_cfg(r.default),
            "default_us": _fmt(r.default_us), "speedup": _fmt(r.speedup, 3), "candidates": str(r.candidates),
            "failed": str(r.failed), "wrong": str(r.wrong), "measured": str(r.measured), "reused": str(r.reused),
            "search_s": _fmt(r.search_s), "space_kept": str(r.space_kept), "space_total": str(r.space_total),
            "pruned": "; ".join(f"{k}: {v}" for k, v in sorted(r.pruned.items())), "worker": str(r.worker),
            "against": "; ".join(f"{name} {a['config']} {_fmt(a['us'])} us (winner / file {_fmt(a['ratio'], 3)})"
                                 for name, a in r.against.items()) or "-",
        })
    return rows


def write_report(run_dir: Path, spec: TuneSpec, results: Sequence[TokenResult], config_path: Path | None) -> list[Path]:
    """report.csv and report.md in the run folder (atomic renames)."""
    rows = report_rows(results)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=REPORT_COLUMNS)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(run_dir / "report.csv", buf.getvalue())
    s = spec.shape
    cpu_note = ("\n\nTimes are CPU / Triton-interpreter wall clock: they test the plumbing, not kernel speed.\n"
                if torch.device(spec.device).type != "cuda" else "\n")
    md = [
        f"# moebench tune: {s.name} (E={s.num_experts}, topk={s.topk}, H={s.hidden}, I={s.intermediate}), "
        f"{spec.layout.describe()}",
        "",
        f"- file: `{config_path}`" if config_path else "- file: none (no token count found a working config)",
        f"- tuned for kernel `{spec.kernel}`: timed {spec.timed_text}"
        + ("" if spec.kernel == "moebench" else f"; the file is for {spec.kernel}'s fused-MoE Triton kernel, "
           "not for moebench's `triton` experts"),
        f"- E={spec.local_experts} local experts, N={spec.inter_per_rank}, dtype {spec.precision}, "
        f"device {TF.device_name(spec.device)}, search `{spec.strategy}`, budget {spec.budget or 'auto (5% of the pruned space, 6-48 configs)'}",
        *(["- GEMM2's own configs (`--down`): each token count's search keeps GEMM1's config fixed (column "
            "`default`, which GEMM2 also runs with when there is no `_down.json` file; from: "
            + "; ".join(sorted({r.gemm1_source for r in results if r.gemm1_source})) + ") and varies GEMM2's, "
            "at GEMM1's BLOCK_SIZE_M"] if spec.down else []),
        *([f"- against (`--against`): {', '.join(f'`{n}`' for n in spec.against)}: at each token count the file's "
           "nearest entry seeded the search and ran in the final stage beside the winner; " + against_summary(results)]
          if spec.against else []),
        "- latencies: median us of one layer call (routing alignment + both GEMMs), final stage" + cpu_note,
    ]
    cols = REPORT_COLUMNS[:10] + ["search_s"] + (["against"] if spec.against else [])
    md += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        md.append("| " + " | ".join(r[c] for c in cols) + " |")
    atomic_write_text(run_dir / "report.md", "\n".join(md) + "\n")
    return [run_dir / "report.csv", run_dir / "report.md"]


def against_summary(results: Sequence[TokenResult]) -> str:
    """'winner / `<name>`: median 0.962, max 1.000 over 18 token counts' for each --against file."""
    import statistics

    parts = []
    names = sorted({n for r in results for n in r.against})
    for name in names:
        ratios = [r.against[name]["ratio"] for r in results if name in r.against and r.against[name]["ratio"]]
        if ratios:
            parts.append(f"winner / `{name}`: median {statistics.median(ratios):.3f}, max {max(ratios):.3f} "
                         f"over {len(ratios)} token counts")
        else:
            parts.append(f"`{name}`: no entry ran")
    return "; ".join(parts)


def write_metadata(run_dir: Path, spec: TuneSpec, config_path: Path | None) -> Path:
    """metadata.json of the run folder: which kernel the file is for and what was timed."""
    import triton

    meta = {"command": "tune", "kernel": spec.kernel, "experts": spec.experts, "timed": spec.timed_text,
            "config_file": str(Path(config_path).resolve()) if config_path else None, "triton_version": triton.__version__,
            "torch_version": torch.__version__, "device": TF.device_name(spec.device), "precision": spec.precision,
            "git_revision": git_revision(), "spec": spec.to_json()}
    p = Path(run_dir) / "metadata.json"
    atomic_write_text(p, json.dumps(meta, indent=2, default=str) + "\n")
    return p


def report_table(results: Sequence[TokenResult], title: str = "tuning report"):
    """The report as a moebench.report.TextTable (winner, runner-up, default, speed-up per token
    count): printed whole, the columns of least use left out first where the console is narrow."""
    from moebench.report import Column, TextTable

    rows = report_rows(results)

    def col(key, header, right=True, **kw):
        return Column(key, header, [r[key] for r in rows], right=right, **kw)

    cols = [col("tokens", "tokens"), col("winner", "winner", right=False), col("winner_us", "winner\nus"),
            col("runner_up", "runner-up", right=False, group="runner-up", drop=40),
            col("runner_up_us", "runner-up\nus", group="runner-up", drop=40, name="runner-up us"),
            col("default_us", "default\nus"), col("speedup", "speed-up\nx"),
            col("candidates", "tried", drop=60), col("failed", "failed", drop=50),
            col("search_s", "search\ns", drop=70)]
    if any(r.against for r in results):
        cols.append(Column("against", "winner\n/ file", [" ".join(_fmt(a["ratio"], 3) for a in r.against.values()) or "-"
                                                         for r in results]))
    return TextTable(title, cols)


def deploy_coverage(device_name: str) -> list[dict]:
    """For every preset model and each of its usual layouts (`MoEShape.deploy`): the bf16 file a
    rank looks up on `device_name` and where it is found along the lookup order (None: missing)."""
    from moebench.models import PRESETS

    rows = []
    for shape in PRESETS.values():
        for name in shape.deploy:
            layout, flags = deploy_layout(name)
            e, n = file_shape(shape, layout)
            found = TF.find_config_file(e, n, device_name)
            counts = sorted(TF.load_config_file(found)) if found else []
            rows.append({"model": shape.name, "layout": name, "tune_flags": flags, "E": e, "N": n,
                         "file": TF.config_file_name(e, n, device_name), "found": str(found.parent) if found else None,
                         "token_counts": counts, "missing_counts": [t for t in TUNE_TOKENS_CUDA if t not in counts]})
    return rows
