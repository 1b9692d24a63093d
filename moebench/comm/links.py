"""Links of a simulated cluster: the link profiles (NVLink by GPU, PCIe), the RDMA links between
nodes, which one a run models (--link, a measurement, the target GPU), and the checks that a world
of ranks fits whole nodes.

Units: bandwidth in GB/s (1e9 bytes per second, per direction per GPU, the same unit as the `gbps`
result column; `--link-gbps` is in these units too).

Link figures come, in order, from an explicit override (`link_gbps`), a measurement file when one
exists (`measured_link`), or a hardware profile chosen by device name (`default_link`). Every
command picks its link through `link_for`: --link, else the target GPU's (`target_gpu`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from moebench.errors import MoebenchError
from moebench.fileio import atomic_write_text



@dataclass(frozen=True)
class LinkProfile:
    """A GPU-to-GPU link: bandwidth_gbps in GB/s per direction per GPU, latency_us per message
    step. source: "profile", "measured" or "override"; vendor: whose GPUs it joins ("nvidia",
    "amd"): a fit of one vendor's points never prices another's link."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    source: str = "profile"
    vendor: str = "nvidia"

    def transfer_us(self, nbytes: float) -> float:
        """Time to move nbytes over the link at full bandwidth, without latency."""
        return float(nbytes) / (self.bandwidth_gbps * 1e3)  # bytes / (GB/s * 1e9) * 1e6 us


#: Hardware profiles. Bandwidths: NVLink4 (H100/H200/H20) 900 GB/s bidirectional = 450 per direction;
#: H800 / A800 (export parts) 400 bidirectional = 200; NVLink5 (B200) 1800 bidirectional = 900;
#: GB200 NVL72: NVLink5 across the 72 GPUs of a rack (one NVLink domain, see NVLINK_DOMAIN);
#: NVLink3 (A100) 600 bidirectional = 300; PCIe Gen5 x16 64 GB/s theoretical, ~50 practical;
#: PCIe Gen4 x16 ~25 practical; 400 Gb/s InfiniBand (NDR) = 50 GB/s. B300 / GB300: NVLink5 as
#: B200 (1800 GB/s bidirectional per GPU). AMD xGMI (Infinity Fabric, 7 links to the 7 peers of an
#: 8-GPU platform): MI300X 7 x 128 GB/s bidirectional = 448 per direction (16 lanes at 32 Gb/s per
#: link); MI325X the same CDNA 3 fabric (assumed from MI300X's); MI355X 7 x 153.6 GB/s bidirectional
#: = 537.6 per direction. Latencies are per-step figures of the order NCCL shows for small messages.
LINK_PROFILES: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("h100-nvlink", 450.0, 1.5),
        LinkProfile("h200-nvlink", 450.0, 1.5),
        LinkProfile("h20-nvlink", 450.0, 1.5),
        LinkProfile("h800-nvlink", 200.0, 1.5),
        LinkProfile("b200-nvlink", 900.0, 1.5),
        LinkProfile("gb200-nvlink", 900.0, 1.5),
        LinkProfile("b300-nvlink", 900.0, 1.5),
        LinkProfile("gb300-nvlink", 900.0, 1.5),
        LinkProfile("mi300x-xgmi", 448.0, 1.5, vendor="amd"),
        LinkProfile("mi325x-xgmi", 448.0, 1.5, vendor="amd"),
        LinkProfile("mi355x-xgmi", 537.6, 1.5, vendor="amd"),
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
    if not math.isfinite(link_gbps) or link_gbps <= 0:
        raise MoebenchError(f"--link-gbps must be a positive finite number of GB/s, got {link_gbps}")
    return replace(link, bandwidth_gbps=float(link_gbps), source="override")


#: GPUs one NVLink domain holds, by GPU: an HGX / DGX box of 8, a GB200 NVL72 rack of 72
#: (NVIDIA's GB200 NVL72 datasheet: 72 GPUs in one NVLink domain).
NVLINK_DOMAIN = {"GB200": 72, "GB300": 72}


def nvlink_domain(gpu: str | None) -> int:
    """GPUs per NVLink domain (--gpus-per-node's default) for GPUs of this name."""
    return NVLINK_DOMAIN.get((gpu or "").upper(), 8)


