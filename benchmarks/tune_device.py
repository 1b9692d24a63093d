"""Device check of `moebench tune` (one NVIDIA GPU, about 4-5 minutes with the defaults).

For each model and token count: `halving` with a small budget vs `grid` over the same pruned
subspace vs the default heuristic, all through `moebench.tuning.tuner.tune` (CUDA-graph timing,
correctness checked once per config). Writes `tune_device.md` / `tune_device.json` and each run's
journal and report to --out (default $OUT).

    PYTHONPATH=. python -m benchmarks tune_device [--models mixtral-8x7b,qwen3-30b-a3b]
        [--tokens 16,256] [--budget 12] [--max-seconds 280] [--full-halving]

Halving runs before grid in the same process, so kernels halving compiled are cached in memory
when grid reaches them: grid's search time is a slight underestimate, which makes the reported
time ratio halving/grid conservative. The subspace (SUBSPACE) keeps the grid affordable; with
--full-halving, halving is also run on the whole pruned space (the CLI's default) for the winner
it finds there.

Reference (design.md, vLLM's shipped H200 configs, GEMM part only, routing/alignment outside the
timed region): shown for orientation; moebench's times include the alignment kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from moebench.layout import ParallelLayout
from moebench.models import get_model
from moebench.tuning import tuner as T
from moebench.tuning.space import key_str

SUBSPACE = {
    "BLOCK_SIZE_M": [16, 32, 64],
    "BLOCK_SIZE_N": [64, 128, 256],
    "BLOCK_SIZE_K": [64, 128],
    "GROUP_SIZE_M": [16],
    "num_warps": [4, 8],
    "num_stages": [4],
}

VLLM_SHIPPED_GEMM_US = {  # design.md "Performance reference points", H200 bf16
    ("mixtral-8x7b", 1): 191, ("mixtral-8x7b", 16): 583, ("mixtral-8x7b", 64): 673, ("mixtral-8x7b", 256): 791,
    ("mixtral-8x7b", 1024): 1682, ("mixtral-8x7b", 4096): 5684,
    ("qwen3-30b-a3b", 1): 37, ("qwen3-30b-a3b", 16): 209, ("qwen3-30b-a3b", 64): 302, ("qwen3-30b-a3b", 256): 332,
    ("qwen3-30b-a3b", 1024): 409, ("qwen3-30b-a3b", 4096): 906,
}


def _keep(run_dir: Path, dest: Path) -> None:
    """Copy a run's small files (journal, report, settings) out of the scratch folder."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in run_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)


