"""compare tp-vs-ep as engines deploy it: every candidate layout with its launch flags, the whole
model's fit and the batch each layout holds, the fit refusal, the target GPUs' links, micro-batch
overlap, the one-sided flip factor against the table's own columns, a 512K-token modeled run that
makes no (tokens, hidden) tensor, and an answer that fits 80 columns."""

from __future__ import annotations

import re
from unittest import mock

import pandas as pd
import pytest

from moebench.errors import MoebenchError
from test_cli import assert_bad_input, moebench_inproc


def _run(tmp_path, *args, name="out"):
    out = tmp_path / name
    res = moebench_inproc("compare", "tp-vs-ep", *args, "--no-check", "--out", str(out))
    assert res.returncode == 0, res.stderr
    run = next(out.iterdir())
    return res, pd.read_csv(run / "compare.csv"), run


def test_deepseek_v3_on_8_h200_prices_every_layout_engines_run_with_their_flags(tmp_path):
    res, s, _ = _run(tmp_path, "--model", "deepseek-v3", "--world-size", "8", "--tokens", "64")
    assert {"TP8", "TP8+EP8", "DP8+EP8", "EP2/TP4", "EP4/TP2"} <= set(s.layout)
    dp = s[s.layout == "DP8+EP8"]
    assert set(dp.prepare_finalize) == {"allgather-rs", "all2all-ll", "deepep-ll", "deepep-ht"}
    flags = s.set_index("candidate")
    assert flags.loc["TP8", "vllm"] == "--tensor-parallel-size 8" and flags.loc["TP8", "sglang"] == "--tp 8"
    assert flags.loc["TP8+EP8", "vllm"] == "--tensor-parallel-size 8 --enable-expert-parallel"
    assert flags.loc["TP8+EP8", "sglang"] == "--tp 8 --ep 8"
    assert "--all2all-backend deepep_low_latency" in flags.loc["DP8+EP8 deepep-ll", "vllm"]
    assert "--moe-a2a-backend deepep --deepep-mode normal" in flags.loc["DP8+EP8 deepep-ht", "sglang"]
    assert "--enable-dp-attention" in flags.loc["DP8+EP8 allgather-rs", "sglang"]
    assert flags.loc["EP2/TP4", "trt_llm"] == "--tp_size 8 --ep_size 2" and not isinstance(flags.loc["EP2/TP4", "vllm"], str)
    # moebench's own all2all-ll runs in no engine: priced, never the answer
    assert not flags.loc["DP8+EP8 all2all-ll", "eligible"] and not s[s.winner].candidate.str.contains("all2all").any()
    # the whole model fits 8 x 141 GB in fp8; DP attention holds the MLA cache once per rank, TP8 once per group
    assert s.fits.all()
    assert flags.loc["DP8+EP8 deepep-ll", "sequences"] > 4 * flags.loc["TP8", "sequences"]
    out = res.stdout
    assert "launch flags:" in out and "--data-parallel-size 8 --enable-expert-parallel" in out.replace("\n", " ")
    # the default overlap is the engines': two-batch on the DeepEP transports, none over the all-reduce
    assert set(flags[flags.prepare_finalize.str.startswith("deepep")].overlap) == {"two-batch"}
    assert set(flags[flags.kind == "tp"].overlap) == {"none"}


def test_a_model_that_fits_no_layout_is_refused_in_one_line_naming_what_fits(tmp_path):
    out = tmp_path / "out"
    res = moebench_inproc("compare", "tp-vs-ep", "--model", "deepseek-v3", "--world-size", "8", "--target-gpu", "H100",
                          "--out", str(out))
    assert_bad_input(res, "does not fit 8 x H100")
    assert "TP8 79" in res.stderr and "16 x H100 fit" in res.stderr and "TP16" in res.stderr
    assert not out.exists()  # refused before any folder or work
    # a shape whose one layer cannot fit: refused the same way, not killed for memory
    res = moebench_inproc("compare", "tp-vs-ep", "--num-experts", "8", "--topk", "2", "--hidden", "1000000",
                          "--intermediate", "100000", "--world-size", "8", "--out", str(out))
    assert_bad_input(res, "one MoE layer's weights")
    assert not out.exists()


