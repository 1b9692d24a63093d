"""The layer a case runs on and the work it does: a rank's weights for a spec (routed experts,
biases, shared experts in their form: moebench.kernels.layer), the float64 reference of a case,
the shared experts' gate, the flops and bytes of a case, and the metrics that follow from its time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.activation import SILU, Activation
from moebench.bench import metrics
from moebench.bench.metrics import bias_bytes, expert_weight_bytes
from moebench.comm.traffic import ep_link_rows, gbps, payload_row_bytes, row_bytes
from moebench.errors import MoebenchError
from moebench.inputs import make_weights
from moebench.kernels.layer import extend_expert_map, extend_routing, fused_count
from moebench.kernels.modular import ExpertBias
from moebench.kernels.reference import reference_moe
from moebench.quant import quantize_weights
from moebench.results import ResultRow
from moebench.sweep.spec import SweepSpec


#: Seeds of the shared MLP's weights: expert ids far above any routed expert's.
_SHARED_SEED_ID = 1 << 20


@dataclass
class RankLayer:
    """One rank's weights of the layer, as the kernels take them.

    w13, w2: routed experts (E_local, 2I, H) / (E_local, H, I), plus the S fused shared experts
    appended (mode fused); quantised (QuantWeight) when the spec is. bias: ExpertBias or None.
    shared_w13 / shared_w2: the separate shared MLP (1, 2Is, H) / (1, H, Is), or None.
    unquantized: the same tuple unquantised (fp8 runs that keep them), for err_vs_unquantized."""

    w13: object
    w2: object
    bias: ExpertBias | None = None
    shared_w13: object = None
    shared_w2: object = None
    num_fused: int = 0
    mode: str = "none"
    unquantized: "RankLayer | None" = None


def _shared_shard(shape, mode: str, shard: tuple[int, int]) -> tuple[int, int]:
    """(rank, size) of the shared MLP's I shard, checked: the model has one and it splits evenly."""
    if not shape.shared_intermediate:
        raise MoebenchError(f"shared experts {mode}: model {shape.name!r} has none (use --shared-experts none)")
    if shape.shared_intermediate % shard[1]:
        raise MoebenchError(f"shared experts: intermediate {shape.shared_intermediate} does not split over {shard[1]} ranks")
    return shard


def _shared_weights(shape, dtype, device, seed, tp_rank, tp_size, interleaved):
    return make_weights([_SHARED_SEED_ID], shape.hidden, shape.shared_intermediate, dtype, device, seed,
                        tp_rank=tp_rank, tp_size=tp_size, interleaved=interleaved)