def _write(out: Path, rows: list[dict], args: argparse.Namespace, sub: dict, total: float) -> None:
    """tune_device.md / .json from the rows so far (called after every model: a run cut short
    still leaves its finished rows)."""
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter: plumbing only)"
    import triton

    lines = [
        f"# moebench tune on {dev} (torch {torch.__version__}, triton {triton.__version__}), "
        f"{time.strftime('%Y-%m-%d')}, {total:.0f} s",
        "",
        f"halving budget {args.budget} vs grid over the subspace {json.dumps(sub)} (pruned per token count); "
        "latencies: median us of one layer call (alignment + both GEMMs), CUDA graph, final stage (50 replays x 8 "
        "routings); search_s: device time of all measurements of the search (compile included).",
        "",
        "| model | M | halving winner | us | grid winner | us | halving/grid | cfgs h/g | search s h/g | time ratio "
        "| default us | speed-up vs default | vLLM shipped GEMM us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v, nd=1: "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))  # noqa: E731
    for d in rows:
        lines.append(
            f"| {d['model']} | {d['tokens']} | {d.get('halving_winner')} | {f(d.get('halving_us'))} | "
            f"{d.get('grid_winner')} | {f(d.get('grid_us'))} | {f(d.get('halving_vs_grid'), 3)} | "
            f"{d.get('halving_configs', '-')}/{d.get('grid_configs', '-')} | "
            f"{f(d.get('halving_search_s'))}/{f(d.get('grid_search_s'))} | {f(d.get('time_ratio'), 3)} | "
            f"{f(d.get('default_us'))} | {f(d.get('speedup_vs_default'), 3)} | {f(d.get('vllm_shipped_gemm_us'))} |"
        )
    if args.full_halving:
        lines += ["", "| model | M | pruned full space | halving-full winner | us | cfgs | search s |", "|---|---|---|---|---|---|---|"]
        for d in rows:
            lines.append(f"| {d['model']} | {d['tokens']} | {d['pruned_full_space']} | {d.get('halving-full_winner')} | "
                         f"{f(d.get('halving-full_us'))} | {d.get('halving-full_configs', '-')} | "
                         f"{f(d.get('halving-full_search_s'))} |")
    text = "\n".join(lines) + "\n"
    (out / "tune_device.md").write_text(text)
    (out / "tune_device.json").write_text(json.dumps({"device": dev, "rows": rows, "subspace": sub,
                                                      "total_s": total}, indent=2, default=str))
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="16,256")
    ap.add_argument("--budget", type=int, default=12)
    ap.add_argument("--max-seconds", type=float, default=270.0, help="Skip blocks that would start after this.")
    ap.add_argument("--full-halving", action="store_true", help="Also run halving over the whole pruned space.")
    ap.add_argument("--out", default=os.environ.get("OUT", "tune_device_out"))
    ap.add_argument("--device", default="cuda", help="cpu only for a plumbing smoke test (Triton interpreter).")
    ap.add_argument("--subspace", default=None, help="JSON value lists replacing SUBSPACE (smoke tests).")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    sub = json.loads(args.subspace) if args.subspace else SUBSPACE
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="moebench-tune-"))
    tokens = [int(t) for t in args.tokens.split(",")]
    t_start = time.perf_counter()
    rows: list[dict] = []
    blocks = [("halving", sub, args.budget), ("grid", sub, None)]
    if args.full_halving:
        blocks.append(("halving-full", None, args.budget * 2))
    for model in args.models.split(","):
        shape = get_model(model)
        model = "".join(c if c.isalnum() or c in "-_." else "_" for c in shape.name)
        per_tok: dict[int, dict] = {t: {"model": model, "tokens": t} for t in tokens}
        for label, space, budget in blocks:
            if time.perf_counter() - t_start > args.max_seconds:
                for t in tokens:
                    per_tok[t][f"{label}_status"] = "skipped (time)"
                continue
            strategy = "grid" if label == "grid" else "halving"
            t0 = time.perf_counter()
            o = T.tune(shape, ParallelLayout(), tokens, dtype, args.device, strategy, budget,
                       out_dir=scratch / "configs" / label, results_dir=scratch / "runs", gpus=[0], space=space,
                       run_dir=scratch / "runs" / f"{model}-{label}")
            wall = time.perf_counter() - t0
            _keep(o.run_dir, out / "runs" / f"{model}-{label}")
            for r in o.results:
                d = per_tok[r.tokens]
                d.update({
                    f"{label}_winner": key_str(r.winner) if r.winner else None, f"{label}_us": r.winner_us,
                    f"{label}_configs": r.candidates, f"{label}_failed": r.failed, f"{label}_search_s": r.search_s,
                    f"{label}_space": r.space_kept, f"{label}_wall_s": wall, f"{label}_status": "ok",
                })
                d.setdefault("default", key_str(r.default) if r.default else None)
                if r.default_us is not None:
                    d.setdefault("default_us", r.default_us)
            print(f"{model} {label}: {wall:.0f} s", flush=True)
        for t in tokens:
            d = per_tok[t]
            d["pruned_full_space"] = len(T.prune_counts(T.TuneSpec(shape, ParallelLayout(), [t], dtype,
                                                                   args.device))[t].kept)
            h, g = d.get("halving_us"), d.get("grid_us")
            d["halving_vs_grid"] = h / g if h and g else None
            hs, gs = d.get("halving_search_s"), d.get("grid_search_s")
            d["time_ratio"] = hs / gs if hs and gs else None
            d["speedup_vs_default"] = d["default_us"] / h if h and d.get("default_us") else None
            d["vllm_shipped_gemm_us"] = VLLM_SHIPPED_GEMM_US.get((model, t))
            rows.append(d)
        _write(out, rows, args, sub, time.perf_counter() - t_start)
    _write(out, rows, args, sub, time.perf_counter() - t_start)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0
