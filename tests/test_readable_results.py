"""What a newcomer reads, end to end through the CLI: a report that keeps measured and modeled rows
(and rows of different devices) in cells of their own and leaves compare's checks out, rows whose
names say which all-reduce they assume, config listings a reader can tell apart at 80 columns, and
refusals of shapes and checkpoints that come before any work, with the reason and what to do."""

import json
import re
from pathlib import Path

import pytest
import torch

from test_cli import assert_bad_input, moebench_inproc

SHAPE = ["--num-experts", "8", "--topk", "2", "--hidden", "64", "--intermediate", "64"]


def _rows(folder):
    return [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines() if line.strip()]


def _md_table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [x for x in text.splitlines() if x.startswith("|")]
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in lines]
    return cells[0], cells[2:]


# -- report: one source per cell, compare's checks left out -------------------------------------

def test_report_keeps_measured_modeled_and_devices_apart_and_leaves_compare_checks_out(tmp_path):
    from moebench.report import layout_label

    runs = tmp_path / "runs"
    env = {"COLUMNS": "200"}
    res = moebench_inproc("compare", "tp-vs-ep", *SHAPE, "--tokens", "4", "--world-size", "2", "--out", str(runs),
                          env=env)
    assert res.returncode == 0, res.stderr
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "4", "--tp", "2", "--dtype", "bf16", "--experts", "torch",
                          "--prepare-finalize", "no-dpep", "--reps", "1", "--out", str(runs), env=env)
    assert res.returncode == 0, res.stderr
    compare_dir = next(p for p in runs.iterdir() if "-compare-" in p.name)
    sweep_dir = next(p for p in runs.iterdir() if "-sweep-" in p.name)
    checks = [r for r in _rows(compare_dir) if not r["modeled"] and r["status"] == "ok"]
    assert checks and all(r["check_only"] for r in checks)  # the real-rank check at a stand-in shape

    res = moebench_inproc("report", str(runs), "--out", str(tmp_path / "report.md"), env=env)
    assert res.returncode == 0, res.stderr
    title = res.stdout.splitlines()[0]
    assert "cpu" not in title, title  # the compare's times speak of H200s, the sweep's of this CPU's experts
    assert "more than one run" not in res.stdout
    assert f"left out {len(checks)} check-only rows" in " ".join(res.stdout.split())
    head, body = _md_table((tmp_path / "report.md").read_text())
    assert "shape" not in head and "I=32" not in (tmp_path / "report.md").read_text()  # no check row is a result
    assert head[:2] == ["device", "tokens"], head
    assert sorted(r[0] for r in body) == ["H200 (modeled)", "cpu + modeled comm"]
    # every cell holds the rows of one source: its value is one row of that source's folder
    source = {"H200 (modeled)": [r for r in _rows(compare_dir) if r["modeled"]],
              "cpu + modeled comm": _rows(sweep_dir)}
    filled = 0
    for rec in body:
        for name, cell in zip(head[3:], rec[3:]):
            if not cell:
                continue
            filled += 1
            # "TP2 no-dpep+torch (custom AR)", "EP2 (dp1xtp2) no-dpep+torch (custom AR)": layout, pair, all-reduce
            mine = [r for r in source[rec[0]] if r["status"] == "ok" and
                    layout_label(r["tp"], r["dp"], r["ep"], r["world_size"]) + " " + f"{r['prepare_finalize']}+"
                    f"{r['experts']}" + (f" ({r['allreduce']} AR)" if r["allreduce"] else "") == name]
            assert [f"{r['latency_us']:.1f}" for r in mine] == [cell.strip("*")], (rec[0], name, cell)
    assert filled >= 4


def test_report_keeps_rows_of_two_gpus_apart(tmp_path):
    """Run folders measured on two GPU models (rows say `cuda`; their metadata names the GPU)."""
    from moebench.results import ResultRow, RunStore

    for gpu, us in (("NVIDIA H100 80GB HBM3", 30.0), ("NVIDIA H200", 20.0)):
        store = RunStore(tmp_path / "runs" / gpu.replace(" ", "_"), metadata={
            "command": "sweep", "device": "cuda", "device_summary": {"device": "cuda", "name": gpu}})
        store.add(ResultRow(model="m", num_experts=8, topk=2, hidden=64, intermediate=32, tokens=16, tp=1, dp=1, ep=1,
                            world_size=1, prepare_finalize="no-dpep", experts="triton", activation_format="Standard",
                            dtype="bf16", device="cuda", routing="uniform", latency_us=us, correct=True))
    res = moebench_inproc("report", str(tmp_path / "runs"), "--out", str(tmp_path / "r.md"), env={"COLUMNS": "200"})
    assert res.returncode == 0, res.stderr
    assert "more than one run" not in res.stdout
    head, body = _md_table((tmp_path / "r.md").read_text())
    assert head[0] == "device" and sorted((r[0], r[-1]) for r in body) == [
        ("NVIDIA H100 80GB HBM3", "**30.0**"), ("NVIDIA H200", "**20.0**")]


# -- rows a reader can tell apart ----------------------------------------------------------------

