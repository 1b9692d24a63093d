"""env --calibrate-link's sweep and fit, on gloo ranks (2 and 4 processes)."""

from __future__ import annotations

import pytest

from moebench.backends import get_prepare_finalize_class, prepare_finalize_names
from moebench.comm import calibration as calibration_
from moebench.runtime.link_calibration import fit_alpha_beta, measure_link


def test_fit_alpha_beta_recovers_a_line():
    pts = [(b, 5.0 + b / 100e3) for b in (1e3, 1e5, 1e7)]  # 5 us + bytes / 100 GB/s
    alpha, gbps, worst = fit_alpha_beta(pts)
    assert alpha == pytest.approx(5.0, rel=1e-6) and gbps == pytest.approx(100.0, rel=1e-6)
    assert worst == pytest.approx(1.0)
    alpha, gbps, _ = fit_alpha_beta([(1e3, 10.0), (1e6, 9.0)])  # noise: larger is not slower
    assert alpha >= 0 and gbps > 0


@pytest.mark.parametrize("world", [2, 4])
def test_calibration_on_gloo(world, tmp_path, monkeypatch):
    link, raw = measure_link(world, "cpu", {n: get_prepare_finalize_class(n) for n in prepare_finalize_names()}, reps=1, sizes=[1024, 16384], tokens=[1, 4])
    keys = {"nccl-all-reduce:all-reduce", "nccl-all-to-all:all-to-all", "nccl-all-to-all:dispatch",
            "nccl-all-to-all:combine"}  # all2all-ll's dispatch / combine, keyed by the transport it declares
    assert set(raw["transports"]) == keys
    assert {"deepep-ll", "deepep-ht"} <= set(raw["skipped"])  # need CUDA and deep_ep
    for v in raw["transports"].values():
        assert v["alpha_us"] >= 0 and v["gbps"] > 0 and v["worst_ratio"] > 0 and len(v["points"]) == 2
        assert all(b > 0 and t > 0 for b, t in v["points"])
    assert link.source == "measured" and link.bandwidth_gbps == raw["transports"]["nccl-all-to-all:all-to-all"]["gbps"]
    # what the CLI writes reads back as measured fits of the CPU (never of a GPU)
    from moebench.comm.links import write_measured_link

    f = tmp_path / "link.json"
    write_measured_link(link, f, device_name="cpu", world_size=world, **raw)
    fits, line = calibration_.measured_fits(f, "cpu")
    assert set(fits) == keys and f"over {world} ranks" in line
    assert calibration_.measured_fits(f, "NVIDIA H200") == ({}, "")
