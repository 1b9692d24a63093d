"""The device jobs: every GPU run behind PERF.md's tables, one list, one runner.

    PYTHONPATH=. python -m benchmarks device --list                      # name, PERF section, minutes, command
    PYTHONPATH=. python -m benchmarks device [--dry-run] [KNOB=VALUE ...] NAME [NAME ...]

A job is a list of steps (`moebench` commands, benchmark cases, GPU tests) run back to back into
$OUT (default ./device-out). Each step writes "=== TEXT (HH:MM:SS)" to stdout and $OUT/log.txt; a
command's output goes there in full, or its last lines where the job keeps a tail ($TAIL overrides
it for `moebench` commands). The commands see PYTHONPATH (default .), PYTHONUNBUFFERED=1,
COLUMNS=220 and MOEBENCH_CACHE_DIR=$OUT/cache. Run folders under $OUT/results are archived into
$OUT/<name>.tgz (file names with '=' or ',' come back inside it, not as plain files). Resumable
jobs keep their state in an ignored folder (.gpu-out/...) that the next call carries.
Knobs are environment variables (TOKENS, MODELS, SKIP_TESTS=1, ...; `--list` names each job's), or
KNOB=VALUE arguments before the names. --dry-run prints the steps and commands without running them
and writes nothing. The runner's exit status is 1 when a step failed, 2 on a bad name.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PY = sys.executable
VLLM_TOKENS = "1,2,4,8,16,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096"
TOKENS6 = "1,16,64,256,1024,4096"
FP8_BLOCK = ["--dtype", "fp8_w8a8", "--block-shape", "128,128"]


class Ctx:
    """One job's run: output folder, log, knobs and the step helpers. With dry=True every command is
    printed instead of run and nothing is written."""

    def __init__(self, out: Path, dry: bool):
        self.out, self.dry, self.failed = out, dry, 0
        self.results = out / "results"
        self.log = out / "log.txt"
        self.env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", "."), PYTHONUNBUFFERED="1",
                        COLUMNS="220", MOEBENCH_CACHE_DIR=str(out / "cache"))
        if not dry:
            out.mkdir(parents=True, exist_ok=True)

    def knob(self, name: str, default: str = "") -> str:
        return os.environ.get(name, default)

    def say(self, text: str) -> None:
        print(text, flush=True)
        if not self.dry:
            with open(self.log, "a") as f:
                f.write(text + "\n")

    def step(self, text: str) -> None:
        self.say(f"=== {text} ({time.strftime('%H:%M:%S', time.gmtime())})")

    def sh(self, cmd: list[str], tail: int | None = None, timeout: float | None = None, env: dict | None = None,
           stdout: Path | None = None, cwd: str | None = None) -> int:
        """Run cmd (in `cwd` when given); its output (stdout into `stdout` when given) in full, or
        its last `tail` lines, to stdout and the log. Returns the exit status (124 when cut at
        `timeout` seconds)."""
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        if self.dry:
            where = f"(cd {shlex.quote(cwd)} && " if cwd else ""
            print(f"$ {where}{envs + ' ' if envs else ''}{shlex.join(cmd)}{')' if cwd else ''}"
                  f"{' > ' + str(stdout) if stdout else ''}", flush=True)
            return 0
        lines: collections.deque = collections.deque(maxlen=tail)
        killed = threading.Event()
        with open(stdout, "w") if stdout else open(os.devnull, "w") as sink:
            p = subprocess.Popen(cmd, env=dict(self.env, **(env or {})), text=True, errors="replace", cwd=cwd,
                                 stdout=sink if stdout else subprocess.PIPE,
                                 stderr=subprocess.PIPE if stdout else subprocess.STDOUT)
            timer = threading.Timer(timeout, lambda: (killed.set(), p.kill())) if timeout else None
            if timer:
                timer.start()
            for line in p.stderr if stdout else p.stdout:
                (lines.append if tail else self.say)(line.rstrip("\n"))
            rc = p.wait()
            if timer:
                timer.cancel()
        rc = 124 if killed.is_set() else rc
        for line in lines:
            self.say(line)
        if rc:
            self.failed += 1
            self.say(f"(exit {rc}: {shlex.join(cmd[:6])} ...)")
        return rc

    def mb(self, *args: str, tail: int | None = None, **kw) -> int:
        """`moebench ARGS` (its last $TAIL lines, else `tail`)."""
        t = int(self.knob("TAIL")) if self.knob("TAIL") else tail
        return self.sh([PY, "-m", "moebench.cli", *args], tail=t, **kw)

    def case(self, name: str, *args: str, sub: str | None = None, **kw) -> int:
        """`python -m benchmarks NAME ARGS`, writing into $OUT/sub when given."""
        env = dict(kw.pop("env", None) or {}, **({"OUT": str(self.out / sub)} if sub else {}))
        return self.sh([PY, "-m", "benchmarks", name, *args], env=env, **kw)

    def pytest(self, *args: str, tail: int = 5, timeout: float | None = None) -> int:
        return self.sh([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], tail=tail, timeout=timeout)

    def capture(self, cmd: list[str]) -> str:
        """The stdout of a command whose answer drives the job (in a dry run: printed, empty answer)."""
        if self.dry:
            print(f"$ {shlex.join(cmd)}  # its output picks the next steps", flush=True)
            return ""
        return subprocess.run(cmd, env=self.env, text=True, capture_output=True).stdout

    def calibrate(self) -> None:
        """`moebench env --calibrate` into $OUT/env.json, its matmul ceilings into the log."""
        self.step("env --calibrate")
        self.mb("env", "--calibrate", "--json", stdout=self.out / "env.json", tail=3)
        if not self.dry and (self.out / "env.json").is_file():
            text = (self.out / "env.json").read_text().splitlines()
            at = next((i for i, ln in enumerate(text) if "matmul_tflops" in ln), None)
            for ln in text[at:at + 9] if at is not None else []:
                self.say(ln)

    def tar(self, dest: Path, root: Path, names: list[str], exclude: tuple[str, ...] = ()) -> None:
        """dest.tgz of root/names (those that exist), without paths holding an `exclude` part."""
        if self.dry:
            print(f"$ tar czf {dest} -C {root} {' '.join(names)}", flush=True)
            return
        with tarfile.open(dest, "w:gz") as tf:
            for n in names:
                if (root / n).exists():
                    tf.add(root / n, arcname=n, filter=lambda ti: None if any(x in ti.name.split("/") for x in exclude) else ti)

    def archive(self, name: str) -> None:
        """The run folders under $OUT/results into $OUT/NAME.tgz, then removed."""
        self.tar(self.out / f"{name}.tgz", self.out, ["results"])
        if not self.dry:
            shutil.rmtree(self.results, ignore_errors=True)

    def reports(self, dest: Path, root: Path, dirs: list[str], runs: str = "runs") -> None:
        """dest.tgz of root/dirs and only the runs' report.* files below root/runs (no journals)."""
        names = list(dirs)
        if (root / runs).is_dir():
            names += sorted(str(p.relative_to(root)) for p in (root / runs).rglob("report.*"))
        self.tar(dest, root, names)

    def tune_in(self, folder: Path, label: str, common: list[str], new: list[str]) -> None:
        """One resumable tune per folder: skipped when its run has a report, resumed (`tune --resume RUN
        COMMON`) when it has its settings (tune.json), else started (`tune NEW COMMON --results-dir FOLDER`)."""
        runs = sorted(p for p in folder.glob("*/") if p.is_dir()) if folder.is_dir() else []
        run = runs[0] if runs else None
        if run and (run / "report.md").is_file():
            self.step(f"done before: {label} ({run})")
        elif run and (run / "tune.json").is_file():
            self.step(f"resume {label} ({run})")
            self.mb("tune", "--resume", str(run), *common)
        else:
            self.step(f"tune {label}")
            if not self.dry:
                folder.mkdir(parents=True, exist_ok=True)
            self.mb("tune", *new, *common, "--results-dir", str(folder))

    def engine_files(self, folder: Path) -> None:
        """vLLM's and SGLang's shipped H200 files (benchmarks/*_h200_configs.json) as files under folder."""
        if not folder.is_dir():
            self.sh([PY, "-m", "benchmarks", "vllm_kernel", "--write-files", str(folder)], tail=1)

    @staticmethod
    def against(folder: Path, shape_key: str, prec: str) -> list[str]:
        """--against FILE for each engine's H200 file of shape E=..,N=.. in precision bf16 | fp8."""
        out = []
        for f in sorted(folder.glob(f"*/{shape_key},device_name=NVIDIA_H200*.json")):
            if ("fp8_w8a8" in f.name) == (prec == "fp8"):
                out += ["--against", str(f)]
        return out


