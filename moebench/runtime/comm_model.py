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
from dataclasses import dataclass, field, replace
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

#: Parameters a (transport, op) has no points for come from this fit (a bulk transfer over CX7).
RDMA_DONOR = ("deepep-ht", "dispatch")

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
    """Model of one (transport, op); eta_* is None where nothing is known.

    One call costs, on its best line (NCCL picks its protocol by message size; each protocol is a
    line of its own fixed cost and bandwidth):

        t = min over lines (alpha_i, eta_i) of
            calls * (alpha_i + alpha_rdma [if it crosses nodes]) + max(nvl / (eta_i * NVLink peak),
                                                                     rdma / (eta_rdma * RDMA peak))

    alpha_us / eta_nvl: the first line; lines: every line, the first included; alpha_rdma_us: the
    fixed cost a call adds when it goes over RDMA. provenance: how each parameter was obtained;
    ratios: published / modeled time of each point; min_bytes: below this message (bytes per rank
    on the links) the fit is not used for the band (fixed cost not pinned)."""

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
    alpha_rdma_us: float = 0.0
    lines: list[tuple[float, float | None]] = field(default_factory=list)

    def __post_init__(self):
        if not self.lines:
            self.lines = [(self.alpha_us, self.eta_nvl)]

    def time_us(self, nvl_bytes: float, rdma_bytes: float, nvl_peak: float, rdma_peak: float, calls: int = 1) -> float:
        t_r = 0.0
        if rdma_bytes > 0:
            if not self.eta_rdma or not rdma_peak:
                raise MoebenchError(f"{self.transport} {self.op} has no RDMA figure")
            t_r = rdma_bytes / (self.eta_rdma * rdma_peak * 1e3)
        fixed_rdma = self.alpha_rdma_us if rdma_bytes > 0 else 0.0
        best = math.inf
        for alpha, eta in self.lines:
            t_n = 0.0
            if nvl_bytes > 0:
                if not eta:
                    raise MoebenchError(f"{self.transport} {self.op} has no NVLink figure")
                t_n = nvl_bytes / (eta * nvl_peak * 1e3)
            best = min(best, calls * (alpha + fixed_rdma) + max(t_n, t_r))
        return best

    def predict(self, pt: Point) -> float:
        return self.time_us(pt.nvlink_bytes, pt.rdma_bytes, pt.nvlink_peak, pt.rdma_peak, pt.calls)

    @property
    def worst_ratio(self) -> float:
        """The ratio furthest from 1 (by max(r, 1/r)); 1.0 without points."""
        return max(self.ratios, key=lambda r: max(r, 1 / r)) if self.ratios else 1.0

    def describe(self) -> str:
        parts = []
        for alpha, eta in self.lines:
            parts.append(f"alpha {alpha:.1f} us" + (f", NVLink {eta:.2f} x peak" if eta else ""))
        text = " | ".join(parts) if len(parts) > 1 else parts[0]
        if len(parts) > 1:
            text = f"best of {len(parts)} lines ({text})"
        if self.eta_rdma:
            text += f", RDMA {self.eta_rdma:.2f} x peak"
        if self.alpha_rdma_us:
            text += f" + {self.alpha_rdma_us:.1f} us per call over RDMA"
        return f"{self.transport} {self.op}: {text}"


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


#: A fit with more lines is kept only while its worst point misses by more than this (and each
#: line has at least POINTS_PER_LINE distinct message sizes behind it).
LINE_TOLERANCE = 0.12
POINTS_PER_LINE = 3
MAX_LINES = 3


