"""Communication cost model for simulated multi-rank runs.

In a simulated run one device computes one rank's share of the work (EP: the busiest rank's
tokens under the chosen routing; TP: the 1/T weight shards) and the communication time comes from
this model: latency + bytes / link bandwidth, per the collective's algorithm.

Units: bytes; bandwidth in GB/s (1e9 bytes per second, per direction per GPU, the same unit as
the `gbps` result column; `--link-gbps` is in these units too); times in microseconds.

Collectives (T ranks, `nbytes` = size of the full tensor on one rank):
    all-reduce (ring):       2 (T-1)/T * nbytes / bw + 2 (T-1) * latency
    all-gather (ring):         (T-1)/T * nbytes / bw +   (T-1) * latency   (nbytes = gathered size)
    reduce-scatter (ring):     (T-1)/T * nbytes / bw +   (T-1) * latency   (nbytes = input size)
    all-to-all (direct):     bytes sent or received by the busiest rank / bw + latency

Dispatch/combine traffic is counted per (token, expert) pair, as DeepEP's low-latency kernels
move it: a token that picks two experts of one rank is sent twice (DeepEP LL does no per-rank
deduplication; its normal-mode kernels do). DeepEP's published GB/s figures divide the bytes of
all pairs (local ones included) by the time; the time model only charges pairs that leave their
rank. Both counts are returned.

Link figures come, in order, from an explicit override (`link_gbps`), a measurement file when one
exists (`measured_link`), or a hardware profile chosen by device name (`default_link`). Every
command picks its link through `link_for`: --link, else the target GPU's (`target_gpu`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from moebench.errors import MoebenchError
from moebench.fileio import atomic_write_text
from moebench.layout import ParallelLayout


@dataclass(frozen=True)
class LinkProfile:
    """A GPU-to-GPU link: bandwidth_gbps in GB/s per direction per GPU, latency_us per message
    step. source: "profile", "measured" or "override"."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    source: str = "profile"

    def transfer_us(self, nbytes: float) -> float:
        """Time to move nbytes over the link at full bandwidth, without latency."""
        return float(nbytes) / (self.bandwidth_gbps * 1e3)  # bytes / (GB/s * 1e9) * 1e6 us


#: Hardware profiles. Bandwidths: NVLink4 (H100/H200/H20) 900 GB/s bidirectional = 450 per direction;
#: H800 / A800 (export parts) 400 bidirectional = 200; NVLink5 (B200) 1800 bidirectional = 900;
#: NVLink3 (A100) 600 bidirectional = 300; PCIe Gen5 x16 64 GB/s theoretical, ~50 practical;
#: PCIe Gen4 x16 ~25 practical; 400 Gb/s InfiniBand (NDR) = 50 GB/s. Latencies are per-step
#: figures of the order NCCL shows for small messages.
LINK_PROFILES: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("h100-nvlink", 450.0, 1.5),
        LinkProfile("h200-nvlink", 450.0, 1.5),
        LinkProfile("h20-nvlink", 450.0, 1.5),
        LinkProfile("h800-nvlink", 200.0, 1.5),
        LinkProfile("b200-nvlink", 900.0, 1.5),
        LinkProfile("a100-nvlink", 300.0, 2.0),
        LinkProfile("a800-nvlink", 200.0, 2.0),
        LinkProfile("pcie-gen5", 50.0, 3.0),
        LinkProfile("pcie-gen4", 25.0, 3.0),
        LinkProfile("ib-400g", 50.0, 5.0),
    )
}


def get_link(name: str, link_gbps: float | None = None) -> LinkProfile:
    """The named profile, with its bandwidth replaced by `link_gbps` (GB/s) when given."""
    if name not in LINK_PROFILES:
        raise MoebenchError(f"unknown link profile '{name}'; known: {', '.join(LINK_PROFILES)}")
    return override(LINK_PROFILES[name], link_gbps)


def override(link: LinkProfile, link_gbps: float | None) -> LinkProfile:
    """`link` with bandwidth `link_gbps` GB/s (source "override"); unchanged when None."""
    if link_gbps is None:
        return link
    if link_gbps <= 0:
        raise MoebenchError(f"--link-gbps must be positive, got {link_gbps}")
    return replace(link, bandwidth_gbps=float(link_gbps), source="override")


