"""Engine config files in the engines' kernel, and moebench's `triton` layer against it, in one run.

    PYTHONPATH=. python -m benchmarks vllm_kernel [--shapes ...] [--precisions bf16,fp8] [--tokens ...]
                                                  [--tuned DIR] [--routings 3] [--smoke]
    # the kernel tables (triton vs the faster engine file) at every shape:
    PYTHONPATH=. python -m benchmarks vllm_kernel --tokens 1,16,64,256,1024,4096 \
        --shapes mixtral,mixtral-tp8,qwen3-30b-a3b,qwen3-235b-tp8,deepseek-v3-tp8,deepseek-v3-ep8

Per shape and precision one sweep (moebench.sweep, `no-dpep`, one run folder under $OUT/runs):
the rows of every column at each token count, on the same routings (cycled through the CUDA-graph
replays, --routings of them; each layer is first checked against the float64 reference). The
engine files are registered sweep variants of the `vllm-triton` experts (`file-new`,
`file-vllm`, `file-sglang`: the experts with the file's nearest entry); `triton` is the layer's
own row of the `triton` experts, `deepgemm` that of the `deepgemm` experts.

  files   the `vllm-triton` experts (vLLM's kernel structure: alignment, fp8 activation
          quantisation, GEMM1, SiLU-and-mul, GEMM2, top-k sum, as vLLM runs them) with each file's
          nearest entry: `new` (the file `tune --kernel vllm` wrote into --tuned, if there),
          vLLM's shipped file (benchmarks/vllm_h200_configs.json), SGLang's
          (benchmarks/sglang_h200_configs.json); ratios new / vllm, new / sglang
  triton  moebench's `triton` experts (its own lookup: moebench's shipped files, alignment and
          activation quantisation included) against the faster of vLLM's / SGLang's file in the
          vllm-triton experts: ratio triton / engine

    # PERF.md's tables from vllm_kernel_triton.csv files (a later file's point replaces an earlier one's):
    PYTHONPATH=. python -m benchmarks vllm_kernel --summary A.csv [B.csv ...] [--ceilings bf16=749.6,fp8=1336.2]

Writes vllm_kernel_files.{csv,md} and vllm_kernel_triton.{csv,md} under $OUT. A point without a
file for a column shows "-" (vLLM ships no H200 file for E=256,N=256 bf16, SGLang's set is
smaller: the JSON files say which; its row in the run folder is a failed one saying so). --smoke:
a tiny shape on a CPU under the interpreter, with stand-in files (checks the script; its times
mean nothing). --summary prints, per precision, how many points of the four
TP shapes (the default ones) are at or below the engine file and their median, then a row per shape: the ratio at 1, 16,
64, 256, 1024 and 4096 tokens (bold: above), at or below, median, the engine file's layer over the
weight-read floor at 16-256 tokens (`read_floor_us`, --read-gbs; the headline counts the points
where 0.90 x the engine would be under it), the 4096-token layer over its compute floor,
2 x tokens x topk x 3 x H x I / the matmul ceiling (--ceilings, TFLOP/s), and at 4096 tokens the
read floor over the compute floor (above 1: a layer within 1.5x of the compute floor must read
its weights at more than 1 / 1.5 of that ratio's share of the read ceiling), and the same with the
bytes of the per-pair structure added (`pair_rows_floor_us`: the intermediate and GEMM2's per-pair
rows, each written and read back; above 1.5: no kernel of that structure meets 1.5x of the compute
floor).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import pandas as pd
import torch

from benchmarks.bench_common import bench_shape, run_shard, script_setup, write_rows, write_table
from moebench.errors import MoebenchError
from moebench.inputs import make_weights
from moebench.kernels.tuned_files import engine_file_name
from moebench.kernels.triton.configs import layer_config
from moebench.kernels.tuned_files import TILE_KEYS, config_search_dirs, device_name, load_config_file, nearest_entry
from moebench.kernels.triton.experts import fused_moe
from moebench.kernels.triton.routing import fused_topk_softmax
from moebench.kernels.vllm_triton import vllm_fused_experts
from moebench.quant import QuantScheme
from moebench.sweep.variants import Case, Variant, register
from moebench.kernels.tuned_files import write_engine_file

#: name: (E, topk, H, I per rank) of a bench_common shard, the engines' file being E=..,N=I. The first
#: four are the tuned files' shapes (the default); mixtral (TP1) and deepseek-v3-ep8 (one EP8 rank's 32
#: experts, top-8 over them as vLLM's tuner routes) complete the kernel tables' shapes.
SHAPES = {name: bench_shape(name)[:4] for name in ("mixtral-tp8", "qwen3-30b-a3b", "qwen3-235b-tp8", "deepseek-v3-tp8",
                                                   "mixtral", "deepseek-v3-ep8")}
DEFAULT_SHAPES = ("mixtral-tp8", "qwen3-30b-a3b", "qwen3-235b-tp8", "deepseek-v3-tp8")
SMOKE_SHAPES = {"tiny": bench_shape("tiny")[:4]}
#: the columns of the files table: the engine files as `vllm-triton` variants
FILES = ("new", "vllm", "sglang")
TOKENS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]
BLOCK = QuantScheme("fp8_w8a8", "block", (128, 128))
HERE = Path(__file__).parent


def engine_table(name: str, e: int, n: int, quant) -> dict[int, dict] | None:
    """The engine's shipped H200 entries for (E, N, scheme) from benchmarks/<name>_h200_configs.json."""
    key = f"E={e},N={n}" + (",dtype=fp8_w8a8,block_shape=[128,128]" if quant is not None else "")
    data = json.loads((HERE / f"{name}_h200_configs.json").read_text())
    if key not in data:
        return None
    return {int(t): dict(zip(TILE_KEYS, v)) for t, v in data[key].items()}


