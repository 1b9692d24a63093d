"""Timers. GPU: warm up, capture in a CUDA graph, time replays with CUDA events (median, p10,
p90). CPU: wall clock, median of repeats; such times test plumbing, not kernel speed."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    reps: int
    method: str  # "cuda-graph", "cuda-events", "cpu-wallclock"


def summarize(samples_us: list[float], method: str) -> Timing:
    """Median, p10 and p90 of `samples_us` (the nearest sample at each quantile)."""
    s = sorted(samples_us)
    q = lambda f: s[min(len(s) - 1, int(round(f * (len(s) - 1))))]  # noqa: E731
    return Timing(statistics.median(s), q(0.10), q(0.90), len(s), method)


def time_cpu(fn: Callable[[], object], warmup: int = 1, reps: int = 5) -> Timing:
    """Wall-clock median of `reps` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return summarize(samples, "cpu-wallclock")


def time_cuda(
    fn: Callable[[], object],
    warmup: int = 3,
    reps: int = 50,
    use_graph: bool = True,
    graph_calls: int = 10,
    before_each: Callable[[], object] | None = None,
) -> Timing:
    """Median/p10/p90 of one call of `fn`, in microseconds.

    With use_graph, `graph_calls` calls are captured in one CUDA graph and each replay is timed
    with events (time / graph_calls per sample). `before_each` (e.g. fresh routing, an L2 flush)
    is captured before every call inside the graph, so it must be timed separately by the caller
    if it should not count; without a graph it runs outside the timed region.
    If capture fails (a backend that syncs with the host), falls back to events around eager
    calls and says so in `method`.
    """
    for _ in range(warmup):
        if before_each is not None:
            before_each()
        fn()
    torch.cuda.synchronize()
    if use_graph:
        try:
            return _time_graph(fn, reps, graph_calls, before_each)
        except RuntimeError:
            torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return summarize(samples, "cuda-events")


def capture_graph(fn: Callable[[], object]) -> tuple["torch.cuda.CUDAGraph", object]:
    """One warm-up call of `fn` on a side stream, then one call captured in a CUDA graph.
    Returns (graph, what the captured call returned): replaying the graph rewrites that output
    from the current contents of the captured inputs."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _time_graph(fn, reps, graph_calls, before_each) -> Timing:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(graph_calls):
                if before_each is not None:
                    before_each()
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / graph_calls)
    del graph
    return summarize(samples, "cuda-graph")


def time_fn(fn: Callable[[], object], device: str, **kw) -> Timing:
    """Dispatch to the CUDA or CPU timer by device name."""
    if device == "cuda":
        return time_cuda(fn, **kw)
    return time_cpu(fn, **{k: v for k, v in kw.items() if k in ("warmup", "reps")})
