"""A simulated multi-rank sweep: one device computes one rank's share for real, the communication
time comes from the cost model (moebench.comm.model). Rows carry modeled = true.

Every prepare/finalize is a candidate whether or not it runs on this machine: its communication is
priced from what it declares (`communication`: moebench.comm), and its experts half runs here
through the communication-free prepare/finalize of the same activation format, on the share the
busiest rank gets:
- tokens that stay (TP): rank 0's weight shard (1/T of I) on all M tokens; the all-reduce of the
  (M, H) output is priced for each implementation it may take (nccl, custom: one row each);
- Standard formats that move tokens (allgather-rs, deepep-ht): the busiest EP rank's experts on
  the whole batch through its expert_map;
- BatchedExperts (all2all-ll, deepep-ll): the busiest EP rank's experts on exactly the (token,
  expert) pairs it receives, in the (E_local, M * world, H) layout.
The layer latency is dispatch + experts + combine (or experts + all-reduce). The experts time is
measured on the device (CUDA graph), or - with an experts model (a datasheet's ceilings: how a
machine without the target GPU answers) - the floor of the rank's work on that GPU, computed from
the shapes alone; the correctness check then runs what this machine can run (a smaller shape, the
activation dtype for a quantised scheme: the row says so). Each row also carries the band of
published transports for the same kind of communication (x_comm_lo_us / x_comm_hi_us) and the bytes
behind the time (x_comm_bytes); x_dispatch_bytes / x_combine_bytes and x_dispatch_gbps /
x_combine_gbps are each column's bytes and bytes / time in the model's own count (x_comm_count
"link": the busiest rank's bytes on its links, moebench.comm.traffic); x_comm_transports names the transports priced and x_comm_not_run
why the prepare/finalize could not have run here ("" where it could).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moebench.activation import SILU
from moebench.bench import kernel_tables, metrics
from moebench.bench.hardware import get_ceilings
from moebench.bench.timing import Timing, time_fn
from moebench.errors import MoebenchError
from moebench.inputs import check_fits
from moebench.kernels.layer import MoELayer, shared_mlp
from moebench.backends import (check_combination, declared_communication, experts_classes, local_prepare_finalize,
                               make_kernel, stand_in)
from moebench.comm.model import CommModel, CommResult
from moebench.comm.traffic import Traffic, gbps, payload_row_bytes
from moebench.kernels.token_layout import local_topk_ids
from moebench.routing import load_imbalance
from moebench.runtime import simulate as sim
from moebench.layout import token_split
from moebench.sweep.cases import CaseRunner, batch_inputs
from moebench.sweep.layer import (
    layer_args,
    layer_bytes_extra,
    layer_reference,
    outline_rank_layer,
    rank_layer,
    shared_gate,
)
from moebench.sweep.measure import measure
from moebench.sweep.variants import Case, measure_variant


def as_comm_model(link) -> CommModel:
    """The communication model of a run: `link` itself, or the model over a LinkProfile (its
    bandwidth as the NVLink peak, published fits, 8 GPUs per node, 400 Gb/s RDMA)."""
    return link if isinstance(link, CommModel) else CommModel.from_link(link, declared_communication(),
                                                                        use_measurement=False)


class SimulatedRunner(CaseRunner):
    """Simulated rows: one rank's share computed on this device, its communication modeled.
    link: a CommModel, or a links.LinkProfile (see `as_comm_model`).

    experts_model: None = time the rank's experts on this device; a Ceilings (e.g. an H200
    datasheet profile) = model the experts time as the roofline floor of the rank's work on that
    GPU (how a CPU machine answers a GPU question; the rows say so); the check then runs on
    `check_spec` (what this machine can run)."""

    modeled = True

    def __init__(self, link, experts_model=None):
        self.link = as_comm_model(link)
        self.experts_model = experts_model
        # a variant is a call timed on this device: with a modeled experts time there is none
        self.runs_variants = experts_model is None
        # the experts half of the current case (tokens, pf, ex), shared by its all-reduce choices
        # (only the modeled communication differs): {"case": (m, pf, ex), variant: what its
        # measure step filled}
        self.measured: dict = {}
        self.weights_cache: dict[tuple, tuple] = {}
        self.check_cache: dict[tuple, tuple] = {}
        self.check_weights: dict[tuple, tuple] = {}

    def start(self, spec, runnable: list[tuple[str, str]]) -> None:
        self.spec = spec
        self.ceilings = get_ceilings(spec.device)
        self.check_spec = check_spec_for(spec) if self.experts_model is not None and spec.check else None

    def inputs(self, m: int, pf: str):
        if self.experts_model is not None:  # a modeled experts time needs the routing, not the tokens
            m_full, _, wts, ids = batch_inputs(self.spec, m, pf, tokens=False)
            return m_full, torch.empty((m_full, self.spec.shape.hidden), device="meta", dtype=self.spec.dtype), wts, ids
        return batch_inputs(self.spec, m, pf)

    def run_case(self, row, m: int, pf: str, ex: str, inputs) -> None:
        _simulate_case(self, row, pf, ex, m, inputs)


#: The shape a machine without the target GPU checks a modeled share on: the model's experts,
#: top-k, routing and layout, with small hidden and intermediate sizes.
CHECK_HIDDEN = 128
CHECK_INTERMEDIATE_PER_RANK = 32


def check_spec_for(spec):
    """The spec whose share this machine checks when the experts time is modeled: the model's
    routing and layout on a small hidden / intermediate (CHECK_*); in the model's precision where
    the shape is that small already and one of its experts runs it here, else in the activation
    dtype (the modeled time keeps the real precision)."""
    s, lay = spec.shape, spec.layout
    i = CHECK_INTERMEDIATE_PER_RANK * lay.moe_tp_size
    si = i * max(1, s.shared_intermediate // s.intermediate) if s.shared_intermediate else 0
    small = replace(s, hidden=min(s.hidden, CHECK_HIDDEN), intermediate=min(s.intermediate, i),
                    shared_intermediate=min(s.shared_intermediate, si) if si else 0)
    checked = replace(spec, shape=small, model_experts=False, reps=1, warmup=0, check_only=True)
    if spec.quant is not None and (small != s or not any(experts_here(ex, checked)[0] for ex in spec.experts)):
        checked = replace(checked, quant=None)
    return checked


def check_note(spec, check_spec) -> str:
    """What the check of a modeled row ran, in words ('' when it is the row's own shape)."""
    parts = []
    c, s = check_spec.shape, spec.shape
    if (c.hidden, c.intermediate) != (s.hidden, s.intermediate):
        parts.append(f"hidden {c.hidden}, intermediate {c.intermediate}")
    if spec.quant is not None:
        parts.append(f"{check_spec.precision} instead of {spec.precision}")
    return f"checked at {', '.join(parts)}" if parts else ""


def _weights(spec, rank: int, cache: dict, moves_tokens: bool, outline: bool = False):
    """Rank `rank`'s RankLayer (moebench.sweep.layer.rank_layer), one shard at a time on the device;
    outline: its shapes only (meta tensors), for a modeled experts time.
    Shared experts: replicated where tokens move (each EP rank serves its own tokens), sharded
    over I across the ranks where they stay (TP, or EP without DP: the all-reduce sums them)."""
    s, lay = spec.shape, spec.layout
    key = (rank, lay.enable_ep, moves_tokens, outline)
    if key not in cache:
        cache.clear()
        shared_shard = (0, 1) if moves_tokens else (rank, lay.world_size)
        if lay.enable_ep:  # whole experts, or (expert TP) this rank's slice of each
            experts, tp_rank, tp_size = lay.local_experts(rank, s.num_experts), 0, lay.moe_tp_size
        else:
            experts, tp_rank, tp_size = range(s.num_experts), rank, lay.moe_tp_size
        if outline:
            cache[key] = outline_rank_layer(s, experts, tp_rank, tp_size, spec.bias, spec.shared, shared_shard)
            return cache[key]
        if lay.enable_ep:
            check_fits(len(experts), s.hidden, lay.intermediate_per_rank(s.intermediate),
                       spec.batch_tokens(max(spec.tokens), True), s.topk,
                       spec.dtype, spec.device)
        else:
            check_fits(s.num_experts, s.hidden, lay.intermediate_per_rank(s.intermediate), max(spec.tokens),
                       s.topk, spec.dtype, spec.device)
        cache[key] = rank_layer(spec, experts, tp_rank=tp_rank, tp_size=tp_size, shared_shard=shared_shard)
    return cache[key]


def _link_label(link, world: int) -> str:
    """'h200-nvlink 450 GB/s' (+ ', rdma-400g 50 GB/s' where the ranks span nodes): the x_link column."""
    if not hasattr(link, "nvlink"):  # a plain LinkProfile
        return f"{link.name} {link.bandwidth_gbps:g} GB/s"
    label = f"{link.nvlink} {link.nvlink_gbps:g} GB/s"
    if world > link.gpus_per_node:
        label += f", {link.rdma} {link.rdma_gbps:g} GB/s"
    return label


class _Share:
    """The busiest rank's share of one case: its rank, expert map, token split, and the kernel's
    arguments (args) for rank layer `lw`."""

    def __init__(self, spec, pf: str, m: int, inputs, cache: dict, outline: bool):
        s, lay = spec.shape, spec.layout
        self.moves = spec.pf_classes[pf].communicates
        self.m_full, x, wts, ids = inputs
        world = lay.world_size
        if lay.enable_ep:
            self.share = sim.busiest_rank_share(ids.cpu(), lay, s.num_experts)
            self.rank, emap = self.share.rank, self.share.expert_map.to(spec.device)
        else:
            self.share, self.rank, emap = None, 0, None
        self.lw = _weights(spec, self.rank, cache, self.moves, outline)
        self.split = token_split(self.m_full, world) if self.moves else [(0, m)] * world
        self.own = slice(*self.split[self.rank]) if self.moves else slice(None)
        self.gate = None if outline else shared_gate(spec, x, m)  # a gate's values change no work
        owner = None
        if self.moves:
            owner = torch.cat([torch.full((b - a,), r, dtype=torch.int64)
                               for r, (a, b) in enumerate(self.split)]).to(x.device)
        self.x, self.ids = x, ids
        self.args = layer_args(self.lw, x, wts, ids, s.num_experts, self.gate, emap,
                               group=self.rank if self.moves else 0, groups=world if self.moves else 1,
                               token_group=owner)

    def work(self, spec) -> tuple[float, float, float]:
        """(flops, bytes, activation bytes) of the rank's experts work (the experts it hits, its
        shared MLP); the activation bytes are the part of the bytes that scales with the tokens."""
        s, el = spec.shape, spec.act_bytes
        local = local_topk_ids(self.args[4], self.args[5])
        pairs = int((local >= 0).sum())
        i_r = self.lw.w2.shape[-1]
        flops = metrics.layer_flops(pairs, 1, s.hidden, i_r)
        hit = int(torch.unique(local[local >= 0]).numel())
        act = 2 * pairs * s.hidden * el
        nbytes = hit * metrics.expert_weight_bytes(s.hidden, i_r, el, spec.quant) + act
        nbytes += layer_bytes_extra(self.lw, s, hit, el, spec.quant)
        if self.lw.shared_w13 is not None:
            own_tokens = self.x[self.own].shape[0]
            flops += metrics.shared_flops(own_tokens, s.hidden, self.lw.shared_w2.shape[-1])
            nbytes += 2 * own_tokens * s.hidden * el
            act += 2 * own_tokens * s.hidden * el
        return float(flops), float(nbytes), float(act)

    def routed(self, spec) -> tuple[int, int, float, float]:
        """(pairs, local experts, flops, bytes) of the routed experts alone (no shared MLP, no
        biases): what a measured kernel table's shard covers."""
        s, el = spec.shape, spec.act_bytes
        local = local_topk_ids(self.args[4], self.args[5])
        pairs = int((local >= 0).sum())
        i_r = self.lw.w2.shape[-1]
        hit = int(torch.unique(local[local >= 0]).numel())
        e_local = self.lw.w13.shape[0] - self.lw.num_fused
        return (pairs, e_local, float(metrics.layer_flops(pairs, 1, s.hidden, i_r)),
                float(hit * metrics.expert_weight_bytes(s.hidden, i_r, el, spec.quant) + 2 * pairs * s.hidden * el))

    def kernel(self, spec, pf: str, ex_cls: type) -> MoELayer:
        """The rank's experts (class `ex_cls`) behind the communication-free prepare/finalize laying
        tokens out as `pf`."""
        lw = self.lw
        return MoELayer(make_kernel(ex_cls, stand_in(spec.pf_classes[pf])), spec.activation, lw.bias,
                        lw.shared_w13, lw.shared_w2, self.gate, shared_rows=self.own)

    def references(self, spec) -> dict:
        """measure()'s reference arguments for this share: the float64 layer on its rows (and the
        layer without quantisation where the weights are quantised)."""
        lw, args = self.lw, self.args
        refs = {"reference": lambda: layer_reference(lw, args, spec.activation, self.gate, self.own)}
        if lw.unquantized is not None:
            unq = lw.unquantized
            refs["unquantized_reference"] = lambda: layer_reference(
                unq, (self.x, unq.w13, unq.w2, *args[3:]), spec.activation, self.gate, self.own)
        return refs

    def check(self, spec, row, kernel) -> None:
        """Check the share against the float64 reference; fills max_rel_err, correct (and
        err_vs_unquantized where the weights are quantised)."""
        measure(lambda: kernel.apply(*self.args), None, dtype=spec.dtype, quant=spec.quant,
                **self.references(spec)).fill(row)


def experts_here(ex: str, spec) -> tuple[str | None, str]:
    """The experts this machine checks in place of `ex` under `spec`: `ex` where it runs here, else
    the first backend of the same activation format that does; (None, why) when none does."""
    cls, why = _experts_here(spec.experts_classes[ex], spec)
    return (None if cls is None else cls.name), why


def _experts_here(ex_cls: type, spec) -> tuple[type | None, str]:
    """experts_here with classes: the class checked in place of `ex_cls`, and the note."""
    fmt = ex_cls.activation_format
    local = local_prepare_finalize(fmt)

    def reason(cls):
        return check_combination(local, cls, spec.device, spec.dtype, 1, None, quant=spec.quant,
                                 activation=spec.activation, bias=spec.bias)

    why = reason(ex_cls)
    if why is None:
        return ex_cls, ""
    for cls in experts_classes():
        if cls.timed and cls.activation_format == fmt and reason(cls) is None:
            return cls, f"checked with experts '{cls.name}' ({why})"
    return None, f"not checked here: {why}"


def _check_modeled(runner, row, pf: str, ex: str, m: int) -> str:
    """The check of a row whose experts time is modeled, on runner.check_spec (once per pair and
    token count), with `ex` or a backend of its format that runs here; returns a note for the
    row's reason."""
    spec, cs = runner.spec, runner.check_spec
    # prepare/finalize backends of one format that move tokens (or keep them) give the busiest rank
    # the same share behind the same stand-in: one check serves them all
    key = (m, stand_in(spec.pf_classes[pf]), spec.pf_classes[pf].communicates, ex)
    if key not in runner.check_cache:
        name, sub = _experts_here(spec.experts_classes[ex], cs)
        if name is None:
            runner.check_cache[key] = (None, None, sub)
        else:
            share = _Share(cs, pf, m, batch_inputs(cs, m, pf), runner.check_weights, outline=False)
            probe = replace(row, extra={})
            share.check(cs, probe, share.kernel(cs, pf, name))
            note = "; ".join(x for x in (check_note(spec, cs), sub) if x)
            runner.check_cache[key] = (probe.max_rel_err, probe.correct, note)
    row.max_rel_err, row.correct, note = runner.check_cache[key]
    return note


def _simulate_case(runner, row, pf, ex, m, inputs) -> None:
    spec, link = runner.spec, runner.link
    s, lay = spec.shape, spec.layout
    el = spec.act_bytes
    world = lay.world_size
    row.extra["link"] = _link_label(link, world)  # the x_link column reports group by
    pf_cls = spec.pf_classes[pf]
    ops = pf_cls.communication if world > 1 else ()

    # The communication first (cheap): a transport that cannot carry this case skips the row.
    drow = payload_row_bytes(s.hidden, el, spec.quant)
    ids_cpu = inputs[3].cpu()
    traffic = Traffic(ids_cpu, lay, s.num_experts, rows=inputs[0], row_bytes={"activations": drow, "outputs": s.hidden * el},
                      topk=s.topk)
    choice = {"all-reduce": f"{row.allreduce}-all-reduce"} if row.allreduce else None
    try:
        res = link.price_ops(ops, traffic, choice) if ops else CommResult(allreduce_us=0.0)
    except MoebenchError as e:
        row.status, row.reason = "skipped", f"not modeled: {e}"
        return

    experts_model = runner.experts_model
    share = _Share(spec, pf, m, inputs, runner.weights_cache, outline=experts_model is not None)
    row.imbalance = load_imbalance(share.ids, s.num_experts)
    if share.share is not None:
        row.rank_imbalance = share.share.imbalance
        row.extra["pairs_per_rank"] = ",".join(map(str, share.share.pairs_per_rank.tolist()))
    else:
        row.rank_imbalance = 1.0
    row.extra["simulated_rank"] = share.rank
    row.rank_tokens = ",".join(str(b - a) for a, b in share.split)
    flops, nbytes, act_bytes = share.work(spec)
    note = ""
    ceilings = runner.ceilings
    if experts_model is not None:
        if spec.check:
            note = _check_modeled(runner, row, pf, ex, m)
        floor = metrics.roofline(flops, nbytes, experts_model, dtype=row.dtype)
        t = Timing(floor, floor, floor, 0, f"roofline model ({experts_model.device_name}, {experts_model.source})")
        row.extra["modeled_gpu"] = experts_model.device_name  # the GPU the row's time speaks of
        # half the batch reads the same weights: what one micro-batch of a two-batch overlap costs
        half = metrics.roofline(flops / 2, nbytes - act_bytes / 2, experts_model, dtype=row.dtype)
        # moebench's own measured times of this shard on that GPU, where a shipped table covers it
        pairs, e_local, rflops, rbytes = share.routed(spec)
        found = kernel_tables.lookup(experts_model.device_name, e_local, s.hidden, share.lw.w2.shape[-1], s.topk,
                                     kernel_tables.precision_key(row.dtype, row.quant), pairs / max(e_local, 1))
        row.extra["experts_source"] = "roofline floor (no measured table covers this shard)"
        if found is not None:
            us = found[0] + floor - metrics.roofline(rflops, rbytes, experts_model, dtype=row.dtype)
            t = Timing(us, us, us, 0, found[1])
            half *= us / floor
            row.extra["experts_source"] = found[1]
        row.extra["experts_half_us"] = half
        ceilings = experts_model
    else:
        if runner.measured.get("case") != (m, pf, ex):
            runner.measured = {"case": (m, pf, ex)}
        if row.variant not in runner.measured:
            runner.measured[row.variant] = _measure_share(spec, share, pf, ex, m, row.variant)
        done = runner.measured[row.variant]
        t = done["timing"]
        for name in ("max_rel_err", "correct", "err_vs_unquantized", "config_source"):
            if done[name] is not None:
                setattr(row, name, done[name])
        row.extra.update(done["notes"])
    row.experts_us, row.timing_method = t.median_us, f"{t.method} (experts) + model ({link.nvlink})"

    row.dispatch_us, row.combine_us, row.allreduce_us = res.dispatch_us, res.combine_us, res.allreduce_us
    for name in ("dispatch", "combine"):  # bytes and time of one count: the model's
        us, moved = getattr(res, f"{name}_us"), res.column_bytes.get(name)
        if us is not None and moved is not None:
            row.extra[f"{name}_bytes"], row.extra[f"{name}_gbps"] = moved, gbps(moved, us)
            row.extra["comm_count"] = "link"
    comm = res.total_us
    not_run = pf_cls.unavailable_reason("cuda", world) if pf_cls.communicates else None
    row.extra.update(comm_bytes=res.bytes, comm_rdma_bytes=res.rdma_bytes, comm_lo_us=res.band_lo_us, comm_hi_us=res.band_hi_us,
                     comm_band=res.band, comm_model=res.how,
                     comm_transports=",".join(dict.fromkeys(c.transport for c in res.costs)),
                     comm_not_run=not_run or "")
    row.latency_us = row.experts_us + comm
    row.p10_us = t.p10_us + comm
    row.p90_us = t.p90_us + comm
    how = "modeled" if experts_model is not None else "measured"
    row.reason = f"modeled: rank {share.rank}'s experts {how}; communication {link.describe()}"
    if note:
        row.reason += f"; {note}"

    # Metrics of the rank's experts work (what was measured or modeled), against its floor.
    if ceilings is not None:
        m_ = metrics.metrics(row.experts_us, flops, nbytes, ceilings, dtype=row.dtype)
        row.tflops, row.gbps, row.roofline_frac, row.floor_us = m_["tflops"], m_["gbps"], m_["roofline_frac"], m_["floor_us"]
        row.ceilings_source = getattr(ceilings, "source", "")


def _measure_share(spec, share: _Share, pf: str, ex: str, m: int, variant: str) -> dict:
    """Check and time the experts half of a case on this device: the rank's experts alone (the
    tokens laid out once, outside the timed calls), or a registered variant's call on the share.
    Returns the filled check columns, the timing, the config source and the variant's notes."""
    kernel = share.kernel(spec, pf, spec.experts_classes[ex])
    refs = share.references(spec) if spec.check else {}
    notes: dict = {}
    if variant:
        outcome, notes = measure_variant(variant, Case(spec, m, kernel, share.args, share.lw), refs)
    else:
        exo = kernel.experts
        xa, w13, w2, wts_a, ids_a, emap_a, n_exp = share.args
        lw, gate, own, x = share.lw, share.gate, share.own, share.x

        def time_experts():
            prep = kernel.kernel.prepare(xa, w13, w2, wts_a, ids_a, emap_a, n_exp)

            def step():
                if spec.activation == SILU and lw.bias is None:
                    exo.apply(prep, w13, w2)
                else:
                    exo.apply(prep, w13, w2, activation=spec.activation, bias=lw.bias)
                if lw.shared_w13 is not None:
                    shared_mlp(x[own], lw.shared_w13, lw.shared_w2, spec.activation,
                               None if gate is None else gate[own])

            return time_fn(step, spec.device, **spec.timing_kwargs())

        outcome = measure(lambda: kernel.apply(*share.args), time_experts, dtype=spec.dtype, quant=spec.quant,
                          **refs)
    return {"timing": outcome.timing, "max_rel_err": outcome.max_rel_err, "correct": outcome.correct,
            "err_vs_unquantized": outcome.err_vs_unquantized, "notes": notes,
            # backends that pick a tile config say where it came from (as in a measured sweep)
            "config_source": kernel.experts.last_config_source or ""}
