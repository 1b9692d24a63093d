"""The layer a case runs on and the work it does: a rank's weights for a spec, the shared
experts' gate, the flops and bytes of a case, and the metrics that follow from its time."""

from __future__ import annotations

import torch

from moebench.bench import metrics
from moebench.kernels.layer import layer_bytes_extra, make_rank_layer, shared_gate_values
from moebench.results import ResultRow
from moebench.sweep.spec import SweepSpec


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


def set_comm_gbps(row, ids_full: torch.Tensor, hidden: int, el: int, world: int, quant=None) -> None:
    """Dispatch / combine GB/s per rank, counting bytes per (token, expert) pair as DeepEP does
    (fp8 dispatch: payload + scales + header; combine sends the activation dtype)."""
    per_rank = {
        "dispatch": metrics.dispatch_bytes(ids_full, hidden, fp8=quant is not None and not quant.weight_only, dtype_bytes=el) / world,
        "combine": metrics.dispatch_bytes(ids_full, hidden, dtype_bytes=el) / world,
    }
    for name in ("dispatch", "combine"):
        us = getattr(row, f"{name}_us")
        row.extra[f"{name}_gbps"] = per_rank[name] / (us * 1e3) if us else None
