"""Measure the transports of the communication model on real ranks (NCCL on GPUs, gloo on CPU).

`moebench env --calibrate-link` sweeps message sizes for every transport moebench can run here and
fits the model's alpha + bytes / bandwidth to each (least squares on relative error):

    nccl-all-reduce:all-reduce   dist.all_reduce of S bytes; bytes = 2 (T-1)/T x S per rank (ring bus bytes)
    nccl-all-to-all:all-to-all   dist.all_to_all_single of S bytes per rank; bytes = (T-1)/T x S sent to peers
    <transport>:dispatch / :combine   every prepare/finalize with a dispatch and a combine that runs
        here (all2all-ll over nccl-all-to-all, DeepEP's where deep_ep runs): its prepare / finalize of
        M tokens per rank, keyed by the transport it declares, the declared calls included

For the dispatch / combine pairs, bytes are the slowest rank's remote rows x row bytes under the
sweep's uniform routing, counted by the same function the model uses (moebench.comm.traffic),
so a fit plugs straight back into the model. Each sample is the slowest rank's time (max over
ranks) between barriers; the median over repetitions is kept.

The result goes to the file `links.measured_link` / `measured_fits` read
($MOEBENCH_LINK_FILE, default results/calibration/link.json), keyed by device name: later simulated
runs on the same GPUs use the measured fits for the NVLink part of those transports (RDMA, which
one node cannot show, stays the published fit's). The file keeps the first calibration's keys
(`bandwidth_gbps`, `latency_us`: the all-to-all fit) for older readers.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from moebench.comm.links import LinkProfile
from moebench.layout import ParallelLayout, token_split
from moebench.runtime.distributed import RankContext, barrier, spawn

#: message sizes (bytes per rank) of the collective sweeps
SIZES = {"cuda": [1 << k for k in range(12, 28, 2)], "cpu": [1 << k for k in range(10, 19, 2)]}
#: tokens per rank of the dispatch / combine sweeps, and their shape
TOKENS = {"cuda": [1, 4, 16, 64, 128], "cpu": [1, 4, 16]}
SHAPE = {"cuda": {"hidden": 7168, "topk": 8, "experts_per_rank": 32}, "cpu": {"hidden": 64, "topk": 2, "experts_per_rank": 2}}


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(bytes, us) points -> (alpha_us, gbps, worst ratio measured / fitted), alpha >= 0, gbps > 0."""
    b = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    a_mat = np.stack([1 / t, b / t], axis=1)
    alpha, x = np.linalg.lstsq(a_mat, np.ones_like(t), rcond=None)[0]
    if alpha < 0:  # no fixed cost visible: bandwidth only
        alpha = 0.0
        x = float((b / t).sum() / ((b / t) ** 2).sum())
    if x <= 0:  # larger messages were not slower (noise): best effective bandwidth seen, then alpha
        x = 1.0 / float((b / t).max())
        alpha = max(0.0, float(np.median(t - x * b)))
    model = alpha + x * b
    ratios = t / model
    worst = float(ratios[np.argmax(np.maximum(ratios, 1 / ratios))])
    return float(alpha), float(1.0 / x / 1e3), worst


