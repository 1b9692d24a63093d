"""A simulated multi-rank sweep: one device computes one rank's share for real, the communication
time comes from the cost model (moebench.runtime.simulate). Rows carry modeled = true.

What one device computes, per prepare/finalize:
- no-dpep (TP path, dp == 1): rank 0's weight shard (1/T of I for TP; for EP over tp ranks, the
  busiest rank's experts) on all M tokens; the all-reduce of the (M, H) output is modeled.
- allgather-rs: the busiest EP rank's experts on all M * world gathered tokens (Standard, through
  its expert_map); all-gather of the tokens and reduce-scatter of the output are modeled.
- all2all-ll / deepep-ll: the busiest EP rank's experts on exactly the (token, expert) pairs it
  receives, in the DeepEP-LL layout (E_local, M * world, H); dispatch and combine are modeled.
The experts time is measured on the device (CUDA graph); the layer latency is
dispatch + experts + combine (or experts + all-reduce). The communication time comes from
moebench.runtime.comm_model (per-transport fits to published or measured points, NVLink inside a
node and RDMA between nodes); each row also carries the band of published transports for the same
kind of communication (x_comm_lo_us / x_comm_hi_us: dispatch/combine transports for all2all-ll and
deepep-ll, NCCL's published spread for the all-reduce and allgather-rs) and the bytes behind the
time (x_comm_bytes).
"""

from __future__ import annotations

import torch

from moebench.activation import SILU
from moebench.bench import metrics
from moebench.bench.hardware import get_ceilings
from moebench.bench.timing import Timing, time_fn
from moebench.cases import CaseRunner, batch_inputs, rank_layer, shared_gate
from moebench.correctness import is_correct, relative_error
from moebench.errors import MoebenchError
from moebench.inputs import check_fits
from moebench.kernels.layer import MoELayer, layer_args, layer_bytes_extra, layer_reference, shared_mlp
from moebench.kernels.modular import poisoned_outputs
from moebench.backends import get_prepare_finalize_class, make_kernel, prepare_finalize_names
from moebench.kernels.token_layout import local_topk_ids
from moebench.routing import load_imbalance
from moebench.runtime import simulate as sim
from moebench.runtime.comm_model import CommModel, CommResult
from moebench.runtime.rank_case import token_split
from moebench.runtime.rank_sweep import set_comm_gbps


def _stand_in(pf_name: str) -> str:
    """The communication-free prepare/finalize that lays tokens out as `pf_name` would on a rank
    (the first one declaring the same activation format that keeps tokens in place)."""
    fmt = get_prepare_finalize_class(pf_name).activation_format
    for name in prepare_finalize_names():
        cls = get_prepare_finalize_class(name)
        if cls.activation_format == fmt and not cls.communicates:
            return name
    raise MoebenchError(f"no prepare/finalize without communication lays tokens out as {fmt} ({pf_name} does)")


def as_comm_model(link) -> CommModel:
    """The communication model of a run: `link` itself, or the model over a LinkProfile (its
    bandwidth as the NVLink peak, published fits, 8 GPUs per node, 400 Gb/s RDMA)."""
    return link if isinstance(link, CommModel) else CommModel.from_link(link, use_measurement=False)


class SimulatedRunner(CaseRunner):
    """Simulated rows: one rank's share computed on this device, its communication modeled.
    link: a CommModel, or a simulate.LinkProfile (see `as_comm_model`).

    experts_model: None = time the rank's experts on this device; a Ceilings (e.g. an H200
    datasheet profile) = model the experts time as the roofline floor of the rank's work on that
    GPU (how a CPU machine answers a GPU question; the rows say so). The share is still computed
    and checked against the reference here."""

    modeled = True

    def __init__(self, link, experts_model=None):
        self.link = as_comm_model(link)
        self.experts_model = experts_model
        self.weights_cache: dict[tuple, tuple] = {}

    def start(self, spec, runnable: list[tuple[str, str]]) -> None:
        self.spec = spec
        self.ceilings = get_ceilings(spec.device)

    def inputs(self, m: int, pf: str):
        return batch_inputs(self.spec, m, pf)

    def run_case(self, row, m: int, pf: str, ex: str, inputs) -> None:
        _simulate_case(self.spec, row, pf, ex, m, inputs, self.link, self.ceilings, self.spec.act_bytes,
                       self.weights_cache, self.experts_model)