def fuse_shared(w13: torch.Tensor, w2: torch.Tensor, sw13: torch.Tensor, sw2: torch.Tensor,
                interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Routed (E_l, 2I, H) / (E_l, H, I) and a shared MLP (1, 2Is, H) / (1, H, Is) -> the routed
    experts with S = Is / I shared chunks appended (chunk c: intermediate columns c*I .. (c+1)*I
    of gate and of up, the matching columns of w2), and S."""
    i = w2.shape[-1]
    s = fused_count(sw2.shape[-1], i)
    g = sw13[0]
    if interleaved:  # rows 2j, 2j + 1 are column j's gate and up: chunks are contiguous row ranges
        chunks13 = g.reshape(s, 2 * i, g.shape[-1])
    else:
        gate, up = g[: s * i].reshape(s, i, -1), g[s * i :].reshape(s, i, -1)
        chunks13 = torch.cat([gate, up], dim=1)
    chunks2 = sw2[0].reshape(sw2.shape[1], s, i).permute(1, 0, 2)
    return torch.cat([w13, chunks13]), torch.cat([w2, chunks2.contiguous()]), s


def make_rank_layer(shape, e_list, dtype, device, seed, tp_rank, tp_size, activation: Activation, bias: bool,
                    mode: str, quant=None, keep_unquantized: bool = False,
                    shared_shard: tuple[int, int] | None = None) -> RankLayer:
    """One rank's RankLayer: the routed experts `e_list` (global ids; TP shard tp_rank of tp_size),
    biases (b2 on TP rank 0 only), the shared MLP in `mode` (its I shard shared_shard = (rank,
    size); default the routed experts' (tp_rank, tp_size)), quantised with `quant` (the fused
    shared experts with the routed ones, per expert)."""
    il = activation.interleaved
    w13, w2 = make_weights(e_list, shape.hidden, shape.intermediate, dtype, device, seed, tp_rank=tp_rank,
                           tp_size=tp_size, interleaved=il)
    b = make_biases(e_list, shape.hidden, shape.intermediate, dtype, device, seed, tp_rank, tp_size) if bias else None
    if il:
        b = interleave_bias(b)
    sw13 = sw2 = None
    s = 0
    if mode != "none":
        sr, ss = _shared_shard(shape, mode, shared_shard or (tp_rank, tp_size))
        sw13, sw2 = _shared_weights(shape, dtype, device, seed, sr, ss, il)
    if mode == "fused":
        w13, w2, s = fuse_shared(w13, w2, sw13, sw2, il)
        sw13 = sw2 = None
        if b is not None:  # the shared experts carry no biases
            b = ExpertBias(torch.cat([b.b13, b.b13.new_zeros((s, b.b13.shape[1]))]),
                           torch.cat([b.b2, b.b2.new_zeros((s, b.b2.shape[1]))]))
    plain = RankLayer(w13, w2, b, sw13, sw2, s, mode)
    if quant is None:
        return plain
    q13, q2 = quantize_weights(w13, w2, quant, dtype)
    qs13, qs2 = quantize_weights(sw13, sw2, quant, dtype) if sw13 is not None else (None, None)
    return RankLayer(q13, q2, b, qs13, qs2, s, mode, unquantized=plain if keep_unquantized else None)


def outline_rank_layer(shape, e_list, tp_rank: int, tp_size: int, bias: bool, mode: str,
                       shared_shard: tuple[int, int] | None = None) -> RankLayer:
    """make_rank_layer's shapes without its numbers: every tensor on the meta device (no memory,
    no time). What a run that models the experts time needs: the work (pairs, experts hit,
    weight bytes) follows from the shapes alone."""
    e, h = len(list(e_list)), shape.hidden
    i = shape.intermediate // tp_size
    meta = dict(device="meta", dtype=torch.bfloat16)
    b = ExpertBias(torch.empty((e, 2 * i), **meta), torch.empty((e, h), **meta)) if bias else None
    sw13 = sw2 = None
    s = 0
    if mode != "none":
        _, ss = _shared_shard(shape, mode, shared_shard or (tp_rank, tp_size))
        si = shape.shared_intermediate // ss
        sw13, sw2 = torch.empty((1, 2 * si, h), **meta), torch.empty((1, h, si), **meta)
    if mode == "fused":
        s = fused_count(sw2.shape[-1], i)
        e += s
        sw13 = sw2 = None
        if b is not None:
            b = ExpertBias(torch.empty((e, 2 * i), **meta), torch.empty((e, h), **meta))
    return RankLayer(torch.empty((e, 2 * i, h), **meta), torch.empty((e, h, i), **meta), b, sw13, sw2, s, mode)


def make_biases(experts, hidden: int, intermediate: int, dtype: torch.dtype, device: str, seed: int,
                tp_rank: int = 0, tp_size: int = 1) -> ExpertBias:
    """Biases of the given global experts, each from its own seed: b13 (E_l, 2I') sharded like
    w13's rows (TP: this rank's columns of gate and of up; in w13's column order, which the caller
    interleaves with the weights), b2 (E_l, H) on TP rank 0, zeros on the others (added once)."""
    experts = list(experts)
    ip = intermediate // tp_size
    lo, hi = tp_rank * ip, (tp_rank + 1) * ip
    b13 = torch.empty((len(experts), 2 * ip), dtype=dtype, device=device)
    b2 = torch.zeros((len(experts), hidden), dtype=dtype, device=device)
    for n, e in enumerate(experts):
        g = torch.Generator(device=device).manual_seed(seed * 1_000_033 + e + 7)
        full13 = torch.randn((2 * intermediate,), generator=g, device=device).mul_(0.5)
        full2 = torch.randn((hidden,), generator=g, device=device).mul_(0.5)
        b13[n, :ip], b13[n, ip:] = full13[lo:hi], full13[intermediate + lo : intermediate + hi]
        if tp_rank == 0:
            b2[n] = full2
    return ExpertBias(b13, b2)


def interleave_bias(bias: ExpertBias | None) -> ExpertBias | None:
    """b13 from halves [gate | up] to interleaved columns (gate j at 2j, up j at 2j + 1)."""
    if bias is None:
        return None
    i = bias.b13.shape[1] // 2
    return ExpertBias(torch.stack([bias.b13[:, :i], bias.b13[:, i:]], dim=-1).reshape(bias.b13.shape), bias.b2)


def shared_gate_values(x: torch.Tensor, seed: int) -> torch.Tensor:
    """(M,) float32 sigmoid(x @ g), g ~ N(0, 1/H) from `seed`: the shared gate of Qwen-MoE."""
    gen = torch.Generator(device=x.device).manual_seed(seed * 1_000_037 + 11)
    g = torch.randn((x.shape[1],), generator=gen, device=x.device).mul_(x.shape[1] ** -0.5)
    return torch.sigmoid(x.float() @ g)


def shared_reference(x: torch.Tensor, sw13, sw2, activation: Activation = SILU,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference of the separate shared MLP (through reference_moe: one expert, every
    token routed to it; fp8 weights with the kernels' rounding points)."""
    m = x.shape[0]
    w = torch.ones((m, 1), dtype=torch.float32, device=x.device) if gate is None else \
        gate.to(x.device, torch.float32).reshape(m, 1)
    return reference_moe(x, sw13, sw2, w, torch.zeros((m, 1), dtype=torch.int64, device=x.device), activation=activation)


