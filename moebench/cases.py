"""What a sweep is made of, shared by its case runners (moebench.sweep for one process,
moebench.runtime for real and simulated ranks): the SweepSpec, the pairs it plans, the row each
case starts from and the metrics it ends with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from moebench.activation import SILU, Activation
from moebench.bench import metrics
from moebench.errors import MoebenchError
from moebench.inputs import dtype_name, make_tokens
from moebench.kernels.layer import layer_bytes_extra, make_rank_layer, shared_gate_values
from moebench.backends import (
    check_combination,
    experts_names,
    get_experts_class,
    get_prepare_finalize_class,
    prepare_finalize_names,
)
from moebench.layout import ParallelLayout
from moebench.models import MoEShape
from moebench.quant import QuantScheme, precision_text
from moebench.routing import make_routing
from moebench.results import ResultRow, RunStore


@dataclass
class SweepSpec:
    shape: MoEShape
    tokens: list[int]
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    experts: list[str] = field(default_factory=lambda: default_experts())
    prepare_finalize: list[str] = field(default_factory=lambda: prepare_finalize_names())
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    routing: str = "uniform"
    seed: int = 0
    check: bool = True
    warmup: int | None = None
    reps: int | None = None
    #: Distinct routings the timed calls cycle through (1 = the checked routing every call). With
    #: N > 1 every CUDA-graph replay runs N different routings, as vLLM's tuner does, so hot
    #: experts' weights do not stay in L2 from one call to the next.
    routings: int = 1
    #: False: `tokens` are per rank (a DP rank brings M tokens, M * world in all). True: `tokens`
    #: are the whole batch, split over the DP ranks (how tp-vs-ep compares equal work).
    tokens_are_global: bool = False
    #: fp8 scheme (weights and activations quantised; `dtype` is then the activation and output
    #: dtype); None = unquantised.
    quant: QuantScheme | None = None
    #: the experts' activation and biases (moebench.activation; from the model unless overridden)
    activation: Activation = SILU
    bias: bool = False
    #: the shared experts' form in the timed layer: "none", "fused" or "separate" (moebench.kernels.layer)
    shared: str = "none"
    #: simulated runs: the communication comes from the model (every declared transport is a
    #: candidate, whether or not it runs here); model_experts: the experts time is the target
    #: GPU's floor too (the experts need not run here)
    model_comm: bool = False
    model_experts: bool = False
    #: the GPU a modeled experts time speaks of (its datasheet's name)
    target_gpu: str = ""

    @property
    def dtype_label(self) -> str:
        """The `dtype` column: 'fp8_w8a8' for quantised runs, else 'bf16' / 'fp16' / 'fp32'."""
        return self.quant.name if self.quant is not None else dtype_name(self.dtype)

    @property
    def quant_label(self) -> str:
        """The `quant` column: 'per-tensor', 'per-token', 'block[128,128]' or ''."""
        return self.quant.scales_label if self.quant is not None else ""

    @property
    def precision(self) -> str:
        """'bf16', or 'fp8_w8a8 block[128,128] (bf16 activations)'."""
        return precision_text(dtype_name(self.dtype), self.quant)

    @property
    def act_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def batch_tokens(self, m: int, moves_tokens: bool) -> int:
        """Tokens of the whole batch for a case of `m` tokens."""
        if moves_tokens and not self.tokens_are_global:
            return m * self.layout.world_size
        return m

    def timing_kwargs(self) -> dict:
        if self.device == "cuda":
            return {"warmup": self.warmup or 3, "reps": self.reps or 50}
        return {"warmup": self.warmup if self.warmup is not None else 1, "reps": self.reps or 3}


def default_experts() -> list[str]:
    """Every experts backend that competes (the float64 reference only checks)."""
    return [n for n in experts_names() if n != "reference"]


def resolve_names(value: str, valid: list[str], kind: str, default: list[str]) -> list[str]:
    """'all' or a comma list -> names, each checked against the registry."""
    if value in ("all", "", None):
        return list(default)
    names = [v.strip() for v in value.split(",") if v.strip()]
    getter = get_experts_class if kind == "experts" else get_prepare_finalize_class
    for n in names:
        if n not in valid:
            getter(n)  # raises the "unknown ..., valid: ..." error with a suggestion
    return names


def plan(spec: SweepSpec) -> list[tuple[str, str, str | None]]:
    """(prepare_finalize, experts, skip reason or None) for every pair, in a stable order."""
    out = []
    for pf in spec.prepare_finalize:
        for ex in spec.experts:
            reason = check_combination(
                pf, ex, spec.device, spec.dtype, spec.layout.world_size, spec.layout.enable_ep, quant=spec.quant,
                activation=spec.activation, bias=spec.bias, comm_modeled=spec.model_comm,
                experts_modeled=spec.target_gpu if spec.model_experts else None,
            )
            if reason is None and spec.layout.dp > 1 and not get_prepare_finalize_class(pf).communicates:
                reason = (f"prepare/finalize '{pf}' keeps tokens where they are, so dp {spec.layout.dp} > 1 "
                          f"needs a token exchange: use allgather-rs or all2all-ll")
            out.append((pf, ex, reason))
    return out


def allreduce_choices(spec: SweepSpec, pf: str) -> list[str]:
    """The all-reduce implementations a case of `pf` runs with (the `allreduce` column): in a
    simulated run every transport its declared all-reduce can take (nccl, custom), each a row of
    its own; on real ranks the process group's; "" where there is none."""
    world = spec.layout.world_size
    ops = [op for op in get_prepare_finalize_class(pf).communication if op.op == "all-reduce"]
    if not ops or world <= 1:
        return [""]
    if spec.model_comm:
        return [t.removesuffix("-all-reduce") for t in ops[0].transports]
    return ["nccl" if spec.device == "cuda" else "gloo"]