def _weights(spec, rank: int, cache: dict, moves_tokens: bool):
    """Rank `rank`'s RankLayer (moebench.sweep.rank_layer), one shard at a time on the device.
    Shared experts: replicated where tokens move (each EP rank serves its own tokens), sharded
    over I across the ranks where they stay (TP, or EP without DP: the all-reduce sums them)."""
    s, lay = spec.shape, spec.layout
    key = (rank, lay.enable_ep, moves_tokens)
    if key not in cache:
        cache.clear()
        if lay.enable_ep:
            check_fits(len(lay.local_experts(rank, s.num_experts)), s.hidden, s.intermediate,
                       spec.batch_tokens(max(spec.tokens), True), s.topk, spec.dtype, spec.device)
        else:
            check_fits(s.num_experts, s.hidden, lay.intermediate_per_rank(s.intermediate), max(spec.tokens),
                       s.topk, spec.dtype, spec.device)
        shared_shard = (0, 1) if moves_tokens else (rank, lay.world_size)
        if lay.enable_ep:
            cache[key] = rank_layer(spec, lay.local_experts(rank, s.num_experts), shared_shard=shared_shard)
        else:
            cache[key] = rank_layer(spec, range(s.num_experts), tp_rank=rank, tp_size=lay.moe_tp_size,
                                    shared_shard=shared_shard)
    return cache[key]


def _link_label(link, world: int) -> str:
    """'h200-nvlink 450 GB/s' (+ ', rdma-400g 50 GB/s' where the ranks span nodes): the x_link column."""
    if not hasattr(link, "nvlink"):  # a plain LinkProfile
        return f"{link.name} {link.bandwidth_gbps:g} GB/s"
    label = f"{link.nvlink} {link.nvlink_gbps:g} GB/s"
    if world > link.gpus_per_node:
        label += f", {link.rdma} {link.rdma_gbps:g} GB/s"
    return label