# ---------------------------------------------------------------------------------------------- jobs


def gpu_tests(c: Ctx, step: str, *args: str, tail: int = 5, timeout: float = 240) -> None:
    if not c.knob("SKIP_TESTS"):
        c.step(step)
        c.pytest(*args, tail=tail, timeout=float(c.knob("TESTS_S", str(timeout))))


def job_sweeps(c: Ctx) -> None:
    r = str(c.results)
    c.calibrate()
    c.step("sweep qwen3-30b-a3b (real, one GPU)")
    c.mb("sweep", "--model", "qwen3-30b-a3b", "--tokens", c.knob("SWEEP_TOKENS", TOKENS6), "--out", r, "--reps", "20")
    for m in ("deepseek-v3", "mixtral-8x7b"):
        bf16 = ["--dtype", "bf16", "--shared-experts", "none"]
        c.step(f"sweep {m} --tp 8 (simulated)")
        c.mb("sweep", "--model", m, "--tp", "8", *bf16, "--tokens", TOKENS6, "--experts", "triton,torch",
             "--prepare-finalize", "no-dpep", "--out", r, "--reps", "20")
        c.step(f"sweep {m} --ep 8 --dp 8 (simulated)")
        c.mb("sweep", "--model", m, "--ep", "8", "--dp", "8", *bf16, "--tokens", "1,16,64,256,1024",
             "--experts", "triton,torch,batched-triton", "--out", r, "--reps", "20")
        c.step(f"compare {m} tp-vs-ep world 8")
        c.mb("compare", "tp-vs-ep", "--model", m, *bf16, "--world-size", "8", "--tokens", "1,8,32,128,512,2048,8192",
             "--experts", "triton,batched-triton,torch", "--plot", str(c.out / f"compare-{m}.png"), "--out", r, "--reps", "20")
    c.step("compare deepseek-v3 tp-vs-ep world 8, zipf routing")
    c.mb("compare", "tp-vs-ep", "--model", "deepseek-v3", "--dtype", "bf16", "--shared-experts", "none", "--world-size", "8",
         "--tokens", "1,8,32,128,512,2048,8192", "--experts", "triton,batched-triton", "--routing", "zipf:1.2",
         "--plot", str(c.out / "compare-deepseek-v3-zipf.png"), "--out", r, "--reps", "20")
    c.step("profile batched-local + batched-triton")
    c.case("profile_case", "--shape", "qwen3-30b-a3b", "--tokens", "1", "--experts", "batched-triton",
           "--prepare-finalize", "batched-local", tail=22)
    if c.knob("TUNE"):
        c.step("tune shards")
        for m, lay in (("deepseek-v3", "--ep"), ("mixtral-8x7b", "--tp")):
            c.mb("tune", "--model", m, lay, "8", "--tokens", TOKENS6, "--budget", "10", "--out", str(c.out / "configs"),
                 "--results-dir", f"{r}/tune")
    gpu_tests(c, "gpu tests", "-m", "gpu", "tests", tail=25, timeout=400)
    c.tar(c.out / "results.tgz", c.out, ["results", "cache", "configs"])
    if not c.dry:
        shutil.rmtree(c.out / "configs", ignore_errors=True)
        shutil.rmtree(c.results, ignore_errors=True)


def job_reference(c: Ctx) -> None:
    gpu_tests(c, "pytest -m gpu tests/gpu", "-m", "gpu", "tests/gpu", tail=15)
    if not c.knob("SKIP_BENCH"):
        c.step("bench_triton")
        c.case("bench_triton", *shlex.split(c.knob("BENCH_ARGS")), tail=30)
    if not c.knob("SKIP_TUNE"):
        for cw in ("0", c.knob("COMPILE_WORKERS", "12")):
            c.step(f"tune qwen3-30b-a3b --compile-workers {cw}")
            c.mb("tune", "--model", "qwen3-30b-a3b", "--tokens", "1,256,4096", "--compile-workers", cw,
                 "--out", str(c.out / f"tune-cw{cw}"), "--results-dir", str(c.results / f"tune-cw{cw}"), tail=14)


#: model, layout, the engines' file shape, precision: the files `tune --kernel vllm` makes (the points
#: where an engine ships a file first)
VK_ITEMS = (("qwen3-30b-a3b", "", "E=128,N=768", "bf16"), ("qwen3-30b-a3b", "", "E=128,N=768", "fp8"),
            ("mixtral-8x7b", "--tp 8", "E=8,N=1792", "bf16"), ("qwen3-235b-a22b", "--tp 8", "E=128,N=192", "bf16"),
            ("deepseek-v3", "--tp 8", "E=256,N=256", "fp8"), ("mixtral-8x7b", "--tp 8", "E=8,N=1792", "fp8"),
            ("qwen3-235b-a22b", "--tp 8", "E=128,N=192", "fp8"), ("deepseek-v3", "--tp 8", "E=256,N=256", "bf16"))


