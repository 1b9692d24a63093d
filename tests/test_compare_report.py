"""compare tp-vs-ep and report, end to end through the CLI; the PNGs are opened and checked."""


import numpy as np
import pytest
import pandas as pd
from matplotlib import image as mpimg

from moebench.compare import summarize
from moebench.results import ResultRow
from test_cli import ROOT, assert_bad_input, moebench, moebench_inproc


def _png_has_content(path, min_w=600, min_h=300):
    img = mpimg.imread(path)
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h, (w, h)
    rgb = img[..., :3]
    # not blank: many distinct colours and a good share of non-white pixels
    assert len(np.unique((rgb * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 20
    assert (rgb.mean(axis=-1) < 0.95).mean() > 0.02


def test_compare_world_size_4_qwen3_routing(tmp_path):
    # Qwen3-30B-A3B's 128 experts and top-8 with small hidden sizes: the same TP4 / EP4 paths on 4
    # real gloo ranks in ~25 s on a 2-core machine instead of ~260 s at the model's own sizes
    plot = tmp_path / "cmp.png"
    res = moebench_inproc("compare", "tp-vs-ep", "--num-experts", "128", "--topk", "8", "--hidden", "256", "--intermediate",
                   "96", "--world-size", "4", "--tokens", "1,16", "--experts", "torch,batched-torch",
                   "--out", str(tmp_path / "res"), "--plot", str(plot))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "roofline floor (datasheet), not measured" in out and "real gloo ranks" in out
    assert "TP4" in out and "DP4+EP4" in out and "launch flags:" in out
    assert "wins from" in out or "wins at every" in out or "too close to call on modeled communication" in out
    run = next((tmp_path / "res").iterdir())
    summary = pd.read_csv(run / "compare.csv")
    # the layouts engines run on 4 GPUs: TP, TP+EP over the all-reduce, EP x TP inside the experts, DP+EP per transport
    assert set(summary.layout) == {"TP4", "TP4+EP4", "EP2/TP2", "DP4+EP4"} and set(summary.tokens) == {1, 16}
    assert set(summary[summary.layout == "DP4+EP4"].prepare_finalize) == {"allgather-rs", "all2all-ll", "deepep-ll",
                                                                          "deepep-ht"}
    assert summary.groupby("tokens").winner.sum().eq(1).all()
    assert not summary[summary.winner].prepare_finalize.eq("all2all-ll").any()  # no engine ships it: never the answer
    elig = summary[summary.eligible]
    assert (elig.comm_flip_factor > 0).all()
    assert (elig.comm_lo_us <= elig.comm_us + 1e-9).all() and (elig.comm_hi_us >= elig.comm_us - 1e-9).all()
    assert np.allclose(elig.latency_lo_us, elig.experts_us + elig.comm_lo_us + elig.latency_us - elig.latency_serial_us)
    ran = summary[summary.checked_on_ranks.notna()]
    assert ran.checked_on_ranks.astype(bool).all()  # every best pair run on real gloo ranks was correct there
    assert {"TP4", "DP4+EP4"} <= set(ran.layout)
    tp = summary[summary.layout == "TP4"]
    assert tp.allreduce_us.notna().all() and tp.dispatch_us.isna().all()
    rows = pd.read_csv(run / "results.csv")
    assert rows[rows.modeled].shape[0] > 0 and rows[~rows.modeled].shape[0] > 0
    # every number in the summary traces back to a modeled row (before any micro-batch overlap)
    for _, s in summary.iterrows():
        match = rows[(rows.tokens == s.tokens) & rows.modeled & (rows.prepare_finalize == s.prepare_finalize)
                     & (rows.experts == s.experts) & np.isclose(rows.latency_us, s.latency_serial_us)]
        assert len(match) >= 1
    _png_has_content(plot)
    assert "crossover" in (run / "compare.md").read_text()


def test_compare_bad_input():
    assert_bad_input(moebench_inproc("compare", "tp-vs-ep", "--model", "mixtral-8x7b"), "--world-size")
    assert_bad_input(moebench_inproc("compare", "tp-vs-ep", "--model", "mixtral-8x7b", "--world-size", "4", "--tp", "4"),
                     "--world-size N")
    assert_bad_input(moebench_inproc("compare", "tp-vs-ep", "--model", "mixtral-8x7b", "--world-size", "12"),
                     "not a multiple of --gpus-per-node")
    assert_bad_input(moebench_inproc("compare", "tp-vs-ep", "--model", "mixtral-8x7b", "--world-size", "2",
                              "--target-gpu", "toaster"), "datasheet")


def _row(tokens, ep, world, lat, exp, comm, modeled=True, correct=True):
    r = ResultRow(model="m", num_experts=8, topk=2, hidden=8, intermediate=8, tokens=tokens, tp=1 if ep > 1 else world,
                  dp=world if ep > 1 else 1, ep=ep, world_size=world,
                  prepare_finalize="all2all-ll" if ep > 1 else "no-dpep", experts="x", activation_format="f",
                  dtype="bf16", device="cpu", routing="uniform", modeled=modeled, latency_us=lat, correct=correct)
    r.experts_us = exp
    if ep > 1:
        r.dispatch_us = r.combine_us = comm / 2
    else:
        r.allreduce_us = comm
    return r


def test_summarize_crossover_and_reason():
    rows = [_row(1, 1, 4, 10, 5, 5), _row(1, 4, 4, 20, 10, 10),
            _row(64, 1, 4, 100, 90, 10), _row(64, 4, 4, 60, 30, 30),
            _row(512, 1, 4, 300, 290, 10), _row(512, 4, 4, 120, 80, 40),
            _row(512, 4, 4, 50, 20, 30, correct=False)]  # a wrong row never wins
    for r in rows:
        if r.ep > 1:
            r.prepare_finalize = "allgather-rs"  # a transport engines ship
    res = summarize(rows, 4)
    assert res.crossover == 64
    assert res.recommendation.startswith("DP4+EP4 over allgather-rs wins from 64 tokens")
    assert "3.0x less per rank" in res.recommendation
    w = res.summary[res.summary.winner]
    assert w.set_index("tokens").layout.to_dict() == {1: "TP4", 64: "DP4+EP4", 512: "DP4+EP4"}
    assert res.summary[(res.summary.tokens == 512) & (res.summary.layout == "DP4+EP4")].latency_us.item() == 120
    # one-sided factors from the table's own columns: the loser's communication alone, the winner's alone
    s = res.summary.set_index(["tokens", "layout"])
    assert s.loc[(64, "TP4"), "comm_flip_factor"] == float("inf")  # its experts alone (90) exceed the winner's 60
    assert s.loc[(64, "DP4+EP4"), "comm_flip_factor"] == pytest.approx((100 - 30) / 30)
    assert s.loc[(1, "TP4"), "comm_flip_factor"] == pytest.approx((20 - 5) / 5)
    assert s.loc[(512, "TP4"), "comm_flip_factor"] == float("inf")
    assert s.loc[(1, "TP4"), "comm_flip_by"] == "all-reduce" and s.loc[(64, "DP4+EP4"), "comm_flip_by"] == "dispatch+combine"


def test_report_merges_and_highlights(tmp_path):
    args = ["--num-experts", "6", "--topk", "2", "--hidden", "24", "--intermediate", "16"]
    for toks, exp in (("1,4", "torch"), ("1,4", "batched-torch")):
        r = moebench_inproc("sweep", *args, "--tokens", toks, "--experts", exp, "--out", str(tmp_path / "runs"))
        assert r.returncode == 0, r.stderr
    folders = sorted((tmp_path / "runs").iterdir())
    html = tmp_path / "r.html"
    plot = tmp_path / "r.png"
    res = moebench_inproc("report", *map(str, folders), "--format", "html", "--out", str(html), "--plot", str(plot))
    assert res.returncode == 0, res.stderr
    text = html.read_text()
    assert "data:image/png;base64," in text and "#c6efce" in text
    # series named by what differs (the pair); what they share is in the title
    assert ">no-dpep+torch</th>" in text and ">batched-local+batched-torch</th>" in text
    assert "<h1>moebench report: custom (E=6, topk=2, H=24, I=16), 1 rank" in text
    _png_has_content(plot, min_w=400, min_h=250)
    md = tmp_path / "r.md"
    res = moebench_inproc("report", *map(str, folders), "--format", "md", "--out", str(md))
    assert res.returncode == 0
    lines = md.read_text().splitlines()
    body = [x for x in lines[4:] if x.startswith("| ")]
    assert len(body) == 2 and all(x.count("**") == 2 for x in body)  # one fastest per token count
    assert "imbalance" in lines[2]
    res = moebench_inproc("report", str(tmp_path / "nothing-here"))
    assert_bad_input(res, "does not exist")


def test_report_keeps_precisions_apart():
    """bf16 and two fp8 schemes of the same pair are three rows of the pivot, not one."""
    from moebench.report import pivot
    from moebench.results import rows_to_frame

    def row(dtype, quant, us):
        return ResultRow(model="m", num_experts=8, topk=2, hidden=64, intermediate=32, tokens=8, tp=1, dp=1, ep=1,
                         world_size=1, prepare_finalize="no-dpep", experts="triton", activation_format="Standard",
                         dtype=dtype, device="cuda", routing="uniform", latency_us=us, correct=True, quant=quant)

    table, fastest = pivot(rows_to_frame([row("bf16", "", 10.0), row("fp8_w8a8", "block[128,128]", 7.0),
                                          row("fp8_w8a8", "per-token", 6.0)]))
    assert sorted(table.dtype) == ["bf16", "fp8_w8a8 block[128,128]", "fp8_w8a8 per-token"]
    assert sorted(table["no-dpep+triton"]) == [6.0, 7.0, 10.0]


def test_default_job_on_a_cpu_is_the_modeled_answer(tmp_path):
    """`bash setup.sh` without arguments runs `moebench demo`: on a CPU the modeled TP-vs-EP answer for
    H200s with the check of what ran here, then the next commands."""
    res = moebench_inproc("demo", "--model", "mixtral-8x7b", "--world-size", "2", "--tokens", "1,64",
                          "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "no GPU here" in res.stdout and "modeled" in res.stdout and "next:" in res.stdout
    run = next(tmp_path.iterdir())
    summary = pd.read_csv(run / "compare.csv")
    assert set(summary.layout) == {"TP2", "TP2+EP2", "DP2+EP2"}
    ran = summary[summary.checked_on_ranks.notna()]
    assert len(ran) and ran.checked_on_ranks.astype(bool).all()
    assert "set -- demo" in (ROOT / "setup.sh").read_text()


def test_compare_help_counts_the_whole_batch_and_refuses_a_plot_name(tmp_path):
    res = moebench_inproc("compare", "tp-vs-ep", "--help")
    assert res.returncode == 0 and "Whole-batch token counts" in res.stdout
    out = tmp_path / "out"
    assert_bad_input(moebench_inproc("compare", "tp-vs-ep", "--model", "mixtral-8x7b", "--world-size", "2",
                                     "--plot", str(tmp_path / "x.txt"), "--out", str(out)), "PNG")
    assert not out.exists()
