"""Re-derive the computed columns of moebench/comm/comm_points.csv from the published ones.

    python scripts/derive_comm_points.py           # table of each row: CSV value vs re-derived, exit 1 on a mismatch

Published sources give a time, a bandwidth, or both; the CSV's `derived` column says which one was
computed from the other, and `bytes_rule` how the bytes per rank were counted:

    pairs           tokens x topk (token, expert) pairs x row bytes, local pairs included (DeepEP LL, pplx);
                    the model puts (gpus_per_node - 1) / world of them on NVLink, (world - gpus_per_node) / world on RDMA
    a2a-tensor      experts x tokens x row bytes: pplx's bench_all_to_all.py all_to_all_single tensor; (world-1)/world on NVLink
    rank-dedup      tokens x E[ranks a token reaches] x row bytes (DeepEP test_intranode.py counts recv_x rows); (world-1)/world on NVLink
    gbps-x-time     GB/s x time (both published); (world-1)/world on NVLink
    gbps-x-time-pairs  GB/s x time (both published), split as `pairs` past one node
    node-dedup      tokens x E[nodes a token reaches] x row bytes: DeepEP test_internode.py's RDMA count (own node included);
                    the model puts all of it on RDMA (DeepEP's RDMA stage moves the own node's rows too) and 7/8 of
                    tokens x E[ranks] x row bytes on NVLink
    ring-allreduce  the nccl-tests message size S; 2 (T-1)/T x S per rank on NVLink (busbw = that / time)
    ring-allreduce-nodes  the same bus bytes past one node: 1/g of them over each GPU's NIC, (g-1)/g over NVLink
                    (g GPUs per node: one ring per channel, each crossing the node boundary at another GPU)
    a2a-buffer      the nccl-tests send buffer S: (min(T, g) - 1)/T x S over NVLink, (T - g)/T x S over RDMA

Row bytes: fp8 = hidden + 4 x hidden / 128 (fp32 scale per 128 values), bf16 = 2 x hidden; fp8+meta and
bf16+weights add what DeepEP V2's test counts per token (int64 ids + fp32 weights, or the weights).
E[ranks] and E[nodes] for routing "uniform" (top-k of the experts uniformly at random) in closed form; for
"group-topG" (top-G node groups by their best expert, then top-k of their experts, as test_internode.py
routes) by Monte Carlo over the same procedure.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def row_bytes(dtype: str, hidden: int, topk: int = 0) -> int:
    return {"fp8": hidden + 4 * (hidden // 128), "fp8+meta": hidden + 4 * (hidden // 128) + 12 * topk,
            "bf16+weights": 2 * hidden + 4 * topk}.get(dtype, 2 * hidden)


def expected_reached(experts: int, groups: int, topk: int) -> float:
    """E[distinct groups of experts/groups experts each that top-k of `experts` uniformly reaches]."""
    per = experts // groups
    return groups * (1 - math.comb(experts - per, topk) / math.comb(experts, topk))


def group_limited_reach(experts: int, world: int, nodes: int, groups: int, topk: int,
                        tokens: int = 1 << 16, reps: int = 16) -> tuple[float, float]:
    """(E[ranks], E[nodes]) a token reaches under test_internode.py's group-limited routing (Monte Carlo)."""
    import torch

    ranks = nodes_hit = 0.0
    for s in range(reps):
        g = torch.Generator().manual_seed(s)
        scores = torch.randn(tokens, experts, generator=g).abs() + 1
        best = scores.view(tokens, nodes, -1).amax(-1)
        chosen = torch.topk(best, groups, dim=-1).indices
        mask = torch.zeros(tokens, nodes, dtype=torch.bool).scatter_(1, chosen, True)
        masked = (scores.view(tokens, nodes, -1) * mask.unsqueeze(-1)).reshape(tokens, experts)
        idx = torch.topk(masked, topk, dim=-1).indices
        ranks += torch.zeros(tokens, world).scatter_(1, idx // (experts // world), 1).sum(1).mean().item()
        nodes_hit += torch.zeros(tokens, nodes).scatter_(1, idx // (experts // nodes), 1).sum(1).mean().item()
    return ranks / reps, nodes_hit / reps


def reach(p, mc_tokens: int = 1 << 16, mc_reps: int = 16) -> tuple[float, float]:
    """(E[ranks], E[nodes]) of point p's routing."""
    nodes = max(1, p.world_size // p.gpus_per_node)
    if p.routing == "uniform":
        return expected_reached(p.experts, p.world_size, p.topk), expected_reached(p.experts, nodes, p.topk)
    if p.routing.startswith("group-top"):
        return group_limited_reach(p.experts, p.world_size, nodes, int(p.routing[len("group-top"):]), p.topk,
                                   mc_tokens, mc_reps)
    raise ValueError(f"line {p.line}: no rule for routing {p.routing!r}")


def derive(p, mc_tokens: int = 1 << 16, mc_reps: int = 16) -> dict[str, float]:
    """The computed columns of point p from its published ones."""
    w, gpn = p.world_size, p.gpus_per_node
    out: dict[str, float] = {}
    if p.bytes_rule == "pairs":
        b = p.tokens * p.topk * row_bytes(p.dtype, p.hidden, p.topk or 0)
        out.update(bytes_per_rank=b, nvlink_bytes=b * (min(w, gpn) - 1) / w, rdma_bytes=b * max(w - gpn, 0) / w)
    elif p.bytes_rule == "a2a-tensor":
        b = p.experts * p.tokens * row_bytes(p.dtype, p.hidden, p.topk or 0)
        out.update(bytes_per_rank=b, nvlink_bytes=b * (w - 1) / w, rdma_bytes=0)
    elif p.bytes_rule == "rank-dedup":
        ranks, _ = reach(p, mc_tokens, mc_reps)
        b = p.tokens * ranks * row_bytes(p.dtype, p.hidden, p.topk or 0)
        out.update(bytes_per_rank=b, nvlink_bytes=b * (w - 1) / w, rdma_bytes=0)
    elif p.bytes_rule == "gbps-x-time":
        b = p.gbps * p.time_us * 1e3
        out.update(bytes_per_rank=b, nvlink_bytes=b * (w - 1) / w, rdma_bytes=0)
    elif p.bytes_rule == "gbps-x-time-pairs":
        b = p.gbps * p.time_us * 1e3
        out.update(bytes_per_rank=b, nvlink_bytes=b * (min(w, gpn) - 1) / w, rdma_bytes=b * max(w - gpn, 0) / w)
    elif p.bytes_rule == "node-dedup":
        ranks, nodes_hit = reach(p, mc_tokens, mc_reps)
        nodes = w // gpn
        row = row_bytes(p.dtype, p.hidden, p.topk or 0)
        b = p.tokens * nodes_hit * row
        out.update(bytes_per_rank=b, rdma_bytes=b,
                   nvlink_bytes=p.tokens * ranks * row * (gpn - 1) / gpn)
    elif p.bytes_rule == "ring-allreduce":
        b = p.bytes_per_rank
        out.update(bytes_per_rank=b, nvlink_bytes=2 * (w - 1) / w * b, rdma_bytes=0)
    elif p.bytes_rule == "ring-allreduce-nodes":
        bus = 2 * (w - 1) / w * p.bytes_per_rank
        out.update(nvlink_bytes=bus * (gpn - 1) / gpn, rdma_bytes=bus / gpn)
    elif p.bytes_rule == "a2a-buffer":
        b = p.bytes_per_rank
        out.update(nvlink_bytes=b * (min(w, gpn) - 1) / w, rdma_bytes=b * max(w - gpn, 0) / w)
    else:
        raise ValueError(f"line {p.line}: unknown bytes_rule {p.bytes_rule!r}")
    counted = out["nvlink_bytes"] if p.bytes_rule == "ring-allreduce" else out.get("bytes_per_rank", p.bytes_per_rank)
    if p.derived == "time":
        out["time_us"] = counted / p.gbps / 1e3
    elif p.derived == "gbps":
        out["gbps"] = counted / p.time_us / 1e3
    return out


def check(points, rel: float = 0.01, **mc) -> list[str]:
    """Mismatches (one line each) between the CSV and the re-derived columns."""
    bad = []
    for p in points:
        for k, v in derive(p, **mc).items():
            have = getattr(p, k)
            if abs(have - v) > rel * max(abs(v), 1.0):
                bad.append(f"line {p.line} {p.transport} {p.op} EP/TP{p.world_size}: {k} {have:g} vs derived {v:g}")
    return bad


def main() -> int:
    from moebench.comm.points import load_points

    points = load_points()
    for p in points:
        d = derive(p)
        print(f"line {p.line:2d} {p.transport:16s} {p.op:10s} W={p.world_size:3d} "
              + " ".join(f"{k}={getattr(p, k):.6g}/{v:.6g}" for k, v in d.items()))
    bad = check(points)
    for b in bad:
        print("MISMATCH", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