def default_link(device_name: str | None) -> LinkProfile:
    """The profile for GPUs of this name (torch.cuda.get_device_name): H200 -> h200-nvlink,
    H800 -> h800-nvlink, H20 -> h20-nvlink, H100 -> h100-nvlink, B200 -> b200-nvlink,
    A800 -> a800-nvlink, A100 -> a100-nvlink; anything else (CPU, unknown, PCIe cards) -> pcie-gen5."""
    n = (device_name or "").upper()
    if "H200" in n:
        return LINK_PROFILES["h200-nvlink"]
    if "PCIE" not in n:
        for tag, name in (("H800", "h800-nvlink"), ("H20", "h20-nvlink"), ("H100", "h100-nvlink"),
                          ("GH200", "h100-nvlink"), ("B200", "b200-nvlink"), ("A800", "a800-nvlink"),
                          ("A100", "a100-nvlink")):
            if tag in n:
                return LINK_PROFILES[name]
    return LINK_PROFILES["pcie-gen5"]


# ---------------------------------------------------------------------------------------------
# Measurement: a JSON file a calibration step writes (`moebench env --calibrate`, future).
#
#   {"name": "...", "bandwidth_gbps": 380.2, "latency_us": 2.1, "world_size": 8,
#    "device_name": "NVIDIA H200", "measured_at": "2026-11-29T10:00:00Z", "method": "..."}
#
# Location: $MOEBENCH_LINK_FILE, else results/calibration/link.json under the working directory.


def link_file() -> Path:
    return Path(os.environ.get("MOEBENCH_LINK_FILE", "results/calibration/link.json"))


def measured_link(path: str | Path | None = None, device_name: str | None = None) -> LinkProfile | None:
    """The measured link from the calibration file, or None when there is none or it was measured on
    another device than `device_name` (names must match exactly; a CPU/gloo measurement is stored as
    "cpu" and so never stands in for a GPU link). A malformed file is an error, not silently ignored."""
    p = Path(path) if path is not None else link_file()
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
        bw, lat = float(d["bandwidth_gbps"]), float(d["latency_us"])
    except (ValueError, KeyError, TypeError) as e:
        raise MoebenchError(f"link measurement {p} is malformed ({e}); delete it or re-run the calibration")
    if d.get("device_name") != device_name:  # measured elsewhere (another GPU, or gloo on a CPU)
        return None
    return LinkProfile(str(d.get("name", "measured")), bw, lat, source="measured")


