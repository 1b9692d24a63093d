"""`moebench tune` on the CPU: pruning, a tiny end-to-end tune under the Triton interpreter,
resume after an interruption, the vLLM file format, and the `configs` commands."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from moebench.bench.timing import time_cpu
from moebench.errors import MoebenchError
from moebench.layout import ParallelLayout
from moebench.models import custom_shape, get_model
from moebench.kernels.triton import configs as C
from moebench.results import ResultRow
from moebench.tuning import candidates as CA
from moebench.tuning import search as S
from moebench.tuning import space as SP
from moebench.tuning import tuner as T
from moebench.cli.tune import configs as configs_group
from moebench.kernels.tuned_files import parse_file_name as parse_config_name
from moebench.tuning.files import diff_tables
from moebench.cli.tune import tune as tune_command
from moebench.kernels import tuned_files as TF

SHAPE = custom_shape(4, 2, 64, 32, name="tiny")
TINY_SPACE = {"BLOCK_SIZE_M": [16, 32], "BLOCK_SIZE_N": [64], "BLOCK_SIZE_K": [64], "GROUP_SIZE_M": [1, 16],
              "num_warps": [4], "num_stages": [2]}
TOKENS = [1, 4]


def fast_timer(fn, reps):
    return time_cpu(fn, warmup=0, reps=1)


class CountingTimer:
    """A CPU timer that counts its calls and raises KeyboardInterrupt at call `stop_at` (a kill
    between measurements: the ones before are journaled, this one is lost)."""

    def __init__(self, stop_at: int | None = None):
        self.calls, self.stop_at = 0, stop_at

    def __call__(self, fn, reps):
        self.calls += 1
        if self.stop_at is not None and self.calls == self.stop_at:
            raise KeyboardInterrupt
        return time_cpu(fn, warmup=0, reps=1)


SPEC_FIELDS = {f.name for f in dataclasses.fields(T.TuneSpec)}


def tune_with(shape, layout, tokens, dtype, device="cpu", **kw):
    """T.tune of the TuneSpec made of the arguments that are its fields; the others go to tune()."""
    fields = {k: kw.pop(k) for k in list(kw) if k in SPEC_FIELDS}
    return T.tune(T.TuneSpec(shape=shape, layout=layout, tokens=list(tokens), dtype=dtype, device=device, **fields),
                  **kw)


def _tune(tmp_path, timer=fast_timer, **kw):
    args = dict(strategy="halving", budget=4, out_dir=tmp_path / "cfg", results_dir=tmp_path / "res",
                space=TINY_SPACE, timer=timer)
    args.update(kw)
    return tune_with(SHAPE, ParallelLayout(), TOKENS, torch.float32, **args)


def _journal_lines(run_dir: Path) -> list[dict]:
    """The candidate rows of a run folder, each as {tokens, config, stage, status (ok / wrong /
    failed), checked, max_rel_err, reason} (a torn line, left by a crash mid-write, is skipped)."""
    out = []
    for p in sorted(run_dir.glob("candidates*.jsonl")):
        for line in p.read_text().splitlines():
            try:
                row = ResultRow.from_dict(json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
            out.append({"tokens": row.tokens, "config": CA.config_of(row), "stage": CA.stage_of(row),
                        "status": CA.verdict(row), "checked": row.extra["checked"], "max_rel_err": row.max_rel_err,
                        "reason": row.reason})
    return out


def _row(cfg, stage, reps, us) -> ResultRow:
    """A candidate row (no kernel): `cfg` timed at `us`."""
    row = ResultRow("tiny", 4, 2, 64, 32, 1, 1, 1, 1, 1, "no-dpep", "triton", "Standard", "fp32", "cpu", "uniform",
                    latency_us=us, variant=CA.candidate_name(cfg, stage))
    row.extra.update(config=dict(cfg), stage=stage, reps=reps)
    return row


def assert_vllm_loadable(path: Path, tokens: list[int]) -> dict:
    """What vLLM's loader relies on: a JSON object, string token keys that int() reads, exactly
    the six kernel arguments per entry (ints), plus "triton_version"."""
    raw = json.loads(path.read_text())
    assert isinstance(raw, dict) and isinstance(raw.pop("triton_version"), str)
    assert sorted(int(k) for k in raw) == tokens
    for k, entry in raw.items():
        assert isinstance(k, str) and k == str(int(k))
        assert set(entry) == set(TF.TILE_KEYS) and all(type(v) is int for v in entry.values())
    assert parse_config_name(path.name) is not None
    return raw


# ---------------------------------------------------------------------------------------------
# Space and pruning


def test_full_space_is_vllms_grid():
    space = SP.full_space()
    assert len(space) == 1920 and len({SP.config_key(c) for c in space}) == 1920


@pytest.mark.parametrize("model,tokens", [("mixtral-8x7b", 1), ("mixtral-8x7b", 256), ("qwen3-30b-a3b", 16),
                                          ("qwen3-30b-a3b", 4096)])
def test_prune_counts_and_reasons(model, tokens):
    s = get_model(model)
    p = SP.Problem(tokens, s.num_experts, s.num_experts, s.topk, s.hidden, s.intermediate, 2, SP.DEFAULT_SMEM_BYTES)
    rep = SP.prune(SP.full_space(), p)
    assert rep.total == 1920 and len(rep.kept) + rep.n_pruned == 1920
    # bf16 on 227 KB: exactly the configs over the limit go for shared memory.
    over = [c for c in SP.full_space() if SP.smem_bytes(c, 2) > SP.DEFAULT_SMEM_BYTES]
    assert rep.pruned["shared memory"] == len(over) > 0
    assert all(SP.smem_bytes(c, 2) <= SP.DEFAULT_SMEM_BYTES for c in rep.kept)
    tpe = tokens * s.topk / s.num_experts
    assert all(c["BLOCK_SIZE_M"] <= max(16, 2 * SP._next_pow2(tpe)) for c in rep.kept)
    # One GROUP_SIZE_M value at most among those >= the row-block count, per rest-of-config.
    seen = set()
    for c in rep.kept:
        if c["GROUP_SIZE_M"] >= p.max_blocks(c["BLOCK_SIZE_M"]):
            rest = tuple(c[k] for k in TF.TILE_KEYS if k != "GROUP_SIZE_M")
            assert rest not in seen
            seen.add(rest)
    if tokens == 1:  # decode: only BLOCK_SIZE_M 16 can win, and G16/32/64 are the same schedule
        assert {c["BLOCK_SIZE_M"] for c in rep.kept} == {16}
        assert rep.pruned["GROUP_SIZE_M duplicate (one group covers all row blocks)"] > 0
    if tokens == 4096:
        assert set(rep.pruned) == {"shared memory"}
    assert "kept" in rep.summary()


def test_prune_tiny_space_and_neighbours():
    rep = SP.prune(SP.full_space(TINY_SPACE), SP.Problem(1, 4, 4, 2, 64, 32, 4))
    assert (len(rep.kept), rep.pruned) == (2, {"BLOCK_SIZE_M above tokens per expert": 2})
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 2}
    nb = {SP.key_str(c) for c in SP.neighbours(cfg)}
    assert "M32,N64,K256,G8,w4,s2" in nb and "M16,N64,K128,G8,w4,s2" in nb and "M16,N64,K256,G1,w4,s2" in nb
    assert "M16,N64,K256,G16,w4,s2" in nb and "M16,N64,K256,G8,w8,s2" in nb and "M16,N64,K256,G8,w4,s3" in nb
    assert len(nb) == 8  # M up; N down/up; K down; G 1/16; warps up; stages up


def test_halving_pool_seeds_first():
    space = SP.full_space()
    seed = space[100]
    pool = S.halving_pool(space, [seed], 10, random.Random(0))
    assert len(pool) == 10 and SP.config_key(pool[0]) == SP.config_key(seed)
    nb = {SP.config_key(c) for c in SP.neighbours(seed)}
    assert sum(SP.config_key(c) in nb for c in pool) == 4  # half the budget: the seed + 4 neighbours
    assert len({SP.config_key(c) for c in pool}) == 10


def test_halving_finds_the_seeds_neighbour_within_budget():
    """Synthetic latencies (no kernel): the optimum is one step from the previous count's winner."""
    space = SP.full_space()
    seed = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16, "num_warps": 4,
            "num_stages": 3}
    best = dict(seed, num_stages=4)
    calls: list[tuple[str, str, int]] = []

    def measure_one(cfg, stage, reps):
        calls.append((SP.key_str(cfg), stage, reps))
        dist = sum(abs(SP.SPACE[k].index(cfg[k]) - SP.SPACE[k].index(best[k])) if cfg[k] in SP.SPACE[k] else 3
                   for k in TF.TILE_KEYS)
        return _row(cfg, stage, reps, 100.0 + 10 * dist)

    def measure(cfgs, stage, reps):
        return [measure_one(c, stage, reps) for c in cfgs]

    default = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8, "num_warps": 4,
               "num_stages": 4}
    for rng_seed in range(5):
        calls.clear()
        res = S.run_search("halving", space, measure, default=default, seeds=[seed], budget=32,
                           rng=random.Random(rng_seed), reps=20, final_reps=50)
        assert CA.config_of(res.winner) == best and res.winner.latency_us == 100.0
        assert CA.stage_of(res.winner) == "final" and res.winner.extra["reps"] == 50
        assert len({c for c, st, _ in calls if st != "final"}) <= 32  # the budget: distinct configs screened
    rounds = sorted({st for _, st, _ in calls if st.startswith("halving")})
    # pool 24 -> 12 -> 6 -> 3 -> 2, then the refinement
    assert rounds == ["halving-r0", "halving-r1", "halving-r2", "halving-r3", "halving-r4", "halving-refine"]
    assert [r for c, st, r in calls if st == "halving-r0"][0] == 5
    assert any(c == SP.key_str(default) for c, st, _ in calls if st == "final")  # the default competes
    grid = S.run_search("grid", space[:10], measure, default=default, reps=3, final_reps=5)
    assert len([c for c in calls[-15:] if c[1] == "grid"]) == 10
    assert grid.winner.latency_us == min(m.latency_us for m in grid.measurements if CA.stage_of(m) == "final")


