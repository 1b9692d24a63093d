"""The benchmark runner (`python -m benchmarks`), its device jobs (`python -m benchmarks device`), and
the cases PERF.md's tables come from: each case's smoke mode runs end to end on CPU through the
runner, on tiny shapes under the Triton interpreter, and checks its layers against the reference."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moebench
from moebench.results import RunStore
from moebench.errors import MoebenchError
from moebench.kernels.triton.configs import heuristic_config
from moebench.kernels.tuned_files import TILE_KEYS
from moebench.kernels.triton.routing import fused_topk_softmax, topk_softmax_launch

from benchmarks import CASES
from benchmarks.bench_common import BENCH_SHAPES, SHAPE_ALIASES, bench_shape, library_gemms, vllm_ref_us
from test_cli import run_here

ROOT = Path(__file__).resolve().parents[1]


def _here(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m benchmarks ARGS` run in this process (the interpreter conftest set up, no
    interpreter start or torch import), with `env` set while it runs."""
    import benchmarks.__main__ as runner

    return run_here(lambda: runner.main(list(args)), ["python -m benchmarks", *args], env=env)


def _runner(*args: str, env: dict | None = None, gpu: bool = False) -> subprocess.CompletedProcess:
    """`python -m benchmarks ARGS`, the repository on PYTHONPATH: Triton kernels under the CPU
    interpreter, or compiled for the GPU (`gpu`: the interpreter would take minutes there)."""
    env = dict(os.environ, **(env or {}))
    if gpu:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_list_names_every_case():
    r = _here("--list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == list(CASES) and all(len(ln.split()) > 1 for ln in lines)
    # every case module is registered, and every registered case is a module with main(argv)
    # (bench_common: the cases' shared set-up; deepgemm_standin: deep_gemm in torch for smoke runs and tests)
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__", "__main__", "bench_common", "deepgemm_standin"}
    assert modules == set(CASES)


def test_unknown_case_is_a_one_line_error():
    r = _here("no_such_case", "--smoke")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no_such_case" in r.stderr
    assert _here().returncode == 2  # no case at all: the usage line


def test_device_list_names_every_job():
    from benchmarks.device import JOBS

    r = _here("device", "--list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()[1:]
    commands = [ln for ln in lines if "python -m benchmarks device" in ln]
    assert [ln.split()[0] for ln in commands] == [j.name for j in JOBS]
    for job, ln in zip(JOBS, commands):
        assert f"python -m benchmarks device {job.name}" in ln and job.sections in ln and job.minutes in ln
    # the job list replaces the shell scripts
    assert not sorted(p.name for p in (ROOT / "benchmarks").glob("*.sh"))


def test_device_dry_run_prints_the_commands(tmp_path):
    # --dry-run: the steps and commands, knobs applied (KNOB=VALUE or the environment), nothing written
    out = tmp_path / "out"
    r = _here("device", "--dry-run", "TOKENS=8,16", "pair_store", "fp8", env={"OUT": str(out), "SKIP_TESTS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert not out.exists()
    lines = r.stdout.splitlines()
    assert lines[0].startswith("=== job pair_store (") and any(ln.startswith("=== job fp8 (") for ln in lines)
    ab = [ln for ln in lines if " decode_launches --variants pairstore,atomic --tokens 8,16 " in ln]
    assert len(ab) == 1 and ab[0].startswith(f"$ OUT={out}/bf16 ")
    assert any("moebench.cli sweep --model qwen3-30b-a3b --tokens 1,16,64,256,1024,4096" in ln and "--dtype fp8_w8a8"
               in ln and "--scales token" in ln for ln in lines)
    assert not any("fp8 gpu tests" in ln for ln in lines)  # SKIP_TESTS=1 leaves the tests out
    assert any(ln == f"$ tar czf {out}/fp8-sweeps.tgz -C {out} results" for ln in lines)
    bad = _here("device", "nope")
    assert bad.returncode == 2 and "unknown job 'nope'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_device_resumable_tunes_skip_resume_or_start(tmp_path, monkeypatch, capsys):
    # a folder whose run has a report is skipped, one with a journal resumed, an empty one started
    from benchmarks.device import Ctx

    c = Ctx(tmp_path / "out", dry=True)
    (tmp_path / "a" / "run1").mkdir(parents=True)
    (tmp_path / "a" / "run1" / "report.md").write_text("done")
    (tmp_path / "b" / "run2").mkdir(parents=True)
    (tmp_path / "b" / "run2" / "tune.json").write_text("{}")
    monkeypatch.delenv("TAIL", raising=False)
    for name in ("a", "b", "c"):
        c.tune_in(tmp_path / name, name, ["--compile-workers", "4"], ["--model", "m", "--tokens", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"=== done before: a ({tmp_path / 'a' / 'run1'})")
    assert out[1].startswith("=== resume b") and out[2].endswith(f"tune --resume {tmp_path / 'b' / 'run2'} --compile-workers 4")
    assert out[3].startswith("=== tune c") and out[4].endswith(
        f"tune --model m --tokens 1 --compile-workers 4 --results-dir {tmp_path / 'c'}")
    # the engines' files a tune runs --against, by shape and precision
    (tmp_path / "e" / "vllm").mkdir(parents=True)
    for n in ("E=8,N=1792,device_name=NVIDIA_H200.json", "E=8,N=1792,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"):
        (tmp_path / "e" / "vllm" / n).write_text("{}")
    assert [p.rsplit("/", 1)[-1] for p in Ctx.against(tmp_path / "e", "E=8,N=1792", "fp8")[1::2]] == [
        "E=8,N=1792,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"]


def test_device_run_logs_each_step(tmp_path):
    # a real (tiny) run: the job's steps and a case's table output land in $OUT/log.txt
    from benchmarks.device import Ctx

    c = Ctx(tmp_path, dry=False)
    c.step("one")
    assert c.sh([sys.executable, "-c", "print('a'); print('b'); print('c')"], tail=2) == 0
    assert c.sh([sys.executable, "-c", "import sys; sys.exit(3)"]) == 3 and c.failed == 1
    assert c.sh([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5) == 124
    log = (tmp_path / "log.txt").read_text().splitlines()
    assert log[0].startswith("=== one (") and log[1:3] == ["b", "c"] and log[3].startswith("(exit 3:")


def test_layer_times_ab_table_pairs_the_trees(tmp_path):
    """layer_times with BASE: each point's median over rounds per tree, new / base; a simulated TP
    row counts its measured experts time (its all-reduce is modeled), failed rows none."""
    from benchmarks.device import layer_times_table
    from moebench.report import markdown

    def write(tree, rnd, rows):
        d = tmp_path / tree / rnd / "run"
        d.mkdir(parents=True)
        keys = ["model", "tp", "ep", "experts", "dtype", "quant", "tokens", "status", "modeled", "latency_us",
                "experts_us"]
        with open(d / "results.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(keys)
            w.writerows(rows)

    write("new", "r0", [["m", 1, 1, "triton", "bf16", "", 16, "ok", False, 10.0, ""],
                        ["m", 8, 1, "triton", "bf16", "", 16, "ok", True, 99.0, 4.0],
                        ["m", 1, 8, "triton", "bf16", "", 16, "ok", True, 99.0, 3.0],
                        ["m", 1, 1, "triton", "bf16", "", 64, "failed", False, "", ""]])
    write("new", "r1", [["m", 1, 1, "triton", "bf16", "", 16, "ok", False, 12.0, ""]])
    write("base", "r0", [["m", 1, 1, "triton", "bf16", "", 16, "ok", False, 22.0, ""],
                         ["m", 8, 1, "triton", "bf16", "", 16, "ok", True, 50.0, 5.0],
                         ["m", 1, 8, "triton", "bf16", "", 16, "ok", True, 50.0, 6.0]])
    table = layer_times_table(tmp_path).set_index(["tp", "ep", "tokens"])
    assert table.loc[(1, 1, 16), "new"] == 11.0 and table.loc[(1, 1, 16), "base"] == 22.0
    assert table.loc[(1, 1, 16), "new_over_base"] == 0.5 and table.loc[(8, 1, 16), "new_over_base"] == 0.8
    assert table.loc[(1, 8, 16), "new_over_base"] == 0.5  # an EP shard is its own point
    assert (1, 1, 64) not in table.index
    md = markdown(table.reset_index())
    assert md.splitlines()[0].endswith("| base | new | new_over_base |") and "| 22 | 11 | 0.5 |" in md
    assert layer_times_table(tmp_path / "none") is None


def test_bench_shapes_come_from_the_presets():
    # the shards the cases time are the presets' numbers split by the layout
    assert bench_shape("qwen3-235b-tp8") == (128, 8, 4096, 192, 128)
    assert bench_shape("dsv3-ep8") == (256, 8, 7168, 2048, 32) and bench_shape("deepseek-v3-ep8") == (32, 8, 7168, 2048, 32)
    assert bench_shape("mixtral-tp8") == (8, 2, 4096, 1792, 8)
    assert set(SHAPE_ALIASES.values()) <= set(BENCH_SHAPES)
    with pytest.raises(MoebenchError, match="unknown shape 'nope'; pick one of mixtral,"):
        bench_shape("nope")
    assert vllm_ref_us("qwen3-30b-a3b", 16) == 209 and vllm_ref_us("deepseek-v3-ep8", 4096) == 7566
    assert vllm_ref_us("mixtral", 8) != vllm_ref_us("mixtral", 8)  # no reference there: nan


def test_profile_case_smoke():
    # torch.profiler's table of the layer's launches, fp8 block included; --plain: the calls alone
    # (what the `ncu` device job runs under ncu) with TritonOptions fields forced; a bad --shape or
    # --option is one line.
    r = _here("profile_case", "--smoke", "--tokens", "3", "--fp8-block", "--calls", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tiny M=3 no-dpep+triton fp8_w8a8 block[128,128], 1 calls" in r.stdout and "Self CPU time total" in r.stdout
    r = _here("profile_case", "--smoke", "--tokens", "3", "--plain", "--calls", "2", "--option", "token_rows=false",
                "--option", "direct_max_fill=0.5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("tiny M=3 no-dpep+triton bf16 token_rows=false direct_max_fill=0.5: 2 calls")
    assert "Self CPU" not in r.stdout
    from benchmarks.profile_case import parse_options
    from moebench.kernels.triton.options import TritonOptions

    assert parse_options(["token_rows=false", "pdl=auto", "direct_max_fill=0.5", "one_launch_max_pairs=0"]) == \
        TritonOptions(token_rows=False, pdl="auto", direct_max_fill=0.5, one_launch_max_pairs=0)
    r = _here("profile_case", "--smoke", "--option", "nope=1")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --option 'nope=1': give NAME=VALUE with NAME one of")
    r = _here("profile_case", "--shape", "nope")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: unknown shape 'nope'; pick one of mixtral,")
    assert len(r.stderr.strip().splitlines()) == 1


def test_no_benchmark_imports_a_private_name():
    src = "\n".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))
    assert not re.search(r"from moebench\S* import .*\b_", src) and not re.search(r"moebench\.[a-z_.]*\._", src)


def _smoke(case: str, tmp_path: Path, *args: str, csv_name: str | None = None) -> list[dict]:
    """`python -m benchmarks CASE --smoke ARGS` (in this process) with OUT=tmp_path; the rows of its
    CSV (csv_name, default CASE.csv)."""
    r = _here(case, "--smoke", *args, env={"OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    return list(csv.DictReader(open(tmp_path / (csv_name or f"{case}.csv"))))


def test_decode_launches_smoke(tmp_path):
    # every variant (a TritonOptions each, a registered sweep variant) correct against the
    # reference, a variant the point cannot take named with its reason, table written
    variants = ("nodirect", "twolaunch", "sk4", "heuristic")
    # one shape: the expert map's paths are the fp8 block smoke's
    rows = _smoke("decode_launches", tmp_path, "--tokens", "1,3", "--shapes", "tiny", "--variants",
                  ",".join(variants + ("sorted",)))
    assert len(rows) == 2 and [r["direct_rule"] for r in rows] == ["True", "False"]
    assert all(float(r[f"{v}_err"]) < 2e-2 for r in rows for v in ("current",) + variants)
    assert all(float(r["sk4/current"]) > 0 and float(r["current/twolaunch"]) > 0 for r in rows)
    assert all(r["sorted_note"].startswith("n/a: sorted_a needs") and not r.get("sorted_us") for r in rows)
    saved = RunStore(next((tmp_path / "runs").iterdir())).rows  # one round: one sweep folder
    assert sorted({r.variant for r in saved}) == ["", "options-heuristic", "options-nodirect", "options-sk4",
                                                  "options-sorted", "options-twolaunch"]
    # `heuristic` ran the default heuristic's config of each point (tiny: E 16, top-2, H 64, I 32)
    for r in rows[:2]:
        cfg = heuristic_config(int(r["tokens"]), 16, 32, 64, 2, torch.bfloat16)
        assert r["heuristic_cfg"] == "/".join(str(cfg[c]) for c in TILE_KEYS) and float(r["heuristic/current"]) > 0


def test_bench_triton_smoke(tmp_path):
    # PERF.md's table through the sweep: the layer, its registered parts and the torch experts are
    # rows of one run folder per shape, checked by the sweep's measure step
    rows = _smoke("bench_triton", tmp_path, "--tokens", "1")
    assert [r["shape"] for r in rows] == ["tiny", "tiny-map"]
    assert all(float(r["max_rel_err"]) < 2e-2 and float(r["gemms_err"]) < 2e-2 for r in rows)
    assert all(float(r["ref_us"]) == 191 for r in rows)  # the smoke shapes stand in for Mixtral's reference row
    parts = ("layer", "gemms", "gemm1", "gemm2", "align", "routing", "library-grouped", "library-mm", "torch")
    assert all(float(r[f"{p}_us"]) > 0 for r in rows for p in parts)
    assert all(r["align_kind"] == "direct" for r in rows)  # one token: the direct alignment
    saved = [RunStore(f).rows for f in sorted((tmp_path / "runs").iterdir())]
    assert [len(rs) for rs in saved] == [9, 18]  # tiny-map: a simulated EP4 shard, nccl and custom all-reduce rows
    assert {r.variant for r in saved[0]} == {"", "gemms", "gemm1", "gemm2", "align", "routing", "library-grouped",
                                             "library-mm"}
    assert all(r.status == "ok" for rs in saved for r in rs)
    assert {r.correct for r in saved[0] if r.variant in ("", "gemms")} == {True}


def test_library_gemms_agree():
    # grouped_mm and the per-expert mm loop compute the same products, expert by expert, including
    # an expert with no rows and remote (-1) pairs; no local pair gives no bound at all
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(5, 16), torch.randn(4, 24, 16), torch.randn(4, 16, 12)
    ids = torch.tensor([[0, 2], [2, -1], [3, 0], [-1, -1], [2, 3]])
    fns = library_gemms(x, w13, w2, ids)
    y_grouped, y_mm = fns["grouped"](), fns["mm"]()
    assert y_grouped.shape == (7, 16) and torch.allclose(y_grouped, y_mm, atol=1e-4)
    assert library_gemms(x, w13, w2, torch.full((5, 2), -1)) == {}



def test_decode_launches_fp8_smoke(tmp_path):
    # per-tensor fp8 weights, all correct; timed in two interleaved rounds (median and spread per variant)
    rows = _smoke("decode_launches", tmp_path, "--tokens", "1", "--fp8", "--variants", "nodirect,again",
                  "--rounds", "2", csv_name="decode_launches_fp8.csv")
    assert len(rows) == 2 and all(float(r[f"{v}_err"]) < 3e-2 for r in rows for v in ("current", "nodirect"))
    assert all(float(r[f"{v}_spread"]) >= 1 and float(r[f"{v}_us"]) > 0 for r in rows for v in ("current", "nodirect", "again"))


def test_decode_launches_fp8_block_variants_smoke(tmp_path):
    # fp8 128 x 128 block weights (H=64: one partial scale group), with an expert map, at 17 tokens
    # (sorted pairs: neither the direct alignment nor token rows): GEMM2's two sums over top-k, as
    # the device job times them, correct (the TMA tiles and both operand orders are
    # tests/test_triton_fp8.py's; every option variant is registered the same way)
    rows = _smoke("decode_launches", tmp_path, "--tokens", "17", "--fp8-block", "--variants", "pairstore,atomic",
                  "--shapes", "tiny-map", csv_name="decode_launches_fp8block.csv")
    assert len(rows) == 1 and rows[0]["shape"] == "tiny-map" and rows[0]["direct_rule"] == "False"
    assert all(float(r[f"{v}_err"]) < 3e-2 for r in rows for v in ("current", "pairstore", "atomic"))
    assert all(float(r["pairstore/atomic"]) > 0 and float(r["current/atomic"]) > 0 for r in rows)


def test_routing_launch_shape_keeps_the_result():
    # the routing kernel's launch shapes (rows per program, warps) give one result
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 40, generator=g)
    ref = fused_topk_softmax(logits, 6)
    for rows, warps in ((1, 1), (2, 4), (16, 8)):
        got = fused_topk_softmax(logits, 6, rows=rows, num_warps=warps)
        assert torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="powers of two"):
        fused_topk_softmax(logits, 6, rows=3)


@pytest.mark.parametrize("e", [8, 32, 60, 128, 256, 512])
def test_routing_launch_rule_shapes(e):
    for m in (1, 3, 16, 256, 1024, 4096):
        rows, warps = topk_softmax_launch(m, e)
        assert rows & (rows - 1) == 0 and warps & (warps - 1) == 0 and warps <= rows <= 16
        assert rows <= max(1, 2 * m - 1)  # never more tokens per program than the next power of two of m


def test_vllm_kernel_smoke(tmp_path):
    # both tables written, every layer checked against the reference (no wrong column)
    rows = _smoke("vllm_kernel", tmp_path, "--tokens", "1,5", "--precisions", "bf16,fp8", csv_name="vllm_kernel_files.csv")
    assert [(r["precision"], int(r["tokens"])) for r in rows] == [("bf16", 1), ("bf16", 5), ("fp8", 1), ("fp8", 5)]
    assert all(r["wrong"] == "-" and float(r["new_over_vllm"]) > 0 for r in rows)
    tri = list(csv.DictReader(open(tmp_path / "vllm_kernel_triton.csv")))
    assert len(tri) == 4 and all(r["engine_file"] in ("vllm", "sglang") and r["wrong"] == "-" for r in tri)
    assert "| tiny | fp8 | 5 |" in (tmp_path / "vllm_kernel_files.md").read_text()
    # one sweep folder per precision: the files as variants of the vllm-triton experts, then triton
    for folder in (tmp_path / "runs").iterdir():
        rows = RunStore(folder).rows
        assert sorted((r.experts, r.variant, r.status) for r in rows if r.tokens == 5) == [
            ("triton", "", "ok"), ("vllm-triton", "file-new", "ok"), ("vllm-triton", "file-sglang", "failed"),
            ("vllm-triton", "file-vllm", "ok")]
        assert all("no sglang file" in r.reason for r in rows if r.status == "failed")


def test_engine_h200_data_files_hold_the_table_shapes():
    from benchmarks.vllm_kernel import BLOCK, DEFAULT_SHAPES, SHAPES, engine_table

    for e, _, _, n in (SHAPES[name] for name in DEFAULT_SHAPES):
        assert engine_table("vllm", e, n, None) is not None or (e, n) == (256, 256)  # vLLM ships no bf16 E=256,N=256
    # the kernel tables' other shapes: Mixtral TP1 (bf16) and the DeepSeek-V3 EP8 shard (fp8 block)
    assert engine_table("vllm", *SHAPES["mixtral"][::3], None) is not None
    ep8 = engine_table("vllm", *SHAPES["deepseek-v3-ep8"][::3], BLOCK)
    assert len(ep8) == 18 and ep8[256]["GROUP_SIZE_M"] == 64 and ep8[2048]["BLOCK_SIZE_K"] == 256
    assert sorted(engine_table("sglang", 256, 256, object())) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512,
                                                                   1024, 1536, 2048, 3072, 4096]


def test_vllm_kernel_summary_tables(tmp_path):
    """--summary: the headline over the default (TP) shapes' points with an engine file, a later
    file's point replacing an earlier one's, bold above 1, the engine over the weight-read floor at
    16-256 tokens, the compute floor at 4096 tokens and the read floor over it."""
    head = "shape,precision,tokens,triton_us,engine_us,engine_file,triton_over_engine,triton_cfg,triton_cfg_source,wrong\n"
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    first.write_text(head + "qwen3-30b-a3b,fp8,1,30,29,vllm,1.034,c,s,-\nqwen3-30b-a3b,fp8,4096,862,757,vllm,1.139,c,s,-\n"
                     "qwen3-30b-a3b,fp8,16,100,101,vllm,0.990,c,s,-\nmixtral,fp8,4096,6000,-,-,-,c,s,-\n")
    second.write_text(head + "qwen3-30b-a3b,fp8,1,28,29,vllm,0.966,c,s,-\n")
    r = _here("vllm_kernel", "--summary", str(first), str(second), "--ceilings", "fp8=1000", "--read-gbs", "4000")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    # Qwen3-30B at 16 tokens: 128 x (1 - (120/128)^16) = 82.4 experts touched, of 3 x 2048 x 768 fp8
    # bytes (+ 4 per 128 x 128 block) each, and x in, out: 389 MB / 4000 GB/s = 97.3 us; 101 / 97.3 =
    # 1.04, and 0.90 x 1.04 < 1: a point the engine's speed bounds.
    assert lines[0].startswith("fp8 (mixtral-tp8, qwen3-30b-a3b,") and lines[0].endswith(
        "2 of 3 points at or below, median 0.990; at 1 of them 0.90 x the engine is under the weight-read floor "
        "(4000 GB/s)")
    # Qwen3-30B at 4096 tokens: 2 x 4096 x 8 x 3 x 2048 x 768 flops / 1000 TFLOP/s = 309 us; all 128
    # experts read, 604 MB with the block scales, and x in, out 34 MB: 159 us, 0.52 of the compute floor;
    # with the 32768 pairs' fp8 intermediate (768 x 1.03125 bytes) and bf16 rows (2048 x 2 bytes), each
    # written and read: + 320 MB, 80 us: 239 us, 0.77
    assert ("| qwen3-30b-a3b | 0.966 | 0.990 | - | - | - | **1.139** | 2 of 3 | 0.990 | 1.04-1.04 | 862 / 309 = **2.79** "
            "| 0.52 | 0.77 |" in lines)
    # Mixtral (TP1): 8 experts of 3 x 4096 x 14336 fp8 bytes and 67 MB of x and out: 369 us of 2886;
    # 8192 pairs' intermediate (14336 x 1.03125) and rows (4096 x 2), each twice: + 376 MB, 94 us
    assert any(ln.startswith("| mixtral | - |") and ln.endswith("| 0 of 0 | - | - | 6000 / 2886 = **2.08** | 0.13 | 0.16 |")
               for ln in lines)


def test_vllm_kernel_writes_the_shipped_files_tune_against_reads(tmp_path):
    """--write-files: every table of the two JSON data files as the engine's own file, readable as
    a `tune --against` file, entries as recorded."""
    from benchmarks.vllm_kernel import BLOCK, engine_table, main
    from moebench.cli.tune import against_tables
    from moebench.kernels.tuned_files import engine_file_name

    assert main(["--write-files", str(tmp_path)]) == 0
    vllm_dsv3 = tmp_path / "vllm" / engine_file_name("vllm", 256, 256, "NVIDIA_H200", BLOCK)
    sglang_dsv3 = tmp_path / "sglang" / engine_file_name("sglang", 256, 256, "NVIDIA_H200", BLOCK)
    tables = against_tables([vllm_dsv3, sglang_dsv3])
    assert tables[f"vllm/{vllm_dsv3.name}"] == engine_table("vllm", 256, 256, BLOCK)
    assert tables[f"sglang/{sglang_dsv3.name}"] == engine_table("sglang", 256, 256, BLOCK)
    assert "[128, 128]" in sglang_dsv3.name  # SGLang's own spelling
    assert len(list((tmp_path / "vllm").glob("*.json"))) == 7


@pytest.mark.gpu
def test_bench_triton_and_decode_launches_run_on_the_gpu(tmp_path):
    """The parts table and an options A/B compiled for the GPU, through the sweep: every part timed,
    the layer and its GEMMs correct; a simulated EP8 shard (the expert map) among them."""
    r = _runner("bench_triton", "--shapes", "qwen3-30b-a3b,dsv3-ep8", "--tokens", "1,64", env={"OUT": str(tmp_path)},
                gpu=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "bench_triton.csv")))
    assert [(x["shape"], x["tokens"]) for x in rows] == [("qwen3-30b-a3b", "1"), ("qwen3-30b-a3b", "64"),
                                                         ("dsv3-ep8", "1"), ("dsv3-ep8", "64")]
    assert all(float(x["max_rel_err"]) < 2e-2 and float(x["gemms_err"]) < 2e-2 for x in rows)
    assert all(float(x[f"{p}_us"]) > 0 for x in rows for p in ("layer", "gemms", "gemm1", "gemm2", "align", "torch"))
    r = _runner("decode_launches", "--shapes", "qwen3-30b-a3b", "--tokens", "4,256", "--variants", "nodirect,sorted,again",
                "--rounds", "2", "--reps", "10", env={"OUT": str(tmp_path)}, gpu=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "decode_launches.csv")))
    assert len(rows) == 2 and all(float(x[f"{v}_err"]) < 2e-2 for x in rows for v in ("current", "nodirect", "again"))
    assert all(x.get("sorted_us") or x["sorted_note"].startswith("n/a: ") for x in rows)  # runs, or says why not
    assert all(0.7 < float(x["again/current"]) < 1.3 for x in rows)


@pytest.mark.gpu
def test_vllm_kernel_and_vendor_gemms_run_on_the_gpu(tmp_path):
    """The engine files as vllm-triton variants and the vendor table, compiled for the GPU through
    the sweep: every file the shape has is timed and correct, triton against the faster one."""
    r = _runner("vllm_kernel", "--shapes", "qwen3-30b-a3b", "--tokens", "1,64,1024", "--routings", "2",
                env={"OUT": str(tmp_path)}, gpu=True)
    assert r.returncode == 0, r.stderr[-2000:]
    files = list(csv.DictReader(open(tmp_path / "vllm_kernel_files.csv")))
    tri = list(csv.DictReader(open(tmp_path / "vllm_kernel_triton.csv")))
    assert [(x["precision"], x["tokens"]) for x in tri] == [(p, t) for p in ("bf16", "fp8") for t in ("1", "64", "1024")]
    assert all(x["wrong"] == "-" and float(x["vllm_file_us"]) > 0 for x in files)
    assert all(x["engine_file"] in ("vllm", "sglang") and 0.2 < float(x["triton_over_engine"]) < 5 for x in tri)
    r = _runner("vendor_gemms", "--shapes", "qwen3-30b-a3b", "--tokens", "1024", env={"OUT": str(tmp_path)}, gpu=True)
    assert r.returncode == 0, r.stderr[-2000:]
    row = list(csv.DictReader(open(tmp_path / "vendor_gemms.csv")))[0]
    assert float(row["triton_err"]) < 2e-2 and float(row["triton/floor"]) >= 1 and float(row["torch_grouped_us"]) > 0
    assert row.get("deepgemm_note") or float(row["deepgemm_err"]) < 2e-2


@pytest.mark.gpu
def test_vllm_kernel_profile_lists_each_layers_launches(tmp_path):
    """--profile on the GPU: per-launch rows for the triton layer and the engine files' layers."""
    r = _runner("vllm_kernel", "--profile", "--shapes", "mixtral-tp8", "--precisions", "bf16", "--tokens", "1,64",
                env={"OUT": str(tmp_path)}, gpu=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "kernel_times.csv")))
    by_col = {c: {row["kernel"] for row in rows if row["column"] == c} for c in ("triton", "vllm")}
    assert any("gemm2" in k for k in by_col["triton"]) and any("vllm_moe_gemm" in k for k in by_col["vllm"])
    assert all(float(row["us_per_call"]) > 0 for row in rows)