def test_tp_sweep_names_the_all_reduce_and_results_md_names_another_runner_up(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "4,16", "--tp", "2", "--experts", "torch",
                          "--prepare-finalize", "no-dpep", "--reps", "1", "--out", str(tmp_path),
                          env={"COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    pairs = re.findall(r"^\s*(\d+)\s+(no-dpep\+torch\S*(?: \(\w+ AR\))?)", res.stdout, re.M)
    assert sorted(pairs) == sorted((t, f"no-dpep+torch ({ar} AR)") for t in ("4", "16") for ar in ("nccl", "custom"))
    run = next(tmp_path.iterdir())
    md = (run / "results.md").read_text()
    head, body = _md_table(md.split("## Fastest correct pair per token count", 1)[1].split("##", 1)[0])
    fastest, nxt = head.index("fastest pair"), head.index("next best")
    assert len(body) == 2
    for rec in body:
        assert rec[nxt].rsplit(" (", 1)[0] != rec[fastest], rec  # never the winner as its own runner-up
        assert {rec[fastest], rec[nxt].rsplit(" (", 1)[0]} == {"no-dpep+torch (nccl AR)", "no-dpep+torch (custom AR)"}


def test_configs_list_shows_the_gemm_and_coverage_cuts_no_cell():
    res = moebench_inproc("configs", "list", env={"COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    rule = next(i for i, x in enumerate(lines) if x.startswith("--"))
    assert "GEMM" in lines[rule - 1].split(), lines[rule - 1]
    table = [x for x in lines[rule + 1:] if x.startswith("[")]  # a row per file: its folder, [n]
    assert len(table) == len(set(table)), "rows a reader cannot tell apart"
    assert {x.split()[-4] for x in table} >= {"1,2", "2"}  # moebench's _down files show as GEMM2's
    assert max(map(len, lines)) <= 80

    res = moebench_inproc("configs", "coverage", env={"COLUMNS": "80"})
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout and max(map(len, res.stdout.splitlines())) <= 80
    folder = re.search(r"found in: \[1\] (\S+)", res.stdout)
    assert folder and Path(folder.group(1)).is_dir(), res.stdout  # the folder whole
    assert re.search(r"^mixtral-8x7b\s+tp8\s+8\s+1792\s+\d+ of 18\s+\[1\]$", res.stdout, re.M), res.stdout


# -- refusals before any work -------------------------------------------------------------------

def _config(path, **fields):
    cfg = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
           "intermediate_size": 32}
    cfg.update(fields)
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("fields,needles", [
    ({"num_local_experts": 0}, ["num_local_experts is 0", "no routed experts"]),
    ({"hidden_size": 1e12}, ["hidden_size must be a positive integer", "1000000000000"]),
    ({"hidden_size": 10 ** 12}, ["needs about", "GiB", "weights"]),
])
def test_bad_config_json_is_refused_in_one_line_before_a_run_folder(tmp_path, fields, needles):
    out = tmp_path / "out"
    res = moebench_inproc("sweep", "--model", _config(tmp_path / "config.json", **fields), "--tokens", "1",
                          "--out", str(out))
    assert_bad_input(res, *needles)
    assert not out.exists()


def test_a_shape_that_cannot_fit_is_refused_with_its_size_before_a_run_folder(tmp_path):
    out = tmp_path / "out"
    res = moebench_inproc("sweep", "--num-experts", "8", "--topk", "2", "--hidden", "1000000000", "--intermediate",
                          "16", "--tokens", "1", "--out", str(out))
    assert_bad_input(res, "needs about", "weights", "GiB")
    assert not out.exists()


@pytest.mark.parametrize("fields", [
    {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}},
    {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}},
])
def test_quantised_checkpoint_on_a_cpu_suggests_bf16_which_runs(tmp_path, monkeypatch, fields):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a user's CPU: no Triton kernels
    cfg = _config(tmp_path / "config.json", **fields)
    out = tmp_path / "out"
    res = moebench_inproc("sweep", "--model", cfg, "--tokens", "1", "--out", str(out))
    assert_bad_input(res, "--dtype bf16", "on cpu")
    assert "format mismatch" not in res.stderr
    assert not out.exists()
    res = moebench_inproc("sweep", "--model", cfg, "--tokens", "1", "--dtype", "bf16", "--experts", "torch",
                          "--prepare-finalize", "no-dpep", "--reps", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    ok = [r for r in _rows(next(out.iterdir())) if r["status"] == "ok"]
    assert ok and all(r["correct"] and r["dtype"] == "bf16" for r in ok)


def test_the_memory_check_compare_shares_refuses_weights_the_target_gpu_cannot_hold():
    """`sweep.check_fits_for` is the one memory check: with the experts time modeled on a target
    GPU it allocates nothing and weighs the busiest rank's weights against that GPU's memory."""
    from moebench.bench.hardware import datasheet_ceilings
    from moebench.errors import MoebenchError
    from moebench.layout import ParallelLayout
    from moebench.models import custom_shape
    from moebench.sweep import SweepSpec, check_fits_for, simulated_spec

    h200 = datasheet_ceilings("H200")
    big = SweepSpec(shape=custom_shape(8, 2, 1_000_000, 100_000), tokens=[16], layout=ParallelLayout(tp=8),
                    dtype=torch.bfloat16, tokens_are_global=True)
    with pytest.raises(MoebenchError, match=r"need 600 GB of weights per rank .* one H200 holds 141 GB"):
        check_fits_for(simulated_spec(big, h200), "simulate")
    fits = SweepSpec(shape=custom_shape(8, 2, 4096, 14336), tokens=[16], layout=ParallelLayout(tp=8),
                     dtype=torch.bfloat16, tokens_are_global=True)
    check_fits_for(simulated_spec(fits, h200), "simulate")  # a Mixtral-sized TP8 shard: 0.35 GB a rank