def test_rivals_seed_the_search_and_compete_in_the_final_stage():
    """A config to beat (an engine's shipped entry) that only a search seeded by it finds wins; one
    outside the pruned space still runs in the final stage, and a slower one loses to the search."""
    space = SP.full_space()[:40]
    outside = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1, "num_warps": 2,
               "num_stages": 2}
    assert SP.config_key(outside) not in {SP.config_key(c) for c in space}
    default = dict(space[0])
    for rival, rival_us, wins in ((dict(space[-1]), 50.0, True), (outside, 50.0, True), (dict(space[-1]), 500.0, False)):
        calls: list[tuple[str, str]] = []

        def measure(cfgs, stage, reps, rival=rival, rival_us=rival_us):
            calls.extend((SP.key_str(cfg), stage) for cfg in cfgs)
            return [_row(cfg, stage, reps, rival_us if SP.config_key(cfg) == SP.config_key(rival)
                         else 100.0 + SP.config_key(cfg)[2]) for cfg in cfgs]

        res = S.run_search("halving", space, measure, default=default, budget=8, rng=random.Random(0), reps=4,
                           final_reps=8, rivals=[rival])
        assert (SP.key_str(rival), "final") in calls
        assert (CA.config_of(res.winner) == rival) is wins
        assert res.winner.latency_us == min(m.latency_us for m in res.final)


