"""Communication model of simulated runs, fitted to published measurements (or to this machine's).

Per transport and operation (dispatch, combine, all-to-all, all-reduce) the time of one call is

    t = calls * alpha + max(nvlink_bytes / (eta_nvl * NVLink peak), rdma_bytes / (eta_rdma * RDMA peak))

alpha: the fixed cost of one call (us); eta_*: the share of the link's per-direction peak the
transport reaches with large messages; *_bytes: what the slowest rank sends or receives (the larger)
over each kind of link. The effective bandwidth bytes / t therefore rises with the message size.
Hierarchical: past one node (--gpus-per-node, default 8) traffic to GPUs of the same node goes
over NVLink, traffic to other nodes over RDMA, at the same time (hence the max).

The fitted figures come from `comm_points.csv` beside this file: one row per published figure, with
its source, its GPU and links, the bytes per rank as the source counts them and the bytes this model
puts on each link (how they were derived is in the row). `fit_transports` fits alpha, eta_nvl and
eta_rdma of each (transport, op) by least squares on the relative error (numpy), wherever the
points determine them; the rest is borrowed, and says from where (`Fit.provenance`). A fit carries
the published / modeled ratio of each of its points (`Fit.ratios`).

Transports and what moebench maps to them:
    deepep-ll        DeepEP low-latency dispatch / combine (moebench's `deepep-ll`)
    pplx             pplx-kernels dispatch / combine over NVLink (not run by moebench; band only)
    deepep-normal    DeepEP normal (high-throughput) kernels (not run by moebench; band only)
    nccl-all-to-all  torch.distributed.all_to_all_single over NCCL; moebench's `all2all-ll` is a
                     count exchange + two such calls (dispatch) and one (combine)
    nccl-all-reduce  NCCL ring all-reduce (TP); all-gather / reduce-scatter (`allgather-rs`) use
                     its per-step cost and efficiency

Real measurements replace the published fit where they exist: `moebench env --calibrate-link`
writes per-transport fits measured on this machine's GPUs (see `measured_fits`); the model uses them
for the NVLink part of the transports they cover and says so.
"""

from __future__ import annotations

import csv
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moebench.errors import MoebenchError
from moebench.layout import ParallelLayout

POINTS_FILE = Path(__file__).with_name("comm_points.csv")

#: RDMA links between nodes: GB/s per direction per GPU (one NIC per GPU). 400 Gb/s = 50 GB/s.
RDMA_GBPS: dict[str, float] = {"rdma-400g": 50.0, "rdma-800g": 100.0}
DEFAULT_RDMA = "rdma-400g"
DEFAULT_GPUS_PER_NODE = 8

#: alpha per ring step of NCCL all-reduce / all-gather / reduce-scatter: a profile figure (the
#: order NCCL shows for small messages), not fitted: no sourced small-message point was found.
NCCL_STEP_US = 1.5

#: Parameters a (transport, op) has no points for come from this fit (a bulk transfer over CX7).
RDMA_DONOR = ("deepep-normal", "dispatch")

#: A fixed cost that makes up at least this share of some point's time is pinned by the data;
#: a transport whose fixed cost is not pinned is not trusted below half its smallest message.
PINNED_SHARE = 0.25

REQUIRED = ("transport", "op", "gpu", "nvlink", "world_size", "gpus_per_node", "calls", "time_us",
            "bytes_rule", "bytes_per_rank", "nvlink_bytes", "rdma_bytes", "bytes_how", "source")


def nvlink_gbps(name: str) -> float:
    """Per-direction NVLink (or PCIe) peak of a link profile of moebench.runtime.simulate."""
    from moebench.runtime.simulate import LINK_PROFILES

    if name not in LINK_PROFILES:
        raise MoebenchError(f"unknown link profile '{name}'; known: {', '.join(LINK_PROFILES)}")
    return LINK_PROFILES[name].bandwidth_gbps


def rdma_gbps(name: str) -> float:
    if name not in RDMA_GBPS:
        raise MoebenchError(f"unknown RDMA link '{name}'; known: {', '.join(RDMA_GBPS)}")
    return RDMA_GBPS[name]


def check_world(world: int, gpus_per_node: int) -> None:
    """A world past one node must be whole nodes."""
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise MoebenchError(f"--gpus-per-node must be a positive integer, got {gpus_per_node!r}")
    if world > gpus_per_node and world % gpus_per_node:
        raise MoebenchError(f"world size {world} is not a multiple of --gpus-per-node {gpus_per_node}: "
                            f"past one node the ranks fill whole nodes")


def check_tp(tp: int, gpus_per_node: int) -> None:
    """TP stays inside a node: an all-reduce per layer over RDMA is not a layout moebench models."""
    if tp > gpus_per_node:
        raise MoebenchError(f"TP{tp} spans {math.ceil(tp / gpus_per_node)} nodes of {gpus_per_node} GPUs: "
                            f"TP stays inside a node; use --tp {gpus_per_node} or expert parallelism (--ep {tp})")