def test_vendor_gemms_smoke(tmp_path):
    # without deep_gemm the DeepGEMM columns say why; the triton layer is checked, the floor computed
    rows = _smoke("vendor_gemms", tmp_path, csv_name="vendor_gemms.csv")
    assert len(rows) == 1 and float(rows[0]["floor_us"]) > 0 and float(rows[0]["torch_grouped_us"]) > 0
    assert float(rows[0]["triton_err"]) < 2e-2
    assert rows[0].get("deepgemm_note") or float(rows[0]["deepgemm_err"]) < 2e-2


def test_ep_model_table_joins_measured_and_modeled_phases(tmp_path):
    """A simulated EP2 sweep stands in for both sides (its rows carry dispatch / combine): every
    joined ratio is then 1; folders without a common point are refused in one line."""
    from test_cli import moebench_inproc

    mod = tmp_path / "mod"
    r = moebench_inproc("sweep", "--num-experts", "8", "--topk", "2", "--hidden", "256", "--intermediate", "128",
                        "--ep", "2", "--tokens", "4,16", "--reps", "1", "--prepare-finalize", "all2all-ll", "--experts", "batched-torch",
                        "--dtype", "bf16", "--simulate", "--out", str(mod))
    assert r.returncode == 0, r.stderr
    r = _here("ep_model_table", str(mod), "--modeled", str(mod))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("| all2all-ll")]
    assert len(lines) == 3, r.stdout  # two token counts, one fixed-cost line
    for ln in lines[:2]:  # dispatch_ratio, combine_ratio: the last two cells
        assert [float(c) for c in ln.strip(" |").split("|")[-2:]] == [1.0, 1.0], ln
    assert "False" in lines[2]
    r = _here("ep_model_table", str(mod), "--modeled", str(tmp_path / "none"))
    assert r.returncode != 0