# ---------------------------------------------------------------------------------------------
# End to end


def test_tiny_tune_end_to_end(tmp_path):
    out = _tune(tmp_path)
    assert [r.tokens for r in out.results] == TOKENS
    raw = assert_vllm_loadable(out.config_path, TOKENS)
    assert out.config_path.parent == tmp_path / "cfg"
    assert out.config_path.name == "E=4,N=32,device_name=cpu.json"
    loaded = TF.load_config_file(out.config_path)
    for r in out.results:
        assert r.winner == dict(loaded[r.tokens]) == raw[str(r.tokens)]
        assert r.winner_us > 0 and r.default_us > 0 and r.speedup == pytest.approx(r.default_us / r.winner_us)
        assert r.failed == r.wrong == 0 and r.reused == 0 and r.space_kept == 2
    lines = _journal_lines(out.run_dir)
    assert len(lines) == sum(r.measured for r in out.results)
    keys = [(d["tokens"], SP.key_str(d["config"]), d["stage"]) for d in lines]
    assert len(keys) == len(set(keys))
    # Correctness checked exactly once per (token count, config).
    pairs = {(d["tokens"], SP.key_str(d["config"])) for d in lines}
    assert sum(d["checked"] for d in lines) == len(pairs)
    assert all(d["max_rel_err"] < 1e-4 for d in lines if d["checked"])
    md = (out.run_dir / "report.md").read_text()
    assert "winner" in md and "default_us" in md and "not kernel speed" in md
    csv = (out.run_dir / "report.csv").read_text().splitlines()
    assert csv[0].startswith("tokens,winner,winner_us,runner_up") and len(csv) == 1 + len(TOKENS)
    assert json.loads((out.run_dir / "tune.json").read_text())["spec"]["strategy"] == "halving"
    # Triton's cache pointed into the run folder, and the setting restored afterwards.
    assert (out.run_dir / "triton-cache" / "w0").is_dir()
    assert os.environ.get("TRITON_CACHE_DIR", "") != str(out.run_dir / "triton-cache" / "w0")


