"""End-to-end multi-rank and simulated sweeps through the CLI (gloo processes on CPU)."""

import json

import pandas as pd

from test_cli import assert_bad_input, moebench_inproc

SHAPE = ["--num-experts", "10", "--topk", "3", "--hidden", "40", "--intermediate", "24"]


def _rows(folder):
    runs = list(folder.iterdir())
    assert len(runs) == 1
    return pd.read_csv(runs[0] / "results.csv"), json.loads((runs[0] / "metadata.json").read_text())


def test_ep_world_size_4_real_ranks(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "0,3,7", "--world-size", "4", "--ep", "4",
                   "--experts", "torch,batched-torch,reference", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df, meta = _rows(tmp_path)
    assert meta["mode"] == "spawn"
    ok = df[df.status == "ok"]
    assert set(ok.prepare_finalize) == {"allgather-rs", "all2all-ll"}
    assert ok.correct.all() and len(ok) == 3 * 3  # 3 token counts x (ag+torch, ag+reference, a2a+batched-torch)
    timed = ok[ok.experts != "reference"]
    assert timed.dispatch_us.notna().all() and timed.combine_us.notna().all() and timed.experts_us.notna().all()
    assert (~df.modeled).all()
    reasons = " ".join(df[df.status == "skipped"].reason)
    assert "format mismatch" in reasons and "batched-local" in reasons and "deepep-ll" in reasons
    # no-dpep keeps tokens in place: with dp 4 it is skipped with the reason, not run
    assert "needs a token exchange" in reasons


def test_ep_world_size_2_triton_rows_name_their_config(tmp_path):
    # real ranks (gloo): both Triton experts on their exchange, each row says which config it took
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "4", "--world-size", "2", "--ep", "2",
                   "--experts", "triton,batched-triton", "--reps", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df, _ = _rows(tmp_path)
    ok = df[df.status == "ok"]
    assert set(ok.experts) == {"triton", "batched-triton"} and ok.correct.all()
    assert (ok.config_source == "default heuristic").all()


def test_tp_world_size_2_all_reduce(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "5", "--world-size", "2", "--tp", "2",
                   "--experts", "torch", "--prepare-finalize", "no-dpep", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df, _ = _rows(tmp_path)
    row = df.iloc[0]
    assert row.status == "ok" and row.correct and row.allreduce_us > 0 and row.tp == 2


def test_simulated_ep_with_notice(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "4,16", "--ep", "4", "--experts", "torch,batched-torch",
                   "--routing", "hot:0.5", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "simulating" in res.stdout
    df, meta = _rows(tmp_path)
    assert meta["mode"] == "simulate" and meta["link"]["bandwidth_gbps"] > 0
    ok = df[df.status == "ok"]
    # every EP transport is a candidate, DeepEP's priced without running here: 4 pairs x 2 token counts
    assert ok.modeled.all() and ok.correct.all() and len(ok) == 8
    assert set(ok.prepare_finalize) == {"allgather-rs", "all2all-ll", "deepep-ll", "deepep-ht"}
    a2a = ok[ok.prepare_finalize == "all2all-ll"]
    assert (a2a.latency_us - (a2a.dispatch_us + a2a.experts_us + a2a.combine_us)).abs().max() < 1e-6
    assert (ok.rank_imbalance > 1.0).all()  # hot routing loads one rank more
    assert "modeled" in res.stdout


def test_simulated_ep_triton_rows_name_their_config(tmp_path):
    # the rank's share runs the Triton experts (interpreter here); each row says which config it took
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "4", "--ep", "4", "--experts", "triton,batched-triton",
                   "--reps", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df, _ = _rows(tmp_path)
    ok = df[df.status == "ok"]
    assert set(ok.experts) == {"triton", "batched-triton"} and ok.correct.all()
    assert (ok.config_source == "default heuristic").all()


def test_simulated_tp_link_override(tmp_path):
    res = moebench_inproc("sweep", *SHAPE, "--tokens", "8", "--tp", "4", "--simulate", "--link-gbps", "10",
                   "--experts", "torch", "--prepare-finalize", "no-dpep", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df, meta = _rows(tmp_path)
    row = df.iloc[0]
    assert row.modeled and row.correct and row.allreduce_us > 0
    # ring all-reduce of 8 x 40 fp32 over 4 ranks at 10 GB/s: 2*3/4 * 1280 B / 10 GB/s = 0.096 us + latency
    assert meta["link"]["bandwidth_gbps"] == 10


def test_multirank_bad_input():
    assert_bad_input(moebench_inproc("sweep", *SHAPE, "--tokens", "1", "--world-size", "3", "--tp", "2"), "does not match")
    assert_bad_input(moebench_inproc("sweep", *SHAPE, "--tokens", "1", "--link-gbps", "5"), "--simulate")
    assert_bad_input(moebench_inproc("sweep", *SHAPE, "--tokens", "1", "--ep", "4", "--simulate", "--link", "carrier-pigeon"),
                     "unknown link profile")


def test_qwen3_ep4_all_pairs(tmp_path):
    """The issue's check: qwen3-30b-a3b on 4 gloo ranks, every pair ok or skipped with a reason."""
    res = moebench_inproc("sweep", "--model", "qwen3-30b-a3b", "--world-size", "4", "--ep", "4", "--dp", "4",
                   "--prepare-finalize", "all", "--experts", "torch,batched-torch", "--tokens", "2", "--reps", "1",
                   "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    df, _ = _rows(tmp_path)
    assert set(df.status) <= {"ok", "skipped"}
    assert (df[df.status == "skipped"].reason.str.len() > 0).all()
    assert df[df.status == "ok"].correct.all() and (df.status == "ok").sum() == 2


def test_calibrate_link_on_gloo(tmp_path):
    res = moebench_inproc("env", "--calibrate-link", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert "link over 2 ranks" in info["link"] and "not a GPU link" in info["link"]
    link = json.loads((tmp_path / "results" / "calibration" / "link.json").read_text())
    assert link["device_name"] == "cpu" and link["bandwidth_gbps"] > 0 and link["latency_us"] > 0


def test_sweep_under_torchrun(tmp_path):
    """Under torchrun moebench joins the group; only rank 0 writes the run folder."""
    import os
    import subprocess
    import sys

    from test_cli import ROOT

    env = dict(os.environ, COLUMNS="200")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "moebench.cli", "sweep", *SHAPE, "--tokens", "3", "--ep", "2",
                          "--experts", "torch,batched-torch", "--out", "res"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    df, meta = _rows(tmp_path / "res")
    assert meta["mode"] == "torchrun"
    ok = df[df.status == "ok"]
    assert len(ok) == 2 and ok.correct.all() and set(ok.prepare_finalize) == {"allgather-rs", "all2all-ll"}


def test_real_ranks_run_the_models_activation(tmp_path):
    """--world-size runs the layer's own activation on real ranks (TP and EP), checked against the
    reference of that layer; fused shared experts are refused with the way out."""
    for name, layout in (("tp", ["--tp", "2"]), ("ep", ["--ep", "2"])):
        res = moebench_inproc("sweep", *SHAPE, "--tokens", "3", "--world-size", "2", *layout, "--activation", "swigluoai",
                       "--experts", "torch,batched-torch", "--out", str(tmp_path / name))
        assert res.returncode == 0, res.stderr
        df, _ = _rows(tmp_path / name)
        ok = df[df.status == "ok"]
        assert len(ok) and (ok.activation == "swigluoai").all() and ok.correct.all() and not ok.modeled.any()
    assert_bad_input(moebench_inproc("sweep", "--model", "qwen2-moe-a2.7b", "--world-size", "2", "--tp", "2",
                                     "--shared-experts", "fused", "--out", str(tmp_path / "f")), "--shared-experts separate")