def write_engine_files(folder: Path) -> list[Path]:
    """Every shipped table of benchmarks/{vllm,sglang}_h200_configs.json as the engine's own file,
    folder/<engine>/<the engine's file name> (what `moebench tune --against` reads)."""
    written = []
    for engine in ("vllm", "sglang"):
        data = json.loads((HERE / f"{engine}_h200_configs.json").read_text())
        for key in data:
            if key.startswith("_"):
                continue
            e, n = (int(part.split("=")[1]) for part in key.split(",")[:2])
            quant = BLOCK if "fp8_w8a8" in key else None
            path = folder / engine / engine_file_name(engine, e, n, "NVIDIA_H200", quant)
            written.append(write_engine_file(path, engine_table(engine, e, n, quant)))
    return written


def tuned_table(folder: Path | None, e: int, n: int, quant) -> dict[int, dict] | None:
    """The file `tune --kernel vllm` wrote for this shape on an H200, if it is in `folder`."""
    if folder is None:
        return None
    p = folder / engine_file_name("vllm", e, n, "NVIDIA_H200", quant)
    return {k: dict(v) for k, v in load_config_file(p).items()} if p.is_file() else None


SUMMARY_TOKENS = (1, 16, 64, 256, 1024, 4096)


def read_floor_us(shape: str, prec: str, tokens: int, read_gbs: float) -> float:
    """The layer's weight-read floor: the bytes of the experts that uniform routing touches in
    expectation (E x (1 - (1 - K/E)^M) of E, each 3 x H x I weights of 2 bytes in bf16, 1 in fp8
    plus a 4-byte scale per 128 x 128 block), x read and the output written, over the read ceiling."""
    e, k, h, n = SHAPES[shape]
    touched = e * (1 - (1 - k / e) ** tokens)
    per_expert = 3 * h * n * (2 if prec == "bf16" else 1 + 4 / (128 * 128))
    return (touched * per_expert + tokens * h * 2 * 2) / (read_gbs * 1e3)


def pair_rows_floor_us(shape: str, prec: str, tokens: int, read_gbs: float) -> float:
    """The read floor plus what the per-pair structure moves (vLLM's kernel, the `triton` layer at
    prefill): GEMM1's intermediate written and read back (pairs x I, 2 bytes in bf16, 1 in fp8 plus a
    4-byte scale per 128 values) and GEMM2's pair rows written and read back by the top-k sum
    (pairs x H x 2 bytes), over the read ceiling."""
    e, k, h, n = SHAPES[shape]
    pairs = tokens * k
    inter = 2 * pairs * n * (2 if prec == "bf16" else 1 + 4 / 128)
    return read_floor_us(shape, prec, tokens, read_gbs) + (inter + 2 * pairs * h * 2) / (read_gbs * 1e3)