def test_resume_after_kill_repeats_nothing(tmp_path):
    killer = CountingTimer(stop_at=4)
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _tune(tmp_path, timer=killer, run_dir=run_dir)
    done = _journal_lines(run_dir)
    assert len(done) == 3 and not list((tmp_path / "cfg").glob("E=*.json"))  # no token count was finished
    # A crash mid-write leaves a torn line: it is dropped and the next record starts a fresh line.
    with open(run_dir / T.CANDIDATES, "a") as f:
        f.write('{"tokens": 4, "conf')
    again = CountingTimer()
    out = _tune(tmp_path, timer=again, resume=run_dir)
    lines = _journal_lines(run_dir)
    assert len(lines) == len((run_dir / T.CANDIDATES).read_text().splitlines())  # the torn line dropped
    keys = [(d["tokens"], SP.key_str(d["config"]), d["stage"]) for d in lines]
    assert len(keys) == len(set(keys))  # nothing measured twice
    assert again.calls == len(lines) - 3  # only the missing ones were timed
    assert sum(r.reused for r in out.results) >= 3
    assert_vllm_loadable(out.config_path, TOKENS)
    # A third run finds everything in the journal and measures nothing.
    idle = CountingTimer()
    out3 = _tune(tmp_path, timer=idle, resume=run_dir)
    assert idle.calls == 0 and [r.winner for r in out3.results] == [r.winner for r in out.results]
    with pytest.raises(MoebenchError, match="differs from the saved one"):
        _tune(tmp_path, resume=run_dir, strategy="grid")


def test_compile_workers_compile_every_candidate_once_before_it_is_timed(tmp_path):
    # Two spawned compile workers (on a CPU they only run the layer; on a GPU that fills Triton's
    # shared on-disk cache). Every distinct config of a token count goes through them once.
    out = _tune(tmp_path, compile_workers=2)
    assert_vllm_loadable(out.config_path, TOKENS)
    lines = _journal_lines(out.run_dir)
    for r in out.results:
        distinct = {SP.key_str(d["config"]) for d in lines if d["tokens"] == r.tokens}
        assert r.precompiled == len(distinct) > 0 and r.precompile_s > 0
        assert r.search_s >= r.precompile_s and r.failed == r.wrong == 0


def test_precompiler_reports_what_fails(tmp_path):
    from moebench.tuning.precompile import Precompiler

    spec = T.TuneSpec(shape=SHAPE, layout=ParallelLayout(), tokens=[2], dtype=torch.float32, device="cpu")
    good = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    with Precompiler(spec, "cpu", 1) as pre:
        ok, bad = pre.compile(2, [good, dict(good, BLOCK_SIZE_M=24)])  # 24: not a power of two
    assert ok == "ok" and bad != "ok" and len(bad.splitlines()) == 1


def test_precompiler_stops_with_a_warning_when_a_worker_dies(capsys):
    # A worker killed (for memory, most often) breaks the pool: the run goes on, the timing process
    # compiling what it times, and says so once.
    from concurrent.futures.process import BrokenProcessPool

    from moebench.tuning.precompile import Precompiler

    class DeadPool:
        def map(self, fn, tasks):
            raise BrokenProcessPool("a process in the process pool was terminated abruptly")

        def shutdown(self, **kw):
            pass

    spec = T.TuneSpec(shape=SHAPE, layout=ParallelLayout(), tokens=[2], dtype=torch.float32, device="cpu")
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    pre = Precompiler(spec, "cpu", 1)
    pre._pool.shutdown()
    pre._pool = DeadPool()
    first = pre.compile(2, [cfg, cfg])
    again = pre.compile(4, [cfg])
    pre.close()
    assert len(first) == 2 and all(v.startswith("not compiled") for v in first + again)
    err = capsys.readouterr().err
    assert err.count("warning: a compile worker died") == 1 and "--compile-workers" in err


def test_tune_out_of_gpu_memory_is_one_line_with_the_run_to_resume(tmp_path, monkeypatch, capsys):
    from moebench.cli import main

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 896.00 MiB. GPU 0 has ...\nmore")

    monkeypatch.setattr(T, "tune", oom)
    monkeypatch.chdir(tmp_path)
    sizes = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--device", "cpu"]
    monkeypatch.setattr("sys.argv", ["moebench", "tune", *sizes, "--tokens", "1", "--compile-workers", "3"])
    with pytest.raises(SystemExit) as ex:
        main()
    err = capsys.readouterr().err.strip()
    assert ex.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "out of GPU memory (CUDA out of memory)" in err and "3 compile workers" in err
    assert "moebench tune --resume" in err


