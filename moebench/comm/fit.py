"""The fit of the communication model to its published points: per (transport, op) a fixed cost
and a share of each link's peak (one or more lines, as NCCL picks a protocol by message size),
least squares on the relative error; what no point determines is borrowed and says from where.

One call costs, on its best line,

    t = calls * (alpha + alpha_rdma [past one node]) + max(nvlink_bytes / (eta_nvl * NVLink peak),
                                                          rdma_bytes / (eta_rdma * RDMA peak))
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from moebench.comm.points import POINTS_FILE, Point, load_points
from moebench.errors import MoebenchError

#: Parameters a (transport, op) has no points for come from this fit (a bulk transfer over CX7).
RDMA_DONOR = ("deepep-ht", "dispatch")

#: A fixed cost that makes up at least this share of some point's time is pinned by the data;
#: a transport whose fixed cost is not pinned is not trusted below half its smallest message.
PINNED_SHARE = 0.25



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
    donors: dict[str, tuple[str, str]] = field(default_factory=dict)
    by_world: dict[int, "Fit"] = field(default_factory=dict)

    def for_world(self, world: int, gpus_per_node: int) -> "Fit":
        """The fit of `world` ranks inside one domain where published points of that size have
        one of their own (WORLD_CLASS_POINTS), else this one."""
        return self.by_world.get(world, self) if world <= gpus_per_node else self

    @property
    def key(self) -> tuple[str, str]:
        return (self.transport, self.op)

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
        fit = self.for_world(pt.world_size, pt.gpus_per_node)
        return fit.time_us(pt.nvlink_bytes, pt.rdma_bytes, pt.nvlink_peak, pt.rdma_peak, pt.calls)

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
ALPHA_DONOR = {"deepep-ht": "deepep-ll", "deepep-v2": "deepep-ll"}


#: Transports without points of their own, priced by another's fit: (transport, op) -> donor.
#: NCCL's all-gather and reduce-scatter are the two halves of its ring all-reduce: per bus byte
#: (nccl-tests' busbw convention, which the points use) they run at its rate.
BORROW = {
    ("nccl-all-gather", "all-gather"): ("nccl-all-reduce", "all-reduce"),
    ("nccl-reduce-scatter", "reduce-scatter"): ("nccl-all-reduce", "all-reduce"),
}


@dataclass(frozen=True)
class SmScaling:
    """How a transport's NVLink rate follows the SMs it runs on: 1 / rate = a + b / SMs, through
    two published rates at two SM counts (`published`: ((sms, GB/s), (sms, GB/s))); its points were
    taken at `points_sms`; `default_sms`: the library's own default."""

    points_sms: int
    default_sms: int
    published: tuple[tuple[int, float], tuple[int, float]]
    source: str

    def factor(self, sms: int) -> float:
        """The NVLink rate at `sms` SMs over the rate at the points' SM count."""
        (s1, g1), (s2, g2) = self.published
        b = (1 / g1 - 1 / g2) / (1 / s1 - 1 / s2)
        a = 1 / g2 - b / s2
        return (a + b / self.points_sms) / (a + b / sms)


#: DeepEP's normal kernels: the published points ran at 24 SMs (DeepEP's tests: test_intranode.py /
#: test_internode.py num_sms = 24), `Buffer.num_sms` defaults to 20 (deep_ep/buffers/legacy.py);
#: the only published rates at two SM counts are DeepEP's SM100 EP8 NVLink figures (README.md,
#: Performance: 643 / 726 GB/s dispatch and 675 / 740 GB/s combine at 24 / 64 SMs).
SM_SOURCE = "deepseek-ai/DeepEP README.md (Performance: SM100 EP8 NVLink at 24 and 64 SMs)"
SM_SCALING = {
    ("deepep-ht", "dispatch"): SmScaling(24, 20, ((24, 643.0), (64, 726.0)), SM_SOURCE),
    ("deepep-ht", "combine"): SmScaling(24, 20, ((24, 675.0), (64, 740.0)), SM_SOURCE),
    # DeepEP V2's NVLink point is its 64-SM ("Max perf") figure; V2 picks its SM count itself
    ("deepep-v2", "dispatch"): SmScaling(64, 64, ((24, 643.0), (64, 726.0)), SM_SOURCE),
    ("deepep-v2", "combine"): SmScaling(64, 64, ((24, 675.0), (64, 740.0)), SM_SOURCE),
}