def test_32_h100_have_tp16_across_two_nodes_among_their_candidates(tmp_path):
    res, s, _ = _run(tmp_path, "--model", "deepseek-v3", "--world-size", "32", "--target-gpu", "H100", "--tokens", "64")
    tp16 = s[s.layout == "TP16x2"].iloc[0]
    assert tp16.fits and tp16.replicas == 2 and tp16.allreduce == "nccl"  # the custom all-reduce stays in a node
    assert tp16.vllm.startswith("--tensor-parallel-size 16") and "--nnodes 2" in tp16.sglang
    assert not s[s.layout == "TP8x4"].fits.any()  # 671B in fp8 does not fit a node of 8 H100


def test_every_target_gpu_models_its_own_link_or_refuses(tmp_path):
    from moebench.bench.hardware import gpu_target, target_names
    from moebench.compare import known_link, plan_compare
    from moebench.models import custom_shape
    from moebench.sweep import SweepSpec

    spec = SweepSpec(shape=custom_shape(16, 2, 256, 256), tokens=[4], device="cpu", check=False)
    names = target_names().split(", ")
    assert {"MI300X", "MI325X", "MI355X", "B200", "B300", "GB200", "GB300"} <= set(names)
    for name in names:
        t = gpu_target(name)
        assert t is not None and t.memory_gib and t.source, name
        if not known_link(t.link or ""):
            with pytest.raises(MoebenchError, match="no link profile"):
                plan_compare(spec, 8, experts_given=False, target_gpu=name, device_name=None)
            continue
        plan = plan_compare(spec, 8, experts_given=False, target_gpu=name, device_name=None)
        assert plan.link.nvlink == t.link, (name, plan.link.nvlink)  # its own link, never another's
        assert plan.experts_model.mem_read_gbps == t.hbm_gbps
    res, _, run = _run(tmp_path, "--num-experts", "16", "--topk", "2", "--hidden", "256", "--intermediate", "256",
                       "--world-size", "8", "--tokens", "4", "--target-gpu", "B200")
    assert "b200-nvlink" in res.stdout and "from --target-gpu" in res.stdout


def test_two_batch_overlap_hides_communication_behind_the_other_half():
    from moebench.compare import overlapped, summarize
    from moebench.results import ResultRow

    def row(pf, ep, lat, exp, d, c, half):
        r = ResultRow(model="m", num_experts=8, topk=2, hidden=8, intermediate=8, tokens=64, tp=1 if ep > 1 else 4,
                      dp=4 if ep > 1 else 1, ep=ep, world_size=4, prepare_finalize=pf, experts="x",
                      activation_format="f", dtype="bf16", device="cpu", routing="uniform", modeled=True,
                      latency_us=lat, correct=True)
        r.experts_us, r.extra["experts_half_us"] = exp, half
        if ep > 1:
            r.dispatch_us, r.combine_us = d, c
        else:
            r.allreduce_us = d
        return r

    assert overlapped(40, 100, 60, 50) == 20 + 50 + 50 + 30  # each half's communication behind the other's experts
    rows = [row("deepep-ht", 4, 200, 100, 40, 60, 50), row("no-dpep", 1, 190, 170, 20, 0, 85)]
    s = summarize(rows, 4).summary.set_index("layout")
    assert s.loc["DP4+EP4", "overlap"] == "two-batch" and s.loc["DP4+EP4", "latency_us"] == 150
    assert s.loc["DP4+EP4", "latency_serial_us"] == 200 and s.loc["TP4", "overlap"] == "none"
    assert s.loc["DP4+EP4", "winner"]  # the overlap turns the answer