def cases_to_run(spec: SweepSpec, store: RunStore | None = None, modeled: bool = False) -> int:
    """How many (tokens, pair) cases of `spec` will be measured: the pairs `plan` does not skip,
    less those whose rows `store` already holds (a resumed run). What a progress bar counts."""
    runnable = [(pf, ex) for pf, ex, reason in plan(spec) if reason is None]
    n = 0
    for m in spec.tokens:
        for pf, ex in runnable:
            for ar in allreduce_choices(spec, pf):
                row = base_row(spec, m, pf, ex, ar)
                row.modeled = modeled
                n += store is None or not store.has(row.key())
    return n


def base_row(spec: SweepSpec, tokens: int, pf: str, ex: str, allreduce: str = "") -> ResultRow:
    s, lay = spec.shape, spec.layout
    try:
        fmt = str(get_experts_class(ex).activation_format)
    except MoebenchError:
        fmt = "?"
    return ResultRow(
        model=s.name, num_experts=s.num_experts, topk=s.topk, hidden=s.hidden, intermediate=s.intermediate,
        tokens=tokens, tp=lay.tp, dp=lay.dp, ep=lay.ep_size, world_size=lay.world_size,
        prepare_finalize=pf, experts=ex, activation_format=fmt, dtype=spec.dtype_label,
        device=spec.device, routing=spec.routing, quant=spec.quant_label, activation=spec.activation.name,
        expert_bias=spec.bias, shared_experts=spec.shared, allreduce=allreduce,
    )


class CaseRunner:
    """How the cases of a sweep run in one mode (one process, real ranks, simulated ranks).
    `run_cases` drives every mode through the same loop; a runner only fills a row.

    modeled: its rows are modeled (simulated communication); writes: this process writes rows."""

    modeled: bool = False
    writes: bool = True

    def done_keys(self, store: RunStore) -> set[tuple]:
        """Rows already in the run (a resumed run): the loop skips them."""
        return store.keys()

    def start(self, spec: SweepSpec, runnable: list[tuple[str, str]]) -> None:
        """Set up what every case shares (weights...), before the first case; `runnable`: the
        pairs that will run."""

    def inputs(self, m: int, pf: str):
        """The inputs of a case of `m` tokens through `pf` (tokens, routing...), made before the
        case runs: an error here is the user's input (a routing file that cannot be read) and ends
        the run, where an error of the case itself only fails its row."""
        return None

    def run_case(self, row: ResultRow, m: int, pf: str, ex: str, inputs) -> None:
        """Check and time the pair `pf + ex` at `m` tokens on `inputs`, filling `row`. An
        exception becomes a failed row."""
        raise NotImplementedError

    def finish(self) -> None:
        """After the last case."""


def batch_inputs(spec: SweepSpec, m: int, pf: str):
    """The whole batch of a multi-rank case of `m` tokens through `pf` (identical on every rank,
    from the seed): (tokens in all, x, topk_weights, topk_ids). A prepare/finalize that moves
    tokens brings `m` per rank (unless the spec's tokens are global); one that keeps them, `m`."""
    s = spec.shape
    m_full = spec.batch_tokens(m, get_prepare_finalize_class(pf).communicates)
    x = make_tokens(m_full, s.hidden, spec.dtype, spec.device, spec.seed + m)
    wts, ids = make_routing(spec.routing, m_full, s.num_experts, s.topk, seed=spec.seed + m, device=spec.device)
    return m_full, x, wts, ids


