"""The communication cost model, checked against hand-computed figures."""

from __future__ import annotations

import json

import pytest
import torch

from moebench.errors import MoebenchError
from moebench.layout import ParallelLayout
from moebench.comm import links as links_
from moebench.runtime import simulate as sim

LINK = links_.LinkProfile("test", bandwidth_gbps=100.0, latency_us=2.0)  # 100 GB/s = 1e5 bytes/us


def test_transfer_units():
    assert LINK.transfer_us(1e5) == pytest.approx(1.0)  # 100 kB at 100 GB/s = 1 us
    assert LINK.transfer_us(1e9) == pytest.approx(1e4)


def test_profiles_and_override():
    assert links_.get_link("h100-nvlink").bandwidth_gbps == 450.0
    assert links_.get_link("h200-nvlink").bandwidth_gbps == 450.0
    assert links_.get_link("a100-nvlink").bandwidth_gbps == 300.0
    assert links_.get_link("pcie-gen5").bandwidth_gbps == 50.0
    ib = links_.get_link("ib-400g")
    assert ib.bandwidth_gbps == 50.0 and ib.latency_us > links_.get_link("h100-nvlink").latency_us
    o = links_.get_link("h100-nvlink", link_gbps=200.0)
    assert (o.bandwidth_gbps, o.latency_us, o.source) == (200.0, 1.5, "override")
    with pytest.raises(MoebenchError, match="unknown link profile"):
        links_.get_link("nvlink9")
    with pytest.raises(MoebenchError):
        links_.get_link("pcie-gen5", link_gbps=0)


def test_default_link_by_device_name():
    assert links_.default_link("NVIDIA H200").name == "h200-nvlink"
    assert links_.default_link("NVIDIA H100 80GB HBM3").name == "h100-nvlink"
    assert links_.default_link("NVIDIA A100-SXM4-80GB").name == "a100-nvlink"
    assert links_.default_link("NVIDIA H100 PCIe").name == "pcie-gen5"
    assert links_.default_link(None).name == "pcie-gen5"


def test_measured_link(tmp_path, monkeypatch):
    f = tmp_path / "link.json"
    monkeypatch.setenv("MOEBENCH_LINK_FILE", str(f))
    assert links_.measured_link() is None
    assert links_.choose_link("NVIDIA H200").name == "h200-nvlink"
    links_.write_measured_link(links_.LinkProfile("nccl-8xH200", 380.0, 2.5), device_name="NVIDIA H200", world_size=8)
    assert links_.measured_link() is None  # asked for no device: a GPU measurement does not apply
    m = links_.measured_link(device_name="NVIDIA H200")
    assert (m.bandwidth_gbps, m.latency_us, m.source) == (380.0, 2.5, "measured")
    assert links_.choose_link("NVIDIA H200").source == "measured"
    assert links_.choose_link("NVIDIA A100-SXM4-80GB").name == "a100-nvlink"  # measured elsewhere
    over = links_.choose_link("NVIDIA H200", link_gbps=100.0)
    assert (over.bandwidth_gbps, over.latency_us, over.source) == (100.0, 2.5, "override")
    links_.write_measured_link(links_.LinkProfile("gloo", 2.0, 150.0), device_name="cpu")
    assert links_.choose_link("NVIDIA H200").name == "h200-nvlink"  # a CPU measurement never stands in
    f.write_text(json.dumps({"name": "x"}))
    with pytest.raises(MoebenchError, match="malformed"):
        links_.measured_link()


def test_deepep_published_figure_is_pair_counting():
    # DeepEP LL dispatch, 128 tokens x top-8, hidden 7168, FP8 (+ 4-byte scale per 128 values):
    # 128*8*(7168 + 7168/128*4) bytes in 77 us is about 98 GB/s, as published.
    nbytes = 128 * 8 * (7168 + 7168 // 128 * 4)
    assert nbytes / 77e-6 / 1e9 == pytest.approx(98, rel=0.03)


def test_busiest_rank_share():
    layout = ParallelLayout(dp=4, enable_ep=True)
    e = 10  # uneven: ranks own 3, 3, 2, 2 experts (0-2, 3-5, 6-7, 8-9)
    ids = torch.tensor([[8, 9], [8, 0], [9, 3], [1, 2], [6, 8]], dtype=torch.int32)
    w = torch.rand(5, 2)
    s = sim.busiest_rank_share(ids, layout, e, w)
    assert s.pairs_per_rank.tolist() == [3, 1, 1, 5]
    assert s.rank == 3 and s.pairs == 5
    assert s.token_index.tolist() == [0, 1, 2, 4]
    assert torch.equal(s.topk_ids, ids[[0, 1, 2, 4]])
    assert torch.equal(s.topk_weights, w[[0, 1, 2, 4]])
    assert s.expert_map.tolist() == [-1] * 8 + [0, 1]
    assert s.imbalance == pytest.approx(5 / 2.5)
    # ties go to the lowest rank
    t = sim.busiest_rank_share(torch.tensor([[0, 3]]), ParallelLayout(dp=2, enable_ep=True), 4)
    assert t.rank == 0


def test_rank_shares_add_up_to_the_layer():
    """Every EP rank's share, computed alone with its experts, sums to the full layer: a
    simulated run that computes the busiest share computes real work of the layer."""
    from moebench.kernels.reference import reference_moe

    g = torch.Generator().manual_seed(0)
    e, m, h, i, k = 10, 17, 16, 8, 3
    layout = ParallelLayout(dp=4, enable_ep=True)
    x = torch.randn(m, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    tw = torch.softmax(torch.randn(m, k, generator=g), dim=-1)
    total = torch.zeros(m, h, dtype=torch.float64)
    for r in range(4):
        s = sim.rank_share(ids, layout, e, r, tw)
        w13_r, w2_r = layout.shard_weights(w13, w2, r)
        total.index_add_(0, s.token_index, reference_moe(x[s.token_index], w13_r, w2_r, s.topk_weights, s.topk_ids, s.expert_map))
        assert s.pairs == int((layout.expert_owner(e)[ids.long()] == r).sum())
    ref = reference_moe(x, w13, w2, tw, ids)
    assert torch.allclose(total, ref, atol=1e-9)