def _factor(summary, tokens):
    """The one-sided factor of the fastest layout of the other kind of communication, from the
    table's own columns: its communication alone must run f x faster to match the winner's total."""
    g = summary[(summary.tokens == tokens) & summary.eligible].sort_values("latency_us")
    w = g.iloc[0]
    kind = (g.kind == "dp-ep") != (w.kind == "dp-ep")  # weighed against the other kind of communication
    r = g[kind].iloc[0]
    return w, r, r.comm_us / (w.latency_us - (r.latency_us - r.comm_us))


@pytest.mark.parametrize("model,world,tokens,gpu,kind", [("qwen3-30b-a3b", "8", 16, "H200", "tp"),
                                                          ("deepseek-v3", "32", 1024, "H100", "dp-ep")])
def test_flip_sentence_states_the_one_sided_factor_of_the_table(tmp_path, model, world, tokens, gpu, kind):
    res, s, run = _run(tmp_path, "--model", model, "--world-size", world, "--tokens", str(tokens), "--overlap", "none",
                       "--target-gpu", gpu)
    w, r, f = _factor(s, tokens)
    assert w.kind == kind
    text = (run / "compare.md").read_text().split("\n")[0]
    by = "all-reduce" if r.kind != "dp-ep" else "dispatch+combine"
    assert f"'s {by} alone run" in text and f"{f:.2f}x faster than modeled" in text, text
    assert r.comm_flip_factor == pytest.approx(f)


def test_a_512k_token_modeled_run_makes_no_token_tensor(tmp_path):
    import moebench.sweep.cases as cases

    real = cases.make_tokens

    def small_only(m, h, *a, **k):
        assert m * h < 2**26, f"a ({m}, {h}) token tensor was made for a modeled run"
        return real(m, h, *a, **k)

    with mock.patch.object(cases, "make_tokens", small_only):
        res, s, _ = _run(tmp_path, "--model", "mixtral-8x7b", "--world-size", "8", "--tokens", "524288")
    assert set(s.tokens) == {524288} and s[s.eligible].latency_us.notna().all()


def test_the_default_demo_fits_80_columns(tmp_path):
    # the demo's own lines and its checked answer at 64 tokens; the widest figures of its default
    # token counts (4096) through the same table without the check, which is what takes the time
    with mock.patch.dict("os.environ", {"COLUMNS": "80"}):
        res = moebench_inproc("demo", "--tokens", "64", "--out", str(tmp_path / "demo"))
        wide_res = moebench_inproc("compare", "tp-vs-ep", "--model", "qwen3-30b-a3b", "--world-size", "8", "--tokens",
                                   "1,4096", "--no-check", "--out", str(tmp_path / "wide"))
    for r in (res, wide_res):
        assert r.returncode == 0, r.stderr
        wide = [line for line in r.stdout.splitlines() if len(line) > 80 and " " in line.strip()]
        assert not wide, wide
        assert "x faster than modeled" in r.stdout.replace("\n", " ")
    assert "the kernels that run here are checked" in res.stdout.replace("\n", " ") and "next:" in res.stdout


def test_whole_model_sizes_match_the_published_totals():
    from moebench.footprint import PRESET_SIZES, total_params
    from moebench.models import get_model

    published = {"deepseek-v3": 671e9, "qwen3-235b-a22b": 235e9, "qwen3-30b-a3b": 30.5e9, "gpt-oss-120b": 117e9,
                 "gpt-oss-20b": 21e9, "mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9, "deepseek-v2": 236e9,
                 "deepseek-v2-lite": 15.7e9, "olmoe-1b-7b": 6.9e9, "dbrx": 132e9, "qwen2-moe-a2.7b": 14.3e9}
    for name, total in published.items():
        assert total_params(get_model(name), PRESET_SIZES[name]) == pytest.approx(total, rel=0.02), name