def _simulate_case(spec, row, pf, ex, m, inputs, link, ceilings, el, weights_cache, experts_model) -> None:
    s, lay = spec.shape, spec.layout
    world = lay.world_size
    row.extra["link"] = _link_label(link, world)  # the x_link column reports group by
    moves_tokens = get_prepare_finalize_class(pf).communicates
    m_full, x, wts, ids = inputs
    row.imbalance = load_imbalance(ids, s.num_experts)
    if lay.enable_ep:
        share = sim.busiest_rank_share(ids.cpu(), lay, s.num_experts)
        rank, emap = share.rank, share.expert_map.to(spec.device)
        row.rank_imbalance = share.imbalance
        row.extra["pairs_per_rank"] = ",".join(map(str, share.pairs_per_rank.tolist()))
    else:
        rank, emap = 0, None
        row.rank_imbalance = 1.0
    lw = _weights(spec, rank, weights_cache, moves_tokens)
    row.extra["simulated_rank"] = rank
    split = token_split(m_full, world) if moves_tokens else [(0, m)] * world
    row.rank_tokens = ",".join(str(b - a) for a, b in split)

    # The rank's compute, on this device: the stand-in P/F lays tokens out as the real one would.
    # Shared experts: the rank's own tokens (where tokens move) or all of them (a shard over I).
    gate = shared_gate(spec, x, m)
    own = slice(*split[rank]) if moves_tokens else slice(None)
    owner = None
    if moves_tokens:
        owner = torch.cat([torch.full((b - a,), r, dtype=torch.int64) for r, (a, b) in enumerate(split)]).to(x.device)
    args = layer_args(lw, x, wts, ids, s.num_experts, gate, emap, group=rank if moves_tokens else 0,
                      groups=world if moves_tokens else 1, token_group=owner)
    kernel = MoELayer(make_kernel(ex, _stand_in(pf)), spec.activation, lw.bias, lw.shared_w13, lw.shared_w2, gate,
                      shared_rows=own)
    if spec.check:
        with poisoned_outputs():
            out = kernel.apply(*args)
        ref = layer_reference(lw, args, spec.activation, gate, own)
        row.max_rel_err = relative_error(out, ref)
        row.correct = is_correct(row.max_rel_err, spec.dtype, spec.quant)
        if lw.unquantized is not None:
            unq = lw.unquantized
            row.err_vs_unquantized = relative_error(
                out, layer_reference(unq, (x, unq.w13, unq.w2, *args[3:]), spec.activation, gate, own))
    # The rank's experts work (flops, bytes of the experts it hits; its shared MLP) for the roofline.
    local = local_topk_ids(args[4], args[5])
    pairs = int((local >= 0).sum())
    i_r = lw.w2.shape[-1]
    flops = metrics.layer_flops(pairs, 1, s.hidden, i_r)
    hit = int(torch.unique(local[local >= 0]).numel())
    nbytes = hit * metrics.expert_weight_bytes(s.hidden, i_r, el, spec.quant) + 2 * pairs * s.hidden * el
    nbytes += layer_bytes_extra(lw, s, hit, el, spec.quant)
    if lw.shared_w13 is not None:
        own_tokens = x[own].shape[0]
        flops += metrics.shared_flops(own_tokens, s.hidden, lw.shared_w2.shape[-1])
        nbytes += 2 * own_tokens * s.hidden * el
    if experts_model is not None:
        floor = metrics.roofline(flops, nbytes, experts_model, dtype=row.dtype)
        t = Timing(floor, floor, floor, 0, f"roofline model ({experts_model.device_name}, {experts_model.source})")
        ceilings = experts_model
    else:
        exo = kernel.experts
        xa, w13, w2, wts_a, ids_a, emap_a, n_exp = args
        prep = kernel.kernel.prepare(xa, w13, w2, wts_a, ids_a, emap_a, n_exp)

        def step():
            if spec.activation == SILU and lw.bias is None:
                exo.apply(prep, w13, w2)
            else:
                exo.apply(prep, w13, w2, activation=spec.activation, bias=lw.bias)
            if lw.shared_w13 is not None:
                shared_mlp(x[own], lw.shared_w13, lw.shared_w2, spec.activation, None if gate is None else gate[own])

        t = time_fn(step, spec.device, **spec.timing_kwargs())
    row.experts_us, row.timing_method = t.median_us, f"{t.method} (experts) + model ({link.nvlink})"
    # Backends that pick a tile config say where it came from (as in a measured sweep).
    row.config_source = kernel.experts.last_config_source or ""

    # Communication from the model.
    drow = metrics.packed_row_bytes(s.hidden, el, spec.quant)
    if not moves_tokens:
        res = link.allreduce(m * s.hidden * el, world) if world > 1 else CommResult(allreduce_us=0.0)
        row.allreduce_us = res.allreduce_us
    elif get_prepare_finalize_class(pf).comm_pattern == "all-gather":
        res = link.allgather_rs(m_full * (drow + s.topk * 8), m_full * s.hidden * el, world)
        row.dispatch_us, row.combine_us = res.dispatch_us, res.combine_us
    else:
        res = link.dispatch_combine(pf, ids.cpu(), lay, s.num_experts, drow, s.hidden * el)
        row.dispatch_us, row.combine_us = res.dispatch_us, res.combine_us
        set_comm_gbps(row, ids, s.hidden, el, world, spec.quant)
    comm = res.total_us
    row.extra.update(comm_bytes=res.bytes, comm_lo_us=res.band_lo_us, comm_hi_us=res.band_hi_us,
                     comm_band=res.band, comm_model=res.how)
    row.latency_us = row.experts_us + comm
    row.p10_us = t.p10_us + comm
    row.p90_us = t.p90_us + comm
    how = "modeled" if experts_model is not None else "measured"
    row.reason = f"modeled: rank {rank}'s experts {how}; communication {link.describe()}"

    # Metrics of the rank's experts work (what was measured or modeled), against its floor.
    if ceilings is not None:
        m_ = metrics.metrics(row.experts_us, flops, nbytes, ceilings, dtype=row.dtype)
        row.tflops, row.gbps, row.roofline_frac, row.floor_us = m_["tflops"], m_["gbps"], m_["roofline_frac"], m_["floor_us"]
        row.ceilings_source = getattr(ceilings, "source", "")