def default_link(device_name: str | None) -> LinkProfile:
    """The profile for GPUs of this name (torch.cuda.get_device_name): H200 -> h200-nvlink,
    H800 -> h800-nvlink, H20 -> h20-nvlink, H100 -> h100-nvlink, B200 -> b200-nvlink,
    A800 -> a800-nvlink, A100 -> a100-nvlink, B300 / GB300 -> b300- / gb300-nvlink, MI300X / MI325X /
    MI355X -> their xGMI; anything else (CPU, unknown, PCIe cards) -> pcie-gen5."""
    n = (device_name or "").upper()
    if "H200" in n:
        return LINK_PROFILES["h200-nvlink"]
    if "PCIE" not in n:
        for tag, name in (("GB300", "gb300-nvlink"), ("B300", "b300-nvlink"), ("MI300X", "mi300x-xgmi"),
                          ("MI325X", "mi325x-xgmi"), ("MI355X", "mi355x-xgmi"),
                          ("GB200", "gb200-nvlink"), ("H800", "h800-nvlink"), ("H20", "h20-nvlink"), ("H100", "h100-nvlink"),
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


#: RDMA links between nodes: GB/s per direction per GPU (one NIC per GPU). 400 Gb/s = 50 GB/s.
#: rdma-400g: InfiniBand NDR (ConnectX-7); roce-400g: 400 Gb/s RoCE (OCI's GB200 racks);
#: efa-400g: AWS EFA, 400 Gb/s per GPU (2 x 200 Gb/s, p5en's 3200 Gb/s over 8 GPUs), priced by
#: the RDMA fits scaled to EFA's published points (moebench.comm.fit.LINK_FITS);
#: rdma-800g: ConnectX-8 800 Gb/s (no published point: said extrapolated).
RDMA_GBPS: dict[str, float] = {"rdma-400g": 50.0, "roce-400g": 50.0, "efa-400g": 50.0, "rdma-800g": 100.0}

#: RDMA links people ask for that no published point backs: refused, with why.
RDMA_REFUSED = {
    "rdma-200g": "no published point of any transport over 200 Gb/s NICs",
    "efa-200g": "no published point over one 200 Gb/s EFA NIC per GPU (pplx's EFA figures use two: efa-400g)",
    "roce-200g": "no published point of any transport over 200 Gb/s RoCE",
}
DEFAULT_RDMA = "rdma-400g"
DEFAULT_GPUS_PER_NODE = 8


def nvlink_gbps(name: str) -> float:
    """Per-direction NVLink (or PCIe) peak of a link profile."""
    if name not in LINK_PROFILES:
        raise MoebenchError(f"unknown link profile '{name}'; known: {', '.join(LINK_PROFILES)}")
    return LINK_PROFILES[name].bandwidth_gbps


def rdma_gbps(name: str) -> float:
    if name in RDMA_REFUSED:
        raise MoebenchError(f"RDMA link '{name}' is not modeled: {RDMA_REFUSED[name]}; modeled: {', '.join(RDMA_GBPS)}")
    if name not in RDMA_GBPS:
        raise MoebenchError(f"unknown RDMA link '{name}'; known: {', '.join(RDMA_GBPS)}")
    return RDMA_GBPS[name]


def check_world(world: int, gpus_per_node: int) -> None:
    """A world past one node must be whole nodes."""
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise MoebenchError(f"--gpus-per-node must be a positive integer, got {gpus_per_node!r}")
    if world > gpus_per_node and world % gpus_per_node:
        raise MoebenchError(f"world size {world} is not a multiple of --gpus-per-node {gpus_per_node}: "
                            f"past one node the ranks fill whole nodes")


def check_tp(tp: int, gpus_per_node: int) -> None:
    """TP stays inside a node: an all-reduce per layer over RDMA is not a layout moebench models."""
    if tp > gpus_per_node:
        raise MoebenchError(f"TP{tp} spans {math.ceil(tp / gpus_per_node)} nodes of {gpus_per_node} GPUs: "
                            f"TP stays inside a node; use --tp {gpus_per_node} or expert parallelism (--ep {tp})")