def test_measured_kernel_tables_price_the_shards_they_cover(tmp_path):
    """The shipped table is what `kernel_table` makes of PERF.md's raw vllm_kernel files; a modeled row
    of a covered shard takes its interpolated time and says so, any other the floor."""
    import math

    from benchmarks import kernel_table
    from moebench.bench import kernel_tables

    out = tmp_path / "h200.csv"
    assert kernel_table.main(["--vllm-kernel", "docs/perf/vllm_kernel_triton-2026-12-03.csv",
                              "docs/perf/vllm_kernel_triton_more-2026-12-03.csv", "--gpu", "NVIDIA H200", "--date",
                              "2026-12-03", "--revision", "5eea1de", "--out", str(out)]) == 0
    shipped = kernel_tables.SHIPPED / "h200-2026-12-03.csv"
    assert out.read_text() == shipped.read_text()
    t = pd.read_csv(shipped)
    dsv3 = t[(t.experts == 256) & (t.intermediate == 256) & (t.precision == "bf16")].set_index("tokens").experts_us
    a, b = dsv3.loc[64], dsv3.loc[96]  # rows per expert 2 and 3: log-log between them
    us, src = kernel_tables.lookup("H200", 256, 7168, 256, 8, "bf16", 2.5)
    assert us == pytest.approx(math.exp(math.log(a) + math.log(2.5 / 2) / math.log(3 / 2) * math.log(b / a)))
    assert "5eea1de" in src and "2026-12-03" in src
    assert kernel_tables.lookup("B200", 256, 7168, 256, 8, "bf16", 2.5) is None  # a GPU without a table
    us100, src100 = kernel_tables.lookup("H100", 256, 7168, 256, 8, "bf16", 2.5)  # the device job's H100 table
    assert "h100-2026-12-07.csv" in src100 and us100 != us
    assert kernel_tables.lookup("H200", 256, 7168, 256, 8, "bf16", 1e6) is None  # past the measured range
    res, s, _ = _run(tmp_path, "--model", "deepseek-v3", "--world-size", "8", "--tokens", "64")
    by = s.set_index("candidate")
    assert by.loc["TP8", "experts_source"].startswith("measured table h200-2026-12-03.csv")
    assert by.loc["TP8", "experts_us"] > by.loc["TP8", "floor_us"]
    assert by.loc["EP2/TP4", "experts_source"].startswith("roofline floor")


def test_the_kernel_times_job_makes_a_table_from_gpu_sweep_folders(tmp_path):
    from benchmarks import kernel_table
    from moebench.results import ResultRow, RunStore

    store = RunStore(tmp_path / "run", metadata={"device_summary": {"name": "NVIDIA H200"},
                                                 "git_revision": "abc1234", "started": "2026-12-07T01:00:00"})
    for tokens, us in ((16, 40.0), (64, 80.0)):
        store.add(ResultRow(model="m", num_experts=8, topk=2, hidden=64, intermediate=32, tokens=tokens, tp=1, dp=1,
                            ep=1, world_size=1, prepare_finalize="no-dpep", experts="triton",
                            activation_format="Standard", dtype="bf16", device="cuda", routing="uniform",
                            latency_us=us, correct=True, status="ok"))
    for allreduce in ("one-shot", "ring"):  # a simulated TP row per modeled all-reduce: one measured time
        store.add(ResultRow(model="m", num_experts=8, topk=2, hidden=64, intermediate=32, tokens=32, tp=2, dp=1,
                            ep=1, world_size=2, prepare_finalize="no-dpep", experts="triton",
                            activation_format="Standard", dtype="bf16", device="cuda", routing="uniform",
                            modeled=True, latency_us=90.0 if allreduce == "ring" else 70.0, experts_us=50.0,
                            allreduce=allreduce, correct=True, status="ok"))
    store.close()
    from moebench.report import write_exports

    write_exports(RunStore(tmp_path / "run"), ["csv"])
    out = tmp_path / "t.csv"
    assert kernel_table.main([str(tmp_path / "run"), "--out", str(out)]) == 0
    t = pd.read_csv(out)
    t = t.sort_values("intermediate", ascending=False)
    assert list(t.intermediate) == [32, 32, 16] and list(t.rows_per_expert) == [4.0, 16.0, 8.0]
    assert list(t.experts_us) == [40.0, 80.0, 50.0]
    assert set(t.revision) == {"abc1234"} and set(t.date) == {"2026-12-07"} and set(t.gpu) == {"NVIDIA H200"}
    from benchmarks.device import JOBS

    assert any(j.name == "kernel_times" for j in JOBS)