# ---------------------------------------------------------------------------------------------
# Published points


@dataclass(frozen=True)
class Point:
    """One published figure (a row of comm_points.csv); see the file's columns."""

    transport: str
    op: str
    gpu: str
    nvlink: str
    rdma: str
    world_size: int
    gpus_per_node: int
    calls: int
    time_us: float
    gbps: float | None
    derived: str
    bytes_rule: str
    bytes_per_rank: float
    nvlink_bytes: float
    rdma_bytes: float
    tokens: int | None
    hidden: int | None
    topk: int | None
    experts: int | None
    routing: str
    dtype: str
    bytes_how: str
    source: str
    note: str
    line: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.transport, self.op)

    @property
    def nvlink_peak(self) -> float:
        return nvlink_gbps(self.nvlink)

    @property
    def rdma_peak(self) -> float:
        return rdma_gbps(self.rdma) if self.rdma else 0.0

    def label(self) -> str:
        size = f"{self.tokens} tok" if self.tokens else f"{self.bytes_per_rank / 1e6:.0f} MB"
        return f"{self.transport} {self.op} {self.gpu} EP/TP{self.world_size} {size}"


def _num(path, line, row, name, kind=float, required=True):
    v = (row.get(name) or "").strip()
    if not v:
        if required:
            raise MoebenchError(f"{path} line {line}: field '{name}' is missing")
        return None
    try:
        x = kind(float(v)) if kind is int else kind(v)
    except ValueError:
        raise MoebenchError(f"{path} line {line}: field '{name}' is not a number: {v!r}") from None
    if not math.isfinite(x) or x < 0:
        raise MoebenchError(f"{path} line {line}: field '{name}' must be a non-negative number, got {v}")
    return x


def load_points(path: str | Path | None = None) -> list[Point]:
    """The published points, checked: every required field present, figures non-negative, links known."""
    p = Path(path) if path is not None else POINTS_FILE
    if not p.is_file():
        raise MoebenchError(f"communication points file {p} does not exist")
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise MoebenchError(f"{p}: columns missing: {', '.join(missing)}")
        points = []
        for i, row in enumerate(reader, start=2):
            for c in REQUIRED:
                if not (row.get(c) or "").strip():
                    raise MoebenchError(f"{p} line {i}: field '{c}' is missing")
            pt = Point(
                transport=row["transport"].strip(), op=row["op"].strip(), gpu=row["gpu"].strip(),
                nvlink=row["nvlink"].strip(), rdma=(row.get("rdma") or "").strip(),
                world_size=_num(p, i, row, "world_size", int), gpus_per_node=_num(p, i, row, "gpus_per_node", int),
                calls=_num(p, i, row, "calls", int), time_us=_num(p, i, row, "time_us"),
                gbps=_num(p, i, row, "gbps", required=False), derived=(row.get("derived") or "").strip(),
                bytes_rule=row["bytes_rule"].strip(), bytes_per_rank=_num(p, i, row, "bytes_per_rank"),
                nvlink_bytes=_num(p, i, row, "nvlink_bytes"), rdma_bytes=_num(p, i, row, "rdma_bytes"),
                tokens=_num(p, i, row, "tokens", int, False), hidden=_num(p, i, row, "hidden", int, False),
                topk=_num(p, i, row, "topk", int, False), experts=_num(p, i, row, "experts", int, False),
                routing=(row.get("routing") or "").strip(), dtype=(row.get("dtype") or "").strip(),
                bytes_how=row["bytes_how"].strip(), source=row["source"].strip(), note=(row.get("note") or "").strip(),
                line=i,
            )
            if pt.time_us <= 0 or pt.bytes_per_rank <= 0 or pt.calls < 1 or pt.world_size < 2:
                raise MoebenchError(f"{p} line {i}: time_us, bytes_per_rank, calls must be positive and world_size >= 2")
            if pt.nvlink_bytes + pt.rdma_bytes <= 0:
                raise MoebenchError(f"{p} line {i}: the point puts no bytes on any link")
            nvlink_gbps(pt.nvlink)
            if pt.rdma_bytes > 0 and not pt.rdma:
                raise MoebenchError(f"{p} line {i}: rdma_bytes without an RDMA link")
            if pt.rdma:
                rdma_gbps(pt.rdma)
            check_world(pt.world_size, pt.gpus_per_node)
            points.append(pt)
    if not points:
        raise MoebenchError(f"{p} holds no points")
    return points


# ---------------------------------------------------------------------------------------------
# Fits


