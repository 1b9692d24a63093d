"""Traffic: the rows and bytes each rank sends, counted once.

`ep_link_rows` is the one count of a dispatch / combine: for a routing over EP ranks it gives, per
rank, the rows it moves over NVLink and over RDMA (what the model prices) and the rows its tokens
make in DeepEP's count (local pairs included: what DeepEP's and pplx's tests divide by their time).
`row_bytes` is the one size of a row. The model's times, the rows' GB/s columns and the layer
metrics all read these two.

Row styles (moebench.comm.CommOp.traffic):
    "pair"  one row per (token, expert) pair, straight to its rank (DeepEP LL, pplx, all2all-ll)
    "rank"  one row per (token, rank) (DeepEP normal inside a node)
    "node"  DeepEP normal past one node: one row per (token, node it reaches, its own included)
            over RDMA to the GPU of the same index there, then one per (token, rank) over NVLink

Collectives over a whole tensor (all-reduce, all-gather, reduce-scatter, all-to-all) count bytes
as nccl-tests does (`BUS_FACTOR`, `collective_bytes`).

Two counts, and every GB/s says which (`COUNTS`):
    "link"    the busiest rank's bytes on its links (remote rows only; a collective's bus bytes):
              the bytes the model prices, so a modeled row's GB/s is the bandwidth the model assumed
    "deepep"  each rank's rows, local pairs included (DeepEP's and pplx's convention), mean over ranks
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from moebench.errors import MoebenchError
from moebench.layout import ParallelLayout

#: the counts a GB/s column may be in (the rows' x_comm_count says which)
COUNTS = {
    "link": "the busiest rank's bytes on its links (remote rows; collectives: nccl-tests' bus bytes), as modeled",
    "deepep": "each rank's rows, local pairs included (DeepEP's convention), mean over ranks",
}

#: values per fp32 scale of an fp8 row when no scheme says otherwise (DeepEP's and DeepGEMM's blocks)
FP8_BLOCK = 128


def gbps(nbytes: float, us: float | None) -> float | None:
    """GB/s of `nbytes` in `us` microseconds (None without a positive time)."""
    return nbytes / (us * 1e3) if us else None


def row_bytes(hidden: int, dtype_bytes: float = 2, scale_groups: int = 0) -> int:
    """Bytes of one token row: `hidden` values of `dtype_bytes` each, plus one fp32 scale per
    group where the row is fp8 (`scale_groups` > 0: then the values are one byte each)."""
    if scale_groups:
        return hidden + 4 * scale_groups
    return int(hidden * dtype_bytes)


def payload_row_bytes(hidden: int, dtype_bytes: float, quant=None) -> int:
    """Bytes of one dispatched row under a layer's precision: an fp8 QuantScheme's payload plus its
    scales (moebench.quant.pack_rows); weight-only schemes and no scheme: the activation dtype."""
    if quant is None:
        return row_bytes(hidden, dtype_bytes)
    return int(quant.row_bytes(hidden, dtype_bytes))


def dtype_row_bytes(dtype: str, hidden: int) -> int:
    """Bytes of one row of `hidden` in "bf16" or "fp8" (one fp32 scale per FP8_BLOCK values)."""
    return row_bytes(hidden, 1, math.ceil(hidden / FP8_BLOCK)) if dtype == "fp8" else row_bytes(hidden, 2)


@dataclass
class LinkRows:
    """Rows (messages) each rank moves, by link: nvl, rdma (world,) int64: the larger of sent and
    received over NVLink / RDMA (what the model prices); sent (world,) int64: the rows each rank's
    tokens make in DeepEP's count (local ones included)."""

    nvl: np.ndarray
    rdma: np.ndarray
    sent: np.ndarray

    def busiest(self, row_bytes: float) -> float:
        """The busiest rank's bytes on its links (the "link" count)."""
        return float(((self.nvl + self.rdma) * row_bytes).max()) if self.nvl.size else 0.0

    def deepep_bytes(self, row_bytes: float, ranks: int | None = None) -> float:
        """Bytes per rank in DeepEP's count (local pairs included), mean over `ranks` (default:
        the ranks counted)."""
        n = ranks or self.sent.size
        return float(self.sent.sum() * row_bytes / n) if n else 0.0


def _split_sources(topk_ids_full: torch.Tensor, world: int):
    from moebench.layout import token_split

    ids = topk_ids_full.long().cpu()
    src = torch.empty(ids.shape[0], dtype=torch.int64)
    for s, (lo, hi) in enumerate(token_split(ids.shape[0], world)):
        src[lo:hi] = s
    return ids, src


