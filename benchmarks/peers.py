"""Every experts kernel an engine would pick, beside moebench's own, in one run: one table.

    PYTHONPATH=. python -m benchmarks peers [--shapes mixtral,...] [--precisions bf16,fp8,mxfp4]
                                            [--tokens 1,16,64,256,1024,4096] [--routings 1] [--reps 10] [--smoke]
    PYTHONPATH=. python -m benchmarks peers --table RUNS [RUNS ...]    # the table from finished runs

Columns, each an experts backend timed on the same routings by the sweep (moebench.sweep; every
layer first checked against the float64 reference):
  triton          moebench's sorted-token fused MoE (no-dpep)
  batched-triton  moebench's batched kernel (batched-local: the tokens placed per expert in the timed call)
  vllm-triton     vLLM's kernel structure with the faster of vLLM's and SGLang's shipped H200 file
                  (the `file-vllm`, `file-sglang` variants of vllm_kernel; which one: `vllm_file`)
  deepgemm        DeepGEMM's contiguous grouped GEMMs (fp8 block and bf16, Hopper)
  triton-kernels  OpenAI's triton_kernels matmul (bf16, fp8 per-tensor, mxfp4; swigluoai fused)
moebench's own: triton, batched-triton; the peers: vllm-triton, deepgemm, triton-kernels.

Shapes (bench_common shards), precisions: mixtral (Mixtral-8x7B TP1), qwen3-30b-a3b,
qwen3-235b-tp8, deepseek-v3-tp8, deepseek-v3-ep8 (one EP8 rank's 32 experts, routed over them as
vLLM's tuner routes) in bf16 and fp8 (128 x 128 blocks); gpt-oss-20b and gpt-oss-120b (swigluoai
with biases) in bf16 and mxfp4. One run folder per (shape, precision, --experts set) under
$OUT/runs/SHAPE-PREC/SET (DONE when finished: a later call skips it, so a cut-off run resumes where
it stopped; the triton-kernels column may run in a process of its own, beside a newer triton).

The table (peers.csv / peers.md under $OUT, rebuilt after every shape; `--table` rebuilds it from
run folders; peers_not_run.{csv,md}: each column that did not run at a shape and precision, why): per (shape, precision, tokens), each column's layer as "x / y": x its latency over
the fastest peer's, y over the floor, the sweep's `floor_us` of the point (max of the bytes over
the read ceiling and the flops over the matmul ceiling, the weights' bytes as stored: packed
e2m1 + e8m0 for mxfp4; so the read floor where bytes bind, decode, and the compute floor where
flops bind, prefill); "-" where the column did not run (its reason in the run folder), "wrong"
where its check failed. `target`: moebench's fastest (triton or batched-triton) at or below the
fastest peer, and within the floor's factor: 1.05 at 16-256 tokens, 1.3 at 1024-4096, and for
mxfp4 1.5 from 16 tokens: "met", else what missed ("no peer ran" where none did and the floor's
factor holds).
--smoke: tiny shapes on a CPU under the interpreter (the GPU-only columns are skipped rows; the
times mean nothing).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

from benchmarks.bench_common import bench_shape, run_shard, script_setup, write_table
from benchmarks.vllm_kernel import _file_layer, file_tables
from moebench.activation import Activation
from moebench.models import get_model
from moebench.quant import QuantScheme
from moebench.results import RunStore, rows_to_frame
from moebench.sweep.variants import Variant, register

NATIVE = ("triton", "batched-triton")
PEERS = ("vllm-triton", "deepgemm", "triton-kernels")
COLUMNS = NATIVE + PEERS
ENGINE_FILES = ("vllm", "sglang")
#: table name: (bench_common shard, its preset (activation, biases), precisions)
SHAPES = {
    "mixtral": ("mixtral", "mixtral-8x7b", ("bf16", "fp8")),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", "qwen3-30b-a3b", ("bf16", "fp8")),
    "qwen3-235b-tp8": ("qwen3-235b-tp8", "qwen3-235b-a22b", ("bf16", "fp8")),
    "deepseek-v3-tp8": ("dsv3-tp8", "deepseek-v3", ("bf16", "fp8")),
    "deepseek-v3-ep8": ("dsv3-ep8-local", "deepseek-v3", ("bf16", "fp8")),
    "gpt-oss-20b": ("gpt-oss-20b", "gpt-oss-20b", ("bf16", "mxfp4")),
    "gpt-oss-120b": ("gpt-oss-120b", "gpt-oss-120b", ("bf16", "mxfp4")),
}
TABLE_NAME = {shard: name for name, (shard, _, _) in SHAPES.items()}
#: --smoke: (shard, activation, precisions); biases with swigluoai
SMOKE = {"tiny": ("tiny", None, ("bf16", "fp8")), "tiny-oss": ("tiny", "swigluoai", ("mxfp4",))}
TOKENS = (1, 16, 64, 256, 1024, 4096)
SCHEMES = {"bf16": None, "fp8": QuantScheme("fp8_w8a8", "block", (128, 128)), "mxfp4": QuantScheme("mxfp4")}


def floor_limit(prec: str, tokens: int) -> float | None:
    """The factor over the floor item 3 asks of moebench's fastest at this point (None: none)."""
    if prec == "mxfp4":
        return 1.5 if tokens >= 16 else None
    if 16 <= tokens <= 256:
        return 1.05
    if 1024 <= tokens <= 4096:
        return 1.3
    return None


