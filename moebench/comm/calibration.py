"""Fits of the communication model measured on this machine's GPUs, read back: the file
`moebench env --calibrate-link` writes (`moebench.runtime.link_calibration` measures it on real
ranks), keyed by device name. Later simulated runs on the same GPUs use these fits for the NVLink
part of the transports they cover (RDMA, which one node cannot show, stays the published fit's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from moebench.comm.links import link_file
from moebench.errors import MoebenchError

# ---------------------------------------------------------------------------------------------
# Reading a calibration back (the model's measured fits)
#: A calibration file's "transports" are keyed "<transport>:<op>" (the op as a prepare/finalize
#: declares it: its calls included; or the transport's own collective, one call). Files of earlier
#: calibrations used these keys:
LEGACY_KEYS = {
    "nccl-all-reduce": "nccl-all-reduce:all-reduce",
    "nccl-all-to-all": "nccl-all-to-all:all-to-all",
    "all2all-ll:dispatch": "nccl-all-to-all:dispatch",
    "all2all-ll:combine": "nccl-all-to-all:combine",
}


def measured_key(key: str) -> str:
    """A calibration key, checked: '<transport>:<op>' with an op moebench.comm knows."""
    from moebench.comm import OPS

    key = LEGACY_KEYS.get(key, key)
    transport, _, op = key.partition(":")
    if not transport or op not in OPS:
        raise MoebenchError(f"unknown transport '{key}'; calibration keys are '<transport>:<op>' with op one of "
                            f"{', '.join(OPS)}")
    return key


@dataclass
class MeasuredFit:
    """alpha + bytes / gbps over NVLink, fitted to this machine's sweep (bytes counted as the model
    counts them: see measure_link above)."""

    key: str
    alpha_us: float
    gbps: float
    world_size: int
    worst_ratio: float

    def time_us(self, nvl_bytes: float) -> float:
        return self.alpha_us + nvl_bytes / (self.gbps * 1e3)


def measured_fits(path: str | Path | None = None, device_name: str | None = None) -> tuple[dict[str, MeasuredFit], str]:
    """Fits of the calibration file measured on `device_name`, and a line saying what they are;
    ({}, "") when there is no file or it was measured elsewhere. A file with missing fields or
    negative figures is an error."""
    p = Path(path) if path is not None else link_file()
    if not p.is_file():
        return {}, ""
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise MoebenchError(f"link measurement {p} is not JSON ({e}); delete it or re-run `moebench env --calibrate-link`")
    if not isinstance(d, dict) or d.get("device_name") != device_name:
        return {}, ""
    out: dict[str, MeasuredFit] = {}
    transports = d.get("transports")
    if transports is None:  # a file of the first calibration: one all-to-all bandwidth and latency
        transports = {"nccl-all-to-all": {"alpha_us": d.get("latency_us"), "gbps": d.get("bandwidth_gbps"),
                                          "worst_ratio": 1.0}}
    if not isinstance(transports, dict):
        raise MoebenchError(f"link measurement {p}: 'transports' must be an object")
    for key, v in transports.items():
        try:
            key = measured_key(key)
        except MoebenchError as e:
            raise MoebenchError(f"link measurement {p}: {e}") from None
        vals = {}
        for name in ("alpha_us", "gbps", "worst_ratio"):
            x = v.get(name) if isinstance(v, dict) else None
            if x is None:
                raise MoebenchError(f"link measurement {p}: {key} has no '{name}'; re-run `moebench env --calibrate-link`")
            try:
                x = float(x)
            except (TypeError, ValueError):
                raise MoebenchError(f"link measurement {p}: {key} {name} is not a number: {x!r}") from None
            if not math.isfinite(x) or x < 0 or (name == "gbps" and x == 0):
                raise MoebenchError(f"link measurement {p}: {key} {name} must be a positive number, got {x}")
            vals[name] = x
        out[key] = MeasuredFit(key, vals["alpha_us"], vals["gbps"], int(d.get("world_size") or 0), vals["worst_ratio"])
    line = (f"measured on {device_name} over {d.get('world_size')} ranks ({d.get('measured_at', 'undated')}, "
            f"`moebench env --calibrate-link`): {', '.join(sorted(out))}")
    return out, line