def with_sms(fit: Fit, sms: int | None) -> Fit:
    """`fit` at `sms` SMs (None: the library's default) where its transport's rate follows its SMs
    (SM_SCALING): its NVLink rates scaled, and said so in its provenance; else `fit` itself."""
    sc = SM_SCALING.get(fit.key)
    if sc is None:
        return fit
    sms = sc.default_sms if sms is None else sms
    if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
        raise MoebenchError(f"--num-sms must be a positive integer, got {sms!r}")
    k = sc.factor(sms)
    if sms == sc.points_sms:
        return fit
    out = replace(fit, lines=[(a, None if e is None else e * k) for a, e in fit.lines],
                  eta_nvl=None if fit.eta_nvl is None else fit.eta_nvl * k, provenance=dict(fit.provenance))
    out.provenance["sms"] = (f"{sms} SMs: NVLink rate x{k:.3f} of the points' {sc.points_sms} (1 / rate = a + b / SMs "
                             f"through {sc.source})")
    return out


#: RDMA links whose published points are fitted as a factor on the transports' own RDMA fits (a
#: share of their rate, a fixed cost per call), not into them: AWS EFA (pplx's EFA column beside
#: its ConnectX-7 one, perplexityai/pplx-garden docs/fabric-lib.md).
LINK_FITTED = ("efa-400g",)


@dataclass
class LinkFit:
    """An RDMA link priced from the transports' fits: eta_factor x their RDMA rate, alpha_us more
    per call over it; points: its published points, ratios: published / modeled of each."""

    rdma: str
    eta_factor: float
    alpha_us: float
    points: list[Point] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)

    def apply(self, fit: Fit) -> Fit:
        if fit.eta_rdma is None:
            return fit
        out = replace(fit, eta_rdma=fit.eta_rdma * self.eta_factor, alpha_rdma_us=fit.alpha_rdma_us + self.alpha_us,
                      provenance=dict(fit.provenance))
        out.provenance["rdma_link"] = self.describe()
        return out

    def describe(self) -> str:
        return (f"{self.rdma}: x{self.eta_factor:.2f} of the RDMA rate, +{self.alpha_us:.1f} us per call "
                f"(fit of {len(self.points)} published points over it)")


def fit_links(points: list[Point], fits: dict[tuple[str, str], Fit]) -> dict[str, LinkFit]:
    """One LinkFit per link of LINK_FITTED that `points` (over it) have, holding `fits` fixed."""
    out = {}
    for rdma in LINK_FITTED:
        mine = [p for p in points if p.rdma == rdma and p.key in fits]
        if not mine:
            continue
        t_pub = np.array([p.time_us for p in mine])

        def loss(lx, mine=mine, t_pub=t_pub, rdma=rdma):
            link = LinkFit(rdma, float(np.exp(lx[0])), float(np.exp(lx[1])))
            t = np.array([link.apply(fits[p.key]).predict(p) for p in mine])
            return float(((t / t_pub - 1.0) ** 2).sum())

        best = min((_nelder_mead(loss, np.log(np.array(x0))) for x0 in ((0.8, 5.0), (0.5, 30.0))), key=loss)
        link = LinkFit(rdma, float(np.exp(best[0])), float(np.exp(best[1])), list(mine))
        link.ratios = [p.time_us / link.apply(fits[p.key]).predict(p) for p in mine]
        out[rdma] = link
    return out


#: Published points of one world size below REFERENCE_WORLD inside one NVLink domain make a fit of
#: their own (fixed cost and bandwidth lines of that size: NCCL's ring and the custom all-reduce
#: change algorithm and step count with the ranks) once there are this many; the main fit is
#: then made of the other sizes' points.
WORLD_CLASS_POINTS = 3
REFERENCE_WORLD = 8


def _world_classes(group: list[Point]) -> tuple[list[Point], dict[int, list[Point]]]:
    by: dict[int, list[Point]] = {}
    for p in group:
        if p.world_size < REFERENCE_WORLD and p.world_size <= p.gpus_per_node and not p.rdma_bytes:
            by.setdefault(p.world_size, []).append(p)
    classes = {w: pts for w, pts in by.items() if len(pts) >= WORLD_CLASS_POINTS}
    inside = {id(p) for pts in classes.values() for p in pts}
    return [p for p in group if id(p) not in inside], classes


