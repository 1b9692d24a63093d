"""The sweep through the Python API: a failing backend becomes a failed row, the rest still runs."""

import json

import pytest

import torch

from moebench import backends as registry
from moebench.kernels.modular import ActivationFormat, Experts, TopKWeightAndReduceNoOp
from moebench.models import custom_shape
from moebench.results import RunStore
from moebench.sweep import SweepSpec, run_local


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
    rows = run_local(spec, RunStore(tmp_path / "run"))
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
    (row,) = run_local(spec, RunStore(tmp_path / "run"))
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
    (row,) = run_local(spec, RunStore(tmp_path / "run"))
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
        with pytest.raises(MoebenchError, match="needs 4 GPUs|needs a GPU"):
            choose_mode(ep4, "cuda", world_size=4)


def test_run_in_folder_opens_resumes_and_keeps_rows(tmp_path):
    """The whole sweep through the library: a new run folder below `out` with its settings, the
    on_start count, the rows; resumed (its folder, not `out`), finished rows are
    skipped and the resume recorded."""
    import dataclasses

    from moebench.sweep import run_in_folder

    spec = SweepSpec(shape=custom_shape(6, 2, 16, 8), tokens=[1, 3], experts=["torch"], prepare_finalize=["no-dpep"],
                     dtype=torch.float32, device="cpu")
    seen = []
    store = run_in_folder([spec], "single", tmp_path / "results", metadata={"command": "sweep", "test": 1},
                          on_start=lambda st, n: seen.append((st.folder, n)))
    folder = store.folder
    assert folder.parent == tmp_path / "results" and seen == [(folder, 2)]
    assert [(r.tokens, r.status) for r in store.rows] == [(1, "ok"), (3, "ok")]
    assert json.loads((folder / "metadata.json").read_text())["test"] == 1
    # resumed with one more token count: only its case runs
    more = dataclasses.replace(spec, tokens=[1, 3, 5])
    seen.clear()
    store = run_in_folder([more], "single", tmp_path / "elsewhere", resume=folder, argv=["--resume", str(folder)],
                          on_start=lambda st, n: seen.append(n))
    assert seen == [1] and store.folder == folder and not (tmp_path / "elsewhere").exists()
    assert sorted(r.tokens for r in RunStore(folder).rows) == [1, 3, 5]
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["test"] == 1 and "resumed" in json.dumps(meta)  # the settings kept, the resume noted


def test_registered_variants_are_rows_of_their_own(tmp_path, monkeypatch):
    """A benchmark's variants run through the sweep loop: one row per (tokens, pair, variant), the
    variant named in the `variant` column, checked where its output is the layer's, resumed like
    any row; runners that cannot time variants skip them with a reason."""
    from moebench.sweep import variants as V
    from moebench.sweep.ranks import RankRunner
    from moebench.sweep.simulated import SimulatedRunner

    monkeypatch.setattr(V, "_VARIANTS", {})
    calls = []

    def layer_twice(case):
        def call():
            calls.append(case.tokens)
            return case.layer.apply(*case.args)
        case.notes["built_for"] = case.tokens
        return call

    V.register(V.Variant("again", layer_twice, checked=True))
    V.register(V.Variant("zeros", lambda case: (lambda: torch.zeros_like(case.args[0])), checked=True))
    V.register(V.Variant("unchecked", lambda case: (lambda: torch.zeros(1)), checked=False))
    spec = SweepSpec(shape=custom_shape(6, 2, 16, 8), tokens=[3], experts=["torch"], prepare_finalize=["no-dpep"],
                     dtype=torch.float32, device="cpu", variants=["", "again", "zeros", "unchecked"], reps=2, warmup=0)
    store = RunStore(tmp_path / "run")
    rows = {r.variant: r for r in run_local(spec, store)}
    assert set(rows) == {"", "again", "zeros", "unchecked"} and len({r.key() for r in rows.values()}) == 4
    assert rows[""].correct and rows["again"].correct and rows["again"].extra["built_for"] == 3
    assert rows["zeros"].correct is False  # a checked variant is held to the reference
    assert rows["unchecked"].correct is None and rows["unchecked"].latency_us > 0
    assert calls  # the variant's own call was checked and timed
    saved = [json.loads(line)["variant"] for line in (tmp_path / "run" / "rows.jsonl").read_text().splitlines()]
    assert sorted(saved) == ["", "again", "unchecked", "zeros"]
    assert run_local(spec, RunStore(tmp_path / "run")) == []  # resumed: every row is there
    from moebench.comm.links import link_for
    link, _ = link_for("cpu", None, None, None)
    assert not RankRunner.runs_variants and not SimulatedRunner(link, experts_model=object()).runs_variants
    assert SimulatedRunner(link).runs_variants  # experts measured here: see the next test
    with pytest.raises(Exception, match="unknown variant 'nope'; registered: again, unchecked, zeros"):
        V.get_variant("nope")


