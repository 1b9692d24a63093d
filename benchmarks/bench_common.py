"""Set-up shared by the cases of `python -m benchmarks` (benchmarks/__init__.py lists them):
output folder and header, the layer shards (named from moebench.models' presets), design.md's
reference latencies, the timer (moebench.bench.timing on this machine), the table writer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import triton

import moebench
from moebench.backends import get_experts_class
from moebench.bench.timing import Timing, time_fn
from moebench.errors import MoebenchError
from moebench.kernels.modular import ActivationFormat
from moebench.layout import ParallelLayout
from moebench.models import custom_shape, get_model
from moebench.report import markdown
from moebench.results import atomic_write_text, rows_to_frame
from moebench.comm.links import link_for
from moebench.sweep import SweepSpec, run_in_folder
from moebench.sweep.variants import Case, Variant, register

ON_GPU = torch.cuda.is_available()

#: The layer shards the cases time, by name: (preset of moebench.models, layout). "tp8": the
#: intermediate size split over 8 ranks; "ep8": one rank's 32 experts of 256, routing over all 256
#: (a real EP8 shard: about M local pairs, reached through an expert map; through the sweep, the
#: busiest of the 8 ranks); "ep8-local": top-k routing over the 32 local experts alone (as vLLM's
#: tuner routes, and the reference table's DeepSeek row).
BENCH_SHAPES = {"mixtral": ("mixtral-8x7b", "tp1"), "mixtral-tp8": ("mixtral-8x7b", "tp8"),
                "qwen3-30b-a3b": ("qwen3-30b-a3b", "tp1"), "qwen3-235b-tp8": ("qwen3-235b-a22b", "tp8"),
                "qwen3-next-80b-a3b": ("qwen3-next-80b-a3b", "tp1"), "dsv3-tp8": ("deepseek-v3", "tp8"),
                "dsv3-ep8": ("deepseek-v3", "ep8"), "dsv3-ep8-local": ("deepseek-v3", "ep8-local"),
                "gpt-oss-20b": ("gpt-oss-20b", "tp1"), "gpt-oss-120b": ("gpt-oss-120b", "tp1")}
#: Other spellings of the same shards (vllm_kernel's table names, as PERF.md's raw files hold them).
SHAPE_ALIASES = {"deepseek-v3-tp8": "dsv3-tp8", "deepseek-v3-ep8": "dsv3-ep8-local"}
#: --smoke shapes (E, topk, H, I, E local): small enough for the Triton interpreter on a CPU.
SMOKE_SHAPES = {"tiny": (16, 2, 64, 32, 16), "tiny-map": (32, 4, 64, 32, 8)}


def bench_shape(name: str) -> tuple[int, int, int, int, int]:
    """(E global, topk, H, I per rank, E local) of a BENCH_SHAPES / SHAPE_ALIASES / SMOKE_SHAPES name,
    from the preset's MoEShape; routing is over the E global experts, the first E local kept (through
    an expert map when fewer). MoebenchError naming the choices for an unknown name."""
    if name in SMOKE_SHAPES:
        return SMOKE_SHAPES[name]
    key = SHAPE_ALIASES.get(name, name)
    if key not in BENCH_SHAPES:
        raise MoebenchError(f"unknown shape {name!r}; pick one of {', '.join([*BENCH_SHAPES, *SHAPE_ALIASES])}")
    preset, layout = BENCH_SHAPES[key]
    s = get_model(preset)
    if layout.startswith("tp"):
        return s.num_experts, s.topk, s.hidden, s.intermediate // int(layout[2:]), s.num_experts
    local = s.num_experts // int(layout[2:].split("-")[0])
    if layout.endswith("-local"):
        return local, s.topk, s.hidden, s.intermediate, local
    return s.num_experts, s.topk, s.hidden, s.intermediate, local


#: design.md's reference table ("Performance reference points"): the GEMM part of a vLLM-style fused
#: MoE with vLLM's shipped H200 configs, bf16, us at VLLM_REF_TOKENS tokens.
VLLM_REF_TOKENS = (1, 16, 64, 256, 1024, 4096)
VLLM_REF_US = {"mixtral": (191, 583, 673, 791, 1682, 5684), "qwen3-30b-a3b": (37, 209, 302, 332, 409, 906),
               "dsv3-ep8-local": (197, 681, 779, 832, 2164, 7566)}


def vllm_ref_us(shape: str, tokens: int) -> float:
    """design.md's reference latency of a shape at a token count, nan where the table has none."""
    row = VLLM_REF_US.get(SHAPE_ALIASES.get(shape, shape))
    return float(row[VLLM_REF_TOKENS.index(tokens)]) if row and tokens in VLLM_REF_TOKENS else float("nan")


