"""What the CLI prints and the reports it writes, end to end as a user runs it: a subprocess at 80
columns with stdout a pipe (a log: nohup, CI, slurm), or a forced terminal where the test says so;
the other commands whose output is read run through the entry point in this process, at 80
columns with stdout not a terminal (what a pipe gives)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from moebench.results import CORE_COLUMNS
from test_cli import moebench_inproc

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-experts", "6", "--topk", "2", "--hidden", "24", "--intermediate", "16", "--device", "cpu"]
ALL = ["--experts", "all", "--prepare-finalize", "all"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_cli(*args, columns=80, tty=False, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env.update(COLUMNS=str(columns))
    if tty:  # rich treats stdout as an interactive terminal
        env.update(TTY_COMPATIBLE="1", TTY_INTERACTIVE="1", TERM="xterm")
    res = subprocess.run([sys.executable, "-m", "moebench.cli", *map(str, args)], capture_output=True, text=True,
                         env=env, timeout=timeout)
    assert res.returncode == 0, (res.stdout, res.stderr)
    return res


def run_here_at(*args, columns=80):
    """As run_cli (stdout not a terminal: plain text, as in a log), through the entry point in this
    process: the commands whose output a test reads, where being a process of its own is not the
    point (the sweep fixture and the terminal test start one)."""
    from moebench.cli.options import console

    res = moebench_inproc(*map(str, args), env={"COLUMNS": str(columns)})
    assert not console.is_terminal  # (a FORCE_COLOR or TTY_COMPATIBLE at import would make it one)
    assert res.returncode == 0, (res.stdout, res.stderr)
    return res


def assert_fits(text: str, width: int = 80) -> None:
    assert "\u2026" not in text, text  # no cell cut with an ellipsis
    # only a word longer than the width (a path, kept whole to be copied) may stand out, on its own line
    long = [line for line in text.splitlines() if len(line) > width and len(line.split()) > 1]
    assert not long, long


RULE = re.compile(r"-+( +-+)+")


def parse_table(out: str) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the first plain table in `out`, cut by the spans of its dashed rule: the
    header lines above the rule and the rows below it are the lines blank between the spans."""
    lines = out.splitlines()
    r = next(i for i, line in enumerate(lines) if RULE.fullmatch(line))
    spans = [m.span() for m in re.finditer(r"-+", lines[r])]
    gaps = [i for (_, b), (a, _) in zip(spans, spans[1:]) for i in range(b, a)]

    def in_table(line: str) -> bool:
        return bool(line.strip()) and all(line.ljust(spans[-1][1])[i] == " " for i in gaps)

    head = r
    while head > 0 and in_table(lines[head - 1]):
        head -= 1
    end = r + 1
    # (the "wrote PATH" line after a table can wrap to a lone "wrote": it is not a row)
    while end < len(lines) and in_table(lines[end]) and lines[end].split()[0] != "wrote":
        end += 1
    cells = lambda line: [line.ljust(spans[-1][1])[a:b].strip() for a, b in spans]  # noqa: E731
    heads = [" ".join(c for c in col if c) for col in zip(*[cells(x) for x in lines[head:r]])]
    return heads, [cells(x) for x in lines[r + 1:end]]


@pytest.fixture(scope="module")
def default_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    res = run_cli("sweep", *TINY, "--tokens", "1,3", *ALL, "--out", out, "--format", "csv,json,md,html")
    return res, next(out.iterdir())


# -- item 9: tables fit 80 columns, plain text in a log ------------------------------------------

def test_sweep_table_fits_80_columns_as_plain_text(default_sweep):
    res, run = default_sweep
    assert_fits(res.stdout)
    assert not re.search("[\u2500-\u257f]", res.stdout)  # plain text: no box drawing in a log
    heads, rows = parse_table(res.stdout)
    assert heads[:3] == ["tokens", "pair", f"latency {heads[2].split()[-1]}"] and heads[2].split()[-1] in ("us", "ms")
    # every measured row, each pair name whole, its check in full
    df = pd.read_csv(run / "results.csv")
    ran = df[df.status != "skipped"]
    assert len(ran) >= 4 and {"no-dpep+torch", "batched-local+batched-torch"} <= {r[1] for r in rows}
    assert sorted((r[0], r[1], r[heads.index("check")]) for r in rows) == sorted(
        (str(t), f"{p}+{e}", "ok" if c else "WRONG") for t, p, e, c in zip(ran.tokens, ran.prepare_finalize, ran.experts, ran.correct))
    assert "not shown at 80 columns:" in res.stdout  # what was left out, and where it is