def write_measured_link(link: LinkProfile, path: str | Path | None = None, **extra: object) -> Path:
    """Write a measurement for `measured_link` (atomic rename). extra: device_name, world_size..."""
    p = Path(path) if path is not None else link_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    data = {"name": link.name, "bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us, **extra}
    atomic_write_text(p, json.dumps(data, indent=2))
    return p


def choose_link(device_name: str | None, link_gbps: float | None = None, use_measurement: bool = True) -> LinkProfile:
    """Override > measurement > profile. With link_gbps, the measured (or profile) latency is kept
    and the bandwidth replaced."""
    base = (measured_link(device_name=device_name) if use_measurement else None) or default_link(device_name)
    return override(base, link_gbps)


#: The GPU that simulated runs on a machine without one speak of (its link and, in compare
#: tp-vs-ep, its roofline floor for the experts time).
DEFAULT_TARGET_GPU = "H200"


def target_gpu(device: str, requested: str | None = None, local_name: str | None = None) -> tuple[str, str]:
    """(name, why) of the GPU a simulated run models: --target-gpu, else this machine's GPU on
    cuda, else DEFAULT_TARGET_GPU."""
    if requested:
        return requested, "from --target-gpu"
    if device == "cuda" and local_name:
        return local_name, "this machine's GPU"
    return DEFAULT_TARGET_GPU, "no GPU here, so the default target GPU"


def link_for(device: str, local_name: str | None = None, link_name: str | None = None,
             link_gbps: float | None = None, requested_gpu: str | None = None) -> tuple[LinkProfile, str]:
    """The link a simulated run models, and why; one rule for every command (sweep --simulate,
    compare tp-vs-ep): --link NAME, else the link of the target GPU (`target_gpu`): its
    measurement (env --calibrate-link) when there is one, else its profile (`default_link`);
    --link-gbps replaces the bandwidth."""
    gbps = ", bandwidth from --link-gbps" if link_gbps is not None else ""
    if link_name:
        return get_link(link_name, link_gbps), f"from --link{gbps}"
    gpu, why = target_gpu(device, requested_gpu, local_name)
    link = choose_link(gpu, link_gbps)
    how = "measured by env --calibrate-link on" if measured_link(device_name=gpu) is not None else "the profile of"
    return link, f"{how} {gpu} ({why}){gbps}; change with --link / --link-gbps"


# ---------------------------------------------------------------------------------------------
# Collective costs


def _check(world: int) -> None:
    if world < 1:
        raise MoebenchError(f"world size must be >= 1, got {world}")


def allreduce_us(nbytes: float, world: int, link: LinkProfile) -> float:
    """Ring all-reduce of an nbytes tensor: 2(T-1)/T * nbytes / bw + 2(T-1) * latency."""
    _check(world)
    if world == 1:
        return 0.0
    t = world
    return link.transfer_us(2 * (t - 1) / t * nbytes) + 2 * (t - 1) * link.latency_us


def allgather_us(nbytes: float, world: int, link: LinkProfile) -> float:
    """Ring all-gather producing an nbytes tensor on every rank: (T-1)/T * nbytes / bw + (T-1) * latency."""
    _check(world)
    if world == 1:
        return 0.0
    t = world
    return link.transfer_us((t - 1) / t * nbytes) + (t - 1) * link.latency_us


def reduce_scatter_us(nbytes: float, world: int, link: LinkProfile) -> float:
    """Ring reduce-scatter of an nbytes input: (T-1)/T * nbytes / bw + (T-1) * latency."""
    return allgather_us(nbytes, world, link)


def all2all_us(busiest_bytes: float, world: int, link: LinkProfile) -> float:
    """Direct all-to-all (every rank sends to every other at once, as DeepEP does): the busiest
    rank's larger of bytes sent / received over the link, plus one latency."""
    _check(world)
    if world == 1 or busiest_bytes <= 0:
        return 0.0
    return link.transfer_us(busiest_bytes) + link.latency_us


# ---------------------------------------------------------------------------------------------
# Dispatch / combine traffic


@dataclass
class DispatchBytes:
    """One rank's dispatch traffic (combine sends the same rows back).

    pairs_per_rank: (world,) int64 (token, expert) pairs this rank sends to each rank
    pairs: all pairs (M_r * K, minus -1 ids); remote_pairs: those whose expert lives elsewhere
    bytes_deepep: pairs * H * dtype_bytes (how DeepEP counts its GB/s)
    bytes_remote: remote_pairs * H * dtype_bytes (what crosses the links)
    """

    pairs_per_rank: torch.Tensor
    pairs: int
    remote_pairs: int
    bytes_deepep: int
    bytes_remote: int


def dispatch_combine_bytes(
    topk_ids: torch.Tensor, expert_owner: torch.Tensor, rank: int, hidden: int, dtype_bytes: int
) -> DispatchBytes:
    """topk_ids (M_r, K) of the tokens on `rank`; expert_owner (E,) rank of each expert
    (ParallelLayout.expert_owner). Counts per (token, expert) pair, as DeepEP LL sends them."""
    ids = topk_ids.reshape(-1).long().cpu()
    ids = ids[ids >= 0]
    owner = expert_owner.long().cpu()
    world = int(owner.max()) + 1 if owner.numel() else 1
    per_rank = torch.bincount(owner[ids], minlength=world)
    pairs = int(per_rank.sum())
    remote = pairs - int(per_rank[rank]) if rank < world else pairs
    row = hidden * dtype_bytes
    return DispatchBytes(per_rank, pairs, remote, pairs * row, remote * row)


@dataclass
class EPTraffic:
    """All ranks' dispatch traffic. matrix[s, d]: pairs rank s sends to rank d; sent / recv:
    remote pairs each rank sends / receives; busiest_pairs: max over ranks of max(sent, recv)."""

    matrix: torch.Tensor
    sent: torch.Tensor
    recv: torch.Tensor
    busiest_pairs: int
    total_pairs: int


def ep_traffic(topk_ids_full: torch.Tensor, layout: ParallelLayout, num_experts: int) -> EPTraffic:
    """topk_ids_full (M, K) of the whole batch, split over the EP ranks as contiguous DP slices
    (remainder to the first ranks, as the rank-case runner does)."""
    from moebench.runtime.rank_case import token_split

    world = layout.ep_size
    owner = layout.expert_owner(num_experts)
    mat = torch.zeros((world, world), dtype=torch.int64)
    for s, (lo, hi) in enumerate(token_split(topk_ids_full.shape[0], world)):
        ids = topk_ids_full[lo:hi].reshape(-1).long().cpu()
        ids = ids[ids >= 0]
        mat[s] = torch.bincount(owner[ids], minlength=world)
    off = mat.clone()
    off.fill_diagonal_(0)
    sent, recv = off.sum(1), off.sum(0)
    busiest = int(torch.maximum(sent, recv).max()) if world else 0
    return EPTraffic(mat, sent, recv, busiest, int(mat.sum()))


def ep_dispatch_combine_us(
    topk_ids_full: torch.Tensor,
    layout: ParallelLayout,
    num_experts: int,
    hidden: int,
    link: LinkProfile,
    dispatch_bytes: int = 2,
    combine_bytes: int = 2,
) -> tuple[float, float]:
    """(dispatch_us, combine_us) of an all-to-all dispatch/combine of the whole batch: the busiest
    rank's remote (token, expert) rows at hidden * dtype bytes each, over `link`. dispatch_bytes
    e.g. 1 for FP8 dispatch (scales ignored), combine_bytes 2 for bf16."""
    tr = ep_traffic(topk_ids_full, layout, num_experts)
    world = layout.ep_size
    return (
        all2all_us(tr.busiest_pairs * hidden * dispatch_bytes, world, link),
        all2all_us(tr.busiest_pairs * hidden * combine_bytes, world, link),
    )


def tp_allreduce_us(num_tokens: int, hidden: int, dtype_bytes: int, world: int, link: LinkProfile) -> float:
    """The TP path's all-reduce of the (M, H) output."""
    return allreduce_us(num_tokens * hidden * dtype_bytes, world, link)


# ---------------------------------------------------------------------------------------------
# The busiest EP rank's share (what one device computes in a simulated EP run)


@dataclass
class RankShare:
    """One EP rank's work under a routing.

    rank: the rank; pairs_per_rank: (P,) int64 (token, expert) pairs each rank receives;
    token_index: (M_s,) int64 global ids of the tokens with at least one expert on `rank`;
    topk_ids / topk_weights: (M_s, K) their routing (global ids; pairs elsewhere are remote);
    expert_map: (E,) int32 for `rank`; imbalance: max / mean of pairs_per_rank.
    """

    rank: int
    pairs_per_rank: torch.Tensor
    token_index: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor | None
    expert_map: torch.Tensor | None
    imbalance: float

    @property
    def pairs(self) -> int:
        return int(self.pairs_per_rank[self.rank])


def rank_share(
    topk_ids: torch.Tensor,
    layout: ParallelLayout,
    num_experts: int,
    rank: int,
    topk_weights: torch.Tensor | None = None,
) -> RankShare:
    """The share of `rank`: tokens of the whole batch topk_ids (M, K) that it receives."""
    owner = layout.expert_owner(num_experts).to(topk_ids.device)
    world = layout.ep_size
    dest = owner[topk_ids.long()]  # (M, K)
    per_rank = torch.bincount(dest.reshape(-1).cpu(), minlength=world)
    hit = (dest == rank).any(dim=1)
    idx = torch.nonzero(hit, as_tuple=True)[0]
    mean = float(per_rank.float().mean()) if world else 0.0
    return RankShare(
        rank=rank,
        pairs_per_rank=per_rank,
        token_index=idx,
        topk_ids=topk_ids[idx],
        topk_weights=None if topk_weights is None else topk_weights[idx],
        expert_map=layout.expert_map(rank, num_experts),
        imbalance=float(per_rank.max()) / mean if mean else 1.0,
    )


def busiest_rank_share(
    topk_ids: torch.Tensor, layout: ParallelLayout, num_experts: int, topk_weights: torch.Tensor | None = None
) -> RankShare:
    """The EP rank that receives the most (token, expert) pairs (lowest rank on ties) and its share."""
    owner = layout.expert_owner(num_experts)
    per_rank = torch.bincount(owner[topk_ids.reshape(-1).long().cpu()], minlength=layout.ep_size)
    rank = int(torch.argmax(per_rank))  # first maximum
    return rank_share(topk_ids, layout, num_experts, rank, topk_weights)


def profiles_table() -> list[dict]:
    """The profiles as rows (for `moebench env` and reports)."""
    return [asdict(p) for p in LINK_PROFILES.values()]
