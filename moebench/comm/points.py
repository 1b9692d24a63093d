"""The published points of the communication model: `comm_points.csv` (fitted) and
`comm_heldout.csv` (never fitted) beside this file, one row per published figure with its source,
its GPU and links, the bytes per rank as the source counts them and the bytes the model puts on
each link (how they were derived is in the row: `bytes_how`; `scripts/derive_comm_points.py`
re-derives the computed columns).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from moebench.comm.links import check_world, nvlink_gbps, rdma_gbps
from moebench.errors import MoebenchError

POINTS_FILE = Path(__file__).with_name("comm_points.csv")
HELDOUT_FILE = Path(__file__).with_name("comm_heldout.csv")

REQUIRED = ("transport", "op", "gpu", "nvlink", "world_size", "gpus_per_node", "calls", "time_us",
            "bytes_rule", "bytes_per_rank", "nvlink_bytes", "rdma_bytes", "bytes_how", "source")



@dataclass(frozen=True)
class Point:
    """One published figure (a row of comm_points.csv); see the file's columns."""

    transport: str
    op: str
    gpu: str
    nvlink: str
    rdma: str
    world_size: int
    gpus_per_node: int
    calls: int
    time_us: float
    gbps: float | None
    derived: str
    bytes_rule: str
    bytes_per_rank: float
    nvlink_bytes: float
    rdma_bytes: float
    tokens: int | None
    hidden: int | None
    topk: int | None
    experts: int | None
    routing: str
    dtype: str
    bytes_how: str
    source: str
    note: str
    line: int
    file: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.transport, self.op)

    @property
    def nvlink_peak(self) -> float:
        return nvlink_gbps(self.nvlink)

    @property
    def rdma_peak(self) -> float:
        return rdma_gbps(self.rdma) if self.rdma else 0.0

    def label(self) -> str:
        size = f"{self.tokens} tok" if self.tokens else f"{self.bytes_per_rank / 1e6:.0f} MB"
        return f"{self.transport} {self.op} {self.gpu} EP/TP{self.world_size} {size}"


def _num(path, line, row, name, kind=float, required=True):
    v = (row.get(name) or "").strip()
    if not v:
        if required:
            raise MoebenchError(f"{path} line {line}: field '{name}' is missing")
        return None
    try:
        x = kind(float(v)) if kind is int else kind(v)
    except ValueError:
        raise MoebenchError(f"{path} line {line}: field '{name}' is not a number: {v!r}") from None
    if not math.isfinite(x) or x < 0:
        raise MoebenchError(f"{path} line {line}: field '{name}' must be a non-negative number, got {v}")
    return x


def load_points(path: str | Path | None = None) -> list[Point]:
    """The published points, checked: every required field present, figures non-negative, links known."""
    p = Path(path) if path is not None else POINTS_FILE
    if not p.is_file():
        raise MoebenchError(f"communication points file {p} does not exist")
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise MoebenchError(f"{p}: columns missing: {', '.join(missing)}")
        points = []
        for i, row in enumerate(reader, start=2):
            for c in REQUIRED:
                if not (row.get(c) or "").strip():
                    raise MoebenchError(f"{p} line {i}: field '{c}' is missing")
            pt = Point(
                transport=row["transport"].strip(), op=row["op"].strip(), gpu=row["gpu"].strip(),
                nvlink=row["nvlink"].strip(), rdma=(row.get("rdma") or "").strip(),
                world_size=_num(p, i, row, "world_size", int), gpus_per_node=_num(p, i, row, "gpus_per_node", int),
                calls=_num(p, i, row, "calls", int), time_us=_num(p, i, row, "time_us"),
                gbps=_num(p, i, row, "gbps", required=False), derived=(row.get("derived") or "").strip(),
                bytes_rule=row["bytes_rule"].strip(), bytes_per_rank=_num(p, i, row, "bytes_per_rank"),
                nvlink_bytes=_num(p, i, row, "nvlink_bytes"), rdma_bytes=_num(p, i, row, "rdma_bytes"),
                tokens=_num(p, i, row, "tokens", int, False), hidden=_num(p, i, row, "hidden", int, False),
                topk=_num(p, i, row, "topk", int, False), experts=_num(p, i, row, "experts", int, False),
                routing=(row.get("routing") or "").strip(), dtype=(row.get("dtype") or "").strip(),
                bytes_how=row["bytes_how"].strip(), source=row["source"].strip(), note=(row.get("note") or "").strip(),
                line=i, file=p.name,
            )
            if pt.time_us <= 0 or pt.bytes_per_rank <= 0 or pt.calls < 1 or pt.world_size < 2:
                raise MoebenchError(f"{p} line {i}: time_us, bytes_per_rank, calls must be positive and world_size >= 2")
            if pt.nvlink_bytes + pt.rdma_bytes <= 0:
                raise MoebenchError(f"{p} line {i}: the point puts no bytes on any link")
            nvlink_gbps(pt.nvlink)
            if pt.rdma_bytes > 0 and not pt.rdma:
                raise MoebenchError(f"{p} line {i}: rdma_bytes without an RDMA link")
            if pt.rdma:
                rdma_gbps(pt.rdma)
            check_world(pt.world_size, pt.gpus_per_node)
            points.append(pt)
    if not points:
        raise MoebenchError(f"{p} holds no points")
    return points