def fit_transports(points: list[Point]) -> dict[tuple[str, str], Fit]:
    """One Fit per (transport, op) of `points` (those over a LINK_FITTED link aside), with fits
    of its own for world sizes that have enough points (`_world_classes`); parameters and
    transports without points are borrowed, and say from where."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        if p.rdma not in LINK_FITTED:
            groups.setdefault(p.key, []).append(p)
    classes: dict[tuple[str, str], dict[int, Fit]] = {}
    for key in list(groups):
        rest, cls = _world_classes(groups[key])
        for world, pts in sorted(cls.items()):
            sub = fit_group(pts)
            if sub.alpha_pinned:  # large messages alone leave a size's fixed cost to the main fit
                classes.setdefault(key, {})[world] = sub
            else:
                rest += pts
        groups[key] = rest
    fits = {k: fit_group(g) for k, g in groups.items() if g}
    for key, cls in classes.items():
        for world, sub in sorted(cls.items()):
            sub.provenance = {k: f"{v} at {world} ranks" for k, v in sub.provenance.items()}
            if key in fits:
                fits[key].by_world[world] = sub
            else:  # only this size is published: it stands for the others too, and says so
                fits[key] = sub
    for key, fit in list(fits.items()):
        donor = fits.get((ALPHA_DONOR.get(key[0], ""), key[1]))
        if donor is not None:
            refit = fit_group(groups[key], fixed_alpha=donor.alpha_us)
            refit.donors["alpha"] = donor.key
            refit.provenance["alpha"] = (f"borrowed from {donor.transport} {donor.op} ({donor.alpha_us:.1f} us): "
                                         f"no published point small enough to pin it")
            fits[key] = refit
    for key, donor_key in BORROW.items():
        donor = fits.get(donor_key)
        if key not in fits and donor is not None:
            def borrowed(fit: Fit, where: str = "") -> Fit:
                return replace(fit, transport=key[0], op=key[1], points=[], ratios=[], by_world={},
                               donors={k: donor_key for k in fit.provenance},
                               provenance={k: f"borrowed from {donor.transport} {donor.op}{where} (no published point; "
                                              f"per bus byte as nccl-tests counts it)" for k in fit.provenance})

            fits[key] = borrowed(donor)
            fits[key].by_world = {w: borrowed(g, f" at {w} ranks") for w, g in donor.by_world.items()}
    donor = fits.get(RDMA_DONOR)
    for fit in fits.values():
        if fit.eta_rdma is None and donor is not None and donor.eta_rdma and fit.transport not in NVLINK_ONLY:
            fit.eta_rdma = donor.eta_rdma
            fit.donors["eta_rdma"] = donor.key
            fit.alpha_rdma_us = fit.alpha_rdma_us or donor.alpha_rdma_us
            fit.provenance["eta_rdma"] = (f"borrowed from {donor.transport} {donor.op} ({donor.eta_rdma:.2f}"
                                          f"{f', {donor.alpha_rdma_us:.1f} us per call' if donor.alpha_rdma_us else ''}): "
                                          f"no published RDMA point")
    return fits


@functools.lru_cache(maxsize=4)
def _published(path: str) -> tuple[dict[tuple[str, str], Fit], dict[str, LinkFit]]:
    points = load_points(path)
    fits = fit_transports(points)
    return fits, fit_links(points, fits)


def published_fits(path: str | Path | None = None) -> dict[tuple[str, str], Fit]:
    """The fits of the shipped table (cached; callers must not mutate them)."""
    return _published(str(Path(path) if path is not None else POINTS_FILE))[0]


def published_link_fits(path: str | Path | None = None) -> dict[str, LinkFit]:
    """The RDMA links of LINK_FITTED fitted on the shipped table's points over them (cached)."""
    return _published(str(Path(path) if path is not None else POINTS_FILE))[1]


def predict(p: Point, fits: dict[tuple[str, str], Fit] | None = None,
            links: dict[str, LinkFit] | None = None) -> float:
    """The modeled time of point p: its (transport, op)'s fit, over its RDMA link's fit where it
    has one (the published ones by default)."""
    fits = published_fits() if fits is None else fits
    links = published_link_fits() if links is None else links
    fit = fits[p.key]
    return (links[p.rdma].apply(fit) if p.rdma in links else fit).predict(p)


def worst_point(fits: dict[tuple[str, str], Fit]) -> tuple[Point, float]:
    """The point whose published / modeled ratio is furthest from 1, and that ratio."""
    pairs = [(p, r) for f in fits.values() for g in (f, *f.by_world.values()) for p, r in zip(g.points, g.ratios)]
    return max(pairs, key=lambda pr: max(pr[1], 1 / pr[1]))


def points_off(fits: dict[tuple[str, str], Fit], tolerance: float = 0.2) -> list[tuple[Point, float]]:
    """Points the model misses by more than `tolerance` (published / modeled outside 1 +- tol)."""
    return [(p, r) for f in fits.values() for g in (f, *f.by_world.values()) for p, r in zip(g.points, g.ratios)
            if abs(r - 1.0) > tolerance]



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