def job_vllm_kernel(c: Ctx) -> None:
    end = time.time() + float(c.knob("BUDGET_S", "480"))
    left = lambda: int(end - time.time())  # noqa: E731
    vk = Path(c.knob("VK_DIR", ".gpu-out/vllmk"))
    cw, tail = c.knob("CW", "12"), 8
    gpu_tests(c, "(a) gpu tests of the vllm-triton experts", "-m", "gpu", "tests/test_vllm_triton.py", tail=3, timeout=150)
    if c.knob("PROFILE"):
        c.step("(e) per-launch CUDA times, fp8 block decode and prefill (triton layer vs the engine files)")
        c.case("vllm_kernel", "--profile", "--shapes", "deepseek-v3-tp8,qwen3-30b-a3b,deepseek-v3-ep8", "--precisions", "fp8",
               "--tokens", "1,16,64,1024,4096", sub="prof", tail=1, timeout=150)
    c.engine_files(vk / "engine")
    done = 0
    for model, lay, en, prec in VK_ITEMS:
        name = f"{model}{lay.replace(' ', '')}-{prec}"
        run = vk / "runs" / name
        if name not in c.knob("ONLY", name).split(","):
            continue
        if (run / "DONE").is_file():
            done += 1
            continue
        budget = left() - int(c.knob("TABLE_RESERVE", "30"))
        if budget < 60 and not c.dry:
            c.step(f"no time left for {name} (next call resumes)")
            continue
        new = vk / "runs" / ".new"
        if (run / "tune.json").is_file():
            args = ["tune", "--resume", str(run), "--compile-workers", cw]
        else:
            args = ["tune", "--model", model, *lay.split(), "--kernel", "vllm", "--tokens", VLLM_TOKENS,
                    *(FP8_BLOCK if prec == "fp8" else []), *c.against(vk / "engine", en, prec),
                    "--budget", c.knob("TUNE_BUDGET", "16"), "--compile-workers", cw, "--out", str(vk / "configs" / "vllm"),
                    "--results-dir", str(new)]
        if not c.dry:
            shutil.rmtree(new, ignore_errors=True)
        c.step(f"(b) tune {name} ({budget}s left for it)")
        rc = c.mb(*args, tail=tail, timeout=budget)
        # a new run's folder is made under .new/: its stable name lets the next call --resume it
        fresh = sorted(new.glob("*-tune-*")) if new.is_dir() else []
        if not run.exists() and fresh:
            fresh[0].rename(run)
        if rc == 0 and not c.dry:
            run.mkdir(parents=True, exist_ok=True)
            (run / "DONE").touch()
            done += 1
    c.step(f"{done} of {len(VK_ITEMS)} tunes done")
    if done == len(VK_ITEMS):
        c.say(f"all {len(VK_ITEMS)} tunes done")
    if done == len(VK_ITEMS) or c.knob("TABLES"):
        routings = c.knob("ROUTINGS", "2")
        c.step("(c) engine files in the vllm-triton experts at the files' token counts (and the triton layer), four shapes")
        c.case("vllm_kernel", "--tuned", c.knob("TUNED_DIR", str(vk / "configs" / "vllm")), "--tokens",
               c.knob("TABLE_TOKENS", VLLM_TOKENS), "--routings", routings, sub="files", tail=4, timeout=max(30, left()))
        c.step("(d) triton layer vs the faster engine file: Mixtral TP1 and the DeepSeek-V3 EP8 shard")
        c.case("vllm_kernel", "--shapes", "mixtral,deepseek-v3-ep8", "--tokens", c.knob("MORE_TOKENS", TOKENS6),
               "--routings", routings, sub="more", tail=4, timeout=max(30, left()))
    c.tar(c.out / "vllmk-state.tgz", vk, ["."], exclude=(".new", "triton-cache"))


def job_pair_store(c: Ctx) -> None:
    t = c.knob("TOKENS", "256,1024,2048,4096")
    c.step("gpu tests of both GEMM2 stores")
    c.pytest("tests/test_triton_experts.py", "tests/test_triton_fp8.py", "-k", "pair_store or topk_sum or matches_reference",
             tail=3, timeout=200)
    c.step("bf16 pair store / atomics / defaults")
    c.case("decode_launches", "--variants", "pairstore,atomic", "--tokens", t, "--rounds", "3", "--reps", "20", "--shapes",
           c.knob("SHAPES", "qwen3-235b-tp8,dsv3-tp8,qwen3-30b-a3b,qwen3-next-80b-a3b,mixtral"), sub="bf16", tail=24, timeout=240)
    c.step("fp8 block pair store / atomics / defaults")
    c.case("decode_launches", "--fp8-block", "--variants", "pairstore,atomic", "--tokens", t, "--rounds", "3", "--reps", "20",
           "--shapes", c.knob("FP8_SHAPES", "qwen3-235b-tp8,dsv3-tp8,qwen3-30b-a3b"), sub="fp8block", tail=16, timeout=200)


def job_token_rows(c: Ctx) -> None:
    shapes = c.knob("SHAPES", "qwen3-30b-a3b,qwen3-235b-tp8,dsv3-tp8,dsv3-ep8,mixtral-tp8,mixtral,qwen3-next-80b-a3b")
    c.step("(0) gpu tests: token rows")
    c.pytest("-m", "gpu", "tests/gpu", "tests/test_triton_experts.py", "tests/test_triton_fp8.py", "-k", "token_rows",
             tail=3, timeout=150)
    for flag, tokens in (([], c.knob("TOKENS", "2,4,8,16,24,32,48,64")), (["--fp8-block"], c.knob("FP8_TOKENS", "4,8,16,32"))):
        c.step(f"(a) decode_launches {' '.join(flag)}")
        c.case("decode_launches", *flag, "--variants", "notokenrows,tokenrows,again", "--tokens", tokens, "--rounds", "3",
               "--reps", "20", "--shapes", shapes, sub="ab", tail=60, timeout=float(c.knob("AB_S", "200")))
    c.step("(b) vllm_kernel bf16")
    c.case("vllm_kernel", "--precisions", "bf16", "--routings", "2", "--shapes",
           c.knob("VK_SHAPES", "qwen3-30b-a3b,qwen3-235b-tp8,mixtral-tp8,mixtral"), "--tokens", c.knob("VK_TOKENS", "8,16"),
           sub="vk", tail=20, timeout=float(c.knob("VK_S", "150")))