def test_peers_smoke_and_table(tmp_path):
    """The peers case on a CPU: every column of a tiny bf16 shape through the sweep (the GPU-only
    ones skipped rows), its table from those rows; then the table rebuilt from the run folders
    with one peer's rows made faster and slower, so the ratios and the target follow the rows."""
    from benchmarks.peers import COLUMNS, load_rows, peer_table

    rows = _smoke("peers", tmp_path, "--shapes", "tiny", "--precisions", "bf16", "--tokens", "3", csv_name="peers.csv")
    assert [(r["shape"], r["precision"], r["tokens"]) for r in rows] == [("tiny", "bf16", "3")]
    (row,) = rows
    assert row["deepgemm"] == "-" and row["triton-kernels"] == "-"  # skipped on a CPU
    assert row["fastest_peer"] == "vllm-triton" and row["vllm-triton"].startswith("1.00 / ")
    assert row["vllm_file"] == "vllm"  # the smoke's stand-ins: no sglang file
    assert (tmp_path / "runs" / "tiny-bf16" / "all" / "DONE").is_file()
    df = load_rows([tmp_path / "runs"])
    assert set(df.experts) == set(COLUMNS) and set(df[df.experts == "triton-kernels"].status) == {"skipped"}
    ok = df[df.status == "ok"]
    native = ok[ok.experts.isin(["triton", "batched-triton"])].latency_us.min()
    peer = ok.experts == "vllm-triton"
    floor = float(ok.floor_us.median())
    for factor, met in ((2.0, True), (0.5, False)):
        df2 = df.copy()
        df2.loc[df2.index[df2.status.eq("ok") & (df2.experts == "vllm-triton")], "latency_us"] = native * factor
        t = peer_table(df2).iloc[0]
        assert t["fastest_peer"] == "vllm-triton"
        assert t[t["best_moebench"]] == f"{1 / factor:.2f} / {native / floor:.2f}"
        assert (t["target"] == "no peer ran" or t["target"] == "met") if met else "vllm-triton 2.00x faster" in t["target"]
    # the floor's factor: 1.05 at 16-256 tokens (the smoke point sits far above a CPU floor)
    df3 = df.copy()
    df3["tokens"] = 16
    assert "x floor" in peer_table(df3).iloc[0]["target"]
    assert peer.any()
    r = _here("peers", "--table", str(tmp_path / "runs"), env={"OUT": str(tmp_path / "again")})
    assert r.returncode == 0 and (tmp_path / "again" / "peers.md").read_text().count("| tiny | bf16 | 3 |") == 1
    why = list(csv.DictReader(open(tmp_path / "again" / "peers_not_run.csv")))
    assert {r["column"] for r in why} >= {"deepgemm", "triton-kernels"}
    assert all(r["status"] == "skipped" and "cpu" in r["reason"] for r in why if r["column"] != "vllm-triton (file-sglang)")