def summary_tables(rows: list[dict], ceilings: dict[str, float], read_gbs: float = 4374.0) -> str:
    """PERF.md's kernel tables from vllm_kernel_triton rows (a later row of the same point replaces
    an earlier one): per precision a headline over the default shapes' points with an engine file,
    then one row per shape (see the module docstring)."""
    points = {(r["shape"], r["precision"], int(r["tokens"])): r for r in rows}
    shapes = list(dict.fromkeys(s for s, _, _ in points))

    def ratio(r) -> float | None:
        return float(r["triton_over_engine"]) if r and r["triton_over_engine"] not in ("-", "") else None

    def engine_over_floor(key) -> float | None:
        r = points.get(key)
        if r is None or r.get("engine_us") in (None, "-", "") or key[0] not in SHAPES:
            return None
        return float(r["engine_us"]) / read_floor_us(*key, read_gbs)

    out = []
    for prec in dict.fromkeys(p for _, p, _ in points):
        keys = [key for key, r in points.items() if key[1] == prec and key[0] in DEFAULT_SHAPES and ratio(r) is not None]
        every = [ratio(points[key]) for key in keys]
        if every:
            bound = [key for key in keys if (f := engine_over_floor(key)) is not None and 0.9 * f < 1]
            out.append(f"{prec} ({', '.join(DEFAULT_SHAPES)}): {sum(v <= 1 for v in every)} of {len(every)} points "
                       f"at or below, median {statistics.median(every):.3f}; at {len(bound)} of them 0.90 x the "
                       f"engine is under the weight-read floor ({read_gbs:.0f} GB/s)\n")
        out.append(f"| {prec} | " + " | ".join(map(str, SUMMARY_TOKENS))
                   + " | at or below | median | engine / read floor, 16-256 | 4096: us / compute floor"
                   " | 4096: read / compute floor | 4096: read + pair rows / compute floor |")
        out.append("|---" * (len(SUMMARY_TOKENS) + 7) + "|")
        for shape in shapes:
            vals = [v for (s, p, t), r in points.items() if s == shape and p == prec and (v := ratio(r)) is not None]
            cells = []
            for t in SUMMARY_TOKENS:
                v = ratio(points.get((shape, prec, t)))
                cells.append("-" if v is None else f"**{v:.3f}**" if v > 1 else f"{v:.3f}")
            last = points.get((shape, prec, SUMMARY_TOKENS[-1]))
            floor = bound = pair_bound = "-"
            if last and last["triton_us"] not in ("-", "") and prec in ceilings:
                e, k, h, n = SHAPES[shape]
                floor_us = 2 * SUMMARY_TOKENS[-1] * k * 3 * h * n / (ceilings[prec] * 1e6)
                us = float(last["triton_us"])
                floor = f"{us:.0f} / {floor_us:.0f} = **{us / floor_us:.2f}**"
                bound = f"{read_floor_us(shape, prec, SUMMARY_TOKENS[-1], read_gbs) / floor_us:.2f}"
                pair_bound = f"{pair_rows_floor_us(shape, prec, SUMMARY_TOKENS[-1], read_gbs) / floor_us:.2f}"
            decode = [f for (s, p, t) in points if s == shape and p == prec and 16 <= t <= 256
                      and (f := engine_over_floor((s, p, t))) is not None]
            span = f"{min(decode):.2f}-{max(decode):.2f}" if decode else "-"
            med = f"{statistics.median(vals):.3f}" if vals else "-"
            out.append(f"| {shape} | " + " | ".join(cells) + f" | {sum(v <= 1 for v in vals)} of {len(vals)} | {med} | "
                       f"{span} | {floor} | {bound} | {pair_bound} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_kernel")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--tuned", type=Path, default=None, help="folder of the files `tune --kernel vllm` wrote")
    ap.add_argument("--routings", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="instead of the tables: per-kernel CUDA times (torch.profiler, eager) of the triton layer "
                         "and of each engine file's vllm-triton layer, one row per launch (kernel_times.csv)")
    ap.add_argument("--write-files", type=Path, default=None, metavar="DIR",
                    help="only write the shipped engine files as DIR/<engine>/<file name> (for `tune --against`)")
    ap.add_argument("--deepgemm", action="store_true",
                    help="also time the `deepgemm` experts (no-dpep prepare: x quantised in the timed region) on the "
                         "same routings where deep_gemm imports and takes the shape: columns deepgemm_us, "
                         "deepgemm_over_engine")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--summary", type=Path, nargs="+", default=None, metavar="CSV",
                    help="only print PERF.md's tables from these vllm_kernel_triton.csv files")
    ap.add_argument("--ceilings", default="bf16=749.6,fp8=1336.2",
                    help="matmul ceilings for --summary's compute floor, TFLOP/s per precision")
    ap.add_argument("--read-gbs", type=float, default=4374.0,
                    help="read ceiling for --summary's weight-read floor, GB/s (`moebench env --calibrate`)")
    args = ap.parse_args(argv)
    if args.summary is not None:
        rows = [r for p in args.summary for r in csv.DictReader(p.open())]
        print(summary_tables(rows, {k: float(v) for k, v in (c.split("=") for c in args.ceilings.split(","))},
                             args.read_gbs))
        return 0
    if args.write_files is not None:
        for p in write_engine_files(args.write_files):
            print(p)
        return 0
    shapes = dict(SHAPES)
    if args.smoke:
        shapes = SMOKE_SHAPES
        args.shapes, args.routings = "tiny", 1
    out_dir, dev, head = script_setup(f"{args.routings} routings per point")
    head = "# " + head
    tokens = [int(t) for t in args.tokens.split(",")]
    kernel_rows, frames, seen = [], [], {}
    for shape in args.shapes.split(","):
        e, k, h, n = shapes[shape]
        for prec in args.precisions.split(","):
            quant = BLOCK if prec == "fp8" else None
            tables = seen[shape, prec] = file_tables(args.tuned, e, n, quant, args.smoke)
            if args.profile:
                w13, w2 = make_weights(range(e), h, n, torch.bfloat16, str(dev), 0, quant=quant)
                for m in tokens:
                    kernel_rows += _kernel_times(shape, prec, m, e, k, h, w13, w2, tables, dev)
                    if kernel_rows:  # none on a CPU: no device timeline
                        write_rows(kernel_rows, out_dir, "kernel_times", head + "; per-kernel CUDA time per call, eager")
                continue
            for col, table in tables.items():
                register(Variant(f"file-{col}", _file_layer(col, table), checked=True,
                                 about=f"the vllm-triton experts with {col}'s file"))
            experts = [("vllm-triton", [f"file-{c}" for c in FILES]), ("triton", [""])]
            if args.deepgemm:
                experts.append(("deepgemm", [""]))
            rows = run_shard(SHAPE_NAMES.get(shape, shape), tokens, out_dir / "runs", dev, experts, quant=quant,
                             routings=args.routings, reps=20)
            frames.append(rows.assign(shape=shape, precision=prec))
            files, tri = point_tables(pd.concat(frames, ignore_index=True), seen, shapes, dev, args.deepgemm)
            write_table(files, out_dir, "vllm_kernel_files", head + "; engine files in the vllm-triton experts")
            write_table(tri, out_dir, "vllm_kernel_triton",
                        head + "; moebench's triton layer vs the faster engine file in the vllm-triton experts")
    return 0


