"""Communication model through the CLI: layouts past one node, the flip factor, measured fits, bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import pandas as pd
import torch

from test_cli import ROOT, assert_bad_input, moebench, moebench_inproc

SHAPE = ["--num-experts", "64", "--topk", "4", "--hidden", "128", "--intermediate", "64"]


def _benchmarks_here(*args):
    """`python -m benchmarks ARGS` (the device scripts' runner) in this process, from the repository root."""
    import benchmarks.__main__ as runner
    from test_cli import run_here

    return run_here(lambda: runner.main(list(args)), ["python -m benchmarks", *args], cwd=ROOT)


def _summary(out_dir):
    run = next(p for p in out_dir.iterdir() if p.is_dir())
    return pd.read_csv(run / "compare.csv"), pd.read_csv(run / "results.csv"), run


def test_compare_past_one_node(tmp_path):
    """32 ranks in nodes of 8: TP is one TP8 replica per node on a quarter of the batch (or TP16 over two
    nodes, its all-reduce over RDMA), DP+EP spans all 32."""
    summaries = {}
    for rdma in ("rdma-400g", "rdma-800g"):
        out = tmp_path / rdma
        res = moebench_inproc("compare", "tp-vs-ep", *SHAPE, "--world-size", "32", "--tokens", "32,1024", "--rdma", rdma,
                       "--experts", "torch,batched-torch", "--no-check", "--out", str(out))
        assert res.returncode == 0, res.stderr
        assert "TP8x4" in res.stdout and "DP32+EP32" in res.stdout and "one TP replica per node" in res.stdout
        summary, rows, run = _summary(out)
        summaries[rdma] = summary
        assert {"TP8x4", "DP32+EP32", "TP16x2", "TP8+EP8x4"} <= set(summary.layout) and set(summary.tokens) == {32, 1024}
        tp = summary[summary.layout == "TP8x4"].set_index("tokens")
        # the TP8 replica of a 1024-token batch computes 256 tokens: its row is the 256-token TP8 row
        tp_rows = rows[(rows.tp == 8) & (rows.ep == 1) & rows.modeled & (rows.status == "ok")]
        assert set(tp_rows.tokens) == {8, 256}
        assert tp.loc[1024, "latency_us"] in set(tp_rows[tp_rows.tokens == 256].latency_us)
        assert (tp.replicas == 4).all() and (summary[summary.layout == "TP16x2"].replicas == 2).all()
        elig = summary[summary.eligible]
        assert elig.comm_flip_factor.notna().all() and (elig.comm_flip_factor > 0).all()
        text = (run / "compare.md").read_text()
        assert ("wins" in text) or ("too close to call" in text)
        # the device script's table of flip factors reads the run folder
        table = _benchmarks_here("flip_table", str(run))
        assert table.returncode == 0, table.stderr
        assert "| 32 |" in table.stdout and "| 1024 |" in table.stdout and "flip x runner-up" in table.stdout
    slow, fast = (summaries[k].set_index(["tokens", "candidate"]) for k in ("rdma-400g", "rdma-800g"))
    ep = [(t, "DP32+EP32 deepep-ll") for t in (32, 1024)]
    assert (fast.loc[ep, "comm_us"] < slow.loc[ep, "comm_us"]).all()  # DP32+EP32 crosses nodes over RDMA
    across = [(t, "TP16x2") for t in (32, 1024)]
    assert (fast.loc[across, "comm_us"] <= slow.loc[across, "comm_us"]).all()  # so does TP16's all-reduce
    tp = [(t, "TP8x4") for t in (32, 1024)]
    assert np.allclose(fast.loc[tp, "comm_us"], slow.loc[tp, "comm_us"])  # TP8 stays inside a node


def test_compare_uses_a_measured_fit_and_says_so(tmp_path):
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"name": "measured-nccl-8ranks", "bandwidth_gbps": 300.0, "latency_us": 20.0,
                                "device_name": "H200", "world_size": 8, "measured_at": "2026-12-01T10:00:00",
                                "transports": {"nccl-all-reduce": {"alpha_us": 250.0, "gbps": 100.0, "worst_ratio": 1.1}}}))
    env_file = os.environ.get("MOEBENCH_LINK_FILE")
    os.environ["MOEBENCH_LINK_FILE"] = str(link)
    try:
        res = moebench_inproc("compare", "tp-vs-ep", *SHAPE, "--world-size", "4", "--tokens", "8", "--experts", "torch",
                       "--no-check", "--out", str(tmp_path / "res"))
        link.write_text('{"device_name": "H200", "transports": {"nccl-all-reduce": {"alpha_us": -1}}}')
        bad = moebench_inproc("compare", "tp-vs-ep", *SHAPE, "--world-size", "4", "--tokens", "8", "--no-check",
                       "--out", str(tmp_path / "res2"))
    finally:
        if env_file is None:
            os.environ.pop("MOEBENCH_LINK_FILE")
        else:
            os.environ["MOEBENCH_LINK_FILE"] = env_file
    assert res.returncode == 0, res.stderr
    assert "measured on H200 over 8 ranks" in res.stdout
    summary, rows, _ = _summary(tmp_path / "res")
    nccl = rows[(rows.tp == 4) & (rows.allreduce == "nccl") & (rows.status == "ok")].iloc[0]
    assert nccl.allreduce_us > 250.0 and "measured" in nccl.x_comm_model
    # the custom all-reduce has no measurement: its published fit, and the faster one is the answer
    tp = summary[summary.layout == "TP4"].iloc[0]
    assert tp.allreduce == "custom" and tp.allreduce_us < 250.0
    assert_bad_input(bad, "link measurement")