def test_terminal_table_fits_and_progress_counts_only_what_runs(tmp_path):
    """Items 9 (a terminal of 80 columns) and 11 (the bar counts and names only runnable cases)."""
    res = run_cli("sweep", *TINY, "--tokens", "1,3", *ALL, "--out", tmp_path, tty=True)
    raw = ANSI.sub("", res.stdout)
    frames = [f for f in re.split(r"[\r\n]", raw) if re.search(r"\d+/\d+ ", f)]
    totals = {int(m.group(2)) for f in frames for m in [re.search(r"(\d+)/(\d+) ", f)]}
    df = pd.read_csv(next(tmp_path.iterdir()) / "results.csv")
    runnable = int((df.status != "skipped").sum())
    assert 4 <= runnable < len(df) and totals == {runnable}, (totals, frames[:3])
    skipped = set(df[df.status == "skipped"].prepare_finalize + "+" + df[df.status == "skipped"].experts)
    named = {m.group(1) for f in frames for m in [re.search(r"M=\d+ (\S+)", f)] if m}
    assert named and not named & skipped, named
    body = [line for line in re.split(r"[\r\n]", raw) if not re.search(r"\d+/\d+ ", line)]
    assert_fits("\n".join(body))
    assert any("latency" in line for line in body) and any("no-dpep+torch" in line for line in body)


# -- item 10: skipped pairs ----------------------------------------------------------------------

def test_default_sweep_fits_one_screen_and_counts_skipped(default_sweep):
    res, run = default_sweep
    lines = res.stdout.splitlines()
    assert len(lines) <= 40, res.stdout
    assert str(run) in res.stdout.replace("\n", "")  # the paths are on the screen too
    text = " ".join(res.stdout.split())
    df = pd.read_csv(run / "results.csv")
    skipped = df[df.status == "skipped"]
    n_pairs = len(set(zip(skipped.prepare_finalize, skipped.experts)))
    mismatch = len(set(zip(*[skipped[skipped.reason.str.startswith("format mismatch")][c]
                             for c in ("prepare_finalize", "experts")])))
    assert re.search(rf"skipped {n_pairs} pairs \(--show-skipped lists them\): {mismatch} format mismatch, ", text)
    assert "no-dpep+batched-torch" not in res.stdout  # the list itself waits for --show-skipped
    assert len(skipped) == 2 * n_pairs  # the files keep every pair at every token count


def test_show_skipped_lists_every_pair(tmp_path):
    res = run_here_at("sweep", *TINY, "--tokens", "1", *ALL, "--out", tmp_path, "--show-skipped")
    assert_fits(res.stdout)
    df = pd.read_csv(next(tmp_path.iterdir()) / "results.csv")
    skipped = df[df.status == "skipped"]
    text = res.stdout.replace("\n", " ")
    for pf, ex in zip(skipped.prepare_finalize, skipped.experts):
        assert re.search(rf"(^|[ ,]){re.escape(pf)}\+{re.escape(ex)}(,|\s|$)", text), (pf, ex)
    assert "format mismatch: a Standard half with a BatchedExperts half" in text


# -- item 12: results.md / results.html ------------------------------------------------------------

