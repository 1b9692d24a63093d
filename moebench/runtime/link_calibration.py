"""Measure the link the cost model uses: all-to-all between real ranks (NCCL on GPUs, gloo on CPU).

Each rank sends `nbytes / world` to every peer with `all_to_all_single`, between barriers; the
slowest rank's median time gives the bandwidth (bytes one rank sends to its peers / time, GB/s per
direction per GPU, the unit of LinkProfile) and a tiny message gives the per-step latency.
The result goes to the file `moebench.runtime.simulate.measured_link` reads, so later simulated
runs use it instead of a datasheet profile (`choose_link`: override > measurement > profile).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from moebench.runtime.distributed import RankContext, barrier, spawn
from moebench.runtime.simulate import LinkProfile


def _time_a2a(ctx: RankContext, nbytes: int, reps: int) -> float:
    """Median over reps of the slowest rank's all-to-all time, in microseconds."""
    world = ctx.world_size
    per_peer = max(1, nbytes // (world * 2))  # bf16 elements per peer
    send = torch.randn(per_peer * world, device=ctx.device).to(torch.bfloat16)
    recv = torch.empty_like(send)
    cuda = ctx.device.type == "cuda"
    samples = []
    for i in range(reps + 2):
        barrier(ctx)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, group=ctx.group)
        if cuda:
            torch.cuda.synchronize(ctx.device)
        us = torch.tensor([(time.perf_counter() - t0) * 1e6], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(us, op=dist.ReduceOp.MAX, group=ctx.group)
        if i >= 2:  # the first calls set up connections
            samples.append(float(us.item()))
    return statistics.median(samples)


def _measure_on_rank(ctx: RankContext, big_bytes: int, reps: int) -> dict:
    latency = _time_a2a(ctx, 64 * ctx.world_size, reps)
    big = _time_a2a(ctx, big_bytes, reps)
    world = ctx.world_size
    sent = (big_bytes // (world * 2)) * 2 * (world - 1)  # bytes one rank sends to its peers
    bw = sent / max(big - latency, 1e-3) / 1e3  # GB/s
    return {"bandwidth_gbps": bw, "latency_us": latency, "big_us": big, "sent_bytes": sent}


def measure_link(world_size: int, device: str, big_bytes: int = 256 << 20, reps: int = 10) -> tuple[LinkProfile, dict]:
    """Spawn `world_size` ranks and measure; returns the profile and the raw figures."""
    res = spawn(_measure_on_rank, world_size, device, big_bytes, reps)[0]
    backend = "nccl" if device == "cuda" else "gloo"
    name = f"measured-{backend}-{world_size}ranks"
    return LinkProfile(name, round(res["bandwidth_gbps"], 2), round(res["latency_us"], 2), source="measured"), res