#: the bench_common shard behind each table name
SHAPE_NAMES = {"deepseek-v3-tp8": "dsv3-tp8", "deepseek-v3-ep8": "dsv3-ep8-local"}


def file_tables(tuned: Path | None, e: int, n: int, quant, smoke: bool) -> dict[str, dict | None]:
    """Each file column's entries for (E, N, scheme): the tuned file in `tuned`, vLLM's, SGLang's;
    None where there is no file. The smoke run's stand-ins exercise every column on its tiny shape."""
    if smoke:  # the real files are for real shapes
        small = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
        return {"new": {1: small}, "vllm": {1: dict(small, BLOCK_SIZE_N=32)}, "sglang": None}
    return {"new": tuned_table(tuned, e, n, quant), "vllm": engine_table("vllm", e, n, quant),
            "sglang": engine_table("sglang", e, n, quant)}


def _file_layer(col: str, table: dict | None):
    """A variant's build: the case's `vllm-triton` layer with the nearest entry of `table`."""

    def build(case: Case):
        if table is None:
            raise MoebenchError(f"no {col} file for this shape and precision")
        layer = case.rebuilt(config=nearest_entry(table, case.tokens)[1])
        return lambda: layer.apply(*case.args)

    return build


def triton_config(shape: tuple, m: int, quant, dev: torch.device) -> tuple[str, str]:
    """GEMM1's config of the `triton` layer at m tokens of `shape` (E, topk, H, I) on `dev`, as its
    lookup finds it: (M/N/K/G/w/s, where it came from)."""
    e, k, h, n = shape
    cfg, src = layer_config(m, local_experts=e, inter=n, hidden=h, topk=k, num_experts=e, dtype=torch.bfloat16,
                            folders=config_search_dirs(), device_name=device_name(dev), quant=quant)
    return "/".join(str(cfg[c]) for c in TILE_KEYS), src


