"""Multi-rank paths on CPU with gloo, at world sizes 2 and 4.

Processes are spawned once per world size; each rank runs every case and returns its errors
against the float64 reference of its own token rows, so a failing case is named in the assert.
Routing is generated here with plain torch (uniform, zipf-like, hot expert, remote-only).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from moebench.errors import MoebenchError
from moebench.kernels.modular import FusedMoEKernel, poisoned_outputs
from moebench.kernels.reference import reference_moe
from moebench.backends import make_experts, make_prepare_finalize
from moebench.layout import ParallelLayout
from moebench.runtime.distributed import RankContext, RankFailedError, join_torchrun, single_context, spawn
from moebench.layout import token_split
from moebench.runtime.rank_case import run_rank_case

H, I, K = 32, 16, 2
TOL = 1e-4  # fp32


# ---------------------------------------------------------------------------------------------
# inputs (identical on every rank: same seed)


def _routing(kind: str, m: int, e: int, k: int, g: torch.Generator, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_weights (M, K) float32 (renormalised softmax), topk_ids (M, K) int32 (as the routers
    emit them), distinct per row."""
    if kind == "uniform":
        ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :k]
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.2
        perm = torch.randperm(e, generator=g)  # popular experts spread over ranks
        ids = perm[torch.multinomial(p.expand(m, e), k, replacement=False, generator=g)] if m else torch.empty(0, k, dtype=torch.long)
    elif kind == "hot":
        p = torch.full((e,), 0.2 / max(e - 1, 1), dtype=torch.float64)
        p[e - 1] = 0.8  # the last expert (on the last rank) is hot
        ids = torch.multinomial(p.expand(m, e), k, replacement=False, generator=g) if m else torch.empty(0, k, dtype=torch.long)
    elif kind == "remote-only":
        # every token picks experts of the next EP rank only: nothing stays local
        layout = ParallelLayout(dp=world, enable_ep=True)
        ids = torch.empty(m, k, dtype=torch.long)
        for r, (lo, hi) in enumerate(token_split(m, world)):
            other = layout.local_experts((r + 1) % world, e)
            for t in range(lo, hi):
                pick = torch.randperm(len(other), generator=g)[:k]
                ids[t] = torch.tensor(list(other))[pick]
    else:
        raise ValueError(kind)
    logits = torch.randn(m, k, generator=g)
    w = torch.softmax(logits, dim=-1).float()
    return w, ids.to(torch.int32)