def test_sweep_simulated_ep16(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "4", "--ep", "16", "--simulate", "--experts", "batched-torch",
                   "--prepare-finalize", "all2all-ll", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    run = next(tmp_path.iterdir())
    df = pd.read_csv(run / "results.csv")
    row = df[df.status == "ok"].iloc[0]
    assert row.modeled and row.world_size == 16
    assert row.x_comm_lo_us <= row.dispatch_us + row.combine_us <= row.x_comm_hi_us
    assert "rdma-400g" in row.reason and "8 GPUs" in row.reason


def test_bad_cluster_input(tmp_path):
    base = ["compare", "tp-vs-ep", *SHAPE, "--tokens", "4", "--no-check", "--out", str(tmp_path)]
    assert_bad_input(moebench_inproc(*base, "--world-size", "12"), "not a multiple of --gpus-per-node 8")
    assert_bad_input(moebench_inproc(*base, "--world-size", "8", "--link", "nvlink9"), "unknown link profile")
    assert_bad_input(moebench_inproc(*base, "--world-size", "8", "--rdma", "rdma-9000g"), "unknown RDMA link")
    assert_bad_input(moebench_inproc(*base, "--world-size", "8", "--gpus-per-node", "0"), "--gpus-per-node")
    sweep = ["sweep", *SHAPE, "--tokens", "4", "--simulate", "--out", str(tmp_path)]
    assert_bad_input(moebench_inproc(*sweep, "--tp", "16"), "TP stays inside a node")
    assert_bad_input(moebench_inproc(*sweep, "--ep", "12"), "not a multiple of --gpus-per-node")


def test_comm_answers_a_users_question():
    res = moebench_inproc("comm", "--transport", "nccl-all-reduce", "--op", "all-reduce", "--gpu", "H200",
                          "--world-size", "8", "--bytes", "4e6", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert 40 < d["time_us"] < 70 and d["nearest"] and d["nearest"][0]["ratio"] > 0
    text = moebench_inproc("comm", "--transport", "deepep-ll", "--op", "dispatch", "--gpu", "H200", "--world-size",
                           "32", "--tokens", "128", "--hidden", "7168", "--topk", "8", "--num-experts", "256",
                           "--dtype", "fp8")
    assert text.returncode == 0, text.stderr
    assert "us (modeled)" in text.stdout and "RDMA" in text.stdout and "nearest published points" in text.stdout


def test_comm_bad_input(tmp_path):
    base = ["comm", "--gpu", "H100", "--world-size", "8"]
    assert_bad_input(moebench_inproc(*base, "--transport", "warp", "--op", "all-reduce", "--bytes", "1e6"), "warp")
    assert_bad_input(moebench_inproc(*base, "--transport", "deepep-ll", "--op", "all-reduce", "--bytes", "1e6"),
                     "has no 'all-reduce'")
    assert_bad_input(moebench_inproc(*base, "--transport", "nccl-all-reduce", "--op", "all-reduce", "--bytes", "0"),
                     "--bytes must be a positive")
    assert_bad_input(moebench_inproc("comm", "--transport", "nccl-all-reduce", "--op", "all-reduce", "--world-size",
                                     "12", "--bytes", "1e6"), "not a multiple of --gpus-per-node")
    base = ["compare", "tp-vs-ep", *SHAPE, "--tokens", "4", "--no-check", "--world-size", "8"]
    for bad in ("nan", "inf", "-1"):
        out = tmp_path / bad
        assert_bad_input(moebench_inproc(*base, "--link-gbps", bad, "--out", str(out)), "--link-gbps")
        assert not out.exists()


def test_presets_answer_on_a_cpu_in_their_shipped_precision(tmp_path):
    """DeepSeek-V3 (fp8 block) and gpt-oss-120b (mxfp4) answer on a CPU with --no-check, with DeepEP
    low-latency / normal and the custom all-reduce among the modeled candidates."""
    from helpers import WorkCounter

    for model, world in (("deepseek-v3", "8"), ("gpt-oss-120b", "32"), ("mixtral-8x22b", "32")):
        out = tmp_path / model
        with WorkCounter() as work:  # modeled: no weights of the model's size are made, nothing of its size runs
            res = moebench_inproc("compare", "tp-vs-ep", "--model", model, "--world-size", world, "--device", "cpu",
                                  "--tokens", "1,256,4096", "--no-check", "--out", str(out))
        assert res.returncode == 0, res.stderr
        # the biggest tensor is the CPU ceilings' 128 MiB calibration buffer; the layers' weights of
        # these models are 1.5 GB (gpt-oss-120b, mxfp4) to 11 GB (deepseek-v3, fp8)
        assert work.largest_bytes <= 128 * 2**20, (model, work.largest_bytes)
        summary, rows, run = _summary(out)
        assert set(summary.tokens) == {1, 256, 4096} and summary.latency_us.notna().all()
        ok = rows[(rows.status == "ok") & rows.modeled]
        assert {"deepep-ll", "deepep-ht"} <= set(ok.prepare_finalize)
        assert {"nccl", "custom"} <= set(ok.allreduce.dropna())
        assert (ok[ok.prepare_finalize.str.startswith("deepep")].x_comm_not_run != "").all()  # said so
        precision = {"deepseek-v3": "fp8_w8a8", "gpt-oss-120b": "mxfp4"}.get(model, "bf16")
        assert precision in set(ok.dtype) and "wins" in (run / "compare.md").read_text()
        if model == "mixtral-8x22b":  # 8 experts on 32 ranks: one EP8 group per replica, as TP8 per node
            assert {"TP8x4", "DP8+EP8x4", "TP8+EP8x4"} <= set(summary.layout)
            assert (summary[summary.layout.isin(["TP8x4", "DP8+EP8x4"])].replicas == 4).all()


def test_simulated_sweep_where_nothing_runs_is_refused_before_any_folder(tmp_path):
    out = tmp_path / "out"
    assert_bad_input(moebench_inproc("sweep", *SHAPE, "--tokens", "1", "--ep", "2", "--simulate", "--experts", "aiter",
                                     "--out", str(out)), "no pair of --experts and --prepare-finalize can run here")
    assert not out.exists()


def test_modeled_rows_gbps_is_their_bytes_over_their_time(tmp_path):
    """A modeled compare row's dispatch (and combine) GB/s is its dispatch bytes over its dispatch
    time, both in the model's count (the busiest rank's bytes on its links), and says so."""
    res = moebench_inproc("compare", "tp-vs-ep", *SHAPE, "--world-size", "8", "--tokens", "64",
                          "--experts", "torch,batched-torch", "--no-check", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    _, rows, _ = _summary(tmp_path)
    ok = rows[rows.modeled & (rows.status == "ok")]
    seen = set()
    for pf in ("deepep-ll", "deepep-ht", "all2all-ll", "allgather-rs"):
        mine = ok[ok.prepare_finalize == pf]
        assert len(mine), f"no modeled row of {pf}"
        for _, r in mine.iterrows():
            for name in ("dispatch", "combine"):
                nbytes, us, gbps = r[f"x_{name}_bytes"], r[f"{name}_us"], r[f"x_{name}_gbps"]
                assert nbytes > 0 and us > 0
                assert gbps == pytest.approx(nbytes / (us * 1e3), rel=1e-9)
            assert r.x_comm_count == "link"
            seen.add(pf)
    # the bytes are the ones the model priced: dispatch + combine make up the row's comm bytes
    for _, r in ok[ok.prepare_finalize.isin(sorted(seen))].iterrows():
        assert r.x_dispatch_bytes + r.x_combine_bytes == pytest.approx(r.x_comm_bytes, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("world", [32, 64])
def test_compare_deepseek_v3_routes_node_limited(tmp_path, world):
    """DeepSeek-V3's router keeps 4 of 8 expert groups per token; on 32 and 64 GPUs (nodes of 8)
    compare's EP rows route that way, and DeepEP normal's RDMA rows (one per (token, node)) fall
    against the same batch routed over every node."""
    from moebench.comm.traffic import ep_link_rows
    from moebench.layout import ParallelLayout
    from moebench.routing import make_routing

    res = moebench_inproc("compare", "tp-vs-ep", "--model", "deepseek-v3", "--world-size", str(world), "--tokens", "4096",
                          "--no-check", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    _, rows, _ = _summary(tmp_path)
    ht = rows[(rows.prepare_finalize == "deepep-ht") & (rows.status == "ok") & (rows.ep == world)].iloc[0]
    layout = ParallelLayout(dp=world, enable_ep=True)
    m = 4096  # compare's batch is the whole batch, routed with seed = tokens
    # fp8 dispatch row with its 1x128 scales and 12 B of routing per top-k slot + bf16 combine row
    row_bytes = (7168 + 4 * 56 + 8 * 12) + 2 * 7168
    reach = {}
    for name, groups in (("limited", (8, 4)), ("every node", None)):
        _, ids = make_routing("uniform", m, 256, 8, seed=m, groups=groups)
        node_of = layout.expert_owner(256)[ids.long()] // 8
        reach[name] = torch.zeros(m, world // 8).scatter_(1, node_of, 1).sum(1)
        reach[name + " rdma"] = float(ep_link_rows(ids, layout, 256, 8, "node").rdma.max() * row_bytes)
    assert reach["limited"].max() <= 4 and reach["limited"].mean() < reach["every node"].mean()
    assert ht.x_comm_rdma_bytes == pytest.approx(reach["limited rdma"], rel=1e-9)
    assert reach["limited rdma"] < reach["every node rdma"] / (1.05 if world == 32 else 1.2)


def test_comm_lines_fit_100_columns_and_name_their_points():
    """`comm` keeps to 100 columns, names every point behind a figure (--json), says "extrapolated"
    where no point of the size class exists, routes node-limited with --max-nodes and prices
    DeepEP normal at --num-sms."""
    ask = ["comm", "--transport", "deepep-ht", "--op", "dispatch", "--gpu", "H200", "--tokens", "4096", "--hidden",
           "7168", "--topk", "8", "--num-experts", "256", "--dtype", "fp8"]
    text = moebench_inproc(*ask, "--world-size", "64")
    assert text.returncode == 0, text.stderr
    assert max(len(line) for line in text.stdout.splitlines()) <= 100, text.stdout
    assert "us (modeled) over 64 x H200" in text.stdout and "published points behind it" in text.stdout
    runs = {}
    for world, extra in (("64", ()), ("64", ("--max-nodes", "4")), ("8", ()), ("8", ("--num-sms", "64"))):
        res = moebench_inproc(*ask, "--world-size", world, *extra, "--json")
        assert res.returncode == 0, res.stderr
        runs[(world, *extra[:1])] = json.loads(res.stdout)
    plain, limited = runs[("64",)], runs[("64", "--max-nodes")]
    assert limited["rdma_bytes"] < plain["rdma_bytes"] / 1.2 and limited["time_us"] < plain["time_us"]
    assert "inside 4 of 8 nodes" in limited["bytes_how"]
    box, sms = runs[("8",)], runs[("8", "--num-sms")]  # inside a node: NVLink-bound, as the SMs drive it
    assert sms["time_us"] < box["time_us"] / 1.1 and "64 SMs" in sms["provenance"]["sms"]
    assert "20 SMs" in box["provenance"]["sms"]
    lines = {(p["file"], p["line"]) for p in plain["points"]}
    assert len(lines) == len(plain["points"]) >= 5 and all(p["source"] for p in plain["points"])
    # the fixed cost is borrowed from DeepEP LL: its points stand behind the figure too
    assert any(p["point"].startswith("deepep-ll") for p in plain["points"])
    two = json.loads(moebench_inproc("comm", "--transport", "deepep-ll", "--op", "dispatch", "--gpu", "H200",
                                     "--world-size", "2", "--bytes", "1e6", "--json").stdout)
    assert any("size class (2 ranks)" in e for e in two["extrapolated"])
    assert_bad_input(moebench_inproc(*ask, "--world-size", "64", "--num-sms", "0"), "--num-sms")
    assert_bad_input(moebench_inproc("comm", "--transport", "nccl-all-reduce", "--op", "all-reduce", "--gpu",
                                     "H200", "--world-size", "8", "--bytes", "1e6", "--max-nodes", "2"), "--max-nodes")