def test_failed_and_wrong_configs_are_skipped(tmp_path, monkeypatch):
    orig_kernel, orig_call = CA.TuneRunner.kernel, CA.TuneRunner.call

    def kernel(self, cfg):
        if cfg["BLOCK_SIZE_M"] == 32:
            raise RuntimeError("out of resource: shared memory, Required: 999999")
        return orig_kernel(self, cfg)

    def call(self, k, i):
        out = orig_call(self, k, i)
        return out * 2 if k.experts.config["GROUP_SIZE_M"] == 16 else out

    monkeypatch.setattr(CA.TuneRunner, "kernel", kernel)
    monkeypatch.setattr(CA.TuneRunner, "call", call)
    space = dict(TINY_SPACE, BLOCK_SIZE_M=[16, 32])
    out = tune_with(SHAPE, ParallelLayout(), [32], torch.float32, strategy="grid", out_dir=tmp_path / "cfg",
                    results_dir=tmp_path / "res", space=space, timer=fast_timer)
    (r,) = out.results
    assert r.winner == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                        "num_warps": 4, "num_stages": 2}
    # BM 32 (both groups, and the default heuristic's M32 config) failed; BM 16 with G16 wrong.
    assert (r.failed, r.wrong, r.default_us, r.speedup) == (3, 1, None, None)
    lines = _journal_lines(out.run_dir)
    assert {d["status"] for d in lines} == {"ok", "failed", "wrong"}
    assert all("out of resource" in d["reason"] for d in lines if d["status"] == "failed")


def test_tp_and_ep_size_the_file(tmp_path):
    shape = get_model("mixtral-8x7b")
    spec = T.TuneSpec(shape, ParallelLayout.from_args(8, None, None), [1], torch.bfloat16, "cpu")
    assert T.config_path_for(spec, tmp_path).name == "E=8,N=1792,device_name=cpu.json"
    q = get_model("qwen3-30b-a3b")
    spec = T.TuneSpec(q, ParallelLayout.from_args(None, None, 8), [1], torch.bfloat16, "cpu")
    assert T.config_path_for(spec, tmp_path).name == "E=16,N=768,device_name=cpu.json"
    assert T.config_path_for(spec).parent == Path("results") / "configs"


def test_split_and_gpus():
    assert T.split_tokens([64, 1, 16, 4, 256], 2) == [[1, 4, 16], [64, 256]]
    assert T.split_tokens([1], 4) == [[1]]
    assert T.resolve_gpus("all", "cpu") == [0] and T.resolve_gpus("0,1", "cpu") == [0, 1]
    with pytest.raises(MoebenchError, match="--gpus"):
        T.resolve_gpus("a,b", "cpu")


def test_cache_guard_prunes_over_limit(tmp_path):
    saved = os.environ.get("TRITON_CACHE_DIR")
    g = T.TritonCacheGuard(tmp_path / "tc", limit_mb=0.001)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "tc")
    (tmp_path / "tc" / "k").mkdir()
    (tmp_path / "tc" / "k" / "a.cubin").write_bytes(b"x" * 100)
    assert not g.check()
    (tmp_path / "tc" / "k" / "b.cubin").write_bytes(b"x" * 2000)
    assert g.check() and g.prunes == 1 and g.size_bytes() == 0
    g.close()
    assert os.environ.get("TRITON_CACHE_DIR") == saved


def test_two_worker_processes_gather_one_file(tmp_path):
    # With compile workers, each spawned tuning worker starts its own (processes spawn processes).
    # (A worker without them is the tuning process's own path, which the in-process tunes take.)
    space = dict(TINY_SPACE, BLOCK_SIZE_M=[16], GROUP_SIZE_M=[1])
    out = tune_with(SHAPE, ParallelLayout(), TOKENS, torch.float32, strategy="grid", out_dir=tmp_path / "cfg",
                    gpus="0,1", results_dir=tmp_path / "res", space=space, reps=1, final_reps=1, compile_workers=1)
    assert sorted(r.worker for r in out.results) == [0, 1]
    assert all(r.precompiled > 0 for r in out.results)
    assert (out.run_dir / "candidates.jsonl").exists() and (out.run_dir / "candidates.w1.jsonl").exists()
    assert_vllm_loadable(out.config_path, TOKENS)


# ---------------------------------------------------------------------------------------------
# CLI


def _group():
    g = click.group()(lambda: None)
    g.add_command(tune_command)
    g.add_command(configs_group)
    return g


GOOD = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4}