def test_results_md_and_html_are_short_reports(default_sweep):
    _, run = default_sweep
    df = pd.read_csv(run / "results.csv")
    assert list(df.columns[: len(CORE_COLUMNS)]) == CORE_COLUMNS and len(df) == len(json.loads((run / "results.json").read_text()))
    md = (run / "results.md").read_text()
    assert md.startswith("# moebench sweep: custom (E=6, topk=2, H=24, I=16)")
    assert "| model | num_experts" not in md  # not the dump of every column
    for needle in ("token counts: 1, 3", "on: CPU", "## Fastest correct pair per token count", "## Measured rows",
                   "## Not run", "results.csv"):
        assert needle in md, needle
    best = md.split("## Fastest correct pair per token count")[1].split("##")[0]
    body = [x for x in best.splitlines() if x.startswith("| ") and not x.startswith("| tokens")]
    ok = df[df.status == "ok"]
    fastest = ok.loc[ok.groupby("tokens").latency_us.idxmin()]
    assert [x.split("|")[1:3] for x in body] == [[f" {t} ", f" {p}+{e} "] for t, p, e in
                                               zip(fastest.tokens, fastest.prepare_finalize, fastest.experts)]
    widest = max(len(line.split("|")) for line in md.splitlines())
    assert widest - 2 <= 16, widest  # a readable number of columns
    page = (run / "results.html").read_text()
    assert "<title>moebench sweep: custom" in page and "<h1>" in page and "<style>" in page
    assert "Fastest correct pair per token count" in page and "class=\"best\"" in page


# -- item 13: report groups by the full setting ----------------------------------------------------

def test_report_keeps_shapes_and_routings_apart_and_finds_run_folders(tmp_path):
    results = tmp_path / "results"
    one = ["--tokens", "1,3", "--experts", "torch", "--prepare-finalize", "no-dpep", "--out", results]
    # the run folders (their sweeps' output is not what this test reads: in this process)
    for args in (TINY, [("8" if a == "6" else a) for a in TINY], [*TINY, "--routing", "hot:0.5"]):  # E=6, E=8, hot
        assert moebench_inproc("sweep", *args, *one).returncode == 0
    res = run_here_at("report", results, "--out", tmp_path / "report.md")  # a folder of run folders
    assert_fits(res.stdout)
    heads, rows = parse_table(res.stdout)
    assert heads[:3] == ["shape", "routing", "tokens"], heads
    assert sorted((r[0], r[1], r[2]) for r in rows) == sorted(
        (s, rt, t) for s, rt in (("E=6", "uniform"), ("E=8", "uniform"), ("E=6", "hot:0.5")) for t in ("1", "3"))
    assert "moebench report: 1 rank, fp32, cpu" in res.stdout
    md = [x.split("|") for x in (tmp_path / "report.md").read_text().splitlines() if x.startswith("| E=")]
    measured = [f"{v:.1f}" for p in results.glob("*/results.csv") for v in pd.read_csv(p).query("status == 'ok'").latency_us]
    assert sorted(x[-2].strip(" *") for x in md) == sorted(measured)  # six cells, none a minimum of two runs


def test_series_labels_name_layout_link_and_precision_apart():
    """Layouts (dp x tp), links and fp8 schemes make separate series, named by what differs."""
    from moebench.report import pivot
    from moebench.results import ResultRow, rows_to_frame

    def row(tp=1, dp=1, ep=1, link="", quant="", us=10.0):
        r = ResultRow(model="m", num_experts=8, topk=2, hidden=64, intermediate=32, tokens=8, tp=tp, dp=dp, ep=ep,
                      world_size=tp * dp, prepare_finalize="allgather-rs" if ep > 1 else "no-dpep", experts="torch",
                      activation_format="Standard", dtype="fp8_w8a8" if quant else "bf16", device="cuda",
                      routing="uniform", modeled=bool(link), latency_us=us, correct=True, quant=quant)
        if link:
            r.extra["link"] = link
        return r

    df = rows_to_frame([row(tp=4, us=5), row(tp=2, dp=2, us=6), row(tp=2, dp=2, ep=4, link="h200-nvlink 450 GB/s", us=7),
                        row(tp=2, dp=2, ep=4, link="pcie-gen5 50 GB/s", us=8)])
    table, _ = pivot(df)
    names = {"TP4 no-dpep+torch", "TP4 (dp2xtp2) no-dpep+torch",
             "EP4 (dp2xtp2) h200-nvlink 450 GB/s allgather-rs+torch",
             "EP4 (dp2xtp2) pcie-gen5 50 GB/s allgather-rs+torch"}
    assert set(table.columns) == names | {"device", "tokens", "imbalance"}, list(table.columns)
    # measured and modeled rows are rows apart (their `device`: what the time speaks of)
    assert list(table.device) == ["cuda", "cuda + modeled comm"]
    assert sorted(table[sorted(names)].stack().dropna()) == [5, 6, 7, 8]
    table, _ = pivot(rows_to_frame([row(us=3), row(quant="block[128,128]", us=2)]))
    assert list(table.dtype) == ["bf16", "fp8_w8a8 block[128,128]"] and list(table["no-dpep+torch"]) == [3, 2]


