"""Set-up shared by the cases of `python -m benchmarks` (benchmarks/__init__.py lists them):
output folder and header, the layer shapes and their tile config, a timer, the table writer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import triton

import moebench
from moebench.bench.timing import time_cpu, time_cuda
from moebench.report import markdown
from moebench.results import atomic_write_text

ON_GPU = torch.cuda.is_available()
#: name: (E global, topk, H, I, E local); routing over the E global experts, the first E local
#: kept (through an expert map when fewer). dsv3-ep8-local: top-8 over DeepSeek-V3's 32 local
#: experts (design.md's reference row); dsv3-ep8: routing over all 256 (a real EP8 shard).
SHAPES = {"mixtral": (8, 2, 4096, 14336, 8), "qwen3-30b-a3b": (128, 8, 2048, 768, 128),
          "dsv3-ep8-local": (32, 8, 7168, 2048, 32), "dsv3-ep8": (256, 8, 7168, 2048, 32),
          "qwen3-next-80b-a3b": (512, 10, 2048, 512, 512), "qwen3-235b-tp8": (128, 8, 4096, 192, 128),
          "dsv3-tp8": (256, 8, 7168, 256, 256), "mixtral-tp8": (8, 2, 4096, 1792, 8)}


def ok_rows(root: Path) -> pd.DataFrame:
    """Every ok row of the run folders under `root` (their results.csv), `quant` filled with ''
    where empty: what the table cases start from."""
    frames = [pd.read_csv(p) for p in sorted(Path(root).rglob("results.csv"))]
    if not frames:
        raise SystemExit(f"no results.csv under {root}")
    df = pd.concat(frames, ignore_index=True)
    df = df[df.status == "ok"].copy()
    df["quant"] = df["quant"].fillna("") if "quant" in df else ""
    return df


def script_setup(what: str) -> tuple[Path, torch.device, str]:
    """(output folder $OUT or ./bench-out, created; the device; a header line naming the GPU,
    torch and triton versions and `what`). On a CPU (smoke runs) the header says the times mean
    nothing."""
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if ON_GPU else "cpu (smoke: times mean nothing)"
    return out_dir, torch.device("cuda" if ON_GPU else "cpu"), f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, {what}"


def shard_weights(shape: tuple, scheme, dev: torch.device):
    """(w13, w2, expert_map) of a SHAPES entry (E, topk, H, I, E local): random bf16 weights of the
    local experts scaled to unit-order outputs, quantised with `scheme` when given; the map keeps the
    first E local of the E global experts (None when all are local)."""
    e, _, h, inter, e_local = shape
    dt = torch.bfloat16
    w13 = torch.randn(e_local, 2 * inter, h, dtype=dt, device=dev).mul_(h**-0.5)
    w2 = torch.randn(e_local, h, inter, dtype=dt, device=dev).mul_(inter**-0.5)
    if scheme is not None:
        w13, w2 = moebench.quantize_weights(w13, w2, scheme, act_dtype=dt)
    emap = None
    if e_local < e:
        emap = torch.full((e,), -1, dtype=torch.int32, device=dev)
        emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=dev)
    return w13, w2, emap


def seeded_inputs(m: int, h: int, e: int, dtype: torch.dtype, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, h) in dtype and router logits (m, e) fp32, drawn from a generator seeded with m: the
    scripts time the same tokens and routing at a point."""
    g = torch.Generator(device=dev).manual_seed(m)
    return torch.randn(m, h, dtype=dtype, device=dev, generator=g), torch.randn(m, e, device=dev, generator=g)


def timed_us(fn: Callable[[], object], reps: int, graph_calls: int) -> float:
    """Median us of fn: CUDA-graph replays on the GPU, one wall-clock call on a CPU (smoke)."""
    if ON_GPU:
        return time_cuda(fn, reps=reps, graph_calls=graph_calls).median_us
    return time_cpu(fn, warmup=1, reps=1).median_us


def write_rows(rows: list[dict], out_dir: Path, stem: str, head: str) -> None:
    """Print the last row (key=value) and rewrite <stem>.csv and <stem>.md (head, then the table)
    under out_dir, each by an atomic rename: a run cut off keeps every finished row."""
    print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    df = pd.DataFrame(rows)
    atomic_write_text(out_dir / f"{stem}.csv", df.to_csv(index=False))
    atomic_write_text(out_dir / f"{stem}.md", head + "\n\n" + markdown(df))


def library_gemms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, local_ids: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The layer's two GEMMs done by torch's library kernels on the same rows per expert: a bound
    on what the vendor GEMMs reach at this point's shapes, not a layer. x (M, H) is gathered into
    expert order once here (not timed), and there is no SiLU-and-mul, router weight or top-k sum
    (GEMM2 multiplies a fixed random (P, I) activation): strictly less work than the layer.

    w13 (E, 2I, H), w2 (E, H, I), local_ids (M, K) local expert per pair, -1 for remote ones.
    Returns {name: fn}, empty when no pair is local: "grouped" = two grouped_mm launches (CUTLASS
    grouped GEMM on sm_90); "mm" = one torch.mm per hit expert and GEMM (cuBLAS), into
    preallocated outputs."""
    flat = local_ids.reshape(-1).long()
    valid = (flat >= 0).nonzero().squeeze(1)
    if valid.numel() == 0:
        return {}
    order = valid[torch.argsort(flat[valid], stable=True)]
    counts = torch.bincount(flat[order], minlength=w13.shape[0]).tolist()
    k = local_ids.shape[1]
    a = x[order // k].contiguous()  # (P, H) rows of x in expert order
    p, inter = a.shape[0], w2.shape[2]
    act = torch.randn(p, inter, dtype=x.dtype, device=x.device) * inter**-0.5
    h13 = torch.empty(p, w13.shape[1], dtype=x.dtype, device=x.device)
    y = torch.empty(p, w2.shape[1], dtype=x.dtype, device=x.device)
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    spans = [(e, s - c, s) for e, (c, s) in enumerate(zip(counts, offs.tolist())) if c]

    def grouped():
        grouped_mm(a, w13.transpose(1, 2), offs=offs)
        return grouped_mm(act, w2.transpose(1, 2), offs=offs)

    def per_expert():
        for e, lo, hi in spans:
            torch.mm(a[lo:hi], w13[e].t(), out=h13[lo:hi])
            torch.mm(act[lo:hi], w2[e].t(), out=y[lo:hi])
        return y

    return {"grouped": grouped, "mm": per_expert}