def _fit_lines(points: list[Point], n_lines: int, fixed_alpha: float | None = None):
    """Least squares on the relative error with `n_lines` NVLink lines: (loss, parameters);
    fixed_alpha: the one line's fixed cost, not fitted."""
    nvl_used = any(p.nvlink_bytes > 0 for p in points)
    rdma_used = any(p.rdma_bytes > 0 for p in points)
    # the fixed cost over RDMA is told apart from the line's only where points without RDMA exist
    alpha_rdma_free = rdma_used and any(p.rdma_bytes == 0 for p in points)
    nb = np.array([p.nvlink_bytes for p in points], float)
    rb = np.array([p.rdma_bytes for p in points], float)
    pn = np.array([p.nvlink_peak for p in points], float) * 1e3
    pr = np.array([p.rdma_peak or 1.0 for p in points], float) * 1e3
    calls = np.array([p.calls for p in points], float)
    over = (rb > 0).astype(float)
    t_pub = np.array([p.time_us for p in points], float)

    def unpack(lx):
        x = np.exp(lx)
        lines, i = [], 0
        if fixed_alpha is not None:
            x = np.concatenate([[fixed_alpha], x])
        for _ in range(n_lines):
            lines.append((x[i], x[i + 1] if nvl_used else None))
            i += 2 if nvl_used else 1
        er = x[i] if rdma_used else None
        i += rdma_used
        ar = x[i] if alpha_rdma_free else 0.0
        return lines, er, ar

    def model(lx):
        lines, er, ar = unpack(lx)
        t_r = rb / (er * pr) if er else 0.0
        return np.min([calls * (a + ar * over) + np.maximum(nb / (en * pn) if en else 0.0, t_r) for a, en in lines], axis=0)

    def loss(lx):
        return float(((model(lx) / t_pub - 1.0) ** 2).sum())

    if n_lines == 1:
        starts = [([a0], [e0]) for a0 in (1.0, 30.0) for e0 in (0.3, 0.8)]
    else:  # lines from a small fixed cost and low rate up to a large one at a high rate
        starts = [(list(np.geomspace(1.0, 60.0, n_lines) * s), list(np.geomspace(0.1, 0.8, n_lines))) for s in (1.0, 3.0)]
    best, best_loss = None, math.inf
    for alphas, etas in starts:
        x0 = []
        for a, e in zip(alphas, etas):
            x0 += [a] + ([e] if nvl_used else [])
        x0 += [0.4] if rdma_used else []
        x0 += [5.0] if alpha_rdma_free else []
        if fixed_alpha is not None:
            x0 = x0[1:]
        x = _nelder_mead(loss, np.log(np.array(x0, float)), iters=600 * (2 * n_lines - 1))
        val = loss(x)
        if val < best_loss:
            best, best_loss = x, val
    return best_loss, unpack(best), alpha_rdma_free


