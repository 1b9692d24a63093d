"""Compile a batch of candidate tile configs in parallel before they are timed
(`moebench tune --compile-workers N`).

Most of a candidate's cost in a tune is compiling GEMM1 and GEMM2 for its config (PERF.md
section 6), and the timing process compiles one config after another. A `Precompiler` keeps N
worker processes on the same device; for each config of a batch one of them runs the layer once,
on inputs of the same shapes and dtypes as the timing process's, which makes Triton compile the
kernels into its on-disk cache (TRITON_CACHE_DIR, which the tuner points at the run folder before
the workers start, so they share it). The timing process then loads them from that cache instead
of compiling. The workers time nothing and run only between measurements: the tuner hands them a
batch and waits for it before timing any of it. A config that fails in a worker is measured, and
recorded as failed, by the timing process as usual. On a CPU (Triton's interpreter compiles
nothing) the workers only repeat work; the option is for GPUs.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Mapping, Sequence

import torch

from moebench.runtime.processes import start_worker, worker_context

_STATE: dict[str, Any] = {}


def _init(spec_json: dict[str, Any], device: str, environ: dict[str, str]) -> None:
    """Worker start: the caller's environment (its TRITON_CACHE_DIR above all), the tuning
    settings and device; weights are built on first use."""
    from moebench.tuning.spec import TuneSpec

    start_worker(environ)
    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
    _STATE.update(spec=TuneSpec.from_json(spec_json), device=device, runner=None)


def _compile_one(task: tuple[int, dict[str, int]]) -> str:
    """Run the layer once with config `cfg` at `tokens`: 'ok', or the one-line error."""
    from moebench.errors import one_line
    from moebench.tuning.candidates import TuneRunner

    tokens, cfg = task
    spec, device = _STATE["spec"], _STATE["device"]
    try:
        runner = _STATE["runner"]
        if runner is None:
            _STATE["runner"] = runner = TuneRunner(spec, device, n_routings=1)
            runner.weights()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()  # the build's temporaries: N workers share one GPU
        runner.run_once(tokens, cfg)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the timing process measures and records the failure
        return one_line(e)


class Precompiler:
    """`workers` worker processes on `device` that compile configs for the run `spec`
    (a moebench.tuning.spec.TuneSpec). Use as a context manager, or call `close`."""

    def __init__(self, spec, device: str, workers: int):
        if workers < 1:
            raise ValueError("Precompiler needs at least one worker")
        self.workers = workers
        self._pool = ProcessPoolExecutor(workers, mp_context=worker_context(__name__), initializer=_init,
                                         initargs=(spec.to_json(), device, dict(os.environ)))

    def compile(self, tokens: int, cfgs: Sequence[Mapping[str, int]]) -> list[str]:
        """Compile every config at `tokens`; returns 'ok' or the error per config, in order.
        When a worker dies (killed, most often for memory: each holds the layer's weights), the
        pool stops for the rest of the run, with one warning on stderr, and the timing process
        compiles what it times itself."""
        if self._pool is None:
            return ["not compiled: no compile workers"] * len(cfgs)
        try:
            return list(self._pool.map(_compile_one, [(int(tokens), dict(c)) for c in cfgs]))
        except BrokenProcessPool:
            self.close()
            print(f"warning: a compile worker died (out of memory with {self.workers} workers holding the "
                  "layer's weights?); compiling in the timing process from here (fewer --compile-workers "
                  "avoids it)", file=sys.stderr, flush=True)
            return ["not compiled: the compile workers stopped"] * len(cfgs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "Precompiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