def ep_link_rows(topk_ids_full: torch.Tensor, layout: ParallelLayout, num_experts: int, gpus_per_node: int,
                 style: str = "pair") -> LinkRows:
    """Rows each rank moves for one dispatch (combine moves the same rows back) of the whole batch
    topk_ids_full (M, K), split over the EP ranks as contiguous slices; see the module docstring
    for the styles."""
    return owner_link_rows(topk_ids_full, layout.expert_owner(num_experts), layout.ep_size, gpus_per_node, style)


def owner_link_rows(topk_ids_full: torch.Tensor, owner: torch.Tensor, world: int, gpus_per_node: int,
                    style: str = "pair") -> LinkRows:
    """`ep_link_rows` for experts owned as `owner` (E,) says (the rank of each expert)."""
    ids, src = _split_sources(topk_ids_full, world)
    owner = owner.to(torch.int64).cpu()
    valid = ids >= 0
    dest = torch.where(valid, owner[ids.clamp(min=0)], torch.full_like(ids, -1))
    node = lambda r: r // gpus_per_node  # noqa: E731
    s2 = src.unsqueeze(1).expand_as(dest)
    sent_n = torch.zeros(world, dtype=torch.int64)
    sent_r, recv_n, recv_r, sent = sent_n.clone(), sent_n.clone(), sent_n.clone(), sent_n.clone()
    if style == "pair":
        sent.index_add_(0, s2[valid], torch.ones_like(s2[valid]))
        m = valid & (dest != s2)
        same = m & (node(dest) == node(s2))
        far = m & (node(dest) != node(s2))
        sent_n.index_add_(0, s2[same], torch.ones_like(s2[same]))
        recv_n.index_add_(0, dest[same], torch.ones_like(dest[same]))
        sent_r.index_add_(0, s2[far], torch.ones_like(s2[far]))
        recv_r.index_add_(0, dest[far], torch.ones_like(dest[far]))
    elif style in ("rank", "node"):
        tok = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(dest)
        hit = torch.zeros(ids.shape[0], world, dtype=torch.bool)  # (token, rank) pairs, deduplicated
        hit[tok[valid], dest[valid]] = True
        t_idx, d_idx = torch.nonzero(hit, as_tuple=True)
        s_idx = src[t_idx]
        sent.index_add_(0, s_idx, torch.ones_like(s_idx))
        if style == "rank" or world <= gpus_per_node:
            m = d_idx != s_idx
            sent_n.index_add_(0, s_idx[m], torch.ones_like(s_idx[m]))
            recv_n.index_add_(0, d_idx[m], torch.ones_like(d_idx[m]))
        else:
            # NVLink: the row reaches d from the GPU of d's node with the source's local index.
            via = node(d_idx) * gpus_per_node + s_idx % gpus_per_node
            m = via != d_idx
            sent_n.index_add_(0, via[m], torch.ones_like(via[m]))
            recv_n.index_add_(0, d_idx[m], torch.ones_like(d_idx[m]))
            nodes = world // gpus_per_node
            nhit = torch.zeros(ids.shape[0], nodes, dtype=torch.bool)
            nhit[tok[valid], node(dest[valid])] = True
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
    return LinkRows(torch.maximum(sent_n, recv_n).numpy(), torch.maximum(sent_r, recv_r).numpy(), sent.numpy())


def deepep_rows(topk_ids: torch.Tensor, per: str = "expert", expert_owner: torch.Tensor | None = None) -> int:
    """Rows one dispatch (or combine) of topk_ids (M, K) sends in DeepEP's count, local ones
    included: per="expert" one per (token, selected expert) pair, ids < 0 skipped (DeepEP
    low-latency); per="rank" one per distinct (token, destination rank), needs expert_owner (E,)
    (DeepEP normal). The count of `owner_link_rows`."""
    if per not in ("expert", "rank"):
        raise MoebenchError(f"per must be 'expert' (low-latency) or 'rank' (normal mode), got {per!r}")
    if per == "expert":
        if expert_owner is None:  # the count does not depend on who owns what
            return int((topk_ids >= 0).sum())
    elif expert_owner is None:
        raise MoebenchError("per='rank' counting needs expert_owner (E,): the rank owning each expert")
    owner = expert_owner.to(torch.int64).cpu()
    world = int(owner.max()) + 1 if owner.numel() else 1
    rows = owner_link_rows(topk_ids, owner, world, world, "pair" if per == "expert" else "rank")
    return int(rows.sent.sum())


# ---------------------------------------------------------------------------------------------
# Collectives over a whole tensor

#: Where a collective over a whole tensor moves its bytes: nccl-tests' bus bytes per rank, as a
#: share of the tensor (all-gather: the gathered tensor; reduce-scatter: its input).
BUS_FACTOR = {"all-reduce": lambda t: 2 * (t - 1) / t, "all-gather": lambda t: (t - 1) / t,
              "reduce-scatter": lambda t: (t - 1) / t, "all-to-all": lambda t: (t - 1) / t}


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