def test_a_runner_without_variants_skips_them_with_a_reason(tmp_path):
    from moebench.sweep.cases import CaseRunner, run_cases

    class LayerOnly(CaseRunner):
        def run_case(self, row, m, pf, ex, inputs):
            row.latency_us = 1.0

    spec = SweepSpec(shape=custom_shape(6, 2, 16, 8), tokens=[3], experts=["torch"], prepare_finalize=["no-dpep"],
                     dtype=torch.float32, device="cpu", variants=["", "gemm"])
    rows = {r.variant: r for r in run_cases(spec, RunStore(tmp_path / "run"), LayerOnly())}
    assert rows[""].status == "ok" and rows[""].latency_us == 1.0
    assert rows["gemm"].status == "skipped" and "variant 'gemm' is timed on this device only" in rows["gemm"].reason


def test_a_simulated_share_times_variants_once_per_case(tmp_path, monkeypatch):
    """With --simulate and the experts measured here, a variant runs on the busiest rank's share
    (its expert map, its tokens): checked against that share's reference, its time the row's
    experts_us. The experts half is measured once for the case's all-reduce choices (nccl and
    custom rows differ only in the modeled all-reduce)."""
    from moebench.layout import ParallelLayout
    from moebench.comm.links import link_for
    from moebench.sweep import run_simulated
    from moebench.sweep import variants as V

    monkeypatch.setattr(V, "_VARIANTS", {})
    built = []

    def layer_on_share(case):
        built.append((case.tokens, case.args[5] is not None))  # the share's expert map under EP
        return lambda: case.layer.apply(*case.args)

    V.register(V.Variant("share", layer_on_share, checked=True))
    V.register(V.Variant("zeros", lambda case: (lambda: torch.zeros_like(case.args[0])), checked=True))
    link, _ = link_for("cpu", None, None, None)
    spec = SweepSpec(shape=custom_shape(8, 2, 32, 16), tokens=[4], layout=ParallelLayout.from_args(2, None, 2),
                     experts=["torch"], prepare_finalize=["no-dpep"], dtype=torch.float32, reps=1, warmup=0,
                     variants=["", "share", "zeros"])  # EP over the TP ranks: tokens stay, an all-reduce sums
    rows = [r for r in run_simulated(spec, RunStore(tmp_path / "run", metadata={}), link)]
    by = {(r.allreduce, r.variant): r for r in rows}
    assert {a for a, _ in by} == {"nccl", "custom"} and {v for _, v in by} == {"", "share", "zeros"}
    assert all(r.status == "ok" and r.modeled for r in rows)
    assert built == [(4, True)]  # built once: the custom row reuses the nccl row's measurement
    for ar in ("nccl", "custom"):
        assert by[ar, "share"].correct and by[ar, "zeros"].correct is False
        assert by[ar, "share"].latency_us == pytest.approx(by[ar, "share"].experts_us + by[ar, "share"].allreduce_us)
    assert by["nccl", "share"].experts_us == by["custom", "share"].experts_us
    assert by["nccl", "share"].allreduce_us != by["custom", "share"].allreduce_us