def precision_of(row) -> str:
    if row["dtype"] == "mxfp4" or "mxfp4" in str(row.get("quant", "")):
        return "mxfp4"
    return "fp8" if str(row["dtype"]).startswith("fp8") else "bf16"


def point_us(point: pd.DataFrame) -> tuple[dict[str, float | str], str, float | None]:
    """({column: latency, or 'wrong'}, the faster engine file, the point's floor) of one point's rows."""
    us: dict[str, float | str] = {}
    vllm_file = "-"
    for col in COLUMNS:
        rows = point[point.experts == col]
        if col == "vllm-triton":
            rows = rows[rows.variant.isin([f"file-{f}" for f in ENGINE_FILES])]
        else:
            rows = rows[rows.variant.fillna("") == ""]
        ran = rows[rows.status == "ok"]
        if len(ran) and (ran.correct == False).any():  # noqa: E712 - a column
            us[col] = "wrong"
            continue
        if len(ran):
            best = ran.loc[ran.latency_us.astype(float).idxmin()]
            us[col] = float(best.latency_us)
            if col == "vllm-triton":
                vllm_file = str(best.variant).removeprefix("file-")
    floors = point.floor_us.dropna().astype(float) if "floor_us" in point else pd.Series(dtype=float)
    return us, vllm_file, (float(floors.median()) if len(floors) else None)


def peer_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The table of the module docstring from the sweep's rows (columns shape, precision, tokens,
    one per experts column, fastest_peer, vllm_file, floor_us, target)."""
    rows = rows.copy()
    rows["precision"] = rows.apply(precision_of, axis=1)
    if "variant" not in rows:
        rows["variant"] = ""
    out = []
    for (shape, prec, m), point in rows.groupby(["model", "precision", "tokens"], sort=False):
        us, vllm_file, floor = point_us(point)
        timed = {c: v for c, v in us.items() if isinstance(v, float)}
        peers = {c: v for c, v in timed.items() if c in PEERS}
        fastest = min(peers, key=peers.get) if peers else None
        row = dict(shape=TABLE_NAME.get(shape, shape), precision=prec, tokens=int(m))
        for col in COLUMNS:
            v = us.get(col)
            if not isinstance(v, float):
                row[col] = v or "-"
                continue
            x = f"{v / peers[fastest]:.2f}" if fastest else "-"
            y = f"{v / floor:.2f}" if floor else "-"
            row[col] = f"{x} / {y}"
        native = {c: v for c, v in timed.items() if c in NATIVE}
        best = min(native, key=native.get) if native else None
        missed = []
        if best is None:
            missed.append("no moebench column ran")
        else:
            if fastest and native[best] > peers[fastest]:
                missed.append(f"{fastest} {native[best] / peers[fastest]:.2f}x faster")
            limit = floor_limit(prec, int(m))
            if limit is not None and floor and native[best] / floor > limit:
                missed.append(f"{native[best] / floor:.2f} > {limit} x floor")
        row.update(fastest_peer=fastest or "-", vllm_file=vllm_file, floor_us=round(floor, 1) if floor else "-",
                   best_moebench=best or "-",
                   target=("not: " + "; ".join(missed)) if missed else "met" if peers else "no peer ran")
        out.append(row)
    return pd.DataFrame(out)


def reasons_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Why a column shows "-": each (column, shape, precision) that did not run, with its rows'
    status and reason (the first token count's; one line per distinct reason)."""
    rows = rows.copy()
    rows["precision"] = rows.apply(precision_of, axis=1)
    bad = rows[rows.status != "ok"]
    out = []
    for (col, shape, prec, status, reason), g in bad.groupby(["experts", "model", "precision", "status", "reason"],
                                                             sort=False):
        variants = sorted(set(g.variant.fillna("")) - {""})
        out.append(dict(column=col + (f" ({', '.join(variants)})" if variants else ""),
                        shape=TABLE_NAME.get(shape, shape), precision=prec, status=status,
                        tokens=",".join(map(str, sorted(set(g.tokens.astype(int))))), reason=reason))
    return pd.DataFrame(out, columns=["column", "shape", "precision", "status", "tokens", "reason"])