def layer_args(lw: RankLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               gate: torch.Tensor | None = None, expert_map: torch.Tensor | None = None, group: int = 0,
               groups: int = 1, token_group: torch.Tensor | None = None) -> tuple:
    """The kernel's arguments (x, w13, w2, topk_weights, topk_ids, expert_map, num_experts) for
    rank layer `lw`: with fused shared experts the routing extended by S slots (ids E + g * S + s,
    g = token_group of each token, this rank's group `group` of `groups`) and the expert map and
    expert count extended to match."""
    if lw.mode != "fused":
        return (x, lw.w13, lw.w2, topk_weights, topk_ids, expert_map, num_experts)
    s = lw.num_fused
    e_local = lw.w13.shape[0] - s
    tw, ids = extend_routing(topk_weights, topk_ids, num_experts, s, gate, token_group)
    emap = extend_expert_map(expert_map, num_experts, e_local, s, group, groups)
    if emap is not None:
        emap = emap.to(x.device)
    return (x, lw.w13, lw.w2, tw, ids, emap, num_experts + groups * s)


def layer_reference(lw: RankLayer, args: tuple, activation: Activation = SILU, gate: torch.Tensor | None = None,
                    shared_rows: slice | None = None) -> torch.Tensor:
    """float64 reference of the layer on `args` (from `layer_args`): the routed (and fused shared)
    experts, plus the separate shared MLP on `shared_rows` of x."""
    x, w13, w2, tw, ids, emap, _ = args
    ref = reference_moe(x, w13, w2, tw, ids, emap, activation=activation, bias=lw.bias)
    if lw.shared_w13 is not None:
        rows = shared_rows or slice(None)
        ref[rows] += shared_reference(x[rows], lw.shared_w13, lw.shared_w2, activation,
                                      None if gate is None else gate[rows])
    return ref