@dataclass
class Fit:
    """alpha-beta model of one (transport, op); eta_* is None where nothing is known.

    provenance: how each parameter was obtained ("fit of N points", "profile figure", "borrowed
    from ..."); ratios: published / modeled time of each point; min_bytes: below this message
    (bytes per rank on the links) the fit is not used for the band (fixed cost not pinned)."""

    transport: str
    op: str
    alpha_us: float
    eta_nvl: float | None
    eta_rdma: float | None
    provenance: dict[str, str] = field(default_factory=dict)
    points: list[Point] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    alpha_pinned: bool = False
    min_bytes: float = 0.0
    measured: bool = False

    def time_us(self, nvl_bytes: float, rdma_bytes: float, nvl_peak: float, rdma_peak: float, calls: int = 1) -> float:
        t_n = t_r = 0.0
        if nvl_bytes > 0:
            if not self.eta_nvl:
                raise MoebenchError(f"{self.transport} {self.op} has no NVLink figure")
            t_n = nvl_bytes / (self.eta_nvl * nvl_peak * 1e3)
        if rdma_bytes > 0:
            if not self.eta_rdma or not rdma_peak:
                raise MoebenchError(f"{self.transport} {self.op} has no RDMA figure")
            t_r = rdma_bytes / (self.eta_rdma * rdma_peak * 1e3)
        return calls * self.alpha_us + max(t_n, t_r)

    def predict(self, pt: Point) -> float:
        return self.time_us(pt.nvlink_bytes, pt.rdma_bytes, pt.nvlink_peak, pt.rdma_peak, pt.calls)

    @property
    def worst_ratio(self) -> float:
        """The ratio furthest from 1 (by max(r, 1/r)); 1.0 without points."""
        return max(self.ratios, key=lambda r: max(r, 1 / r)) if self.ratios else 1.0

    def describe(self) -> str:
        parts = [f"alpha {self.alpha_us:.1f} us"]
        if self.eta_nvl:
            parts.append(f"NVLink {self.eta_nvl:.2f} x peak")
        if self.eta_rdma:
            parts.append(f"RDMA {self.eta_rdma:.2f} x peak")
        return f"{self.transport} {self.op}: " + ", ".join(parts)


