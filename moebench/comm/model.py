"""The communication model of simulated runs: the time of each declared operation
(moebench.comm.CommOp) of a prepare/finalize, from the fits of published points (moebench.comm.fit)
or of this machine's (moebench.comm.calibration), over the links of moebench.comm.links, for the
traffic counted by moebench.comm.traffic.

Per transport and operation (dispatch, combine, all-to-all, all-reduce) the time of one call is

    t = calls * alpha + max(nvlink_bytes / (eta_nvl * NVLink peak), rdma_bytes / (eta_rdma * RDMA peak))

alpha: the fixed cost of one call (us); eta_*: the share of the link's per-direction peak the
transport reaches with large messages; *_bytes: what the slowest rank sends or receives (the larger)
over each kind of link. The effective bandwidth bytes / t therefore rises with the message size.
Hierarchical: past one node (--gpus-per-node, default 8) traffic to GPUs of the same node goes
over NVLink, traffic to other nodes over RDMA, at the same time (hence the max).

The model is given the operations the prepare/finalize backends declare (`CommModel.from_link(link,
ops)`): how each transport moves its rows comes from them, never from a backend's name.

Transports and what moebench maps to them:
    deepep-ll        DeepEP low-latency dispatch / combine (moebench's `deepep-ll`)
    pplx             pplx-kernels dispatch / combine over NVLink (not run by moebench; band only)
    deepep-ht        DeepEP normal (high-throughput) kernels (moebench's `deepep-ht`)
    nccl-all-to-all  torch.distributed.all_to_all_single over NCCL; moebench's `all2all-ll` is a
                     count exchange + two such calls (dispatch) and one (combine)
    nccl-all-reduce  NCCL ring all-reduce (TP); all-gather / reduce-scatter (`allgather-rs`) use
                     its per-step cost and efficiency
    custom-all-reduce  the one-shot / two-shot all-reduce through peer memory (vLLM, SGLang)

Real measurements replace the published fit where they exist: `moebench env --calibrate-link`
writes per-transport fits measured on this machine's GPUs (`calibration.measured_fits`); the model
uses them for the NVLink part of the transports they cover and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moebench.comm.calibration import MeasuredFit, measured_fits
from moebench.comm.fit import (BORROW, NVLINK_ONLY, Fit, LinkFit, fits_table, published_fits, published_link_fits,
                               with_sms)
from moebench.comm.fit import predict as point_us
from moebench.comm.links import (DEFAULT_GPUS_PER_NODE, DEFAULT_RDMA, LINK_PROFILES, RDMA_GBPS, check_world,
                                 default_link, rdma_gbps)
from moebench.comm.points import Point
from moebench.comm.traffic import (BUS_FACTOR, LinkRows, Traffic, collective_bytes, dtype_row_bytes,
                                   ep_link_rows)
from moebench.errors import MoebenchError
from moebench.layout import ParallelLayout

#: how rows of a dispatch / combine travel for transports no prepare/finalize declares
#: (pplx is published, not run by moebench)
UNDECLARED_TRAFFIC = {"pplx": "pair", "pplx-kernels": "pair", "mori": "pair", "deepep-v2": "rank"}


def traffic_styles(ops) -> dict[str, str]:
    """transport -> 'pair' or 'rank': how the declared operations `ops` (moebench.comm.CommOp of
    every prepare/finalize, in the registry's order: the first declaration of a transport counts)
    move the rows of each dispatch / combine transport."""
    out: dict[str, str] = {}
    for op in ops:
        if op.traffic != "tensor":
            for t in op.transports:
                out.setdefault(t, op.traffic)
    for t, style in UNDECLARED_TRAFFIC.items():
        out.setdefault(t, style)
    return out



#: EP transports a comparison's band is drawn from (each moves rows as its declaration says)
BAND_EP = ("deepep-ll", "pplx", "deepep-ht", "nccl-all-to-all")

#: Largest tensor (bytes per rank) a transport takes; larger ones go to the next candidate.
#: custom-all-reduce: vLLM's CustomAllreduce default max_size, 8 MiB
#: (vllm/distributed/device_communicators/custom_all_reduce.py).
MAX_BYTES = {"custom-all-reduce": 8 * 1024 * 1024}

#: Result columns of each op.
OP_COLUMN = {"dispatch": "dispatch", "all-gather": "dispatch", "combine": "combine", "reduce-scatter": "combine",
             "all-reduce": "allreduce", "all-to-all": "dispatch"}


def transport_label(transport: str) -> str:
    """The `allreduce` column's word for a transport: nccl-all-reduce -> nccl, custom-all-reduce -> custom."""
    return transport.removesuffix("-all-reduce")


@dataclass
class OpCost:
    """One priced operation: its time, the busiest rank's bytes (rdma_bytes: the most any rank
    sends over RDMA) and how the time was obtained."""

    op: str
    transport: str
    us: float
    bytes: float
    how: str
    rdma_bytes: float = 0.0


@dataclass
class CommResult:
    """Modeled time of one row's communication and what stands behind it.

    dispatch_us / combine_us (EP) or allreduce_us (TP); bytes: the slowest rank's bytes over the
    links (every op; for the collectives the bus bytes each rank moves); band_lo_us / band_hi_us:
    the fastest / slowest published transport for the same traffic (own model included); band:
    'name us' of each member; how: one line; costs: each op's OpCost; column_bytes: the bytes
    behind each result column ("dispatch", "combine", "allreduce"), in the count its time comes
    from (moebench.comm.traffic "link")."""

    dispatch_us: float | None = None
    combine_us: float | None = None
    allreduce_us: float | None = None
    bytes: float = 0.0
    rdma_bytes: float = 0.0
    band_lo_us: float = 0.0
    band_hi_us: float = 0.0
    band: str = ""
    how: str = ""
    costs: list[OpCost] = field(default_factory=list)
    column_bytes: dict[str, float] = field(default_factory=dict)

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
    replace the NVLink part of their transport); styles: transport -> how its dispatch / combine
    rows travel ('pair', 'rank'), from the operations the prepare/finalize backends declare
    (`traffic_styles`)."""

    nvlink: str
    nvlink_gbps: float
    rdma: str = DEFAULT_RDMA
    rdma_gbps: float = RDMA_GBPS[DEFAULT_RDMA]
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    source: str = "profile"
    fits: dict[tuple[str, str], Fit] = field(default_factory=published_fits)
    measured: dict[str, MeasuredFit] = field(default_factory=dict)
    measured_line: str = ""
    styles: dict[str, str] = field(default_factory=lambda: dict(UNDECLARED_TRAFFIC))
    num_sms: int | None = None
    links: dict[str, LinkFit] = field(default_factory=published_link_fits)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_link(cls, link, ops, rdma: str = DEFAULT_RDMA, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
                  device_name: str | None = None, use_measurement: bool = True,
                  num_sms: int | None = None) -> "CommModel":
        """From a links.LinkProfile (`--link` / `--link-gbps` / the default for the device) and the
        operations the prepare/finalize backends declare (`ops`: moebench.comm.CommOp):
        its bandwidth is the NVLink peak (a measured profile's is an effective all-to-all figure,
        so the device's datasheet profile gives the peak then); measured fits of `device_name`
        are used where a calibration file has them, unless --link-gbps overrode the link
        (override > measurement > profile, as links.choose_link). num_sms: the SMs DeepEP's normal
        kernels run on (None: DeepEP's default; fit.SM_SCALING)."""
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
                   gpus_per_node=gpus_per_node, source=source, measured=measured, measured_line=line,
                   styles=traffic_styles(ops), num_sms=num_sms)

    def as_dict(self) -> dict:
        """Plain figures for a run's metadata."""
        return {"name": self.nvlink, "bandwidth_gbps": self.nvlink_gbps,  # the LinkProfile keys earlier runs wrote
                "nvlink": self.nvlink, "nvlink_gbps": self.nvlink_gbps, "rdma": self.rdma, "rdma_gbps": self.rdma_gbps,
                "gpus_per_node": self.gpus_per_node, "source": self.source, "measured": self.measured_line,
                "fits": fits_table(self.fits)}

    # -- helpers -----------------------------------------------------------------------------
    def fit(self, transport: str, op: str, world: int = 0) -> Fit:
        """The fit pricing `op` over `transport` (on `world` ranks: the fit of that size where its
        published points have one): its own (transport, op), else the transport's one operation
        (an all-to-all transport prices a dispatch as one of its calls)."""
        if (transport, op) in self.fits:
            return self._priced(self.fits[(transport, op)].for_world(world, self.gpus_per_node))
        own = [f for (t, _), f in self.fits.items() if t == transport]
        if len(own) == 1:
            return self._priced(own[0].for_world(world, self.gpus_per_node))
        known = sorted({t for t, _ in self.fits})
        if own:
            raise MoebenchError(f"transport '{transport}' has no '{op}'; it has: {', '.join(f.op for f in own)}")
        raise MoebenchError(f"unknown transport '{transport}'; known: {', '.join(known)}")

    @property
    def vendor(self) -> str:
        """Whose GPUs the intra-node link joins ("nvidia", "amd"; a measured link: its GPU's)."""
        prof = LINK_PROFILES.get(self.nvlink)
        return prof.vendor if prof is not None else "nvidia"

    def points_behind(self, fit: Fit) -> list:
        """Every published point `fit` stands on: its own, its donors', its RDMA link's of it."""
        pts = list(fit.points)
        for key in dict.fromkeys(fit.donors.values()):
            if key in self.fits:
                pts += self.fits[key].points
        link = self.links.get(self.rdma)
        if link is not None:
            pts += [p for p in link.points if p.key == fit.key]
        return pts

    def _priced(self, fit: Fit) -> Fit:
        """`fit` on these links: refused where no point of it is on this vendor's GPUs; at
        num_sms SMs where its transport follows its SMs; over a fitted RDMA link's figures."""
        pts = self.points_behind(fit)
        if pts and not any(LINK_PROFILES[p.nvlink].vendor == self.vendor for p in pts):
            vendors = sorted({LINK_PROFILES[p.nvlink].vendor for p in pts})
            raise MoebenchError(f"{fit.transport} {fit.op} has no published point on {self.vendor.upper()} GPUs "
                                f"({self.nvlink}; its points are {', '.join(v.upper() for v in vendors)}): not modeled")
        fit = with_sms(fit, self.num_sms)
        link = self.links.get(self.rdma)
        return link.apply(fit) if link is not None else fit

    def style(self, transport: str) -> str:
        """'pair' or 'rank': how `transport` moves the rows of a dispatch / combine (as declared)."""
        return self.styles.get(transport, "pair")

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
        fit = self.fit(transport, op.op, world)
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
            return OpCost(op.op, transport, us, bus, f"{fit.describe()} over {where}", rdma)
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
        return OpCost(op.op, transport, us, rows.busiest(row), how, float(rows.rdma.max() * row) if rows.rdma.size else 0.0)

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
            res.column_bytes[col] = res.column_bytes.get(col, 0.0) + cost.bytes
            res.bytes += cost.bytes
            res.rdma_bytes += cost.rdma_bytes
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
        world = traffic.layout.world_size
        ratios = [r for c in res.costs if c.us for r in self.fit(c.transport, c.op, world).ratios] or [1.0]
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
            style = self.style(transport)
            ops = ("all-to-all", "all-to-all") if transport == "nccl-all-to-all" else ("dispatch", "combine")
            if any((transport, op) not in self.fits for op in ops):
                continue
            fd, fc = self.fit(transport, ops[0]), self.fit(transport, ops[1])
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


def size_class(world: int, gpus_per_node: int) -> str:
    """The size class of a world of ranks: "2 ranks", "4 ranks", "8 ranks" inside one NVLink domain
    (others by their count), "N nodes" past one."""
    if world > gpus_per_node:
        return f"{world // gpus_per_node} nodes"
    return f"{world} ranks"


def ask(model: "CommModel", transport: str, op: str, world: int, size: float | None = None, *,
        tokens: int | None = None, hidden: int | None = None, topk: int | None = None,
        experts: int | None = None, dtype: str = "bf16", gpu: str = "", max_nodes: int | None = None) -> dict:
    """The modeled time of one `op` over `transport` on `world` ranks, for `size` bytes per rank
    (as nccl-tests counts them; a dispatch / combine: its rows as the source counts them, local
    pairs included) or for `tokens` per rank routed uniformly (top-`topk` of `experts`, rows of
    `hidden` in `dtype`; a combine carries bf16). Returns time_us, the bytes on each link, the fit
    and its provenance, every published point behind it (`points`: its own and its donors'), the
    nearest ones with published / modeled, and what is extrapolated (no point of this GPU's link,
    RDMA link or size class). max_nodes: each token reaches at most this many nodes (node-limited
    routing, as DeepSeek-V3's router; with --tokens past one node)."""
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
    fit = model.fit(transport, op, world)
    gpn = model.gpus_per_node
    tensor = op in BUS_FACTOR
    how = ""
    if size is None:
        if tokens is None or hidden is None or tokens < 1 or hidden < 1:
            raise MoebenchError("give --bytes N, or --tokens M with --hidden H (and --topk K --num-experts E for a "
                                "dispatch or combine)")
        row = dtype_row_bytes("bf16" if op == "combine" else dtype, hidden)
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
        nodes = world // gpn if world > gpn else 1
        groups = None
        if max_nodes is not None:
            if max_nodes < 1:
                raise MoebenchError(f"--max-nodes must be a positive integer, got {max_nodes}")
            if nodes > 1 and max_nodes < nodes:
                groups = (nodes, max_nodes)
        _, ids = make_routing("uniform", tokens * world, experts, topk, seed=0, groups=groups)
        style = model.style(transport)
        style = "node" if (style == "rank" and world > gpn) else style
        rows = ep_link_rows(ids, ParallelLayout(dp=world, enable_ep=True), experts, gpn, style)
        row = dtype_row_bytes("bf16" if op == "combine" else dtype, hidden)
        us = model._op_us(fit, rows, row)
        i = int(np.argmax((rows.nvl + rows.rdma)))
        nvl, rdma = float(rows.nvl[i] * row), float(rows.rdma[i] * row)
        total = nvl + rdma
        limit = f" inside {max_nodes} of {nodes} nodes" if groups else ""
        how = (f"{tokens} tokens per rank, top-{topk} of {experts} experts uniformly{limit}, {row} B rows, "
               f"one row per {'(token, expert) pair' if style == 'pair' else '(token, rank)'}: busiest rank")

    def distance(p: Point) -> tuple:
        pb = p.nvlink_bytes + p.rdma_bytes
        return (p.world_size != world, p.nvlink_peak != model.nvlink_gbps, abs(math.log(max(pb, 1) / max(total, 1))))

    near = sorted(fit.points, key=distance)[:3]
    behind = {}
    for p in model.points_behind(fit):
        behind.setdefault((p.file, p.line), p)
    link = model.links.get(model.rdma)
    if link is not None and world > gpn:
        for p in link.points:
            behind.setdefault((p.file, p.line), p)
    extrapolated = []
    own = [p for p in model.points_behind(fit) if p.key == fit.key] or list(behind.values())
    if own:
        sizes = [p.nvlink_bytes + p.rdma_bytes for p in own]
        if not any(p.nvlink_peak == model.nvlink_gbps for p in own):
            extrapolated.append(f"no published {transport} {op} point on a {model.nvlink_gbps:g} GB/s {model.nvlink}")
        if not any(size_class(p.world_size, p.gpus_per_node) == size_class(world, gpn) for p in own):
            extrapolated.append(f"no published point of its size class ({size_class(world, gpn)})")
        if world > gpn and not any(p.rdma == model.rdma and p.rdma_bytes > 0 for p in own):
            extrapolated.append(f"no published point over {model.rdma}")
        if total < min(sizes) / 2 or total > max(sizes) * 2:
            extrapolated.append(f"{total / 1e6:.3g} MB on the links is outside the published "
                                f"{min(sizes) / 1e6:.3g}..{max(sizes) / 1e6:.3g} MB")
    if not fit.points:
        extrapolated.append(f"no published point of its own: {'; '.join(sorted(set(fit.provenance.values())))}")
    return {
        "transport": transport, "op": op, "gpu": gpu, "world_size": world, "gpus_per_node": gpn,
        "nvlink": model.nvlink, "nvlink_gbps": model.nvlink_gbps, "rdma": model.rdma if world > gpn else "",
        "time_us": us, "nvlink_bytes": nvl, "rdma_bytes": rdma, "bytes_how": how, "fit": fit.describe(),
        "provenance": dict(fit.provenance),
        "points": [{"point": p.label(), "file": p.file, "line": p.line, "source": p.source}
                   for p in sorted(behind.values(), key=lambda p: (p.transport, p.op, p.line))],
        "nearest": [{"point": p.label(), "gpu": p.gpu, "source": p.source, "file": p.file, "line": p.line,
                     "published_us": p.time_us, "modeled_us": point_us(p, model.fits, model.links),
                     "ratio": p.time_us / point_us(p, model.fits, model.links)} for p in near],
        "extrapolated": extrapolated,
    }