def _timed(ctx: RankContext, fn, reps: int) -> float:
    """Median over reps of the slowest rank's time of fn() (us); two warm-up calls first."""
    cuda = ctx.device.type == "cuda"
    samples = []
    for i in range(reps + 2):
        barrier(ctx)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(ctx.device)
        us = torch.tensor([(time.perf_counter() - t0) * 1e6], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(us, op=dist.ReduceOp.MAX, group=ctx.group)
        if i >= 2:  # the first calls set up connections
            samples.append(float(us.item()))
    return statistics.median(samples)


def _collectives(ctx: RankContext, sizes: list[int], reps: int) -> dict[str, list[tuple[float, float]]]:
    w = ctx.world_size
    ar, a2a = [], []
    for size in sizes:
        n = max(w, size // 2 // w * w)  # bf16 elements, a multiple of the world
        x = torch.randn(n, device=ctx.device).to(torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
        nbytes = x.numel() * x.element_size()
        ar.append((2 * (w - 1) / w * nbytes, _timed(ctx, lambda: dist.all_reduce(x, group=ctx.group), reps)))
        out = torch.empty_like(x)
        a2a.append(((w - 1) / w * nbytes, _timed(ctx, lambda: dist.all_to_all_single(out, x, group=ctx.group), reps)))
    return {"nccl-all-reduce:all-reduce": ar, "nccl-all-to-all:all-to-all": a2a}


def _dispatch_combine(ctx: RankContext, cls, tokens: list[int], shape: dict, reps: int) -> dict:
    """(bytes, us) of prepare and finalize of prepare/finalize class `cls` at each token count per rank."""
    from moebench.routing import make_routing
    from moebench.comm.traffic import ep_link_rows

    w, h, k = ctx.world_size, shape["hidden"], shape["topk"]
    e = shape["experts_per_rank"] * w
    layout = ParallelLayout(dp=w, enable_ep=True)
    e_local = len(layout.local_experts(ctx.rank, e))
    emap = layout.expert_map(ctx.rank, e).to(ctx.device)
    dt = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    el = torch.tensor([], dtype=dt).element_size()
    pf = cls(group=ctx.group, max_tokens_per_rank=max(tokens))
    wr = pf.default_weight_and_reduce()
    disp, comb = [], []
    for m in tokens:
        wts, ids = make_routing("uniform", m * w, e, k, seed=m)  # the same on every rank
        lo, hi = token_split(m * w, w)[ctx.rank]
        x = torch.randn(hi - lo, h, generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device, dt)
        my_w, my_ids = wts[lo:hi].to(ctx.device), ids[lo:hi].to(ctx.device)
        rows = ep_link_rows(ids, layout, e, gpus_per_node=w, style="pair")
        state = {}

        def dispatch():
            state["prep"] = pf.prepare(x, my_w, my_ids, e, e_local, emap)

        t_d = _timed(ctx, dispatch, reps)
        prep = state["prep"]
        out = prep.a if prep.a.dtype == dt else prep.a.to(dt)
        t_c = _timed(ctx, lambda: pf.finalize(out, prep, my_w, wr), reps)
        ops = {op.op: op for op in pf.communication}
        disp.append((rows.busiest(h * el + ops["dispatch"].row_extra + k * ops["dispatch"].topk_extra), t_d))
        comb.append((rows.busiest(h * el + ops["combine"].row_extra), t_c))
    return {f"{ops['dispatch'].transports[0]}:dispatch": disp, f"{ops['combine'].transports[0]}:combine": comb}


def _measure_on_rank(ctx: RankContext, reps: int, sizes: list[int] | None, tokens: list[int] | None,
                     prepare_finalize: dict) -> dict:
    kind = "cuda" if ctx.device.type == "cuda" else "cpu"
    pts = _collectives(ctx, sizes or SIZES[kind], reps)
    skipped = {}
    for name, cls in prepare_finalize.items():  # every dispatch / combine that runs here, as it declares them
        if not cls.communicates or {op.op for op in cls.communication} != {"dispatch", "combine"}:
            continue
        try:
            reason = cls.unavailable_reason(ctx.device.type, ctx.world_size)
        except Exception as e:  # noqa: BLE001 - an unusable backend is a reason, not a failure
            reason = str(e)
        if reason is None:
            pts.update(_dispatch_combine(ctx, cls, [t for t in (tokens or TOKENS[kind]) if t <= 128],
                                         SHAPE[kind], reps))
        else:
            skipped[name] = reason
    return {"points": pts, "skipped": skipped}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def measure_link(world_size: int, device: str, prepare_finalize: dict, reps: int = 10,
                 sizes: list[int] | None = None, tokens: list[int] | None = None) -> tuple[LinkProfile, dict]:
    """Spawn `world_size` ranks, sweep and fit the collectives and every dispatch / combine of
    `prepare_finalize` (name -> class, the registry's) that runs here.

    Returns the all-to-all fit as a LinkProfile (the first calibration's figures) and the raw
    record: {"transports": {key: {alpha_us, gbps, worst_ratio, points}}, "skipped": {name: why}}."""
    res = spawn(_measure_on_rank, world_size, device, reps, sizes, tokens, prepare_finalize)[0]
    transports = {}
    for key, pts in res["points"].items():
        alpha, gbps, worst = fit_alpha_beta(pts)
        transports[key] = {"alpha_us": _sig(alpha), "gbps": _sig(gbps), "worst_ratio": _sig(worst),
                           "points": [[round(b, 1), _sig(t)] for b, t in pts]}
    backend = "nccl" if device == "cuda" else "gloo"
    a2a = transports["nccl-all-to-all:all-to-all"]
    link = LinkProfile(f"measured-{backend}-{world_size}ranks", a2a["gbps"], a2a["alpha_us"], source="measured")
    return link, {"transports": transports, "skipped": res["skipped"]}