def shard_spec(name: str, tokens: list[int], dev: torch.device, experts: str, variants: list[str], *,
               quant=None, routings: int = 1, reps: int | None = None, check: bool = True,
               shapes: dict | None = None, activation=None, bias: bool = False) -> tuple[SweepSpec, str, object]:
    """The sweep of one `bench_shape` shard with `experts` behind `no-dpep` (`batched-local` for
    BatchedExperts experts): (spec, mode, link). activation, bias: the experts' (None: silu, none).
    A shard whose experts are all local is a shape of its own, run in one process; one reached
    through an expert map (an EP rank's share of routing over every expert) is a simulated EP run
    over the TP ranks (tokens stay), the busiest rank's experts measured here. reps: timed calls
    (the sweep's default where None); on a CPU (smoke runs) one call after none to warm up."""
    e, k, h, inter, e_local = bench_shape(name)
    batched = get_experts_class(experts).activation_format == ActivationFormat.BATCHED
    spec = SweepSpec(shape=custom_shape(e, k, h, inter, name=name), tokens=tokens, experts=[experts],
                     prepare_finalize=["batched-local" if batched else "no-dpep"], dtype=torch.bfloat16,
                     device=dev.type, quant=quant, routings=routings, reps=reps if ON_GPU else 1,
                     warmup=None if ON_GPU else 0, variants=variants, check=check,
                     **({"activation": activation} if activation is not None else {}), bias=bias)
    if e_local == e:
        return spec, "single", None
    ranks = e // e_local
    spec.layout = ParallelLayout.from_args(ranks, None, ranks)
    link, _ = link_for(dev.type)
    return spec, "simulate", link


def run_shard(name: str, tokens: list[int], runs: Path, dev: torch.device, experts: list[tuple[str, list[str]]],
              **kw) -> pd.DataFrame:
    """Every (experts, its variants) of `experts` on shard `name` through the sweep, into one run
    folder under `runs`: its rows (one per tokens, experts, variant; a simulated shard's rows once
    per modeled all-reduce, whose experts time is the one measurement), as a frame."""
    planned = [shard_spec(name, tokens, dev, ex, variants, **kw) for ex, variants in experts]
    _, mode, link = planned[0]
    store = run_in_folder([sp for sp, _, _ in planned], mode, runs, link=link,
                          metadata={"benchmark": name, "tokens": tokens})
    return rows_to_frame(store.rows)


def write_table(df: pd.DataFrame, out_dir: Path, stem: str, head: str) -> None:
    """Rewrite <stem>.csv and <stem>.md (head, then the table) under out_dir, each by an atomic
    rename, and print the table's last line: a run cut off keeps every finished line."""
    print(" ".join(f"{k}={v}" for k, v in df.iloc[-1].items()), flush=True)
    atomic_write_text(out_dir / f"{stem}.csv", df.to_csv(index=False))
    atomic_write_text(out_dir / f"{stem}.md", head + "\n\n" + markdown(df))


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
    """(w13, w2, expert_map) of a `bench_shape` (E, topk, H, I, E local): random bf16 weights of the
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


def timed(fn: Callable[[], object], reps: int = 30, graph_calls: int = 5, use_graph: bool = True) -> Timing:
    """moebench's timer on this machine: CUDA-graph replays (or events around eager calls without
    use_graph) on the GPU; on a CPU (smoke runs) one call after one warm-up, as the interpreter is slow."""
    if ON_GPU:
        return time_fn(fn, "cuda", reps=reps, graph_calls=graph_calls, use_graph=use_graph)
    return time_fn(fn, "cpu", warmup=1, reps=1)


def timed_us(fn: Callable[[], object], reps: int, graph_calls: int) -> float:
    """Median us of `timed`."""
    return timed(fn, reps=reps, graph_calls=graph_calls).median_us


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


def _library_variant(how: str):
    def build(case: Case):
        x, w13, w2, _, ids, emap, _ = case.args
        local = ids.long() if emap is None else emap.long()[ids.long()]
        calls = library_gemms(x, w13, w2, local)
        if not calls:
            raise MoebenchError("no pair of this rank's share is local: no GEMM to time")
        return calls[how]
    return build


#: the library bounds as sweep variants (16-bit weights): "library-grouped" (torch.grouped_mm),
#: "library-mm" (one torch.mm per hit expert)
LIBRARY_VARIANTS = tuple(register(Variant(f"library-{how}", _library_variant(how), about=about)).name for how, about in (
    ("grouped", "the layer's two GEMMs by torch.grouped_mm on x in expert order, less work than the layer"),
    ("mm", "the layer's two GEMMs by one torch.mm per hit expert, less work than the layer")))