def point_tables(rows: pd.DataFrame, tables: dict, shapes: dict, dev: torch.device,
                 deepgemm: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The files table (each file's layer, new / vllm, new / sglang, the entries, the largest error,
    any column above its tolerance) and the triton table (the `triton` layer against the faster
    of vLLM's and SGLang's files; the `deepgemm` layer beside them where asked for)."""
    rows = rows.copy()
    rows["col"] = rows["variant"].fillna("").str.removeprefix("file-").where(rows["variant"].fillna("") != "",
                                                                               rows["experts"])
    files, tri = [], []
    for (shape, prec, m), point in rows.groupby(["shape", "precision", "tokens"], sort=False):
        ok = point[point.status == "ok"].set_index("col")
        us = {c: round(float(ok.at[c, "latency_us"]), 1) if c in ok.index else None
              for c in (*FILES, "triton", "deepgemm")}
        errs = ok["max_rel_err"].dropna()
        bad = ",".join(ok.index[ok["correct"] == False]) or "-"  # noqa: E712 - a column, not a bool

        def ratio(a, b):
            return round(us[a] / us[b], 3) if us.get(a) and us.get(b) else "-"

        entries = {c: _cfg(tables[shape, prec][c], m) for c in FILES}
        files.append(dict(shape=shape, precision=prec, tokens=m, new_us=us["new"] or "-",
                          vllm_file_us=us["vllm"] or "-", sglang_file_us=us["sglang"] or "-",
                          new_over_vllm=ratio("new", "vllm"), new_over_sglang=ratio("new", "sglang"),
                          new_cfg=entries["new"], vllm_cfg=entries["vllm"], sglang_cfg=entries["sglang"],
                          max_err=f"{errs.max():.2e}" if len(errs) else "-", wrong=bad))
        eng = min((c for c in ("vllm", "sglang") if us[c]), key=lambda c: us[c], default=None)
        cfg, src = triton_config(shapes[shape], m, BLOCK if prec == "fp8" else None, dev)
        row = dict(shape=shape, precision=prec, tokens=m, triton_us=us["triton"] or "-",
                   engine_us=us[eng] if eng else "-", engine_file=eng or "-",
                   triton_over_engine=ratio("triton", eng) if eng else "-", triton_cfg=cfg, triton_cfg_source=src,
                   wrong=bad)
        if deepgemm:
            dg = point[point.experts == "deepgemm"]
            note = "" if us["deepgemm"] else (dg["reason"].iloc[0] if len(dg) else "not run")[:60]
            row.update(deepgemm_us=us["deepgemm"] or "-", deepgemm_over_engine=ratio("deepgemm", eng) if eng else "-",
                       deepgemm_note=note)
        tri.append(row)
    return pd.DataFrame(files), pd.DataFrame(tri)


def _kernel_times(shape, prec, m, e, k, h, w13, w2, tables, dev, calls: int = 10) -> list[dict]:
    """Per-launch CUDA time (us per call, torch.profiler over `calls` eager calls) of the triton
    layer and of every engine file's vllm-triton layer at one point: where each spends its time."""
    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, h, dtype=torch.bfloat16, device=dev, generator=g)
    tw, ids = fused_topk_softmax(torch.randn(m, e, device=dev, generator=g), k, renormalize=True)
    fns = {"triton": lambda: fused_moe(x, w13, w2, tw, ids)}
    for col, table in tables.items():
        if table is not None:
            cfg = nearest_entry(table, m)[1]
            fns[col] = lambda cfg=cfg: vllm_fused_experts(x, w13, w2, tw, ids, cfg)
    rows = []
    for col, fn in fns.items():
        for _ in range(3):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(calls):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        for ev in prof.key_averages():
            dev_us = getattr(ev, "device_time_total", 0.0) or 0.0
            if dev_us <= 0 or ev.key.startswith("aten::"):  # host-side op totals repeat their kernels' time
                continue
            rows.append(dict(shape=shape, precision=prec, tokens=m, column=col, kernel=ev.key[:80],
                             launches_per_call=round(ev.count / calls, 2), us_per_call=round(dev_us / calls, 2)))
    return rows


def _cfg(table, m) -> str:
    if table is None:
        return "-"
    cfg = nearest_entry(table, m)[1]
    return "/".join(str(cfg[k]) for k in TILE_KEYS)