def _nelder_mead(f, x0: np.ndarray, iters: int = 600, step: float = 0.4) -> np.ndarray:
    """Minimise f over R^n from x0 (deterministic simplex search)."""
    n = len(x0)
    simplex = [x0.astype(float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(s) for s in simplex]
    for _ in range(iters):
        order = np.argsort(vals)
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-12 and np.abs(np.array(simplex) - simplex[0]).max() < 1e-7:
            break
        c = np.mean(simplex[:-1], axis=0)
        xr = c + (c - simplex[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - simplex[-1])
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (simplex[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (s - simplex[0]) for s in simplex[1:]]
                vals = [f(s) for s in simplex]
    return simplex[int(np.argmin(vals))]


def fit_group(points: list[Point], fixed_alpha: float | None = None) -> Fit:
    """Least squares on relative error of one (transport, op): alpha (unless fixed), eta_nvl where
    a point puts bytes on NVLink, eta_rdma where one puts bytes on RDMA."""
    t, op = points[0].key
    free = [] if fixed_alpha is not None else ["alpha"]
    if any(p.nvlink_bytes > 0 for p in points):
        free.append("eta_nvl")
    if any(p.rdma_bytes > 0 for p in points):
        free.append("eta_rdma")

    nb = np.array([p.nvlink_bytes for p in points], float)
    rb = np.array([p.rdma_bytes for p in points], float)
    pn = np.array([p.nvlink_peak for p in points], float) * 1e3
    pr = np.array([p.rdma_peak or 1.0 for p in points], float) * 1e3
    calls = np.array([p.calls for p in points], float)
    t_pub = np.array([p.time_us for p in points], float)

    def params(lx):
        d = dict(zip(free, np.exp(lx)))
        return d.get("alpha", fixed_alpha or 0.0), d.get("eta_nvl"), d.get("eta_rdma")

    def loss(lx):  # the same model as Fit.time_us, over all points at once
        a, en, er = params(lx)
        t_n = nb / (en * pn) if en else 0.0
        t_r = rb / (er * pr) if er else 0.0
        return float((((calls * a + np.maximum(t_n, t_r)) / t_pub - 1.0) ** 2).sum())

    best, best_loss = None, math.inf
    for a0 in (1.0, 30.0):
        for e0 in (0.3, 0.8):
            x0 = np.log([{"alpha": a0}.get(k, e0) for k in free])
            x = _nelder_mead(loss, x0)
            val = loss(x)
            if val < best_loss:
                best, best_loss = x, val
    a, en, er = params(best)
    fit = Fit(t, op, float(a), None if en is None else float(en), None if er is None else float(er))
    n = len(points)
    fit.provenance = {k: f"fit of {n} published point{'s' if n > 1 else ''}" for k in free}
    if fixed_alpha is not None:
        fit.provenance["alpha"] = (f"profile figure {fixed_alpha:g} us per ring step (no sourced small-message "
                                   f"point; not fitted)")
    fit.points = list(points)
    fit.ratios = [p.time_us / fit.predict(p) for p in points]
    fit.alpha_pinned = fixed_alpha is None and any(p.calls * fit.alpha_us >= PINNED_SHARE * p.time_us for p in points)
    fit.min_bytes = 0.0 if fit.alpha_pinned else min(p.nvlink_bytes + p.rdma_bytes for p in points) / 2
    return fit


def fit_transports(points: list[Point]) -> dict[tuple[str, str], Fit]:
    """One Fit per (transport, op) of `points`; parameters without points are borrowed."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        groups.setdefault(p.key, []).append(p)
    fits = {k: fit_group(g, NCCL_STEP_US if k[0] == "nccl-all-reduce" else None) for k, g in groups.items()}
    donor = fits.get(RDMA_DONOR)
    for fit in fits.values():
        if fit.eta_rdma is None and donor is not None and donor.eta_rdma:
            fit.eta_rdma = donor.eta_rdma
            fit.provenance["eta_rdma"] = (f"borrowed from {donor.transport} {donor.op} ({donor.eta_rdma:.2f}): "
                                          f"no published RDMA point")
    return fits


@functools.lru_cache(maxsize=4)
def _published(path: str) -> dict[tuple[str, str], Fit]:
    return fit_transports(load_points(path))


def published_fits(path: str | Path | None = None) -> dict[tuple[str, str], Fit]:
    """The fits of the shipped table (cached; callers must not mutate them)."""
    return _published(str(Path(path) if path is not None else POINTS_FILE))


def worst_point(fits: dict[tuple[str, str], Fit]) -> tuple[Point, float]:
    """The point whose published / modeled ratio is furthest from 1, and that ratio."""
    pairs = [(p, r) for f in fits.values() for p, r in zip(f.points, f.ratios)]
    return max(pairs, key=lambda pr: max(pr[1], 1 / pr[1]))


def points_off(fits: dict[tuple[str, str], Fit], tolerance: float = 0.2) -> list[tuple[Point, float]]:
    """Points the model misses by more than `tolerance` (published / modeled outside 1 +- tol)."""
    return [(p, r) for f in fits.values() for p, r in zip(f.points, f.ratios) if abs(r - 1.0) > tolerance]


# ---------------------------------------------------------------------------------------------
# Measured fits (moebench env --calibrate-link)

#: keys of a calibration file's "transports" and what each replaces
MEASURED_KEYS = {
    "nccl-all-reduce": ("nccl-all-reduce", "all-reduce"),
    "nccl-all-to-all": ("nccl-all-to-all", "all-to-all"),
    "all2all-ll:dispatch": ("all2all-ll", "dispatch"),
    "all2all-ll:combine": ("all2all-ll", "combine"),
    "deepep-ll:dispatch": ("deepep-ll", "dispatch"),
    "deepep-ll:combine": ("deepep-ll", "combine"),
}


@dataclass
class MeasuredFit:
    """alpha + bytes / gbps over NVLink, fitted to this machine's sweep (bytes counted as the model
    counts them: see moebench.runtime.link_calibration)."""

    key: str
    alpha_us: float
    gbps: float
    world_size: int
    worst_ratio: float

    def time_us(self, nvl_bytes: float) -> float:
        return self.alpha_us + nvl_bytes / (self.gbps * 1e3)


def measured_fits(path: str | Path | None = None, device_name: str | None = None) -> tuple[dict[str, MeasuredFit], str]:
    """Fits of the calibration file measured on `device_name`, and a line saying what they are;
    ({}, "") when there is no file or it was measured elsewhere. A file with missing fields or
    negative figures is an error."""
    from moebench.runtime.simulate import link_file

    p = Path(path) if path is not None else link_file()
    if not p.is_file():
        return {}, ""
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise MoebenchError(f"link measurement {p} is not JSON ({e}); delete it or re-run `moebench env --calibrate-link`")
    if not isinstance(d, dict) or d.get("device_name") != device_name:
        return {}, ""
    out: dict[str, MeasuredFit] = {}
    transports = d.get("transports")
    if transports is None:  # a file of the first calibration: one all-to-all bandwidth and latency
        transports = {"nccl-all-to-all": {"alpha_us": d.get("latency_us"), "gbps": d.get("bandwidth_gbps"),
                                          "worst_ratio": 1.0}}
    if not isinstance(transports, dict):
        raise MoebenchError(f"link measurement {p}: 'transports' must be an object")
    for key, v in transports.items():
        if key not in MEASURED_KEYS:
            raise MoebenchError(f"link measurement {p}: unknown transport '{key}'; known: {', '.join(MEASURED_KEYS)}")
        vals = {}
        for name in ("alpha_us", "gbps", "worst_ratio"):
            x = v.get(name) if isinstance(v, dict) else None
            if x is None:
                raise MoebenchError(f"link measurement {p}: {key} has no '{name}'; re-run `moebench env --calibrate-link`")
            try:
                x = float(x)
            except (TypeError, ValueError):
                raise MoebenchError(f"link measurement {p}: {key} {name} is not a number: {x!r}") from None
            if not math.isfinite(x) or x < 0 or (name == "gbps" and x == 0):
                raise MoebenchError(f"link measurement {p}: {key} {name} must be a positive number, got {x}")
            vals[name] = x
        out[key] = MeasuredFit(key, vals["alpha_us"], vals["gbps"], int(d.get("world_size") or 0), vals["worst_ratio"])
    line = (f"measured on {device_name} over {d.get('world_size')} ranks ({d.get('measured_at', 'undated')}, "
            f"`moebench env --calibrate-link`): {', '.join(sorted(out))}")
    return out, line


# ---------------------------------------------------------------------------------------------
# Traffic of a dispatch / combine on the links


@dataclass
class LinkRows:
    """Rows (messages) each rank moves over each kind of link: the larger of sent and received.
    nvl, rdma: (world,) int64."""

    nvl: np.ndarray
    rdma: np.ndarray

    def busiest(self, row_bytes: float) -> float:
        return float(((self.nvl + self.rdma) * row_bytes).max()) if self.nvl.size else 0.0


def _split_sources(topk_ids_full: torch.Tensor, world: int):
    from moebench.runtime.rank_case import token_split

    ids = topk_ids_full.long().cpu()
    src = torch.empty(ids.shape[0], dtype=torch.int64)
    for s, (lo, hi) in enumerate(token_split(ids.shape[0], world)):
        src[lo:hi] = s
    return ids, src


def ep_link_rows(topk_ids_full: torch.Tensor, layout: ParallelLayout, num_experts: int, gpus_per_node: int,
                 style: str = "pair") -> LinkRows:
    """Rows each rank moves for one dispatch (combine moves the same rows back) of the whole batch
    topk_ids_full (M, K), split over the EP ranks as contiguous slices.

    style "pair": one row per remote (token, expert) pair, straight to its rank (DeepEP LL, pplx,
    all2all-ll); "rank": one row per (token, remote rank) (DeepEP normal inside a node); "node":
    DeepEP normal past one node: one row per (token, remote node) over RDMA to the GPU of the same
    index there, then one per (token, rank) over NVLink from that GPU."""
    world = layout.ep_size
    ids, src = _split_sources(topk_ids_full, world)
    owner = layout.expert_owner(num_experts)
    valid = ids >= 0
    dest = torch.where(valid, owner[ids.clamp(min=0)], torch.full_like(ids, -1))
    node = lambda r: r // gpus_per_node  # noqa: E731
    s2 = src.unsqueeze(1).expand_as(dest)
    sent_n = torch.zeros(world, dtype=torch.int64)
    sent_r, recv_n, recv_r = sent_n.clone(), sent_n.clone(), sent_n.clone()
    if style == "pair":
        m = valid & (dest != s2)
        same = m & (node(dest) == node(s2))
        far = m & (node(dest) != node(s2))
        sent_n.index_add_(0, s2[same], torch.ones_like(s2[same]))
        recv_n.index_add_(0, dest[same], torch.ones_like(dest[same]))
        sent_r.index_add_(0, s2[far], torch.ones_like(s2[far]))
        recv_r.index_add_(0, dest[far], torch.ones_like(dest[far]))
    elif style in ("rank", "node"):
        hit = torch.zeros(ids.shape[0], world, dtype=torch.bool)  # (token, rank) pairs, deduplicated
        hit.scatter_(1, dest.clamp(min=0), valid)
        t_idx, d_idx = torch.nonzero(hit, as_tuple=True)
        s_idx = src[t_idx]
        if style == "rank" or world <= gpus_per_node:
            m = d_idx != s_idx
            sent_n.index_add_(0, s_idx[m], torch.ones_like(s_idx[m]))
            recv_n.index_add_(0, d_idx[m], torch.ones_like(d_idx[m]))
            far_pairs = torch.zeros(0, dtype=torch.int64)
        else:
            # NVLink: the row reaches d from the GPU of d's node with the source's local index.
            via = node(d_idx) * gpus_per_node + s_idx % gpus_per_node
            m = via != d_idx
            sent_n.index_add_(0, via[m], torch.ones_like(via[m]))
            recv_n.index_add_(0, d_idx[m], torch.ones_like(d_idx[m]))
            nodes = world // gpus_per_node
            nhit = torch.zeros(ids.shape[0], nodes, dtype=torch.bool)
            nhit.scatter_(1, node(dest.clamp(min=0)), valid)
            t2, n2 = torch.nonzero(nhit, as_tuple=True)
            s2_ = src[t2]
            far = n2 != node(s2_)
            sent_r.index_add_(0, s2_[far], torch.ones_like(s2_[far]))
            tgt = n2[far] * gpus_per_node + s2_[far] % gpus_per_node
            recv_r.index_add_(0, tgt, torch.ones_like(tgt))
    else:
        raise MoebenchError(f"unknown traffic style '{style}'")
    return LinkRows(torch.maximum(sent_n, recv_n).numpy(), torch.maximum(sent_r, recv_r).numpy())


# ---------------------------------------------------------------------------------------------
# The model a simulated run uses


#: EP transports a comparison's band is drawn from: (transport, how it moves rows; see ep_link_rows)
BAND_EP = (
    ("deepep-ll", "pair"),
    ("pplx", "pair"),
    ("deepep-normal", "rank"),
    ("nccl-all-to-all", "pair"),
)


@dataclass
class CommResult:
    """Modeled time of one row's communication and what stands behind it.

    dispatch_us / combine_us (EP) or allreduce_us (TP); bytes: the slowest rank's bytes over the
    links (both ops; for the ring collectives the bytes each rank moves); band_lo_us / band_hi_us: the fastest / slowest published transport for the
    same traffic (own model included); band: 'name us' of each member; how: one line."""

    dispatch_us: float | None = None
    combine_us: float | None = None
    allreduce_us: float | None = None
    bytes: float = 0.0
    band_lo_us: float = 0.0
    band_hi_us: float = 0.0
    band: str = ""
    how: str = ""

    @property
    def total_us(self) -> float:
        return sum(v or 0.0 for v in (self.dispatch_us, self.combine_us, self.allreduce_us))


@dataclass
class CommModel:
    """Links of the simulated cluster and the fits that turn traffic into time.

    nvlink / nvlink_gbps: intra-node link profile and its per-direction peak; rdma / rdma_gbps: the
    NIC per GPU between nodes; gpus_per_node: node size; source: "profile", "override" (peak
    replaced by --link-gbps) or "measured" (fits of a calibration are in use); fits: published
    fits; measured: fits measured on these GPUs (they replace the NVLink part of their transport)."""

    nvlink: str
    nvlink_gbps: float
    rdma: str = DEFAULT_RDMA
    rdma_gbps: float = RDMA_GBPS[DEFAULT_RDMA]
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    source: str = "profile"
    fits: dict[tuple[str, str], Fit] = field(default_factory=published_fits)
    measured: dict[str, MeasuredFit] = field(default_factory=dict)
    measured_line: str = ""

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_link(cls, link, rdma: str = DEFAULT_RDMA, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
                  device_name: str | None = None, use_measurement: bool = True) -> "CommModel":
        """From a simulate.LinkProfile (`--link` / `--link-gbps` / the default for the device):
        its bandwidth is the NVLink peak (a measured profile's is an effective all-to-all figure,
        so the device's datasheet profile gives the peak then); measured fits of `device_name`
        are used where a calibration file has them, unless --link-gbps overrode the link
        (override > measurement > profile, as simulate.choose_link)."""
        from moebench.runtime.simulate import default_link

        check_world(1, gpus_per_node)
        peak, source = link.bandwidth_gbps, link.source
        if link.source == "measured":
            peak = default_link(device_name).bandwidth_gbps
        use = use_measurement and link.source != "override"
        measured, line = measured_fits(device_name=device_name) if use else ({}, "")
        if measured:
            source = "measured"
        return cls(nvlink=link.name, nvlink_gbps=float(peak), rdma=rdma, rdma_gbps=rdma_gbps(rdma),
                   gpus_per_node=gpus_per_node, source=source, measured=measured, measured_line=line)

    def as_dict(self) -> dict:
        """Plain figures for a run's metadata."""
        return {"name": self.nvlink, "bandwidth_gbps": self.nvlink_gbps,  # the LinkProfile keys earlier runs wrote
                "nvlink": self.nvlink, "nvlink_gbps": self.nvlink_gbps, "rdma": self.rdma, "rdma_gbps": self.rdma_gbps,
                "gpus_per_node": self.gpus_per_node, "source": self.source, "measured": self.measured_line,
                "fits": fits_table(self.fits)}

    # -- helpers -----------------------------------------------------------------------------
    def fit(self, transport: str, op: str) -> Fit:
        if (transport, op) not in self.fits:
            raise MoebenchError(f"unknown transport '{transport} {op}'; known: "
                                f"{', '.join(sorted({t for t, _ in self.fits}))}")
        return self.fits[(transport, op)]

    def describe(self) -> str:
        s = f"{self.nvlink} {self.nvlink_gbps:g} GB/s"
        if self.source == "override":
            s += " (--link-gbps)"
        s += f", {self.rdma} {self.rdma_gbps:g} GB/s between nodes of {self.gpus_per_node} GPUs"
        s += "; fits of published points" + (f"; {self.measured_line}" if self.measured_line else "")
        return s

    def _op_us(self, fit: Fit, rows: LinkRows, row_bytes: float, calls: int = 1,
               measured: MeasuredFit | None = None) -> float:
        """The slowest rank's time for one op moving `rows` of `row_bytes` each: calls x the fixed
        cost (every rank takes part, with or without rows) plus the slower of its NVLink and RDMA
        transfers. A measured fit replaces the fixed cost and the NVLink bandwidth; RDMA (which a
        calibration inside one node cannot see) stays the published fit's."""
        alpha = measured.alpha_us if measured is not None else fit.alpha_us
        worst = calls * alpha
        for n, r in zip(rows.nvl.tolist(), rows.rdma.tolist()):
            if not (n or r):
                continue
            if measured is not None:
                t_n = n * row_bytes / (measured.gbps * 1e3)
                t = calls * alpha + max(t_n, fit.time_us(0, r * row_bytes, self.nvlink_gbps, self.rdma_gbps, 0))
            else:
                t = fit.time_us(n * row_bytes, r * row_bytes, self.nvlink_gbps, self.rdma_gbps, calls)
            worst = max(worst, t)
        return worst

    # -- TP ------------------------------------------------------------------------------------
    def allreduce(self, nbytes: float, world: int) -> CommResult:
        """Ring all-reduce of an nbytes tensor over `world` ranks of one node."""
        check_tp(world, self.gpus_per_node)
        if world <= 1:
            return CommResult(allreduce_us=0.0, how="one rank: no all-reduce")
        fit = self.fit("nccl-all-reduce", "all-reduce")
        bus = 2 * (world - 1) / world * nbytes
        if "nccl-all-reduce" in self.measured:
            mf = self.measured["nccl-all-reduce"]
            us = mf.time_us(bus)
            how = f"nccl-all-reduce measured fit ({mf.alpha_us:.1f} us + bytes / {mf.gbps:.0f} GB/s)"
        else:
            us = fit.time_us(bus, 0, self.nvlink_gbps, self.rdma_gbps, 2 * (world - 1))
            how = f"{fit.describe()} ({self.nvlink})"
        lo, hi = min(fit.ratios), max(fit.ratios)
        return CommResult(allreduce_us=us, bytes=bus, band_lo_us=us * min(lo, 1.0), band_hi_us=us * max(hi, 1.0),
                          band=f"nccl-all-reduce published spread x{lo:.2f}..x{hi:.2f}", how=how)

    # -- all-gather / reduce-scatter (allgather-rs) ---------------------------------------------
    def _ring_us(self, nbytes: float, world: int) -> float:
        """(T-1)/T * nbytes over the ring's slowest link + (T-1) steps: all-gather / reduce-scatter."""
        if world <= 1:
            return 0.0
        fit = self.fit("nccl-all-reduce", "all-reduce")
        moved = (world - 1) / world * nbytes
        if world > self.gpus_per_node:
            return fit.time_us(0, moved, self.nvlink_gbps, self.rdma_gbps, world - 1)
        return fit.time_us(moved, 0, self.nvlink_gbps, self.rdma_gbps, world - 1)

    def allgather_rs(self, gather_bytes: float, scatter_bytes: float, world: int) -> CommResult:
        """All-gather of the tokens (gather_bytes: the gathered tensor) and reduce-scatter of the
        output (scatter_bytes: its input) over `world` EP ranks (ring, past one node over RDMA)."""
        check_world(world, self.gpus_per_node)
        d, c = self._ring_us(gather_bytes, world), self._ring_us(scatter_bytes, world)
        fit = self.fit("nccl-all-reduce", "all-reduce")
        lo, hi = min(min(fit.ratios), 1.0), max(max(fit.ratios), 1.0)
        total = d + c
        return CommResult(dispatch_us=d, combine_us=c, bytes=(world - 1) / world * (gather_bytes + scatter_bytes),
                          band_lo_us=total * lo, band_hi_us=total * hi,
                          band=f"NCCL collectives: nccl-all-reduce published spread x{lo:.2f}..x{hi:.2f}",
                          how=f"NCCL ring all-gather + reduce-scatter: nccl-all-reduce's per-step cost and "
                              f"{'RDMA' if world > self.gpus_per_node else 'NVLink'} efficiency")

    # -- dispatch / combine --------------------------------------------------------------------
    def dispatch_combine(self, pf: str, topk_ids_full: torch.Tensor, layout: ParallelLayout, num_experts: int,
                         dispatch_row: float, combine_row: float) -> CommResult:
        """Dispatch + combine of moebench's prepare/finalize `pf` (all2all-ll or deepep-ll) of the
        whole batch topk_ids_full (M, K); rows of dispatch_row / combine_row bytes."""
        world = layout.ep_size
        check_world(world, self.gpus_per_node)
        rows = ep_link_rows(topk_ids_full, layout, num_experts, self.gpus_per_node, "pair")
        m = self.measured
        if pf == "all2all-ll":
            # dispatch: counts, then rows and their local expert ids (int64) in two all_to_all_single
            # calls; combine: the rows back in one.
            fit = self.fit("nccl-all-to-all", "all-to-all")
            drow = dispatch_row + 8
            if "all2all-ll:dispatch" in m:
                d = self._op_us(fit, rows, drow, 1, m["all2all-ll:dispatch"])
            else:
                d = self._op_us(fit, rows, drow, 3, m.get("nccl-all-to-all"))
            c = self._op_us(fit, rows, combine_row, 1, m.get("all2all-ll:combine", m.get("nccl-all-to-all")))
            used = [k for k in ("all2all-ll:dispatch", "all2all-ll:combine", "nccl-all-to-all") if k in m]
            how = ("all2all-ll = 3 NCCL all_to_all_single calls (dispatch) + 1 (combine), "
                   + (f"measured fit ({', '.join(used)})" if used else fit.describe()))
        elif pf == "deepep-ll":
            fd, fc = self.fit("deepep-ll", "dispatch"), self.fit("deepep-ll", "combine")
            drow = dispatch_row
            d = self._op_us(fd, rows, drow, 1, m.get("deepep-ll:dispatch"))
            c = self._op_us(fc, rows, combine_row, 1, m.get("deepep-ll:combine"))
            used = [k for k in ("deepep-ll:dispatch", "deepep-ll:combine") if k in m]
            how = f"measured fit ({', '.join(used)})" if used else f"{fd.describe()}; {fc.describe()}"
        else:
            raise MoebenchError(f"no dispatch/combine model for prepare/finalize '{pf}'")
        res = CommResult(dispatch_us=d, combine_us=c, bytes=rows.busiest(drow) + rows.busiest(combine_row), how=how)
        self.ep_band(res, topk_ids_full, layout, num_experts, dispatch_row, combine_row, rows)
        return res

    def band_members(self, topk_ids_full: torch.Tensor, layout: ParallelLayout, num_experts: int,
                     dispatch_row: float, combine_row: float, pair_rows: LinkRows | None = None) -> dict[str, float]:
        """dispatch + combine (us) of every published EP transport that applies to this traffic
        (their published fits, with this model's links): past one node only those with published
        RDMA points; below half its smallest published message not one whose fixed cost (of either
        op) no point pins."""
        multi = layout.ep_size > self.gpus_per_node
        cache: dict[str, LinkRows | None] = {"pair": pair_rows}
        out = {}
        for transport, style in BAND_EP:
            ops = ("all-to-all", "all-to-all") if transport == "nccl-all-to-all" else ("dispatch", "combine")
            if any((transport, op) not in self.fits for op in ops):
                continue
            fd, fc = self.fits[(transport, ops[0])], self.fits[(transport, ops[1])]
            if multi and not all(any(p.rdma_bytes > 0 for p in f.points) for f in (fd, fc)):
                continue
            st = "node" if (style == "rank" and multi) else style
            if cache.get(st) is None:
                cache[st] = ep_link_rows(topk_ids_full, layout, num_experts, self.gpus_per_node, st)
            rows = cache[st]
            # a transport whose fixed cost no point pins is not trusted below its published sizes
            if not (fd.alpha_pinned or fc.alpha_pinned) and (
                    rows.busiest(dispatch_row) < fd.min_bytes or rows.busiest(combine_row) < fc.min_bytes):
                continue
            out[transport] = self._op_us(fd, rows, dispatch_row) + self._op_us(fc, rows, combine_row)
        return out

    def ep_band(self, res: CommResult, topk_ids_full: torch.Tensor, layout: ParallelLayout, num_experts: int,
                dispatch_row: float, combine_row: float, pair_rows: LinkRows | None = None) -> CommResult:
        """Fill res.band_*: the fastest and the slowest of the published EP transports for this
        traffic and res's own modeled time."""
        members = self.band_members(topk_ids_full, layout, num_experts, dispatch_row, combine_row, pair_rows)
        vals = list(members.values()) + [res.total_us]
        res.band_lo_us, res.band_hi_us = min(vals), max(vals)
        res.band = ", ".join(f"{k} {v:.0f} us" for k, v in sorted(members.items(), key=lambda kv: kv[1]))
        return res


def fits_table(fits: dict[tuple[str, str], Fit] | None = None) -> list[dict]:
    """One row per fit (for the README and `moebench env`): parameters, provenance, worst ratio."""
    fits = fits if fits is not None else published_fits()
    out = []
    for (t, op), f in sorted(fits.items()):
        out.append({"transport": t, "op": op, "alpha_us": round(f.alpha_us, 2),
                    "eta_nvl": None if f.eta_nvl is None else round(f.eta_nvl, 3),
                    "eta_rdma": None if f.eta_rdma is None else round(f.eta_rdma, 3),
                    "points": len(f.points), "worst_ratio": round(f.worst_ratio, 3),
                    "provenance": "; ".join(f"{k}: {v}" for k, v in f.provenance.items())})
    return out