def test_configs_list_show_diff_commit(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TF.ENV_CONFIG_DIR, raising=False)
    pkg = tmp_path / "pkg_configs"
    monkeypatch.setattr(TF, "PACKAGE_CONFIG_DIR", pkg)
    a = TF.write_config_file(tmp_path / "results" / "configs" / "E=8,N=64,device_name=cpu.json",
                            {1: GOOD, 16: GOOD}, triton_version="3.6.0")
    other = dict(GOOD, BLOCK_SIZE_N=128, num_warps=8)
    b = TF.write_config_file(tmp_path / "b" / "E=8,N=64,device_name=cpu.json", {1: GOOD, 16: other, 64: GOOD})
    r = CliRunner()
    g = _group()

    res = r.invoke(g, ["configs", "list", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [(x["E"], x["N"], x["device"], x["tokens"]) for x in rows] == [(8, 64, "cpu", [1, 16])]

    res = r.invoke(g, ["configs", "show", "8,64", "--device", "cpu", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["16"] == GOOD
    res = r.invoke(g, ["configs", "show", str(b)])
    assert res.exit_code == 0 and "64" in res.output

    assert diff_tables(TF.load_config_file(a), TF.load_config_file(b)) == [
        (16, "BLOCK_SIZE_N 64->128; num_warps 4->8"), (64, "only in B")]
    res = r.invoke(g, ["configs", "diff", str(a), str(b)])
    assert res.exit_code == 0 and "only in B" in res.output and "num_warps 4->8" in res.output

    res = r.invoke(g, ["configs", "commit", "--allow-cpu", str(b)])
    assert res.exit_code == 0 and "added" in res.output
    assert TF.load_config_file(pkg / "moebench" / b.name) == TF.load_config_file(b)  # the kernel's folder
    assert TF.tuned_routing(pkg / "moebench" / b.name) is None  # b's folder records no routing: none committed
    TF.write_tuned_routing(b, (64, 2))  # ...now it does: the routing goes with the file
    res = r.invoke(g, ["configs", "commit", "--allow-cpu", str(b)])
    assert "unchanged" in res.output and TF.tuned_routing(pkg / "moebench" / b.name) == (64, 2)
    rows = json.loads(r.invoke(g, ["configs", "list", "--json", "--dir", str(pkg)]).output)
    assert [x["routing"] for x in rows if x["dir"] == str(pkg / "moebench")] == [{"experts": 64, "topk": 2}]

    bad = tmp_path / "E=8,N=64,device_name=X.json"
    bad.write_text(json.dumps({"1": dict(GOOD, BLOCK_SIZE_N=48)}))
    res = r.invoke(g, ["configs", "commit", str(bad)])
    assert isinstance(res.exception, MoebenchError) and "power of two" in str(res.exception)
    assert not (pkg / "moebench" / bad.name).exists()
    res = r.invoke(g, ["configs", "commit", str(tmp_path / "b")])
    assert isinstance(res.exception, MoebenchError)
    res = r.invoke(g, ["configs", "show", "9,9", "--device", "cpu"])
    assert isinstance(res.exception, MoebenchError) and "no E=9,N=9" in str(res.exception)


def test_tune_command_dry_run_and_tiny_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    g, r = _group(), CliRunner()
    sizes = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--device", "cpu"]
    res = r.invoke(g, ["tune", *sizes, "--tokens", "1,4", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "search space after pruning" in res.output and "/ 1920" in res.output
    res = r.invoke(g, ["tune", *sizes, "--tokens", "1", "--budget", "2", "--reps", "1", "--final-reps", "1"])
    assert res.exit_code == 0, res.output
    path = tmp_path / "results" / "configs" / "E=4,N=32,device_name=cpu.json"
    assert_vllm_loadable(path, [1])
    assert TF.tuned_routing(path) == (4, 2)  # what its token keys mean: top-2 over 4 experts
    res = r.invoke(g, ["configs", "list", "--json"])
    listed = [x for x in json.loads(res.output) if x["E"] == 4 and x["N"] == 32]  # the package ships others
    assert [x["tokens"] for x in listed] == [[1]]
    res = r.invoke(g, ["tune", *sizes, "--search", "nope"])
    assert res.exit_code == 2  # click's own usage error
    res = r.invoke(g, ["tune", *sizes, "--budget", "0"])
    assert isinstance(res.exception, MoebenchError)
    res = r.invoke(g, ["tune", *sizes, "--compile-workers", "-1"])
    assert isinstance(res.exception, MoebenchError) and "--compile-workers" in str(res.exception)
    res = r.invoke(g, ["tune", *sizes, "--tokens", "2", "--budget", "2", "--reps", "1", "--final-reps", "1",
                       "--compile-workers", "1"])
    assert res.exit_code == 0, res.output
    assert_vllm_loadable(path, [1, 2])  # entries for other token counts are kept
    res = r.invoke(g, ["tune", "--resume", str(tmp_path / "nowhere")])
    assert isinstance(res.exception, MoebenchError) and "tune.json" in str(res.exception)


TORCHRUN_SCRIPT = """
import os, sys, torch
from moebench.layout import ParallelLayout
from moebench.models import custom_shape
from moebench.tuning.tuner import TuneSpec, tune
space = {"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [64], "BLOCK_SIZE_K": [64], "GROUP_SIZE_M": [1], "num_warps": [4],
         "num_stages": [2]}
spec = TuneSpec(custom_shape(4, 2, 64, 32, name="tiny"), ParallelLayout(), [1, 4, 8], torch.float32, "cpu", "grid",
                space=space, reps=1, final_reps=1)
o = tune(spec, out_dir=sys.argv[1] + "/cfg", results_dir=sys.argv[1] + "/res")
line = " ".join(map(str, ["RANK", os.environ["RANK"], o.is_main, o.config_path, sorted(r.tokens for r in o.results)]))
open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".txt"), "w").write(line)  # ranks share stdout
"""


def test_torchrun_ranks_split_and_gather_on_rank0(tmp_path):
    import subprocess
    import sys

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this python")
    script = tmp_path / "tr.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = sorted((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert len(lines) == 2 and lines[0].startswith("RANK 0 True") and lines[0].endswith("[1, 4, 8]"), p.stdout
    assert lines[1] == "RANK 1 False None [8]", p.stdout
    (run_dir,) = list((tmp_path / "res").iterdir())  # one folder: rank 0's name, broadcast
    assert (run_dir / "candidates.w1.jsonl").exists()
    assert_vllm_loadable(tmp_path / "cfg" / "E=4,N=32,device_name=cpu.json", [1, 4, 8])


def test_configs_coverage_of_the_presets_usual_layouts(tmp_path, monkeypatch):
    # Every preset's deploy layouts map to the (E, N) file one rank looks up; a file in
    # $MOEBENCH_CONFIG_DIR covers its shard, and --shards lists each missing file once.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TF, "PACKAGE_CONFIG_DIR", tmp_path / "pkg")
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path / "mine"))
    TF.write_config_file(tmp_path / "mine" / "E=32,N=2048,device_name=NVIDIA_H200.json", {1: GOOD})
    g, r = _group(), CliRunner()
    res = r.invoke(g, ["configs", "coverage", "--json"])
    assert res.exit_code == 0, res.output
    rows = {(x["model"], x["layout"]): x for x in json.loads(res.output)}
    assert (rows[("mixtral-8x7b", "tp8")]["E"], rows[("mixtral-8x7b", "tp8")]["N"]) == (8, 1792)
    assert (rows[("qwen3-235b-a22b", "ep8")]["E"], rows[("qwen3-235b-a22b", "ep8")]["N"]) == (16, 1536)
    assert rows[("deepseek-v3", "ep8")]["found"] == str(tmp_path / "mine")
    assert rows[("deepseek-v3", "tp8")]["found"] is None
    shards = r.invoke(g, ["configs", "coverage", "--shards"]).output.strip().split(";")
    assert "mixtral-8x7b:" in shards and "mixtral-8x7b:--tp 8" in shards and "qwen3-235b-a22b:--ep 8" in shards
    assert "deepseek-v3:--ep 8" not in shards and "deepseek-r1:--ep 8" not in shards
    assert sum(s.startswith(("deepseek-v3:--tp 8", "deepseek-r1:--tp 8")) for s in shards) == 1  # one file
    res = r.invoke(g, ["configs", "coverage"])
    assert res.exit_code == 0 and "missing" in res.output and "covered" in res.output
    assert "1 of 18" in res.output and "fewer than vLLM's 18 token counts" in res.output
    # --fill: one tune per sparse file, its missing counts, merged into the folder it was found in
    fill = r.invoke(g, ["configs", "coverage", "--fill"]).output.strip().splitlines()
    assert fill == [f"moebench tune --model deepseek-v3 --ep 8 --tokens 2,4,8,16,24,32,48,64,96,128,256,512,1024,"
                    f"1536,2048,3072,4096 --out {tmp_path / 'mine'}"]


def test_deploy_layout_names():
    from moebench.tuning.tuner import deploy_layout

    assert deploy_layout("tp1")[1] == "" and deploy_layout("tp8")[1] == "--tp 8" and deploy_layout("ep8")[1] == "--ep 8"
    assert deploy_layout("ep8")[0].enable_ep and deploy_layout("tp4")[0].moe_tp_size == 4
    with pytest.raises(MoebenchError, match="tpN or epN"):
        deploy_layout("pp2")


def test_down_tune_writes_sglang_down_file_against_gemm1s_config(tmp_path, monkeypatch):
    # GEMM1's file first (found by the lookup through $MOEBENCH_CONFIG_DIR), then `--down`: GEMM2's
    # configs searched at GEMM1's BLOCK_SIZE_M with GEMM1's config fixed, written as `_down.json`.
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path / "cfg"))
    monkeypatch.chdir(tmp_path)
    up = _tune(tmp_path)
    gemm1 = TF.load_config_file(up.config_path)
    space = dict(TINY_SPACE, BLOCK_SIZE_N=[32, 64], BLOCK_SIZE_K=[32, 64])
    out = _tune(tmp_path, down=True, space=space)
    assert out.config_path == tmp_path / "cfg" / "E=4,N=32,device_name=cpu_down.json"
    down = TF.load_config_file(out.config_path)
    assert parse_config_name(out.config_path.name)["down"]
    for r in out.results:
        assert r.default == dict(gemm1[r.tokens])  # the baseline: GEMM2 with GEMM1's config
        assert down[r.tokens]["BLOCK_SIZE_M"] == gemm1[r.tokens]["BLOCK_SIZE_M"]
        assert 0 < r.space_kept <= 8 and r.gemm1_source.endswith(f"[{r.tokens}]")  # 2 N x 2 K x 2 GROUP
        assert r.failed == r.wrong == 0 and r.winner_us > 0
    md = (out.run_dir / "report.md").read_text()
    assert "GEMM2's own configs (`--down`)" in md and str(up.config_path) in md
    assert json.loads((out.run_dir / "tune.json").read_text())["spec"]["down"] is True
    # what the layer then uses: both files
    cfg2, src = C.lookup_down_config(4, 32, 1, gemm1[1], torch.float32, device_name="cpu",
                                     folders=TF.config_search_dirs())
    assert cfg2 == down[1] and src.endswith("_down.json[1]")
    # a --down resume of a run that was not one is refused (the settings differ)
    with pytest.raises(MoebenchError, match="down"):
        _tune(tmp_path, down=True, resume=up.run_dir)


def test_tune_command_down_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TF.ENV_CONFIG_DIR, raising=False)
    g, r = _group(), CliRunner()
    sizes = ["--num-experts", "4", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--device", "cpu"]
    res = r.invoke(g, ["tune", *sizes, "--tokens", "1", "--down", "--dry-run"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps lines
    assert "cpu_down.json" in text and "GEMM2 against GEMM1's config" in text
    assert "/ 384" in text  # the 1920-config grid at one BLOCK_SIZE_M
    res = r.invoke(g, ["tune", *sizes, "--tokens", "1", "--down", "--budget", "2", "--reps", "1", "--final-reps", "1"])
    assert res.exit_code == 0, res.output
    path = tmp_path / "results" / "configs" / "E=4,N=32,device_name=cpu_down.json"
    # no GEMM1 file: GEMM1 runs the default heuristic, and the down entry has its BLOCK_SIZE_M
    heur = C.default_config(1, 4, 32, 64, 2, torch.float32)
    assert TF.load_config_file(path)[1]["BLOCK_SIZE_M"] == heur["BLOCK_SIZE_M"]
    res = r.invoke(g, ["configs", "list", "--json"])
    assert [x["down"] for x in json.loads(res.output) if x["E"] == 4 and x["N"] == 32] == [True]


def test_configs_show_down(tmp_path, monkeypatch):
    monkeypatch.setenv(TF.ENV_CONFIG_DIR, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    entry = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4,
             "num_stages": 5, "USE_TMA": False}
    TF.write_config_file(tmp_path / "E=4,N=32,device_name=cpu_down.json", {1: entry})
    g, r = _group(), CliRunner()
    res = r.invoke(g, ["configs", "show", "4,32", "--device", "cpu", "--down", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"1": entry}
    res = r.invoke(g, ["configs", "show", "4,32", "--device", "cpu", "--down"])
    assert "USE_TMA" in res.output and "False" in res.output
    res = r.invoke(g, ["configs", "show", "4,32", "--device", "cpu"])  # GEMM1's file: not there
    assert isinstance(res.exception, MoebenchError) and "E=4,N=32,device_name=cpu.json" in str(res.exception)
