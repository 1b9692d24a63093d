"""Work, bytes and roofline of an MoE layer.

Layer (design.md "Timing and metrics"):
    flops = 2 * tokens * topk * 3 * H * I            (GEMM1: 2I x H, GEMM2: H x I, per (token, k))
    bytes = experts_hit * 3 * H * I * dtype_bytes    (w13 + w2 of every expert that gets a token;
                                                      quantised: the packed bytes and scales,
                                                      `expert_weight_bytes`)
          + 2 * tokens * H * dtype_bytes             (activations in and out)
    floor = max(bytes / read bandwidth, flops / matmul peak);  roofline_frac = floor / latency

Communication bytes (rows each rank sends, DeepEP's count and the links') are moebench.comm.traffic's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moebench.bench.hardware import Ceilings
from moebench.errors import MoebenchError


def layer_flops(tokens: int, topk: int, hidden: int, intermediate: int) -> int:
    """2 * tokens * topk * 3 * H * I: both GEMMs of every (token, k) pair."""
    return 2 * tokens * topk * 3 * hidden * intermediate


def experts_hit(topk_ids: torch.Tensor, num_experts: int) -> int:
    """How many distinct experts in [0, E) receive at least one token. topk_ids: (M, K);
    ids outside [0, E) (such as -1 for an expert on another rank) are not counted."""
    flat = topk_ids.reshape(-1)
    flat = flat[(flat >= 0) & (flat < num_experts)]
    return int(torch.unique(flat).numel())


def expert_weight_bytes(hidden: int, intermediate: int, dtype_bytes: int | float, quant=None) -> float:
    """Bytes of one expert's w13 (2I x H) + w2 (H x I) as stored (`QuantScheme.weight_bytes` of
    each; dtype_bytes: the activation dtype's). Unquantised: 3 * H * I * dtype_bytes. fp8: one byte
    per element plus the fp32 scales (tensor: 2 per expert; token: one per output channel, 2I + H;
    block: one per [bn, bk] block of each matrix). int8_w8a16: one byte per element plus a scale
    per output channel (activation dtype); int4_w4a16: half a byte per element of the K padded to
    whole groups, a scale per group (activation dtype) and, with zero points, half a byte per
    group; mxfp4: half a byte per element plus one e8m0 byte per 32."""
    if quant is None:
        return 3 * hidden * intermediate * dtype_bytes
    return (quant.weight_bytes(2 * intermediate, hidden, dtype_bytes)
            + quant.weight_bytes(hidden, intermediate, dtype_bytes))


def layer_bytes(
    topk_ids: torch.Tensor,
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype_bytes: int | float,
    tokens: int | None = None,
    quant=None,
) -> int:
    """Bytes the layer must move at least once: the weights of the experts hit (w13 + w2,
    3 * H * I elements each; fp8 payload and scales with `quant`, see `expert_weight_bytes`) plus
    the activations in and out (2 * tokens * H in the activation dtype, `dtype_bytes`).
    topk_ids: (M, K); tokens defaults to M."""
    m = topk_ids.shape[0] if tokens is None else tokens
    hit = experts_hit(topk_ids, num_experts)
    return int(round(hit * expert_weight_bytes(hidden, intermediate, dtype_bytes, quant) + 2 * m * hidden * dtype_bytes))


def shared_flops(tokens: int, hidden: int, shared_intermediate: int) -> int:
    """2 * tokens * 3 * H * Is: the shared MLP's two GEMMs for every token (fused or separate)."""
    return 2 * tokens * 3 * hidden * shared_intermediate


def bias_bytes(experts: int, hidden: int, intermediate: int, dtype_bytes: int | float) -> float:
    """Bytes of the biases of `experts` experts: b13 (2I) + b2 (H) each, in the activation dtype."""
    return experts * (2 * intermediate + hidden) * dtype_bytes


def roofline(flops: float, nbytes: float, ceilings: Ceilings, dtype: str | torch.dtype = "bf16") -> float:
    """Lowest possible time in microseconds: max(bytes / read bandwidth, flops / matmul peak)."""
    bw = ceilings.read_gbps()
    peak = ceilings.tflops(dtype)
    if not bw or not peak:
        raise MoebenchError(
            f"ceilings of {ceilings.device_name} lack a bandwidth or matmul peak: run `moebench env --calibrate`"
        )
    return max(nbytes / (bw * 1e9), flops / (peak * 1e12)) * 1e6


def metrics(
    latency_us: float,
    flops: float,
    nbytes: float,
    ceilings: Ceilings | None,
    dtype: str | torch.dtype = "bf16",
) -> dict[str, Any]:
    """tflops, gbps, floor_us (the roofline time; None without ceilings), roofline_frac
    (= floor / latency) and roofline_ref (where the ceilings come from, e.g. "measured 2026-11-29",
    "datasheet", "cpu measured ... (CPU, not GPU)"). dtype picks the matmul peak.
    A latency that is not a positive number gives None rates."""
    out: dict[str, Any] = {"tflops": None, "gbps": None, "floor_us": None, "roofline_frac": None,
                           "roofline_ref": ceilings.label if ceilings is not None else None}
    if ceilings is not None and ceilings.read_gbps() and ceilings.tflops(dtype):
        out["floor_us"] = roofline(flops, nbytes, ceilings, dtype)
    if latency_us is None or not math.isfinite(latency_us) or latency_us <= 0:
        return out
    t = latency_us * 1e-6
    out["tflops"] = flops / t / 1e12
    out["gbps"] = nbytes / t / 1e9
    if out["floor_us"] is not None:
        out["roofline_frac"] = out["floor_us"] / latency_us
    return out