def _weights(e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(e, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(e, H, I, generator=g) / I**0.5
    return w13, w2


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0 if out.shape == ref.shape else float("inf")
    if out.shape != ref.shape:
        return float("inf")
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _cases(world: int) -> list[dict]:
    """(name, layout, pf, experts, E, M, routing) for one world size."""
    placements = [8, 9, 5] if world == 2 else [8, 60, 10]
    out = []
    for e in placements:
        for routing in ("uniform", "zipf", "hot", "remote-only"):
            for m in (13, world - 1):  # world - 1: at least one rank without tokens
                ep = ParallelLayout(dp=world, enable_ep=True)
                out.append(dict(pf="allgather-rs", experts="torch", layout=ep, e=e, m=m, routing=routing))
                out.append(dict(pf="all2all-ll", experts="batched-torch", layout=ep, e=e, m=m, routing=routing))
    for routing in ("uniform", "zipf", "hot"):
        ep = ParallelLayout(dp=world, enable_ep=True)
        out.append(dict(pf="allgather-rs", experts="reference", layout=ep, e=placements[1], m=11, routing=routing))
        out.append(dict(pf="all2all-ll", experts="batched-torch", layout=ep, e=placements[1], m=0, routing=routing))
        out.append(dict(pf="allgather-rs", experts="torch", layout=ep, e=placements[1], m=0, routing=routing))
        # TP MoE: I sharded over the ranks, all-reduce
        out.append(dict(pf="no-dpep", experts="torch", layout=ParallelLayout(tp=world), e=8, m=13, routing=routing))
        out.append(dict(pf="no-dpep", experts="torch", layout=ParallelLayout(tp=world), e=8, m=1, routing=routing))
        # EP without all2all (dp 1): every rank all tokens, its experts, all-reduce
        out.append(dict(pf="no-dpep", experts="torch", layout=ParallelLayout(tp=world, enable_ep=True), e=placements[1], m=13, routing=routing))
    return out


def _pf_kwargs(name: str, ctx: RankContext) -> dict:
    if name == "all2all-ll":
        return {"group": ctx.group, "max_tokens_per_rank": 16}
    if name == "allgather-rs":
        return {"group": ctx.group}
    return {}


def _check_all_cases(ctx: RankContext) -> dict[str, float]:
    """Runs on every rank: each case's relative error on this rank's rows (inf when it raised)."""
    errs: dict[str, float] = {}
    for i, c in enumerate(_cases(ctx.world_size)):
        g = torch.Generator().manual_seed(1000 + i)
        w13, w2 = _weights(c["e"], g)
        x = torch.randn(c["m"], H, generator=g)
        tw, ti = _routing(c["routing"], c["m"], c["e"], K, g, ctx.world_size)
        kernel = FusedMoEKernel(make_prepare_finalize(c["pf"], **_pf_kwargs(c["pf"], ctx)), make_experts(c["experts"]))
        name = f"{c['pf']}+{c['experts']} {c['layout'].describe()} E={c['e']} M={c['m']} {c['routing']}"
        with poisoned_outputs():  # an unwritten output element is NaN and fails the check
            res = run_rank_case(ctx, kernel, x, w13, w2, tw, ti, c["layout"])
        lo, hi = res.rows
        errs[name] = _rel_err(res.out, reference_moe(x, w13, w2, tw, ti)[lo:hi])
        # the rows this rank answers for: its contiguous slice on the DP path, all on the TP path
        if c["pf"] == "no-dpep":
            assert (lo, hi) == (0, c["m"])
        else:
            assert (lo, hi) == token_split(c["m"], ctx.world_size)[ctx.rank]

    # Timed run: phase names, figures identical on every rank (max over ranks).
    g = torch.Generator().manual_seed(7)
    w13, w2 = _weights(8, g)
    x = torch.randn(12, H, generator=g)
    tw, ti = _routing("uniform", 12, 8, K, g)
    timed = {}
    for pf, ex, layout in (
        ("all2all-ll", "batched-torch", ParallelLayout(dp=ctx.world_size, enable_ep=True)),
        ("no-dpep", "torch", ParallelLayout(tp=ctx.world_size)),
    ):
        kernel = FusedMoEKernel(make_prepare_finalize(pf, **_pf_kwargs(pf, ctx)), make_experts(ex))
        res = run_rank_case(ctx, kernel, x, w13, w2, tw, ti, layout, time_phases=True, warmup=1, reps=3)
        timed[pf] = {k: v.median_us for k, v in res.phases.items()}
    errs["__timed__"] = timed  # type: ignore[assignment]

    # what the batched experts' config lookup keys on: this rank's tokens x world
    lay = ParallelLayout(dp=ctx.world_size, enable_ep=True)
    lo, hi = token_split(12, ctx.world_size)[ctx.rank]
    prep = make_prepare_finalize("all2all-ll", **_pf_kwargs("all2all-ll", ctx)).prepare(
        x[lo:hi], tw[lo:hi], ti[lo:hi], 8, 8 // ctx.world_size, lay.expert_map(ctx.rank, 8))
    errs["__num_tokens__"] = ((prep.num_tokens, prep.topk), ((hi - lo) * ctx.world_size, K))  # type: ignore[assignment]

    # max_tokens_per_rank exceeded on every rank: a clear error, no hang
    kernel = FusedMoEKernel(make_prepare_finalize("all2all-ll", group=ctx.group, max_tokens_per_rank=2), make_experts("batched-torch"))
    try:
        run_rank_case(ctx, kernel, x, w13, w2, tw, ti, ParallelLayout(dp=ctx.world_size, enable_ep=True))
        errs["__overflow__"] = "no error"  # type: ignore[assignment]
    except MoebenchError as e:
        errs["__overflow__"] = str(e)  # type: ignore[assignment]
    return errs


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def rank_results(request):
    world = request.param
    t0 = time.monotonic()
    results = spawn(_check_all_cases, world, "cpu", timeout_s=120, total_timeout_s=600)
    return world, results, time.monotonic() - t0


def test_all_cases_match_reference(rank_results):
    world, results, _ = rank_results
    assert len(results) == world
    names = [n for n in results[0] if not n.startswith("__")]
    assert len(names) == len(_cases(world))
    bad = {
        f"rank {r}: {n}": errs[n]
        for r, errs in enumerate(results)
        for n in names
        if not errs[n] < TOL
    }
    assert not bad, bad


def test_phase_times_are_collective(rank_results):
    world, results, _ = rank_results
    t0 = results[0]["__timed__"]
    assert set(t0["all2all-ll"]) == {"dispatch", "experts", "combine", "total"}
    assert set(t0["no-dpep"]) == {"experts", "allreduce", "total"}
    for r in range(1, world):
        assert results[r]["__timed__"] == t0  # max over ranks: the same on every rank
    assert all(v > 0 for d in t0.values() for v in d.values())


def test_all2all_ll_reports_routed_tokens(rank_results):
    _, results, _ = rank_results
    for errs in results:
        got, want = errs["__num_tokens__"]
        assert tuple(got) == tuple(want) and want[0] > 0


def test_max_tokens_per_rank_exceeded(rank_results):
    _, results, _ = rank_results
    for errs in results:
        assert "max_tokens_per_rank is 2" in errs["__overflow__"]


# ---------------------------------------------------------------------------------------------
# failures reach the parent, quickly


def _raise_on_rank1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the others wait for a peer that never comes
    return ctx.rank


def _exit_on_rank1(ctx: RankContext, how: str) -> int:
    if ctx.rank == 1:
        if how == "sigkill":
            os.kill(os.getpid(), 9)
        os._exit(7)
    dist.barrier()
    return ctx.rank


# A failure must reach the parent at once, not when the peers' collective times out: the
# collective timeout (timeout_s) is far beyond the run's hang limit (total_timeout_s), so a
# failure noticed only through the collective would end as "did not finish within HANG_S s".
HANG_S = 60


def test_rank_exception_reaches_parent():
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 failed: ValueError: boom on purpose") as ei:
        spawn(_raise_on_rank1, 2, "cpu", timeout_s=3600, total_timeout_s=HANG_S)
    assert ei.value.rank == 1
    assert "Traceback" in ei.value.traceback and "_raise_on_rank1" in ei.value.traceback


@pytest.mark.parametrize(
    "how, message",
    [("exit", r"rank 1 of 2 exited with code 7 without reporting"), ("sigkill", r"rank 1 of 2 was killed by signal 9")],
)
def test_killed_rank_is_noticed(how, message):
    with pytest.raises(RankFailedError, match=message):
        spawn(_exit_on_rank1, 2, "cpu", how, timeout_s=3600, total_timeout_s=HANG_S)


def _sleep_forever(ctx: RankContext) -> None:
    time.sleep(600)


def test_hung_run_hits_total_timeout():
    import threading

    raised: list[BaseException] = []

    def run():
        try:
            spawn(_sleep_forever, 2, "cpu", timeout_s=60, total_timeout_s=3)
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)  # a hang limit: spawn past it means the total timeout never stopped the ranks
    assert not t.is_alive(), f"spawn(_sleep_forever, total_timeout_s=3) still running after {HANG_S} s"
    assert len(raised) == 1 and isinstance(raised[0], RankFailedError), raised
    assert "did not finish within 3 s" in str(raised[0])


def _square(ctx: RankContext, base: int) -> tuple[int, int, torch.Tensor]:
    return ctx.rank, ctx.world_size, torch.full((2,), float(base + ctx.rank))


def test_spawn_returns_values_in_rank_order():
    out = spawn(_square, 2, "cpu", 10, timeout_s=60)
    assert [o[:2] for o in out] == [(0, 2), (1, 2)]
    assert torch.equal(out[1][2], torch.tensor([11.0, 11.0]))


# ---------------------------------------------------------------------------------------------
# torchrun: join the job's process group

_TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
from moebench.runtime.distributed import join_torchrun, is_main
ctx = join_torchrun(timeout_s=60)
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
if is_main(ctx):
    print("RESULT", ctx.world_size, ctx.backend, float(t.item()), flush=True)
dist.destroy_process_group()
"""


def test_join_torchrun(tmp_path, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    monkeypatch.delenv("RANK", raising=False)
    assert join_torchrun() is None  # not under torchrun
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines == ["RESULT 2 gloo 3.0"]  # only rank 0 prints


# ---------------------------------------------------------------------------------------------
# one process, no process group


def test_all2all_ll_single_process_matches_reference():
    g = torch.Generator().manual_seed(3)
    w13, w2 = _weights(6, g)
    x = torch.randn(9, H, generator=g)
    tw, ti = _routing("zipf", 9, 6, K, g)
    kernel = FusedMoEKernel(make_prepare_finalize("all2all-ll", max_tokens_per_rank=9), make_experts("batched-torch"))
    res = run_rank_case(single_context(), kernel, x, w13, w2, tw, ti, ParallelLayout())
    assert _rel_err(res.out, reference_moe(x, w13, w2, tw, ti)) < TOL
    assert res.pairs_per_rank == [9 * K] and res.load_imbalance == 1.0


def test_load_counts():
    ids = torch.tensor([[0, 1], [0, 4], [5, 0]])
    ep = ParallelLayout(dp=2, enable_ep=True)  # E=6: experts 0-2 on rank 0, 3-5 on rank 1
    from moebench.runtime.rank_case import pairs_per_rank

    assert pairs_per_rank(ids, ep, 6) == [4, 2]
    assert pairs_per_rank(ids, ParallelLayout(tp=2), 6) == [6, 6]


def test_rank_case_rejects_bad_layouts():
    g = torch.Generator().manual_seed(4)
    w13, w2 = _weights(4, g)
    x = torch.randn(4, H, generator=g)
    tw, ti = _routing("uniform", 4, 4, K, g)
    kernel = FusedMoEKernel(make_prepare_finalize("no-dpep"), make_experts("torch"))
    with pytest.raises(MoebenchError, match="layout has 2 ranks"):
        run_rank_case(single_context(), kernel, x, w13, w2, tw, ti, ParallelLayout(tp=2))


def test_token_split():
    assert token_split(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert token_split(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert token_split(0, 2) == [(0, 0), (0, 0)]


def test_capabilities_say_why_not():
    from moebench.dispatch.deepep_ll import DeepEPLLPrepareAndFinalize
    from moebench.backends import check_combination

    assert "needs at least 2 ranks" in check_combination("allgather-rs", "torch", "cpu", world_size=1)
    assert check_combination("allgather-rs", "torch", "cpu", world_size=2) is None
    assert check_combination("all2all-ll", "batched-torch", "cpu", world_size=1) is None
    assert "format mismatch" in check_combination("all2all-ll", "torch", "cpu", world_size=2)
    assert check_combination("deepep-ll", "batched-torch", "cpu", world_size=2) is not None
    reason = DeepEPLLPrepareAndFinalize.unavailable_reason("cuda", 2)
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        assert reason == "deep_ep is not installed (moebench vendor install deepep)"
    else:
        assert reason is None or "CUDA" in reason or "import" in reason


def test_deepep_ll_prepare_reports_routed_tokens(monkeypatch):
    # DeepEP's buffer stood in for (deep_ep is optional): what prepare hands the batched experts,
    # including the routed token count and top-k their config lookup keys on (one process: world 1).
    from moebench.dispatch.deepep_ll import DeepEPLLPrepareAndFinalize

    class Buffer:
        def low_latency_dispatch(self, x, ids, max_tokens, num_experts, **kw):
            return torch.zeros(num_experts, max_tokens, x.shape[1]), torch.zeros(num_experts, dtype=torch.int32), \
                "handle", None, None

    pf = DeepEPLLPrepareAndFinalize(max_tokens_per_rank=16)
    monkeypatch.setattr(pf, "_get_buffer", lambda *a: Buffer())
    x = torch.randn(5, 128).bfloat16()
    ti = torch.randint(0, 8, (5, 2), dtype=torch.int32)
    prep = pf.prepare(x, torch.rand(5, 2), ti, 8, 8, None)
    assert (prep.num_tokens, prep.topk, tuple(prep.a.shape)) == (5, 2, (8, 16, 128))


# ---------------------------------------------------------------------------------------------
# NCCL on >= 2 GPUs (skipped elsewhere)


def _gpu_cases(ctx: RankContext) -> dict[str, float]:
    from moebench.dispatch.deepep_ll import DeepEPLLPrepareAndFinalize

    errs = {}
    g = torch.Generator().manual_seed(5)
    e, m, h, i = 16, 24, 256, 128
    x = torch.randn(m, h, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    tw, ti = _routing("zipf", m, e, 4, g)
    ep = ParallelLayout(dp=ctx.world_size, enable_ep=True)
    combos = [
        ("allgather-rs", "torch", ep, {"group": ctx.group}),
        ("all2all-ll", "batched-torch", ep, {"group": ctx.group, "max_tokens_per_rank": 32}),
        ("no-dpep", "torch", ParallelLayout(tp=ctx.world_size), {}),
    ]
    if DeepEPLLPrepareAndFinalize.unavailable_reason("cuda", ctx.world_size) is None:
        combos.append(("deepep-ll", "batched-torch", ep, {"group": ctx.group, "max_tokens_per_rank": 128}))
    for pf, ex, layout, kw in combos:
        kernel = FusedMoEKernel(make_prepare_finalize(pf, **kw), make_experts(ex))
        res = run_rank_case(ctx, kernel, x, w13, w2, tw, ti, layout, time_phases=True, reps=5)
        lo, hi = res.rows
        errs[pf] = _rel_err(res.out.cpu(), reference_moe(x, w13, w2, tw, ti)[lo:hi])
    return errs


@pytest.mark.gpu
def test_nccl_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for errs in spawn(_gpu_cases, 2, "cuda", timeout_s=120, total_timeout_s=300):
        assert all(v < 2e-2 for v in errs.values()), errs


def _phased_runs(ctx: RankContext):
    """Three runs of two phases; rank 1 is slow in its second phase, more so in the last run."""
    from moebench.runtime.rank_case import PhaseTimer

    timer = PhaseTimer(ctx)
    for i in range(3):
        with timer.run():
            with timer.phase("dispatch"):
                time.sleep(0.01)
            with timer.phase("experts"):
                time.sleep(0.05 * (i + 1) if ctx.rank == 1 else 0.01)
    return {k: (v.median_us, v.p10_us, v.p90_us) for k, v in timer.summarise().items()}


def test_phases_are_those_of_the_runs_slowest_rank_and_add_up():
    """Each run's latency is its slowest rank's; the phases shown are that rank's in the median run,
    so they add up to the total they break down (no remainder counted twice, none negative)."""
    a, b = spawn(_phased_runs, 2, "cpu", timeout_s=60)
    assert a == b  # every rank reports the same figures
    total, disp, exp = a["total"][0], a["dispatch"][0], a["experts"][0]
    assert 0 <= total - (disp + exp) < 2e3  # the marks' own cost only (us)
    assert 95e3 < exp < 150e3  # rank 1's median run: 0.1 s in its second phase, not rank 0's 0.01 s
    assert a["total"][2] > 150e3  # p90: the slowest run
