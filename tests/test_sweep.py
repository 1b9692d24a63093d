"""The sweep through the Python API: a failing backend becomes a failed row, the rest still runs."""

import torch

from moebench import backends as registry
from moebench.kernels.modular import ActivationFormat, Experts, TopKWeightAndReduceNoOp
from moebench.models import custom_shape
from moebench.results import RunStore
from moebench.sweep import SweepSpec, run_sweep


class BrokenExperts(Experts):
    name = "broken-for-test"
    activation_format = ActivationFormat.STANDARD

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, prep, w13, w2):
        raise Exception("compilation failed: out of resources (test)")  # noqa: TRY002 - like Triton's own


def test_failing_backend_is_a_failed_row(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._discover().experts, BrokenExperts.name, BrokenExperts)
    spec = SweepSpec(shape=custom_shape(6, 2, 16, 8), tokens=[3], experts=["broken-for-test", "torch"],
                     prepare_finalize=["no-dpep"], dtype=torch.float32, device="cpu")
    rows = run_sweep(spec, RunStore(tmp_path / "run"))
    by = {r.experts: r for r in rows}
    assert by["broken-for-test"].status == "failed" and "out of resources" in by["broken-for-test"].reason
    assert by["torch"].status == "ok" and by["torch"].correct


def test_wrong_result_is_not_correct(tmp_path, monkeypatch):
    class WrongExperts(BrokenExperts):
        name = "wrong-for-test"

        def apply(self, prep, w13, w2):
            return torch.zeros_like(prep.a)  # plausible shape, wrong values

    monkeypatch.setitem(registry._discover().experts, WrongExperts.name, WrongExperts)
    spec = SweepSpec(shape=custom_shape(6, 2, 16, 8), tokens=[3], experts=["wrong-for-test"],
                     prepare_finalize=["no-dpep"], dtype=torch.float32, device="cpu")
    (row,) = run_sweep(spec, RunStore(tmp_path / "run"))
    assert row.status == "ok" and row.correct is False and row.max_rel_err > 0.5


def test_timed_calls_cycle_through_routings(tmp_path, monkeypatch):
    """--routings N: the timed calls see N different routings (the first is the checked one)."""
    seen = []

    class Recording(BrokenExperts):
        name = "recording-for-test"

        def apply(self, prep, w13, w2):
            seen.append(prep.topk_ids.clone())
            from moebench.kernels.reference import reference_moe

            return reference_moe(prep.a, w13, w2, prep.topk_weights, prep.topk_ids).to(prep.a.dtype)

    monkeypatch.setitem(registry._discover().experts, Recording.name, Recording)
    spec = SweepSpec(shape=custom_shape(16, 2, 16, 8), tokens=[6], experts=["recording-for-test"],
                     prepare_finalize=["no-dpep"], dtype=torch.float32, device="cpu", routings=3, reps=6, warmup=0)
    (row,) = run_sweep(spec, RunStore(tmp_path / "run"))
    assert row.correct and row.extra["routings"] == 3 and "3 routings cycled" in row.timing_method
    timed = seen[1:]  # the first call is the check
    assert len(timed) == 6
    distinct = {tuple(t.flatten().tolist()) for t in timed}
    assert len(distinct) == 3 and tuple(seen[0].flatten().tolist()) in distinct


def test_choose_mode():
    import pytest

    from moebench.errors import MoebenchError
    from moebench.layout import ParallelLayout
    from moebench.sweep import choose_mode

    one, ep4 = ParallelLayout(), ParallelLayout(dp=4, enable_ep=True)
    assert choose_mode(one, "cpu") == ("single", None)
    assert choose_mode(one, "cpu", simulate=True)[0] == "single"  # with a notice
    assert choose_mode(ep4, "cpu", simulate=True) == ("simulate", None)
    assert choose_mode(ep4, "cpu", world_size=4) == ("spawn", None)
    mode, notice = choose_mode(ep4, "cpu")
    assert mode == "simulate" and "--world-size 4" in notice
    if torch.cuda.device_count() < 4:
        with pytest.raises(MoebenchError, match="needs 4 GPUs"):
            choose_mode(ep4, "cuda", world_size=4)