def test_nvfp4_is_a_modeled_precision_of_blackwell_targets(tmp_path):
    from moebench.comm.traffic import payload_row_bytes
    from moebench.quant import parse_quant

    q = parse_quant("nvfp4")
    assert q.scales_label == "e4m3 group[16]" and q.modeled_only and not q.weight_only
    assert q.weight_bytes(4096, 7168) == 4096 * 7168 / 2 + 4096 * 7168 // 16 + 4  # e2m1 values, e4m3 per 16, fp32
    assert payload_row_bytes(7168, 2, q) == 7168 // 2 + 7168 // 16  # dispatched rows travel in nvfp4 too
    with pytest.raises(MoebenchError, match="group"):
        parse_quant("nvfp4", group_size=32)
    res, s, run = _run(tmp_path, "--model", "deepseek-v3", "--world-size", "8", "--dtype", "nvfp4", "--target-gpu", "B200",
                       "--tokens", "64")
    rows = pd.read_csv(run / "results.csv")
    assert set(rows[rows.modeled & (rows.status == "ok")].dtype) == {"nvfp4"}
    fp8 = _run(tmp_path, "--model", "deepseek-v3", "--world-size", "8", "--target-gpu", "B200", "--tokens", "64",
               name="fp8")[1].set_index("candidate")
    nv = s.set_index("candidate")
    assert nv.loc["TP8", "weights_gib"] < 0.65 * fp8.loc["TP8", "weights_gib"]  # the experts at 4.5 bits, not 8
    assert nv.loc["TP8", "sequences"] > fp8.loc["TP8", "sequences"]
    assert_bad_input(moebench_inproc("compare", "tp-vs-ep", "--model", "deepseek-v3", "--world-size", "8", "--dtype",
                                     "nvfp4", "--target-gpu", "H200", "--out", str(tmp_path / "no")), "4-bit tensor cores")
    assert_bad_input(moebench_inproc("sweep", "--num-experts", "8", "--topk", "2", "--hidden", "64", "--intermediate",
                                     "32", "--dtype", "nvfp4", "--out", str(tmp_path / "no")), "modeled precision")


def test_num_sms_prices_deepep_normal_mode_in_compare_and_sweep(tmp_path):
    """--num-sms reaches the model of compare's and a simulated sweep's EP rows: DeepEP normal mode
    on more SMs moves its rows faster, the other transports stay; refused without a simulation."""
    args = ("--model", "deepseek-v3", "--world-size", "8", "--tokens", "4096")
    _, base, _ = _run(tmp_path, *args, name="base")
    _, more, _ = _run(tmp_path, *args, "--num-sms", "64", name="more")
    key = ["candidate", "tokens"]
    base, more = base.set_index(key), more.set_index(key)
    ht, ll = ("DP8+EP8 deepep-ht", 4096), ("DP8+EP8 deepep-ll", 4096)
    assert more.loc[ht, "dispatch_us"] < base.loc[ht, "dispatch_us"]
    assert more.loc[ll, "dispatch_us"] == pytest.approx(base.loc[ll, "dispatch_us"])
    assert_bad_input(moebench_inproc("compare", "tp-vs-ep", *args, "--num-sms", "0", "--no-check", "--out",
                                     str(tmp_path / "bad")), "--num-sms")
    shape = ("--num-experts", "8", "--topk", "2", "--hidden", "64", "--intermediate", "32", "--tokens", "2")
    assert_bad_input(moebench_inproc("sweep", *shape, "--num-sms", "64", "--out", str(tmp_path / "real")),
                     "only apply to simulated runs")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "real").exists()