def write_tables(rows: pd.DataFrame, out_dir: Path, head: str) -> None:
    write_table(peer_table(rows), out_dir, "peers", head)
    reasons = reasons_table(rows)
    if len(reasons):
        write_table(reasons, out_dir, "peers_not_run", head + "; the columns that did not run, and why")


def load_rows(folders: list[Path]) -> pd.DataFrame:
    """Every row of the run folders under `folders` (their rows.jsonl)."""
    frames = [rows_to_frame(RunStore(p.parent).rows) for f in folders for p in sorted(Path(f).rglob("rows.jsonl"))]
    frames = [f for f in frames if len(f)]
    if not frames:
        raise SystemExit(f"no run folders with rows under {', '.join(map(str, folders))}")
    return pd.concat(frames, ignore_index=True)


def _experts(columns: list[str], tables: dict) -> list[tuple[str, list[str]]]:
    for col in ENGINE_FILES:
        register(Variant(f"file-{col}", _file_layer(col, tables.get(col)), checked=True,
                         about=f"the vllm-triton experts with {col}'s file"))
    return [(c, [f"file-{f}" for f in ENGINE_FILES] if c == "vllm-triton" else [""]) for c in columns]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="peers")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--precisions", default="bf16,fp8,mxfp4", help="those of each shape's that are listed here run")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--routings", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--experts", default=",".join(COLUMNS),
                    help="the columns to time in this call (a run folder per set; the table joins them)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--table", type=Path, nargs="+", default=None, metavar="RUNS",
                    help="only rebuild peers.{csv,md} under $OUT from the run folders below these folders")
    args = ap.parse_args(argv)
    out_dir, dev, head = script_setup(f"{args.routings} routing(s) per point")
    from moebench.kernels.triton_kernels import installed_version

    head = f"# {head}, triton_kernels {installed_version()}"
    if args.table is not None:
        write_tables(load_rows(args.table), out_dir, head)
        return 0
    shapes = {k: (shard, None, precs) for k, (shard, _, precs) in SHAPES.items()}
    if args.smoke:
        shapes, args.routings = SMOKE, 1
        if not all(s in SMOKE for s in args.shapes.split(",")):
            args.shapes = ",".join(SMOKE)
    columns = args.experts.split(",")
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise SystemExit(f"peers: unknown --experts {', '.join(unknown)}; the columns are {', '.join(COLUMNS)}")
    tag = "all" if columns == list(COLUMNS) else "_".join(columns)
    tokens = [int(t) for t in args.tokens.split(",")]
    runs = out_dir / "runs"
    for name in args.shapes.split(","):
        shard, act, precs = shapes[name]
        if not args.smoke:
            preset = get_model(SHAPES[name][1])
            act, bias = preset.activation, preset.expert_bias
        else:
            bias = act is not None
        e, k, h, n, _ = bench_shape(shard)
        for prec in (p for p in precs if p in args.precisions.split(",")):
            folder = runs / f"{name}-{prec}" / tag
            if (folder / "DONE").is_file():
                print(f"done before: {name} {prec} {tag}", flush=True)
                continue
            shutil.rmtree(folder, ignore_errors=True)  # a cut-off run of this set starts again
            tables = file_tables(None, e, n, SCHEMES[prec], args.smoke) if prec != "mxfp4" else {}
            run_shard(shard, tokens, folder, dev, _experts(columns, tables), quant=SCHEMES[prec], routings=args.routings,
                      reps=args.reps, activation=Activation(act) if act else None, bias=bias)
            (folder / "DONE").touch()
            write_tables(load_rows([runs]), out_dir, head)
    return 0