def layer_bytes_extra(lw: RankLayer, shape, hit: int, dtype_bytes: int | float, quant=None) -> float:
    """Bytes the layer moves beyond the routed experts hit: the separate shared MLP's weights
    (fused shared experts are among the experts hit) and the biases of the experts hit."""
    i = lw.w2.shape[-1]
    extra = bias_bytes(hit, shape.hidden, i, dtype_bytes) if lw.bias is not None else 0.0
    if lw.shared_w13 is not None:
        extra += expert_weight_bytes(shape.hidden, lw.shared_w2.shape[-1], dtype_bytes, quant)
    return extra


def fill_metrics(row: ResultRow, flops: float, nbytes: float, ceilings) -> None:
    m = metrics.metrics(row.latency_us, flops, nbytes, ceilings, dtype=row.dtype)
    row.tflops, row.gbps, row.roofline_frac = m["tflops"], m["gbps"], m.get("roofline_frac")
    row.floor_us = m.get("floor_us")
    row.ceilings_source = getattr(ceilings, "source", "") if ceilings is not None else "none"


def rank_layer(spec: SweepSpec, experts, tp_rank: int = 0, tp_size: int = 1, shared_shard=None):
    """The RankLayer (moebench.kernels.layer) of `spec` for the global experts `experts` and TP
    shard tp_rank of tp_size: weights (quantised when spec.quant, the unquantised ones kept for
    err_vs_unquantized when checking), biases, shared experts in spec.shared's form."""
    return make_rank_layer(spec.shape, experts, spec.dtype, spec.device, spec.seed, tp_rank, tp_size, spec.activation,
                           spec.bias, spec.shared, spec.quant, keep_unquantized=spec.check, shared_shard=shared_shard)


def shared_gate(spec: SweepSpec, x, m: int):
    """The shared experts' per-token gate (M,) where the model gates them and they run, else None."""
    if spec.shared == "none" or not spec.shape.shared_gate:
        return None
    return shared_gate_values(x, spec.seed + m)


def layer_work(spec: SweepSpec, lw, args: tuple, tokens: int, shared_tokens: int | None = None) -> tuple[float, float]:
    """(flops, bytes) of the layer case `args` (from layer_args): the routed pairs (and fused
    shared pairs) over the experts they hit, the separate shared MLP on `shared_tokens` (default:
    tokens), the biases of the experts hit, the activations in and out."""
    s = spec.shape
    x, w13, w2, tw, ids, emap, n_exp = args
    i = w2.shape[-1]
    local = ids if emap is None else emap.to(ids.device).long()[ids]
    pairs = int((local >= 0).sum())
    hit = int(torch.unique(local[local >= 0]).numel())
    flops = metrics.layer_flops(pairs, 1, s.hidden, i)
    st = tokens if shared_tokens is None else shared_tokens
    if lw.shared_w13 is not None:
        flops += metrics.shared_flops(st, s.hidden, lw.shared_w2.shape[-1])
    nbytes = (hit * metrics.expert_weight_bytes(s.hidden, i, spec.act_bytes, spec.quant)
              + 2 * tokens * s.hidden * spec.act_bytes + layer_bytes_extra(lw, s, hit, spec.act_bytes, spec.quant))
    return float(flops), float(nbytes)


def set_comm_gbps(row, ids_full: torch.Tensor, layout, num_experts: int, hidden: int, el: int, quant=None) -> None:
    """Dispatch / combine bytes and GB/s per rank of a measured row, in DeepEP's count (one row per
    (token, expert) pair, local pairs included, mean over ranks: moebench.comm.traffic; dispatch
    rows in the layer's precision, combine rows in the activation dtype); x_comm_count says so."""
    rows = ep_link_rows(ids_full, layout, num_experts, layout.ep_size, "pair")
    world = layout.world_size
    per_rank = {"dispatch": rows.deepep_bytes(payload_row_bytes(hidden, el, quant), world),
                "combine": rows.deepep_bytes(row_bytes(hidden, el), world)}
    for name in ("dispatch", "combine"):
        row.extra[f"{name}_bytes"] = per_rank[name]
        row.extra[f"{name}_gbps"] = gbps(per_rank[name], getattr(row, f"{name}_us"))
    row.extra["comm_count"] = "deepep"