def job_ncu(c: Ctx) -> None:
    ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/opt/nvidia/nsight-compute").glob("*/ncu"))), None) \
        or ("/usr/local/cuda/bin/ncu" if Path("/usr/local/cuda/bin/ncu").exists() else None)
    if ncu is None and not c.dry:
        c.step("no ncu on this machine")
        c.failed += 1
        return
    keep = ("Duration", "DRAM Throughput", "Registers Per Thread", "Achieved Occupancy", "Grid Size",
            "Theoretical Occupancy", "Dynamic Shared Memory Per Block", "Eligible Warps Per Scheduler")
    for case in c.knob("CASES", "dsv3-tp8:64:bf16 dsv3-tp8:64:fp8 qwen3-30b-a3b:64:bf16 qwen3-30b-a3b:64:fp8").split():
        shape, tok, prec = case.split(":")
        c.step(f"ncu {case}")
        csv_path = c.out / "ncu" / f"{case}.csv"
        if not c.dry:
            csv_path.parent.mkdir(parents=True, exist_ok=True)
        # 3 warm-up calls of 2 GEMM launches each are skipped; then one call's GEMM1 and GEMM2
        sections = [a for s in ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats",
                                "SchedulerStats") for a in ("--section", s)]
        c.sh([ncu or "ncu", "--clock-control", "none", "-k", "regex:gemm", "--launch-skip", "6", "--launch-count", "2",
              *sections, "--csv", "--page", "details", "--log-file", str(csv_path), PY, "-m", "benchmarks", "profile_case",
              "--shape", shape, "--tokens", tok, *(["--fp8-block"] if prec == "fp8" else []), "--plain", "--calls", "1"],
             tail=3, timeout=float(c.knob("CASE_S", "150")))
        if not c.dry and csv_path.is_file():
            import csv

            rows = list(csv.reader(ln for ln in csv_path.open() if ln.startswith('"')))
            if rows:
                head = rows[0]
                k, m, u, v = (head.index(x) for x in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value"))
                for r in rows[1:]:
                    if r[m] in keep:
                        c.say(f"{r[k][:28]} {r[m]} {r[v]} {r[u]}")
    c.tar(c.out / "ncu.tgz", c.out, ["ncu"])


def job_tune(c: Ctx) -> None:
    r = c.results
    if not c.knob("SKIP_FP8"):
        for lay in ("--ep", "--tp"):
            c.step(f"tune deepseek-v3 {lay} 8 fp8 block 128,128")
            c.mb("tune", "--model", "deepseek-v3", lay, "8", "--tokens", c.knob("FP8_TOKENS", TOKENS6), *FP8_BLOCK,
                 "--out", str(c.out / "configs"), "--results-dir", str(r / "fp8"), tail=14)
        c.reports(c.out / "fp8-tune.tgz", c.out, ["configs"], runs="results/fp8")
    # halving (the default budget) against the whole pruned grid, separate processes and Triton caches
    for pt in c.knob("GRID_POINTS", "qwen3-30b-a3b:1 mixtral-8x7b:16").split():
        m, t = pt.split(":")
        for s in ("halving", "grid"):
            c.step(f"tune {m} --tokens {t} --search {s}")
            cache = c.out / f"tcache-{m}-{t}-{s}"
            c.mb("tune", "--model", m, "--tokens", t, "--search", s, "--out", str(c.out / f"cfg-{s}"),
                 "--results-dir", str(r / s), tail=14, env={"TRITON_CACHE_DIR": str(cache)})
            if not c.dry:
                shutil.rmtree(cache, ignore_errors=True)
                for rep in sorted((r / s).glob("*/report.md")):
                    c.say(f"--- {rep}\n{rep.read_text()}")
    if not c.dry:
        for d in (r, c.out / "cfg-halving", c.out / "cfg-grid"):
            shutil.rmtree(d, ignore_errors=True)


def job_presets(c: Ctx) -> None:
    p = Path(c.knob("PRESETS_DIR", ".gpu-out/presets"))
    if not c.dry:
        (p / "configs").mkdir(parents=True, exist_ok=True)
    items: list[tuple[str, str, str]] = []  # model, layout flags, tokens
    if c.knob("FILL"):
        # vLLM's missing token counts of every sparse shipped file, merged into a copy of it
        rows = json.loads(c.capture([PY, "-m", "moebench.cli", "configs", "coverage", "--device", "NVIDIA_H200", "--json"]) or "[]")
        models = [m for m in c.knob("MODELS").split(",") if m]
        if models:
            rows = sorted((r for r in rows if r["model"] in models), key=lambda r: models.index(r["model"]))
        seen: set[str] = set()
        for r in rows:
            if r["found"] and r["missing_counts"] and r["file"] not in seen:
                seen.add(r["file"])
                if not c.dry and not (p / "configs" / r["file"]).is_file():
                    shutil.copy(Path(r["found"]) / r["file"], p / "configs" / r["file"])
                items.append((r["model"], r["tune_flags"], ",".join(map(str, r["missing_counts"]))))
    else:
        shards = c.knob("SHARDS") or c.capture([PY, "-m", "moebench.cli", "configs", "coverage", "--device", "NVIDIA_H200",
                                                "--shards"]).strip()
        for item in filter(None, shards.split(";")):
            model, _, lay = item.partition(":")
            items.append((model, lay, c.knob("TOKS", TOKENS6)))
    for model, lay, toks in items:
        folder = p / "runs" / (model + lay.replace(" ", "").replace("-", "") + ("-fill" if c.knob("FILL") else ""))
        c.tune_in(folder, f"{model} {lay}", ["--gpus", c.knob("GPUS", "all"), "--compile-workers", c.knob("CW", "0"),
                                             "--out", str(p / "configs")], ["--model", model, *lay.split(), "--tokens", toks])
        c.reports(c.out / "presets.tgz", p, ["configs"])


def job_down(c: Ctx) -> None:
    model, toks = c.knob("MODEL", "qwen3-30b-a3b"), c.knob("TOKS", "1,2,4,8,16")
    d = Path(".gpu-out/down")
    fp8 = bool(c.knob("FP8_BLOCK"))
    if not c.dry:
        shutil.rmtree(d / "runs", ignore_errors=True)  # configs stay: a later call adds token counts to the file
        d.mkdir(parents=True, exist_ok=True)
    c.step("gpu tests (down config)")
    c.pytest("-m", "gpu", "tests/gpu", "-k", "gemm2_own", tail=3)
    c.step(f"tune --down {model} {toks}")
    budget = ["--budget", c.knob("BUDGET")] if c.knob("BUDGET") else []
    c.mb("tune", "--model", model, *c.knob("LAYOUT").split(), "--tokens", toks, *(FP8_BLOCK if fp8 else []), "--down",
         *budget, "--compile-workers", c.knob("CW", "12"), "--out", str(d / "configs"), "--results-dir", str(d / "runs"), tail=12)
    c.reports(c.out / "down.tgz", d, ["configs"])
    c.step("layer with / without the down file")
    c.case("decode_launches", "--shapes", c.knob("SHAPE", model), "--tokens", toks, *(["--fp8-block"] if fp8 else []),
           "--variants", "nodown,again", "--rounds", "2", tail=8, env={"MOEBENCH_CONFIG_DIR": str(d / "configs")})


#: model, tune flags, the moebench file: the files PERF.md section 1's tables read
REFRESH_ITEMS = ("mixtral-8x7b|--tp 8|E=8,N=1792,device_name=NVIDIA_H200.json;"
                 "qwen3-235b-a22b|--tp 8|E=128,N=192,device_name=NVIDIA_H200.json;"
                 "deepseek-v3|--tp 8 --dtype fp8_w8a8 --block-shape 128,128|"
                 "E=256,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json;"
                 "qwen3-30b-a3b|--dtype fp8_w8a8 --block-shape 128,128|"
                 "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")


def job_refresh_files(c: Ctx) -> None:
    p = Path(c.knob("REFRESH_DIR", ".gpu-out/refresh"))
    if not c.dry:
        (p / "configs").mkdir(parents=True, exist_ok=True)
    c.engine_files(p / "engines")
    for item in filter(None, c.knob("ITEMS", REFRESH_ITEMS).split(";")):
        model, flags, file = item.split("|")
        folder = p / "runs" / (model + "".join(ch for ch in flags if ch not in " -,"))
        if not c.dry and not (p / "configs" / file).is_file():
            shutil.copy(Path("moebench/configs") / file, p / "configs" / file)
        prec = "fp8" if "fp8_w8a8" in file else "bf16"
        c.tune_in(folder, f"{model} {flags}", ["--compile-workers", c.knob("CW", "14"), "--out", str(p / "configs")],
                  ["--model", model, *flags.split(), "--tokens", c.knob("TOKENS", VLLM_TOKENS), "--against",
                   f"moebench/configs/{file}", *c.against(p / "engines", file.split(",device_name")[0], prec),
                   "--budget", c.knob("TUNE_BUDGET", "8")])
    c.reports(c.out / "refresh.tgz", p, ["configs"])


def job_vllm_grid(c: Ctx) -> None:
    g = c.out / "grid"
    c.engine_files(g / "engine")
    for model, lay, en, prec in (("qwen3-30b-a3b", "", "E=128,N=768", "bf16"), ("deepseek-v3", "--tp 8", "E=256,N=256", "fp8")):
        t = c.knob("TOKENS", "1,64,1024")
        c.step(f"grid: {model} {lay} {prec} at {t}")
        c.mb("tune", "--model", model, *lay.split(), "--kernel", "vllm", "--search", "grid", "--tokens", t,
             *(FP8_BLOCK if prec == "fp8" else []), *c.against(g / "engine", en, prec), "--compile-workers",
             c.knob("CW", "14"), "--out", str(g / "configs"), "--results-dir", str(g / "runs"), tail=14,
             timeout=float(c.knob("EACH_S", "270")))
    c.tar(c.out / "grid.tgz", c.out, ["grid"], exclude=("triton-cache",))
    if not c.dry:
        shutil.rmtree(g, ignore_errors=True)


def _sweep_pairs(c: Ctx, runs: list[tuple[str, list[str], list[str]]], table: str, common: list[str], md: str) -> None:
    """Per (label, model flags, second dtype's flags): a bf16 sweep and the other dtype's, then the
    table case over everything so far into $OUT/md (a run cut off keeps it)."""
    for label, model, other in runs:
        c.step(f"bf16 / {label} sweeps: {' '.join(model)}")
        sub = other[1] if other[:1] == ["--dtype"] else label
        c.mb("sweep", *model, *common, "--dtype", "bf16", "--out", str(c.results / "bf16"), tail=6)
        c.mb("sweep", *model, *common, *other, "--out", str(c.results / sub), tail=6)
        c.case(table, str(c.results), stdout=c.out / md, tail=3)


def job_fp8(c: Ctx) -> None:
    tok = c.knob("TOK", TOKENS6)
    c.calibrate()
    common = ["--tokens", tok, "--prepare-finalize", "no-dpep", "--reps", "20", "--routings", "4"]
    for model in (["--model", "mixtral-8x7b"], ["--model", "qwen3-30b-a3b"],
                  ["--num-experts", "32", "--topk", "8", "--hidden", "7168", "--intermediate", "2048"]):
        c.step(f"bf16 / fp8 sweeps: {' '.join(model)}")
        c.mb("sweep", *model, *common, "--experts", "triton,torch", "--out", str(c.results / "bf16"), tail=6)
        c.mb("sweep", *model, *common, *FP8_BLOCK, "--experts", "triton", "--out", str(c.results / "fp8-block"), tail=6)
        c.mb("sweep", *model, *common, "--dtype", "fp8_w8a8", "--scales", "token", "--experts", "triton,torch",
             "--out", str(c.results / "fp8-token"), tail=6)
        c.case("fp8_table", str(c.results), stdout=c.out / "fp8_table.md", tail=3)
    c.archive("fp8-sweeps")
    gpu_tests(c, "fp8 gpu tests", "-m", "gpu", "tests/gpu", "-k", "fp8", tail=15)


def job_weight_only(c: Ctx) -> None:
    c.calibrate()
    # silu, no shared experts: the weight-only GEMMs alone, the same layer on both sides of each ratio
    common = ["--tokens", c.knob("TOK", TOKENS6), "--experts", "triton", "--prepare-finalize", "no-dpep", "--reps", "20",
              "--routings", "4", "--activation", "silu", "--shared-experts", "none"]
    _sweep_pairs(c, [(q, ["--model", m], ["--dtype", q]) for m, q in
                     (("gpt-oss-20b", "mxfp4"), ("gpt-oss-120b", "mxfp4"), ("qwen3-30b-a3b", "int4_w4a16"))],
                 "weight_only_table", common, "weight_only.md")
    c.archive("weight-only-sweeps")
    gpu_tests(c, "weight-only gpu tests", "-m", "gpu", "tests/gpu/test_weight_only_gpu.py", tail=15)


def job_shared_experts(c: Ctx) -> None:
    r = c.results
    common = ["--tokens", c.knob("TOK", TOKENS6), "--experts", "triton", "--prepare-finalize", "no-dpep", "--reps", "20",
              "--routings", "4"]
    ds = ["--model", "deepseek-v3", "--tp", "8", "--simulate", "--shared-experts", "all"]
    c.step("deepseek-v3 TP8 bf16, shared experts none / fused / separate")
    c.mb("sweep", *ds, "--dtype", "bf16", *common, "--out", str(r / "ds-bf16"), tail=14)
    c.step("deepseek-v3 TP8 fp8 block[128,128] (the checkpoint's quantization_config), shared experts none / fused / separate")
    c.mb("sweep", *ds, *common, "--out", str(r / "ds-fp8"), tail=14)
    c.case("shared_table", str(r), stdout=c.out / "shared_experts.md", tail=3)
    for dt, sub in (("bf16", "oss"), ("mxfp4", "oss-mxfp4")):
        c.step(f"gpt-oss-20b {dt}: swigluoai with biases vs silu")
        for act in ([], ["--activation", "silu"]):
            c.mb("sweep", "--model", "gpt-oss-20b", "--dtype", dt, *act, *common, "--out", str(r / sub), tail=14)
    c.case("shared_table", str(r), stdout=c.out / "shared_experts.md", tail=3)
    c.archive("shared-sweeps")


def job_compare_flip(c: Ctx) -> None:
    # Mixtral-8x22B has 8 experts: its EP32 is refused in one line (kept in the log), world 8 runs
    for m in c.knob("MODELS", "deepseek-v3 qwen3-235b-a22b gpt-oss-120b mixtral-8x22b").split():
        for w in c.knob("WORLDS", "8 32").split():
            c.step(f"compare {m} tp-vs-ep world {w}")
            c.mb("compare", "tp-vs-ep", "--model", m, "--world-size", w, "--tokens", c.knob("TOKENS", "1,4,16,64,256,1024,4096"),
                 "--experts", c.knob("EXPERTS", "triton,batched-triton"), "--plot", str(c.out / f"compare-{m}-w{w}.png"),
                 "--out", str(c.results / f"{m}-w{w}"), "--reps", c.knob("REPS", "20"), *shlex.split(c.knob("EXTRA")))
    c.step("flip factors")
    folders = [str(p) for p in sorted(c.results.glob("*/*/"))] if not c.dry else [f"{c.results}/*/*/"]
    c.case("flip_table", *folders, stdout=c.out / "flip.md", tail=3)
    if not c.dry and (c.out / "flip.md").is_file():
        c.say((c.out / "flip.md").read_text())
    c.tar(c.out / "results.tgz", c.out, ["results"])


def job_vendor(c: Ctx) -> None:
    vendor = c.knob("VENDOR", "/tmp/moebench-vendor")
    c.step("machine")
    c.sh([PY, "-c", "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', "
          "sys.version.split()[0], torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', "
          "torch.cuda.device_count(), 'GPU(s)')"])
    if not c.knob("SKIP_INSTALL"):
        c.step(f"(0) vendor install from .whl-vendor into {vendor}")
        for lib in ("deepgemm", "deepep"):
            c.mb("vendor", "install", lib, "--find-links", ".whl-vendor", "--target", vendor, tail=5)
    c.env["PYTHONPATH"] = f"{vendor}:{c.env['PYTHONPATH']}"
    # DeepEP's extension looks for NVSHMEM's host library where its build machine had it: the installed one
    nv = c.capture([PY, "-c", "import nvidia.nvshmem as n, os; print(os.path.join(list(n.__path__)[0], 'lib'))"]).strip()
    if nv:
        c.env["LD_LIBRARY_PATH"] = nv + (":" + c.env["LD_LIBRARY_PATH"] if c.env.get("LD_LIBRARY_PATH") else "")
    c.step("env")
    c.mb("vendor", "status", "--json", stdout=c.out / "vendor.json", tail=3)
    c.mb("env", tail=40)
    gpu_tests(c, "(1) gpu tests: shared GPU, vendor adapters", "-m", "gpu", "-rs", "tests/gpu/test_shared_gpu_gpu.py",
              "tests/gpu/test_vendor_gpu.py", tail=40, timeout=420)
    if c.knob("SKIP_SWEEPS"):
        return
    ll, ht, r = c.knob("TOKENS_LL", "1,16,64,128"), c.knob("TOKENS_HT", "128,1024,4096"), str(c.results)
    ep2 = ["--model", "deepseek-v3", "--ep", "2", "--world-size", "2", "--device", "cuda"]
    # MPS=1: CUDA's multi-process service for the normal-mode step (2c), so that the two ranks' kernels
    # run at once on the one GPU instead of taking turns in time slices (a daemon of the user's; the
    # card's settings stay as they are)
    mps = bool(c.knob("MPS")) and shutil.which("nvidia-cuda-mps-control") is not None
    sweep_s = float(c.knob("SWEEP_S", "200"))  # a two-rank sweep that hangs gives the call back
    if c.knob("MPS") and not mps:
        c.say("MPS=1 asked, but this machine has no nvidia-cuda-mps-control: the ranks take turns")
    c.step("(2a) DeepSeek-V3 EP2, two ranks on one GPU: deepep-ll vs all2all-ll, bf16")
    c.mb("sweep", *ep2, "--dtype", "bf16", "--tokens", ll, "--prepare-finalize", "deepep-ll,all2all-ll",
         "--experts", "batched-triton", "--out", r, tail=25, timeout=sweep_s)
    c.step("(2b) the same, fp8 block (DeepEP quantises in its dispatch)")
    c.mb("sweep", *ep2, "--tokens", ll, "--prepare-finalize", "deepep-ll,all2all-ll", "--experts", "batched-triton",
         "--out", r, tail=25, timeout=sweep_s)
    if mps:  # normal mode only: under MPS, DeepEP low-latency's dispatch receive times out (H100, 2026-12-07)
        c.step("MPS daemon on (nvidia-cuda-mps-control -d): the two ranks' kernels run at once")
        mps = c.sh(["nvidia-cuda-mps-control", "-d"], tail=5) == 0
    c.step("(2c) DeepSeek-V3 EP2 prefill, two ranks on one GPU: deepep-ht vs allgather-rs, bf16")
    c.mb("sweep", *ep2, "--dtype", "bf16", "--tokens", ht, "--prepare-finalize", "deepep-ht,allgather-rs",
         "--experts", "triton", "--out", r, tail=25, timeout=sweep_s)
    if mps:
        c.step("MPS daemon off")
        c.sh(["sh", "-c", "echo quit | nvidia-cuda-mps-control"], tail=5)
    c.step("(2d) DeepSeek-V3 TP8 fp8 block: deepgemm vs triton (one rank's share)")
    c.mb("sweep", "--model", "deepseek-v3", "--tp", "8", "--tokens", "16,256,4096", "--prepare-finalize", "no-dpep",
         "--experts", "deepgemm,triton", "--out", r, tail=25)
    c.archive("vendor_sweeps")
    if not c.knob("SKIP_BREAKDOWN"):
        bd = c.knob("BREAKDOWN_TOKENS", "16,64,256,1024,4096")
        c.step("(3) DeepGEMM pairs per launch, DeepSeek-V3 TP8 and EP8 shards, fp8 block")
        c.case("deepgemm_breakdown", "--shapes", "dsv3-tp8,dsv3-ep8", "--tokens", bd, tail=30, timeout=240)


PEER_COLUMNS = "triton,batched-triton,vllm-triton,deepgemm"


def job_peers(c: Ctx) -> None:
    """The peers table (benchmarks/peers.py) in one call: DeepGEMM and triton_kernels installed from
    .whl-vendor; one `peers` run of the moebench columns, vllm-triton and deepgemm over every shape
    and precision, then one of triton-kernels (bf16, mxfp4: it takes no fp8 block scales) beside
    the triton of TK_TRITON, a triton wheel or an unpacked one (a folder), when given (tokenspeed-triton-kernels does not import
    with triton 3.6); their run folders kept under PEERS_DIR (.gpu-out/peers, carried: a cut-off
    call resumes at the first unfinished shape); then the table of every finished run into
    $OUT/peers.md."""
    end = time.time() + float(c.knob("BUDGET_S", "510"))
    left = lambda: int(end - time.time())  # noqa: E731
    vendor, pdir = c.knob("VENDOR", "/tmp/moebench-vendor"), Path(c.knob("PEERS_DIR", ".gpu-out/peers"))
    c.sh(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv"])
    c.sh(["git", "rev-parse", "--short", "HEAD"])
    tk_env = {"PYTHONPATH": f"{vendor}:{c.env['PYTHONPATH']}"}
    wheel = c.knob("TK_TRITON") or next((str(p) for p in sorted(Path(".whl-vendor").glob("triton-*.whl"))), "")
    if wheel and Path(wheel).is_dir():  # an unpacked triton (a wheel too big for one call travels in parts)
        c.step(f"(0) triton for the triton-kernels column: {wheel}")
        tk_env["PYTHONPATH"] = f"{wheel}:{tk_env['PYTHONPATH']}"
    elif wheel:
        side = c.knob("TK_TRITON_DIR", "/tmp/moebench-tk-triton")
        c.step(f"(0) triton for the triton-kernels column: {wheel} into {side}")
        c.sh([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", side, wheel], tail=5)
        tk_env["PYTHONPATH"] = f"{side}:{tk_env['PYTHONPATH']}"
    if not c.knob("SKIP_INSTALL"):
        c.step(f"(0) vendor install deepgemm, triton-kernels from .whl-vendor into {vendor}")
        c.mb("vendor", "install", "deepgemm", "--find-links", ".whl-vendor", "--target", vendor, tail=5)
        if c.mb("vendor", "install", "triton-kernels", "--find-links", ".whl-vendor", "--target", vendor, tail=5, env=tk_env):
            # refused (e.g. known not to import with this triton): put it there all the same, so that
            # `env` and the column's skipped rows give the import's own error
            c.sh([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--find-links", ".whl-vendor", "--target",
                  vendor, "tokenspeed-triton-kernels"], tail=5)
    c.env["PYTHONPATH"] = f"{vendor}:{c.env['PYTHONPATH']}"
    c.mb("vendor", "status", tail=12, env=tk_env)
    if not c.knob("SKIP_TESTS"):
        c.step("(1) gpu tests: the triton-kernels experts (sweeps in bf16, fp8 per-tensor, mxfp4; an EP shard)")
        c.sh([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", "tests/gpu/test_triton_kernels_gpu.py"],
             tail=12, timeout=float(c.knob("TESTS_S", "120")), env=tk_env)
    common = ["--shapes", c.knob("SHAPES", "qwen3-30b-a3b,gpt-oss-20b,mixtral,qwen3-235b-tp8,deepseek-v3-tp8,"
                                           "deepseek-v3-ep8,gpt-oss-120b"),
              "--tokens", c.knob("TOKENS", TOKENS6), "--routings", c.knob("ROUTINGS", "1"), "--reps", c.knob("REPS", "10")]
    precs = c.knob("PRECISIONS", "bf16,fp8,mxfp4")
    tk_s = int(c.knob("TK_S", "90"))
    c.step(f"(2) peers: {c.knob('COLUMNS', PEER_COLUMNS)} ({left()}s left, {tk_s}s kept for triton-kernels)")
    c.case("peers", *common, "--precisions", precs, "--experts", c.knob("COLUMNS", PEER_COLUMNS),
           env={"OUT": str(pdir)}, tail=4, timeout=max(20, left() - tk_s - 15))
    tk_precs = ",".join(p for p in precs.split(",") if p != "fp8")
    if tk_precs and not c.knob("SKIP_TK"):
        c.step(f"(3) peers: triton-kernels, {tk_precs} ({left()}s left)")
        c.case("peers", *common, "--precisions", tk_precs, "--experts", "triton-kernels",
               env=dict(tk_env, OUT=str(pdir)), tail=4, timeout=max(20, left() - 15))
    c.step("(4) the table from every finished run")
    c.case("peers", "--table", str(pdir / "runs"), env={"OUT": str(c.out)}, tail=2)
    if not c.dry and (c.out / "peers.md").is_file():
        c.say((c.out / "peers.md").read_text())
    c.tar(c.out / "peers-state.tgz", pdir, ["."])

#: the layer_times points: PERF.md section 1's shapes through `moebench sweep` (model, its flags)
LAYER_POINTS = (
    ("mixtral-8x7b", ["--experts", "triton", "--prepare-finalize", "no-dpep"]),
    ("mixtral-8x7b", ["--tp", "8", "--experts", "triton", "--prepare-finalize", "no-dpep"]),
    ("qwen3-30b-a3b", ["--experts", "triton", "--prepare-finalize", "no-dpep"]),
    ("deepseek-v3", ["--tp", "8", "--dtype", "bf16", "--shared-experts", "none", "--experts", "triton",
                     "--prepare-finalize", "no-dpep"]),
    ("deepseek-v3", ["--tp", "8", *FP8_BLOCK, "--shared-experts", "none", "--experts", "triton",
                     "--prepare-finalize", "no-dpep"]),
    ("qwen3-30b-a3b", ["--experts", "batched-triton", "--prepare-finalize", "batched-local"]),
)
POINT_KEYS = ["model", "tp", "ep", "experts", "dtype", "quant", "tokens"]


def job_layer_times(c: Ctx) -> None:
    """The triton layer at PERF section 1's points through `moebench sweep`. With BASE (the root of
    another tree, e.g. `git archive REV moebench | tar -x -C DIR`), the same sweeps run from both
    trees in ROUNDS rounds of alternating order, and $OUT/layer_times.md gives each point's median
    latency per tree and new / base: a change's same-run A/B."""
    c.sh(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv"])
    c.sh(["git", "rev-parse", "--short", "HEAD"])
    gpu_tests(c, "gpu tests", "-m", "gpu", "tests/gpu", tail=12)
    runs = (c.results / "layer_times").resolve()
    base = c.knob("BASE")
    trees = [("new", None)] + ([("base", str(Path(base).resolve()))] if base else [])
    rounds = int(c.knob("ROUNDS", "2" if base else "1"))
    # POINTS=TEXT keeps the points whose model and flags contain TEXT (e.g. batched)
    points = [(m, f) for m, f in LAYER_POINTS if c.knob("POINTS", "") in " ".join([m, *f])]
    for r in range(rounds):
        for label, root in (trees if r % 2 == 0 else trees[::-1]):
            for model, flags in points:
                c.step(f"{label} round {r}: sweep {model} {' '.join(flags)}")
                c.mb("sweep", "--model", model, *flags, "--tokens", c.knob("TOKENS", TOKENS6), "--routings", "4",
                     "--out", str(runs / label / f"r{r}"), "--format", "csv", tail=3, timeout=150,
                     cwd=root, env={"PYTHONPATH": root} if root else None)
    if c.dry:
        return
    table = layer_times_table(runs)
    if table is not None:
        table.to_csv(c.out / "layer_times.csv", index=False)
        from moebench.report import markdown

        (c.out / "layer_times.md").write_text(markdown(table))
        c.say(table.to_string(index=False))
    shutil.rmtree(c.results, ignore_errors=True)


def layer_times_table(runs: Path):
    """Median measured time per point and tree (folders runs/<tree>/<round>/<run>/results.csv):
    the layer's latency, or for a simulated TP row the rank's measured experts time (its
    all-reduce is modeled); new / base where both trees ran. None when no row was measured."""
    import pandas as pd

    frames = []
    for f in sorted(runs.glob("*/*/*/results.csv")):
        df = pd.read_csv(f)
        frames.append(df.assign(tree=f.parts[-4]))
    if not frames:
        return None
    df = pd.concat(frames)
    df = df[df.status == "ok"].copy()
    df["quant"] = df["quant"].astype(object).fillna("")
    df["measured_us"] = df["experts_us"].where(df["modeled"].astype(bool), df["latency_us"])
    table = df.pivot_table(index=POINT_KEYS, columns="tree", values="measured_us", aggfunc="median").reset_index()
    if {"new", "base"} <= set(table.columns):
        table["new_over_base"] = (table["new"] / table["base"]).round(3)
    return table.round({"new": 1, "base": 1})


#: the kernel_times shards: moebench's triton / batched-triton experts on the presets' ranks, through
#: `moebench sweep` (simulated where the shard is one rank's: its experts measured here)
KERNEL_TIME_POINTS = (
    ("mixtral-8x7b", ["--experts", "triton", "--prepare-finalize", "no-dpep"]),
    ("mixtral-8x7b", ["--tp", "8", "--experts", "triton", "--prepare-finalize", "no-dpep"]),
    ("qwen3-30b-a3b", ["--experts", "triton", "--prepare-finalize", "no-dpep"]),
    ("qwen3-235b-a22b", ["--tp", "8", "--experts", "triton", "--prepare-finalize", "no-dpep"]),
    ("deepseek-v3", ["--tp", "8", "--dtype", "bf16", "--shared-experts", "none", "--experts", "triton",
                     "--prepare-finalize", "no-dpep"]),
    ("deepseek-v3", ["--tp", "8", *FP8_BLOCK, "--shared-experts", "none", "--experts", "triton",
                     "--prepare-finalize", "no-dpep"]),
    ("deepseek-v3", ["--ep", "8", "--simulate", *FP8_BLOCK, "--shared-experts", "none", "--experts", "triton",
                     "--prepare-finalize", "allgather-rs"]),
    ("deepseek-v3", ["--ep", "8", "--simulate", "--dtype", "bf16", "--shared-experts", "none", "--experts", "triton",
                     "--prepare-finalize", "allgather-rs"]),
)


def job_kernel_times(c: Ctx) -> None:
    """moebench's measured experts times for compare's modeled rows (moebench/bench/kernel_times):
    the KERNEL_TIME_POINTS sweeps, then `kernel_table` over their folders into
    $OUT/kernel_times/<gpu>.csv, the file to ship in moebench/bench/kernel_times/."""
    c.sh(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv"])
    runs = c.results / "kernel_times"
    for model, flags in KERNEL_TIME_POINTS:
        c.step(f"sweep {model} {' '.join(flags)}")
        c.mb("sweep", "--model", model, *flags, "--tokens", c.knob("TOKENS", "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"),
             "--routings", "4", "--out", str(runs), "--format", "csv", tail=3, timeout=600)
    c.step("kernel_table")
    gpu = "gpu"
    if not c.dry:
        import torch

        gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    folders = [str(p) for p in sorted(runs.glob("*/"))] if not c.dry else [f"{runs}/*/"]
    c.case("kernel_table", *folders, "--out", str(c.out / "kernel_times" / f"{gpu}.csv"), tail=2)
    c.tar(c.out / "kernel_times_runs.tgz", c.results, ["kernel_times"])


@dataclass(frozen=True)
class Job:
    name: str
    sections: str  # the PERF.md sections it feeds ("-": none, a tool)
    minutes: str
    what: str
    knobs: str
    run: Callable[[Ctx], None]


JOBS = (
    Job("vllm_kernel", "1, 2", "<= 9 per call", "vllm-triton GPU tests; tune --kernel vllm for 8 files (resumable from "
        ".gpu-out/vllmk, carried); then the same-run kernel tables ($OUT/files, $OUT/more)",
        "SKIP_TESTS TABLES ONLY TUNED_DIR BUDGET_S TUNE_BUDGET CW PROFILE ROUTINGS TABLE_TOKENS MORE_TOKENS VK_DIR",
        job_vllm_kernel),
    Job("pair_store", "1", "3", "GEMM2's per-pair rows vs fp32 atomics: decode_launches bf16 and fp8 block, GPU tests",
        "TOKENS SHAPES FP8_SHAPES", job_pair_store),
    Job("token_rows", "1", "2.5", "token-rows rule A/B (decode_launches) and the vllm_kernel rows it covers",
        "TOKENS FP8_TOKENS SHAPES VK_SHAPES VK_TOKENS AB_S VK_S", job_token_rows),
    Job("ncu", "1", "1", "Nsight Compute on both GEMMs (profile_case --plain) at shape:tokens:precision points",
        "CASES CASE_S", job_ncu),
    Job("reference", "1, 2, 5", "8", "GPU tests, bench_triton (layer, floors, library GEMMs, torch), tune with / without "
        "compile workers", "SKIP_TESTS SKIP_BENCH SKIP_TUNE BENCH_ARGS COMPILE_WORKERS TESTS_S", job_reference),
    Job("vendor", "1", "8", "DeepGEMM / DeepEP installed from carried wheels (.whl-vendor), their GPU tests, EP2 "
        "sweeps with two ranks on one GPU, TP8 deepgemm vs triton", "SKIP_INSTALL SKIP_TESTS SKIP_SWEEPS MPS SWEEP_S TOKENS_LL "
        "TOKENS_HT VENDOR SKIP_BREAKDOWN BREAKDOWN_TOKENS", job_vendor),
    Job("peers", "1", "<= 9 per call", "every engine's experts kernel beside moebench's (triton, batched-triton, "
        "vllm-triton with the faster engine file, deepgemm, triton-kernels) at 7 shapes x 2 precisions: ratios to the "
        "fastest peer and to the floor, item-3 targets ($OUT/peers.md; resumable from .gpu-out/peers, carried)",
        "SHAPES PRECISIONS COLUMNS TOKENS ROUTINGS REPS BUDGET_S TK_S TK_TRITON SKIP_TK SKIP_INSTALL SKIP_TESTS TESTS_S "
        "PEERS_DIR VENDOR", job_peers),
    Job("tune", "2, 3", "10", "fp8 block configs for DeepSeek-V3 EP8 / TP8, then halving vs the whole pruned grid",
        "SKIP_FP8 FP8_TOKENS GRID_POINTS", job_tune),
    Job("presets", "2", "resumable", "bf16 files for the preset layouts without one (FILL=1: vLLM's missing counts); "
        ".gpu-out/presets", "SHARDS GPUS CW FILL MODELS TOKS PRESETS_DIR", job_presets),
    Job("down", "2", "3-8", "GEMM2 (_down.json) file by tune --down, then the layer with / without it",
        "MODEL LAYOUT SHAPE TOKS FP8_BLOCK BUDGET CW", job_down),
    Job("refresh_files", "2", "resumable", "re-tune the files behind section 1 at vLLM's 18 counts against the ones they "
        "replace; .gpu-out/refresh", "ITEMS TOKENS TUNE_BUDGET CW REFRESH_DIR", job_refresh_files),
    Job("vllm_grid", "2", "5 per shape", "every config of vLLM's tuner space against vLLM's and SGLang's files",
        "TOKENS EACH_S CW", job_vllm_grid),
    Job("fp8", "3", "2.5", "env --calibrate, bf16 vs fp8 block / per-token sweeps, fp8_table, fp8 GPU tests",
        "TOK SKIP_TESTS", job_fp8),
    Job("weight_only", "3", "2", "env --calibrate, mxfp4 / int4_w4a16 vs bf16 sweeps, weight_only_table, GPU tests",
        "TOK SKIP_TESTS", job_weight_only),
    Job("shared_experts", "3", "1.5", "DeepSeek-V3 TP8 shared experts fused / separate / none, gpt-oss-20b swigluoai "
        "vs silu, shared_table", "TOK", job_shared_experts),
    Job("kernel_times", "4", "6", "the measured experts times compare's modeled rows read: sweeps of the presets' "
        "ranks (triton, bf16 / fp8 block), kernel_table -> $OUT/kernel_times/<gpu>.csv (ship it in "
        "moebench/bench/kernel_times/)", "TOKENS", job_kernel_times),
    Job("compare_flip", "4", "3", "compare tp-vs-ep for four presets at 8 and 32 ranks, flip_table ($OUT/flip.md)",
        "MODELS WORLDS EXPERTS TOKENS REPS EXTRA", job_compare_flip),
    Job("sweeps", "4, 5", "4", "ceilings, a real sweep, simulated TP8 / EP8 sweeps and tp-vs-ep, GPU tests",
        "SWEEP_TOKENS TUNE SKIP_TESTS", job_sweeps),
    Job("layer_times", "1", "5 (x2 ROUNDS x2 trees with BASE)", "GPU tests, then the triton (and batched-triton) layer "
        "times at section 1's points through moebench sweep; with BASE=DIR (another tree's root) a same-run A/B "
        "($OUT/layer_times.md: new / base per point)", "TOKENS POINTS BASE ROUNDS SKIP_TESTS TESTS_S", job_layer_times),
)
BY_NAME = {j.name: j for j in JOBS}


def list_jobs() -> str:
    width = max(len(j.name) for j in JOBS)
    lines = [f"{'job':<{width}}  {'PERF':<7}  {'minutes':<13}  command (knobs: environment or KNOB=VALUE)"]
    for j in JOBS:
        lines.append(f"{j.name:<{width}}  {j.sections:<7}  {j.minutes:<13}  PYTHONPATH=. python -m benchmarks device {j.name}"
                     f"  [{' '.join(k + '=' for k in j.knobs.split())}]")
        lines.append(f"{'':<{width}}  {j.what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(argv or [])
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    if args == ["--list"]:
        print(list_jobs())
        return 0
    dry = "--dry-run" in args
    names = []
    for a in (a for a in args if a != "--dry-run"):
        key, sep, value = a.partition("=")
        if sep and key.isupper():
            os.environ[key] = value
        else:
            names.append(a)
    bad = [n for n in names if n not in BY_NAME]
    if bad or not names:
        print(f"benchmarks device: {'unknown job ' + repr(bad[0]) if bad else 'no job named'}; "
              f"one of {', '.join(BY_NAME)} (--list)", file=sys.stderr)
        return 2
    failed = 0
    for n in names:
        c = Ctx(Path(os.environ.get("OUT", "./device-out")), dry)
        c.step(f"job {n}")
        BY_NAME[n].run(c)
        c.step("done" if not c.failed else f"done, {c.failed} step(s) failed")
        failed += c.failed
    return 1 if failed else 0