def fit_group(points: list[Point], fixed_alpha: float | None = None) -> Fit:
    """Least squares on relative error of one (transport, op): one line (alpha, eta_nvl), more
    lines where the points ask for them (message sizes in several protocol regimes), eta_rdma
    where a point puts bytes on RDMA, and the fixed cost of a call over RDMA where points with and
    without RDMA tell it apart."""
    t, op = points[0].key
    sizes = len({p.nvlink_bytes for p in points if p.rdma_bytes == 0})
    max_lines = 1 if fixed_alpha is not None else max(1, min(MAX_LINES, sizes // POINTS_PER_LINE))
    for n in range(1, max_lines + 1):
        _, (lines, er, ar), _ = _fit_lines(points, n, fixed_alpha)
        fit = Fit(t, op, float(lines[0][0]), None if lines[0][1] is None else float(lines[0][1]),
                  None if er is None else float(er), alpha_rdma_us=float(ar),
                  lines=[(float(a), None if e is None else float(e)) for a, e in sorted(lines)])
        fit.alpha_us, fit.eta_nvl = fit.lines[0]
        fit.points = list(points)
        fit.ratios = [p.time_us / fit.predict(p) for p in points]
        if max(abs(r - 1) for r in fit.ratios) <= LINE_TOLERANCE:
            break
    n = len(points)
    src = f"fit of {n} published point{'s' if n > 1 else ''}"
    fit.provenance = {"alpha": src if fixed_alpha is None else f"fixed at {fixed_alpha:.1f} us"}
    if fit.eta_nvl is not None:
        fit.provenance["eta_nvl"] = src + (f" ({len(fit.lines)} lines: NCCL-style protocols by message size)"
                                           if len(fit.lines) > 1 else "")
    if fit.eta_rdma is not None:
        fit.provenance["eta_rdma"] = src
    if fit.alpha_rdma_us:
        fit.provenance["alpha_rdma"] = src + " (points with and without RDMA)"
    small = min(a for a, _ in fit.lines)
    fit.alpha_pinned = any(p.calls * small >= PINNED_SHARE * p.time_us for p in points)
    fit.min_bytes = 0.0 if fit.alpha_pinned else min(p.nvlink_bytes + p.rdma_bytes for p in points) / 2
    return fit


#: Transports that run inside one NVLink domain only (peer memory): never priced over RDMA.
NVLINK_ONLY = {"custom-all-reduce"}


#: Fixed costs no point can pin come from a kin transport's fit: every published point of DeepEP's
#: normal kernels moves 60 MB or more per rank, where a fixed cost of 15 us and one of 700 us fit
#: alike; they launch like its low-latency kernels (the same library, one kernel per op).
ALPHA_DONOR = {"deepep-ht": "deepep-ll"}


#: Transports without points of their own, priced by another's fit: (transport, op) -> donor.
#: NCCL's all-gather and reduce-scatter are the two halves of its ring all-reduce: per bus byte
#: (nccl-tests' busbw convention, which the points use) they run at its rate.
BORROW = {
    ("nccl-all-gather", "all-gather"): ("nccl-all-reduce", "all-reduce"),
    ("nccl-reduce-scatter", "reduce-scatter"): ("nccl-all-reduce", "all-reduce"),
}


def fit_transports(points: list[Point]) -> dict[tuple[str, str], Fit]:
    """One Fit per (transport, op) of `points`; parameters and transports without points are
    borrowed, and say from where."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        groups.setdefault(p.key, []).append(p)
    fits = {k: fit_group(g) for k, g in groups.items()}
    for key, fit in list(fits.items()):
        donor = fits.get((ALPHA_DONOR.get(key[0], ""), key[1]))
        if donor is not None:
            refit = fit_group(groups[key], fixed_alpha=donor.alpha_us)
            refit.provenance["alpha"] = (f"borrowed from {donor.transport} {donor.op} ({donor.alpha_us:.1f} us): "
                                         f"no published point small enough to pin it")
            fits[key] = refit
    for key, donor_key in BORROW.items():
        donor = fits.get(donor_key)
        if key not in fits and donor is not None:
            fits[key] = replace(donor, transport=key[0], op=key[1], points=[], ratios=[],
                                provenance={k: f"borrowed from {donor.transport} {donor.op} (no published point; "
                                               f"per bus byte as nccl-tests counts it)" for k in donor.provenance})
    donor = fits.get(RDMA_DONOR)
    for fit in fits.values():
        if fit.eta_rdma is None and donor is not None and donor.eta_rdma and fit.transport not in NVLINK_ONLY:
            fit.eta_rdma = donor.eta_rdma
            fit.alpha_rdma_us = fit.alpha_rdma_us or donor.alpha_rdma_us
            fit.provenance["eta_rdma"] = (f"borrowed from {donor.transport} {donor.op} ({donor.eta_rdma:.2f}"
                                          f"{f', {donor.alpha_rdma_us:.1f} us per call' if donor.alpha_rdma_us else ''}): "
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

#: A calibration file's "transports" are keyed "<transport>:<op>" (the op as a prepare/finalize
#: declares it: its calls included; or the transport's own collective, one call). Files of earlier
#: calibrations used these keys:
LEGACY_KEYS = {
    "nccl-all-reduce": "nccl-all-reduce:all-reduce",
    "nccl-all-to-all": "nccl-all-to-all:all-to-all",
    "all2all-ll:dispatch": "nccl-all-to-all:dispatch",
    "all2all-ll:combine": "nccl-all-to-all:combine",
}


def measured_key(key: str) -> str:
    """A calibration key, checked: '<transport>:<op>' with an op moebench.comm knows."""
    from moebench.comm import OPS

    key = LEGACY_KEYS.get(key, key)
    transport, _, op = key.partition(":")
    if not transport or op not in OPS:
        raise MoebenchError(f"unknown transport '{key}'; calibration keys are '<transport>:<op>' with op one of "
                            f"{', '.join(OPS)}")
    return key


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
        try:
            key = measured_key(key)
        except MoebenchError as e:
            raise MoebenchError(f"link measurement {p}: {e}") from None
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
    DeepEP normal past one node: one row per (token, node it reaches, its own included) over RDMA
    to the GPU of the same index there, then one per (token, rank) over NVLink from that GPU."""
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
            # DeepEP's internode kernels pass every (token, node) row through their RDMA stage,
            # its own node's included: test_internode.py counts them so and the published times
            # follow that count (the RDMA-bound rate is the same with one node or three remote)
            sent_r.index_add_(0, s2_, torch.ones_like(s2_))
            tgt = n2 * gpus_per_node + s2_ % gpus_per_node
            recv_r.index_add_(0, tgt, torch.ones_like(tgt))
    else:
        raise MoebenchError(f"unknown traffic style '{style}'")
    return LinkRows(torch.maximum(sent_n, recv_n).numpy(), torch.maximum(sent_r, recv_r).numpy())


# ---------------------------------------------------------------------------------------------
# The model a simulated run uses


#: EP transports a comparison's band is drawn from (each moves rows as `declared_traffic` says)
BAND_EP = ("deepep-ll", "pplx", "deepep-ht", "nccl-all-to-all")

#: Largest tensor (bytes per rank) a transport takes; larger ones go to the next candidate.
#: custom-all-reduce: vLLM's CustomAllreduce default max_size, 8 MiB
#: (vllm/distributed/device_communicators/custom_all_reduce.py).
MAX_BYTES = {"custom-all-reduce": 8 * 1024 * 1024}

#: Where a collective over a whole tensor moves its bytes: nccl-tests' bus bytes per rank, as a
#: share of the tensor (all-gather: the gathered tensor; reduce-scatter: its input).
BUS_FACTOR = {"all-reduce": lambda t: 2 * (t - 1) / t, "all-gather": lambda t: (t - 1) / t,
              "reduce-scatter": lambda t: (t - 1) / t, "all-to-all": lambda t: (t - 1) / t}

#: Result columns of each op.
OP_COLUMN = {"dispatch": "dispatch", "all-gather": "dispatch", "combine": "combine", "reduce-scatter": "combine",
             "all-reduce": "allreduce", "all-to-all": "dispatch"}


def collective_bytes(op: str, world: int, gpus_per_node: int, size: float) -> tuple[float, float]:
    """(NVLink, RDMA) bytes per rank of a collective over a tensor of `size` bytes (nccl-tests'
    size): its bus bytes inside one node; past one node an all-to-all sends (T - g)/T of its
    buffer over RDMA and the rest over NVLink, a ring sends 1/g of its bus bytes over each GPU's
    NIC and the rest over NVLink (one ring per channel, each crossing the node boundary at another
    GPU)."""
    bus = BUS_FACTOR[op](world) * size
    if world <= gpus_per_node:
        return bus, 0.0
    if op == "all-to-all":
        return size * (gpus_per_node - 1) / world, size * (world - gpus_per_node) / world
    return bus * (gpus_per_node - 1) / gpus_per_node, bus / gpus_per_node


def transport_label(transport: str) -> str:
    """The `allreduce` column's word for a transport: nccl-all-reduce -> nccl, custom-all-reduce -> custom."""
    return transport.removesuffix("-all-reduce")


@dataclass
class Traffic:
    """What one layer's communication works on: the whole batch's routing (M, K) over `layout`,
    `rows` rows in a collective's tensor, and the bytes of one row of each payload."""

    topk_ids: torch.Tensor | None
    layout: ParallelLayout
    num_experts: int
    rows: int
    row_bytes: dict[str, float]
    topk: int


@dataclass
class OpCost:
    """One priced operation: its time, the busiest rank's bytes and how the time was obtained."""

    op: str
    transport: str
    us: float
    bytes: float
    how: str


@dataclass
class CommResult:
    """Modeled time of one row's communication and what stands behind it.

    dispatch_us / combine_us (EP) or allreduce_us (TP); bytes: the slowest rank's bytes over the
    links (every op; for the collectives the bus bytes each rank moves); band_lo_us / band_hi_us:
    the fastest / slowest published transport for the same traffic (own model included); band:
    'name us' of each member; how: one line; costs: each op's OpCost."""

    dispatch_us: float | None = None
    combine_us: float | None = None
    allreduce_us: float | None = None
    bytes: float = 0.0
    band_lo_us: float = 0.0
    band_hi_us: float = 0.0
    band: str = ""
    how: str = ""
    costs: list[OpCost] = field(default_factory=list)

    @property
    def total_us(self) -> float:
        return sum(v or 0.0 for v in (self.dispatch_us, self.combine_us, self.allreduce_us))


@dataclass
class CommModel:
    """Links of the simulated cluster and the fits that turn traffic into time.

    nvlink / nvlink_gbps: intra-node link profile and its per-direction peak; rdma / rdma_gbps: the
    NIC per GPU between nodes; gpus_per_node: the NVLink domain (8 for an HGX box, 72 for an NVL72
    rack); source: "profile", "override" (peak replaced by --link-gbps) or "measured" (fits of a
    calibration are in use); fits: published fits; measured: fits measured on these GPUs (they
    replace the NVLink part of their transport)."""

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
        if not (math.isfinite(peak) and peak > 0):
            raise MoebenchError(f"link bandwidth must be a positive finite number of GB/s, got {peak}")
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
        """The fit pricing `op` over `transport`: its own (transport, op), else the transport's one
        operation (an all-to-all transport prices a dispatch as one of its calls)."""
        if (transport, op) in self.fits:
            return self.fits[(transport, op)]
        own = [f for (t, _), f in self.fits.items() if t == transport]
        if len(own) == 1:
            return own[0]
        known = sorted({t for t, _ in self.fits})
        if own:
            raise MoebenchError(f"transport '{transport}' has no '{op}'; it has: {', '.join(f.op for f in own)}")
        raise MoebenchError(f"unknown transport '{transport}'; known: {', '.join(known)}")

    def transports(self) -> list[str]:
        return sorted({t for t, _ in self.fits})

    def extrapolated(self, transports) -> list[str]:
        """Those of `transports` no published point backs on this NVLink (its per-direction peak)."""
        out = []
        for t in transports:
            own = [k for k in self.fits if k[0] == t]
            keys = [BORROW.get(k, k) for k in own]  # a borrowed fit stands on its donor's points
            pts = [p for k in keys if k in self.fits for p in self.fits[k].points]
            if not any(p.nvlink_peak == self.nvlink_gbps for p in pts):
                out.append(t)
        return out

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
        transfers. A measured fit (of the whole op) replaces the fixed cost and the NVLink
        bandwidth; RDMA (which a calibration inside one node cannot see) stays the published fit's."""
        if measured is not None:
            worst = measured.alpha_us
            for n, r in zip(rows.nvl.tolist(), rows.rdma.tolist()):
                if n or r:
                    t_n = n * row_bytes / (measured.gbps * 1e3)
                    t_r = fit.time_us(0, r * row_bytes, self.nvlink_gbps, self.rdma_gbps, 0) if r else 0.0
                    worst = max(worst, measured.alpha_us + max(t_n, t_r))
            return worst
        worst = fit.time_us(0, 0, self.nvlink_gbps, self.rdma_gbps, calls)
        for n, r in zip(rows.nvl.tolist(), rows.rdma.tolist()):
            if n or r:
                worst = max(worst, fit.time_us(n * row_bytes, r * row_bytes, self.nvlink_gbps, self.rdma_gbps, calls))
        return worst

    def _measured(self, transport: str, op: str, fit: Fit) -> tuple[MeasuredFit | None, bool]:
        """(measured fit, whole op?) of `transport` `op` on these GPUs: the op's own measurement
        (its calls included), else its transport's per-call one."""
        if f"{transport}:{op}" in self.measured:
            return self.measured[f"{transport}:{op}"], True
        return self.measured.get(f"{transport}:{fit.op}"), False

    # -- pricing -------------------------------------------------------------------------------
    def price(self, op, transport: str, traffic: Traffic) -> OpCost:
        """The modeled time of one declared operation (moebench.comm.CommOp) over `transport`."""
        world = traffic.layout.world_size if op.traffic == "tensor" else traffic.layout.ep_size
        check_world(world, self.gpus_per_node)
        fit = self.fit(transport, op.op)
        row = traffic.row_bytes[op.payload] + op.row_extra + traffic.topk * op.topk_extra
        mfit, whole = self._measured(transport, op.op, fit)
        if op.traffic == "tensor":
            size = traffic.rows * row
            if world <= 1:
                return OpCost(op.op, transport, 0.0, 0.0, "one rank: no communication")
            if transport in NVLINK_ONLY and world > self.gpus_per_node:
                raise MoebenchError(f"{transport} runs inside one NVLink domain of {self.gpus_per_node} GPUs, not over "
                                    f"{world} ranks")
            limit = MAX_BYTES.get(transport)
            if limit is not None and size > limit:
                raise MoebenchError(f"{transport} takes tensors up to {limit / 2**20:g} MiB, this one is {size / 2**20:.1f} MiB")
            bus = BUS_FACTOR[op.op](world) * size
            if mfit is not None and world <= self.gpus_per_node:
                us = (mfit.alpha_us + bus / (mfit.gbps * 1e3)) * (1 if whole else op.calls)
                return OpCost(op.op, transport, us, bus, f"{transport} measured fit ({mfit.alpha_us:.1f} us + bytes / {mfit.gbps:.0f} GB/s)")
            nvl, rdma = collective_bytes(op.op, world, self.gpus_per_node, size)
            us = fit.time_us(nvl, rdma, self.nvlink_gbps, self.rdma_gbps, op.calls)
            where = "NVLink" if not rdma else "NVLink and RDMA"
            return OpCost(op.op, transport, us, bus, f"{fit.describe()} over {where}")
        style = "node" if (op.traffic == "rank" and world > self.gpus_per_node) else op.traffic
        rows = ep_link_rows(traffic.topk_ids, traffic.layout, traffic.num_experts, self.gpus_per_node, style)
        chunks = math.ceil(math.ceil(traffic.rows / world) / op.chunk) if op.chunk else 1
        calls = (op.calls if mfit is None or not whole else 1) * chunks
        us = self._op_us(fit, rows, row, calls, mfit)
        if mfit is not None and chunks > 1:  # a measured fit prices one call: its fixed cost once per chunk
            us += (chunks - 1) * mfit.alpha_us
        how = (f"{transport} {op.op} measured fit" if mfit is not None else fit.describe())
        if op.calls * chunks > 1:
            how = f"{op.calls * chunks} calls{f' ({chunks} chunks of {op.chunk} tokens per rank)' if chunks > 1 else ''}: {how}"
        return OpCost(op.op, transport, us, rows.busiest(row), how)

    def price_ops(self, ops, traffic: Traffic, choice: dict[str, str] | None = None) -> CommResult:
        """Price a prepare/finalize's declared operations; `choice`: op -> transport where the op
        has several (default: its first)."""
        res = CommResult()
        parts = {}
        for op in ops:
            transport = (choice or {}).get(op.op, op.transports[0])
            cost = self.price(op, transport, traffic)
            res.costs.append(cost)
            col = OP_COLUMN[op.op]
            parts[col] = parts.get(col, 0.0) + cost.us
            res.bytes += cost.bytes
        res.dispatch_us, res.combine_us, res.allreduce_us = (parts.get(c) for c in ("dispatch", "combine", "allreduce"))
        res.how = "; ".join(f"{c.op}: {c.how}" for c in res.costs)
        self.band(res, ops, traffic)
        return res

    def candidates(self, op, traffic: Traffic) -> list[str]:
        """The transports of `op` that can carry this traffic (a size limit, a missing fit)."""
        out = []
        for t in op.transports:
            try:
                self.price(op, t, traffic)
            except MoebenchError:
                continue
            out.append(t)
        return out

    def band(self, res: CommResult, ops, traffic: Traffic) -> CommResult:
        """Fill res.band_*: for dispatch/combine the fastest and the slowest published EP transport
        for this traffic; for collectives the spread of their fits' published points."""
        if any(op.traffic != "tensor" for op in ops):
            members = self.band_members(traffic)
            vals = list(members.values()) + [res.total_us]
            res.band_lo_us, res.band_hi_us = min(vals), max(vals)
            res.band = ", ".join(f"{k} {v:.0f} us" for k, v in sorted(members.items(), key=lambda kv: kv[1]))
            return res
        ratios = [r for c in res.costs if c.us for r in self.fit(c.transport, c.op).ratios] or [1.0]
        lo, hi = min(min(ratios), 1.0), max(max(ratios), 1.0)
        res.band_lo_us, res.band_hi_us = res.total_us * lo, res.total_us * hi
        names = sorted({c.transport for c in res.costs})
        res.band = f"{', '.join(names)} published spread x{lo:.2f}..x{hi:.2f}"
        return res

    def band_members(self, traffic: Traffic) -> dict[str, float]:
        """dispatch + combine (us) of every published EP transport that applies to this traffic
        (their published fits, with this model's links): past one node only those with published
        RDMA points; below half its smallest published message not one whose fixed cost (of either
        op) no point pins."""
        layout = traffic.layout
        dispatch_row, combine_row = traffic.row_bytes["activations"], traffic.row_bytes["outputs"]
        multi = layout.ep_size > self.gpus_per_node
        cache: dict[str, LinkRows] = {}
        out = {}
        for transport in BAND_EP:
            style = declared_traffic(transport)
            ops = ("all-to-all", "all-to-all") if transport == "nccl-all-to-all" else ("dispatch", "combine")
            if any((transport, op) not in self.fits for op in ops):
                continue
            fd, fc = self.fits[(transport, ops[0])], self.fits[(transport, ops[1])]
            if multi and not all(any(p.rdma_bytes > 0 for p in f.points) for f in (fd, fc)):
                continue
            st = "node" if (style == "rank" and multi) else style
            if st not in cache:
                cache[st] = ep_link_rows(traffic.topk_ids, layout, traffic.num_experts, self.gpus_per_node, st)
            rows = cache[st]
            # a transport whose fixed cost no point pins is not trusted below its published sizes
            if not (fd.alpha_pinned or fc.alpha_pinned) and (
                    rows.busiest(dispatch_row) < fd.min_bytes or rows.busiest(combine_row) < fc.min_bytes):
                continue
            out[transport] = self._op_us(fd, rows, dispatch_row) + self._op_us(fc, rows, combine_row)
        return out


# ---------------------------------------------------------------------------------------------
# One question: what does this collective or dispatch/combine cost (`moebench comm`)

#: how rows of a dispatch / combine travel per transport, where no prepare/finalize declares it
#: (pplx is published, not run by moebench)
UNDECLARED_TRAFFIC = {"pplx": "pair", "pplx-kernels": "pair"}


@functools.lru_cache(maxsize=None)
def declared_traffic(transport: str) -> str:
    """'pair' or 'rank': how the prepare/finalize that uses `transport` for its dispatch moves rows."""
    from moebench.backends import get_prepare_finalize_class, prepare_finalize_names

    for name in prepare_finalize_names():
        for op in get_prepare_finalize_class(name).communication:
            if transport in op.transports and op.traffic != "tensor":
                return op.traffic
    return UNDECLARED_TRAFFIC.get(transport, "pair")


def row_payload(dtype: str, hidden: int) -> int:
    """Bytes of one token row: fp8 with one fp32 scale per 128 values, or bf16."""
    return hidden + 4 * math.ceil(hidden / 128) if dtype == "fp8" else 2 * hidden


def ask(model: "CommModel", transport: str, op: str, world: int, size: float | None = None, *,
        tokens: int | None = None, hidden: int | None = None, topk: int | None = None,
        experts: int | None = None, dtype: str = "bf16", gpu: str = "") -> dict:
    """The modeled time of one `op` over `transport` on `world` ranks, for `size` bytes per rank
    (as nccl-tests counts them; a dispatch / combine: its rows as the source counts them, local
    pairs included) or for `tokens` per rank routed uniformly (top-`topk` of `experts`, rows of
    `hidden` in `dtype`; a combine carries bf16). Returns time_us, the bytes on each link, the fit
    and its provenance, the published points nearest to the question with published / modeled,
    and what is extrapolated."""
    if (transport, op) not in model.fits:
        own = sorted(o for t, o in model.fits if t == transport)
        if own:
            raise MoebenchError(f"transport '{transport}' has no '{op}'; it has: {', '.join(own)}")
        raise MoebenchError(f"unknown transport '{transport}'; known: {', '.join(model.transports())}")
    if world < 2:
        raise MoebenchError(f"--world-size must be at least 2, got {world}")
    check_world(world, model.gpus_per_node)
    if transport in NVLINK_ONLY and world > model.gpus_per_node:
        raise MoebenchError(f"{transport} runs inside one NVLink domain ({model.gpus_per_node} GPUs here), not over "
                            f"{world} ranks")
    fit = model.fits[(transport, op)]
    gpn = model.gpus_per_node
    tensor = op in BUS_FACTOR
    how = ""
    if size is None:
        if tokens is None or hidden is None or tokens < 1 or hidden < 1:
            raise MoebenchError("give --bytes N, or --tokens M with --hidden H (and --topk K --num-experts E for a "
                                "dispatch or combine)")
        row = row_payload("bf16" if op == "combine" else dtype, hidden)
        if tensor:
            size = float(tokens * row)
            how = f"{tokens} tokens x {row} B"
    if tensor or tokens is None:
        if not (math.isfinite(size) and size > 0):
            raise MoebenchError(f"--bytes must be a positive number, got {size:g}")
        if tensor:
            nvl, rdma = collective_bytes(op, world, gpn, size)
            how = how or f"{size:.0f} B per rank"
            how += f"; bus bytes {BUS_FACTOR[op](world) * size:.0f} (nccl-tests' busbw convention)"
        else:  # rows as DeepEP / pplx count them (local pairs included): the share to each link
            nvl, rdma = size * (min(world, gpn) - 1) / world, size * max(world - gpn, 0) / world
            how = f"{size:.0f} B per rank, local rows included: {min(world, gpn) - 1}/{world} over NVLink, "                   f"{max(world - gpn, 0)}/{world} over RDMA"
        us = fit.time_us(nvl, rdma, model.nvlink_gbps, model.rdma_gbps)
        total = nvl + rdma
    else:
        from moebench.routing import make_routing

        if not topk or not experts or topk > experts or experts % world:
            raise MoebenchError("a dispatch or combine needs --topk K and --num-experts E with K <= E and E a "
                                f"multiple of --world-size {world}")
        _, ids = make_routing("uniform", tokens * world, experts, topk, seed=0)
        style = declared_traffic(transport)
        style = "node" if (style == "rank" and world > gpn) else style
        rows = ep_link_rows(ids, ParallelLayout(dp=world, enable_ep=True), experts, gpn, style)
        row = row_payload("bf16" if op == "combine" else dtype, hidden)
        us = model._op_us(fit, rows, row)
        i = int(np.argmax((rows.nvl + rows.rdma)))
        nvl, rdma = float(rows.nvl[i] * row), float(rows.rdma[i] * row)
        total = nvl + rdma
        how = (f"{tokens} tokens per rank, top-{topk} of {experts} experts uniformly, {row} B rows, "
               f"one row per {'(token, expert) pair' if style == 'pair' else '(token, rank)'}: busiest rank")

    def distance(p: Point) -> tuple:
        pb = p.nvlink_bytes + p.rdma_bytes
        return (p.world_size != world, p.nvlink_peak != model.nvlink_gbps, abs(math.log(max(pb, 1) / max(total, 1))))

    near = sorted(fit.points, key=distance)[:3]
    extrapolated = []
    if fit.points:
        sizes = [p.nvlink_bytes + p.rdma_bytes for p in fit.points]
        if not any(p.nvlink_peak == model.nvlink_gbps for p in fit.points):
            extrapolated.append(f"no published {transport} {op} point on a {model.nvlink_gbps:g} GB/s NVLink")
        if not any(p.world_size == world for p in fit.points):
            extrapolated.append(f"no published point at {world} ranks")
        if total < min(sizes) / 2 or total > max(sizes) * 2:
            extrapolated.append(f"{total / 1e6:.3g} MB on the links is outside the published "
                                f"{min(sizes) / 1e6:.3g}..{max(sizes) / 1e6:.3g} MB")
    else:
        extrapolated.append(f"no published point of its own: {'; '.join(sorted(set(fit.provenance.values())))}")
    return {
        "transport": transport, "op": op, "gpu": gpu, "world_size": world, "gpus_per_node": gpn,
        "nvlink": model.nvlink, "nvlink_gbps": model.nvlink_gbps, "rdma": model.rdma if world > gpn else "",
        "time_us": us, "nvlink_bytes": nvl, "rdma_bytes": rdma, "bytes_how": how, "fit": fit.describe(),
        "provenance": dict(fit.provenance),
        "nearest": [{"point": p.label(), "gpu": p.gpu, "source": p.source, "line": p.line, "published_us": p.time_us,
                     "modeled_us": fit.predict(p), "ratio": p.time_us / fit.predict(p)} for p in near],
        "extrapolated": extrapolated,
    }


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