def test_deepgemm_breakdown_smoke(tmp_path):
    """The DeepGEMM pairs through the torch stand-in for deep_gemm (glue under the interpreter):
    every adapter step's profiler range is found and given time, GEMMs apart from the glue."""
    rows = _smoke("deepgemm_breakdown", tmp_path, "--tokens", "3", csv_name="deepgemm_breakdown.csv")
    assert [r["pair"] for r in rows] == ["no-dpep+deepgemm", "batched-local+batched-deepgemm"]
    contiguous, masked = rows
    for step in ("align", "gather", "gemm1", "act", "gemm2", "sum"):
        assert float(contiguous[f"{step}_us"]) > 0, step
    assert all(float(masked[f"{s}_us"]) > 0 for s in ("pack", "gemm1", "act", "gemm2"))
    assert float(contiguous["gemms_us"]) == pytest.approx(float(contiguous["gemm1_us"]) + float(contiguous["gemm2_us"]), abs=0.2)
    assert (tmp_path / "deepgemm_breakdown.md").exists() and (tmp_path / "deepgemm_kernels.csv").exists()


def test_deepgemm_padding_counts_the_alignment_rows(tmp_path):
    """--padding (modeled, no GEMM): each local expert's rows rounded up to 128 (64 masked); a
    routing's rows counted by hand agree."""
    from benchmarks.deepgemm_breakdown import padding_rows

    ids = torch.tensor([[0, 1], [0, 5], [1, 2]])  # experts 0-3 local: 0 x2, 1 x2, 2 x1; 5 is remote
    assert padding_rows(ids, 4, 128) == (3, 384) and padding_rows(ids, 4, 64) == (3, 192)
    r = _here("deepgemm_breakdown", "--padding", "--shapes", "dsv3-ep8", "--tokens", "16,4096", env={"OUT": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "deepgemm_padding.csv")))
    assert [int(x["tokens"]) for x in rows] == [16, 4096]
    assert all(int(x["contiguous_rows"]) % 128 == 0 and int(x["contiguous_rows"]) >= int(x["pairs"]) for x in rows)
    assert float(rows[0]["padding_x"]) > float(rows[1]["padding_x"])  # few rows per expert: mostly padding
    bad = _here("deepgemm_breakdown", "--padding", "--gpu", "nope", env={"OUT": str(tmp_path)})
    assert bad.returncode == 2 and "datasheet" in bad.stderr


def test_deepgemm_breakdown_gemms_by_difference_when_the_profiler_misses_them():
    """On a GPU, a GEMM step holding only torch's kernels (DeepGEMM's JIT launches unrecorded): the
    GEMMs are the layer minus the glue and marked so; a DeepGEMM kernel in a GEMM step is taken as
    profiled."""
    from benchmarks.deepgemm_breakdown import split_time

    steps = {"align": 20.0, "sum": 12.0, "gemm2": 0.1}
    torch_only = [{"kernel": "void at::native::vectorized_elementwise_kernel<2>", "step": "gemm2"},
                  {"kernel": "void at_cuda_detail::cub::DeviceScanKernel", "step": "align"}]
    assert split_time(400.0, steps, torch_only, on_gpu=True) == (368.0, 32.0, False)
    seen = torch_only + [{"kernel": "sm90_fp8_gemm_1d2d_impl<128, 128>", "step": "gemm1"}]
    assert split_time(400.0, dict(steps, gemm1=300.0), seen, on_gpu=True) == (300.1, 32.0, True)
    assert split_time(400.0, steps, [], on_gpu=False)[2]  # on a CPU the ranges' own time stands