def run_cases(spec: SweepSpec, store: RunStore, runner: CaseRunner,
              on_progress: Callable[[ResultRow], None] | None = None) -> list[ResultRow]:
    """The sweep loop of every mode: each (tokens, pair) of `plan(spec)` not already in `store`
    becomes a row: skipped (with the plan's reason), run by `runner`, or failed (the exception's
    first line). Rows go to `store` as they are made (when the runner writes); returns them in
    plan order. `on_progress` sees each row that ran."""
    pairs = plan(spec)
    done = runner.done_keys(store)
    runner.start(spec, [(pf, ex) for pf, ex, reason in pairs if reason is None])
    rows: list[ResultRow] = []
    try:
        for m in spec.tokens:
            for pf, ex, reason in pairs:
                for ar in allreduce_choices(spec, pf):
                    row = base_row(spec, m, pf, ex, ar)
                    row.modeled = runner.modeled
                    if row.key() in done:
                        continue
                    if reason is not None:
                        row.status, row.reason = "skipped", reason
                    else:
                        inputs = runner.inputs(m, pf)
                        try:
                            runner.run_case(row, m, pf, ex, inputs)
                        except MoebenchError as e:
                            row.status, row.reason = "failed", str(e)
                        except Exception as e:  # any backend failure (compile error, out of resources, OOM)
                            if spec.device == "cuda":
                                torch.cuda.synchronize()
                            row.status, row.reason = "failed", one_line(e)
                    if runner.writes:
                        store.add(row)
                    rows.append(row)
                    if on_progress is not None and reason is None:
                        on_progress(row)
    finally:
        runner.finish()
    return rows


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def fill_metrics(row: ResultRow, flops: float, nbytes: float, ceilings) -> None:
    m = metrics.metrics(row.latency_us, flops, nbytes, ceilings, dtype=row.dtype)
    row.tflops, row.gbps, row.roofline_frac = m["tflops"], m["gbps"], m.get("roofline_frac")
    row.floor_us = m.get("floor_us")
    row.ceilings_source = getattr(ceilings, "source", "") if ceilings is not None else "none"


def rank_layer(spec: SweepSpec, experts, tp_rank: int = 0, tp_size: int = 1, shared_shard=None):
    """The RankLayer (moebench.kernels.layer) of `spec` for the global experts `experts` and TP
    shard tp_rank of tp_size: weights (quantised when spec.quant, the unquantised ones kept for
    err_vs_unquantized when checking), biases, shared experts in spec.shared's form."""
    return make_rank_layer(spec.shape, experts, spec.dtype, spec.device, spec.seed, tp_rank, tp_size, spec.activation,
                           spec.bias, spec.shared, spec.quant, keep_unquantized=spec.check, shared_shard=shared_shard)


def shared_gate(spec: SweepSpec, x, m: int):
    """The shared experts' per-token gate (M,) where the model gates them and they run, else None."""
    if spec.shared == "none" or not spec.shape.shared_gate:
        return None
    return shared_gate_values(x, spec.seed + m)


def layer_work(spec: SweepSpec, lw, args: tuple, tokens: int, shared_tokens: int | None = None) -> tuple[float, float]:
    """(flops, bytes) of the layer case `args` (from layer_args): the routed pairs (and fused
    shared pairs) over the experts they hit, the separate shared MLP on `shared_tokens` (default:
    tokens), the biases of the experts hit, the activations in and out."""
    s = spec.shape
    x, w13, w2, tw, ids, emap, n_exp = args
    i = w2.shape[-1]
    local = ids if emap is None else emap.to(ids.device).long()[ids]
    pairs = int((local >= 0).sum())
    hit = int(torch.unique(local[local >= 0]).numel())
    flops = metrics.layer_flops(pairs, 1, s.hidden, i)
    st = tokens if shared_tokens is None else shared_tokens
    if lw.shared_w13 is not None:
        flops += metrics.shared_flops(st, s.hidden, lw.shared_w2.shape[-1])
    nbytes = (hit * metrics.expert_weight_bytes(s.hidden, i, spec.act_bytes, spec.quant)
              + 2 * tokens * s.hidden * spec.act_bytes + layer_bytes_extra(lw, s, hit, spec.act_bytes, spec.quant))
    return float(flops), float(nbytes)