# -- item 14: the breakdown adds up ----------------------------------------------------------------

def test_breakdown_shows_the_remainder_as_other(tmp_path):
    res = run_here_at("sweep", *TINY, "--tokens", "1,3", "--tp", "2", "--world-size", "2", "--experts", "torch",
                      "--prepare-finalize", "no-dpep", "--out", tmp_path)
    assert_fits(res.stdout)
    heads, rows = parse_table(res.stdout)
    unit = heads[heads.index(next(h for h in heads if h.startswith("latency")))].split()[-1]
    for name in ("latency", "experts", "all-reduce", "other"):
        assert f"{name} {unit}" in heads, heads
    col = {h.split()[0]: i for i, h in enumerate(heads)}
    df = pd.read_csv(next(tmp_path.iterdir()) / "results.csv")
    for r in rows:
        # the parts are timed in the same runs as the layer, on the run's slowest rank: they add up to
        # it, so other is what the marks leave between them (>= 0), never blank, never negative
        assert r[col["other"]] != "-", r
        lat, exp, ar, other = (float(r[col[c]].rstrip("*")) for c in ("latency", "experts", "all-reduce", "other"))
        step = 10 ** -len(r[col["other"]].partition(".")[2])
        assert abs(lat - (exp + ar + other)) <= 2 * step, r
        row = df[df.tokens == int(r[col["tokens"]])].iloc[0]
        k = 1e-3 if unit == "ms" else 1.0
        assert abs(other - k * (row.latency_us - row.experts_us - row.allreduce_us)) <= step, r
        assert row.latency_us - row.experts_us - row.allreduce_us >= 0, r
    assert "other is blank at" not in " ".join(res.stdout.split())


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    shape = ["--num-experts", "8", "--topk", "2", "--hidden", "24", "--intermediate", "16", "--device", "cpu"]
    sweep = run_here_at("sweep", *shape, "--tokens", "2", "--ep", "2", "--experts", "torch,batched-torch",
                        "--out", out / "sweep")
    compare = run_here_at("compare", "tp-vs-ep", *shape, "--tokens", "2,8", "--world-size", "2", "--no-check",
                          "--experts", "torch,batched-torch", "--out", out / "compare")
    meta = {k: json.loads(next((out / k).iterdir()).joinpath("metadata.json").read_text()) for k in ("sweep", "compare")}
    return sweep, compare, meta


def test_compare_table_fits_and_shows_other(ep_runs):
    _, compare, _ = ep_runs
    assert_fits(compare.stdout)
    heads, rows = parse_table(compare.stdout)
    assert heads[:3] == ["batch tokens", "layout", "via"] and any(h.startswith("other ") for h in heads)
    assert {r[1] for r in rows} == {"TP2", "TP2+EP2", "DP2+EP2"}
    total = next(i for i, h in enumerate(heads) if h.startswith("total"))
    assert sum(r[total].endswith("*") for r in rows) == 2  # one faster layout per token count


# -- item 15: one link rule ------------------------------------------------------------------------

def test_sweep_and_compare_pick_the_same_link_and_say_why(ep_runs):
    sweep, compare, meta = ep_runs
    assert meta["sweep"]["link"]["name"] == meta["compare"]["link"]["name"] == "h200-nvlink"
    for res in (sweep, compare):
        text = " ".join(res.stdout.split())
        assert "communication: h200-nvlink 450 GB/s" in text
        assert "the profile of H200 (no GPU here, so the default target GPU)" in text
