"""More ranks than GPUs: where the ranks go (a gloo group, several to a GPU), the notice, rows
marked as timed on a shared GPU (never ranked against one GPU per rank, resumed by their case),
and DeepEP accepted with one GPU. The GPU side: tests/gpu/test_shared_gpu_gpu.py."""

from __future__ import annotations

import pytest
import torch

from moebench.errors import MoebenchError
from moebench.results import ResultRow, RunStore, rows_to_frame
from moebench.runtime.distributed import place_ranks
from moebench.sweep.ranks import SHARED_GPU_DEVICE, SharedGpuRows


@pytest.mark.parametrize("world,device,gpus,share,want", [
    (2, "cpu", 0, False, ("gloo", None, 1)),
    (2, "cuda", 2, False, ("nccl", (0, 1), 1)),
    (2, "cuda", 8, True, ("nccl", (0, 1), 1)),
    (2, "cuda", 1, True, ("gloo", (0, 0), 2)),
    (4, "cuda", 2, True, ("gloo", (0, 1, 0, 1), 2)),
    (3, "cuda", 2, True, ("gloo", (0, 1, 0), 2)),
])
def test_place_ranks(world, device, gpus, share, want):
    p = place_ranks(world, device, gpus, share)
    assert (p.backend, p.devices, p.ranks_per_gpu) == want
    assert p.shared == (want[2] > 1)


@pytest.mark.parametrize("world,gpus,share,needle", [
    (2, 1, False, "needs 2 GPUs but 1 are visible"),
    (2, 0, True, "none is visible"),
    (0, 1, True, "must be >= 1"),
])
def test_place_ranks_refusals(world, gpus, share, needle):
    with pytest.raises(MoebenchError, match=needle):
        place_ranks(world, "cuda", gpus, share)


def test_choose_mode_shares_one_gpu(monkeypatch):
    from moebench.layout import ParallelLayout
    from moebench.sweep import choose_mode, shared_gpu_note

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    mode, note = choose_mode(ParallelLayout(dp=2, enable_ep=True), "cuda", world_size=2)
    assert mode == "spawn" and SHARED_GPU_DEVICE in note and "2 ranks share a GPU" in note
    assert shared_gpu_note(2, "cuda", gpu_count=2) is None and shared_gpu_note(2, "cpu") is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(MoebenchError, match="none is visible"):
        choose_mode(ParallelLayout(dp=2, enable_ep=True), "cuda", world_size=2)


def _row(**kw) -> ResultRow:
    base = dict(model="custom", num_experts=16, topk=4, hidden=2048, intermediate=256, tokens=64, tp=1, dp=2, ep=2,
                world_size=2, prepare_finalize="deepep-ll", experts="batched-torch", activation_format="batched",
                dtype="bf16", device="cuda", routing="uniform")
    return ResultRow(**{**base, **kw})


def test_rows_of_a_shared_gpu_are_marked_and_resumed(tmp_path):
    store = SharedGpuRows(RunStore(tmp_path), ranks_per_gpu=2)
    ok = _row(latency_us=50.0, correct=True)
    skipped = _row(experts="torch", status="skipped", reason="format mismatch")
    store.add(ok)
    store.add(skipped)
    again = RunStore(tmp_path)  # the folder as a resumed run reads it
    assert [r.device for r in again.rows] == [SHARED_GPU_DEVICE] * 2
    assert [r.extra["ranks_per_gpu"] for r in again.rows] == [2, 2]
    assert "2 ranks shared each GPU" in again.rows[0].reason and again.rows[1].reason == "format mismatch"
    resumed = SharedGpuRows(again, ranks_per_gpu=2)
    assert resumed.has(_row().key()) and resumed.has(_row(experts="torch").key())  # the cases they came from
    assert not resumed.has(_row(tokens=128).key())
    assert not again.has(_row().key())  # unwrapped, they are not cuda rows
    tp = _row(prepare_finalize="no-dpep", experts="triton", dp=1, ep=1, tp=2, allreduce="nccl", latency_us=9.0)
    resumed.add(tp)
    assert tp.allreduce == "gloo" and resumed.has(_row(prepare_finalize="no-dpep", experts="triton", dp=1, ep=1, tp=2,
                                                        allreduce="nccl").key())


def test_shared_rows_never_rank_against_one_gpu_per_rank():
    from moebench.report import _fastest, label_series

    df = rows_to_frame([_row(latency_us=80.0, correct=True),
                        _row(experts="batched-triton", latency_us=90.0, correct=True),
                        _row(device=SHARED_GPU_DEVICE, latency_us=10.0, correct=True)])
    fastest = _fastest(df, label_series(df)).tolist()
    assert fastest == [True, False, True]  # the shared row is fastest only among shared rows


def test_deep_ep_takes_one_gpu(monkeypatch):
    from moebench.backends import check_combination
    from moebench.dispatch import deepep_ll

    monkeypatch.setattr(deepep_ll, "_IMPORT_ERROR", [None])  # deep_ep imports (stand-in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert deepep_ll.deep_ep_unavailable_reason("cuda") is None
    assert deepep_ll.deep_ep_unavailable_reason("cpu") == "deep_ep needs CUDA"
    for pf, ex in (("deepep-ll", "batched-torch"), ("deepep-ht", "torch")):
        assert check_combination(pf, ex, "cuda", world_size=2, enable_ep=True) is None
        assert "needs at least 2 ranks" in check_combination(pf, ex, "cuda", world_size=1)
    monkeypatch.setattr(deepep_ll, "_IMPORT_ERROR", ["deep_ep is not installed (moebench vendor install deepep)"])
    assert "moebench vendor install deepep" in check_combination("deepep-ll", "batched-torch", "cuda", world_size=2)


def test_deepep_ll_refuses_a_process_without_peers(monkeypatch):
    """No process group: DeepEP stops a one-rank buffer, so the adapter says so before building one."""
    import sys
    import types

    from moebench.dispatch import deepep_ll
    from moebench.errors import UnsupportedError

    fake = types.ModuleType("deep_ep")

    class Buffer:
        @staticmethod
        def get_low_latency_rdma_size_hint(*a):
            return 1

    fake.Buffer = Buffer
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    monkeypatch.setattr(deepep_ll, "_IMPORT_ERROR", [None])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pf = deepep_ll.DeepEPLLPrepareAndFinalize(max_tokens_per_rank=8)
    with pytest.raises(UnsupportedError, match=">= 2 ranks"):
        pf._get_buffer(2048, 16, 1)


def test_one_buffer_per_process_and_group():
    from moebench.dispatch.deepep_ll import _BUFFERS, shared_buffer

    made = []

    def make(size):
        return lambda: made.append(size) or ((size,), f"buffer{size}")

    group = object()
    try:
        assert shared_buffer("t", group, lambda k: k[0] >= 10, make(20)) == "buffer20"
        assert shared_buffer("t", group, lambda k: k[0] >= 15, make(30)) == "buffer20"  # big enough: reused
        assert shared_buffer("t", group, lambda k: k[0] >= 25, make(40)) == "buffer40"  # too small: a new one
        assert made == [20, 40]
    finally:
        _BUFFERS.pop(("t", id(group)), None)
