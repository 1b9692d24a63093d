"""The sweep loop every runner shares: the pairs a spec plans, the row each case starts from, the
runner contract (`CaseRunner`) and `run_cases`, which turns each planned case into a row."""

from __future__ import annotations

from typing import Callable

import torch

from moebench.backends import check_combination
from moebench.errors import WRITE_ERRNOS, MoebenchError, WriteError, one_line
from moebench.inputs import make_tokens
from moebench.results import ResultRow, RunStore
from moebench.routing import make_routing
from moebench.sweep.spec import SweepSpec


def plan(spec: SweepSpec) -> list[tuple[str, str, str | None]]:
    """(prepare_finalize, experts, skip reason or None) for every pair, in a stable order."""
    out = []
    for pf in spec.prepare_finalize:
        for ex in spec.experts:
            reason = check_combination(
                spec.pf_classes[pf], spec.experts_classes[ex], spec.device, spec.dtype, spec.layout.world_size, spec.layout.enable_ep, quant=spec.quant,
                activation=spec.activation, bias=spec.bias, comm_modeled=spec.model_comm,
                experts_modeled=spec.target_gpu if spec.model_experts else None,
            )
            if reason is None and spec.layout.dp > 1 and not spec.pf_classes[pf].communicates:
                reason = (f"prepare/finalize '{pf}' keeps tokens where they are, so dp {spec.layout.dp} > 1 "
                          f"needs a token exchange: use allgather-rs or all2all-ll")
            out.append((pf, ex, reason))
    return out


def allreduce_choices(spec: SweepSpec, pf: str) -> list[str]:
    """The all-reduce implementations a case of `pf` runs with (the `allreduce` column): in a
    simulated run every transport its declared all-reduce can take (nccl, custom), each a row of
    its own; on real ranks the process group's; "" where there is none."""
    world = spec.layout.world_size
    ops = [op for op in spec.pf_classes[pf].communication if op.op == "all-reduce"]
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
                for v in spec.variants:
                    row = base_row(spec, m, pf, ex, ar, v)
                    row.modeled = modeled
                    n += store is None or not store.has(row.key())
    return n


def base_row(spec: SweepSpec, tokens: int, pf: str, ex: str, allreduce: str = "", variant: str = "") -> ResultRow:
    s, lay = spec.shape, spec.layout
    fmt = str(spec.experts_classes[ex].activation_format)
    return ResultRow(
        model=s.name, num_experts=s.num_experts, topk=s.topk, hidden=s.hidden, intermediate=s.intermediate,
        tokens=tokens, tp=lay.tp, dp=lay.dp, ep=lay.ep_size, world_size=lay.world_size,
        prepare_finalize=pf, experts=ex, activation_format=fmt, dtype=spec.dtype_label,
        device=spec.device, routing=spec.routing, quant=spec.quant_label, activation=spec.activation.name,
        expert_bias=spec.bias, shared_experts=spec.shared, allreduce=allreduce, variant=variant,
        check_only=spec.check_only,
    )


class CaseRunner:
    """How the cases of a sweep run in one mode (one process, real ranks, simulated ranks).
    `run_cases` drives every mode through the same loop; a runner only fills a row.

    modeled: its rows are modeled (simulated communication); writes: this process writes rows;
    runs_variants: it times registered variants (moebench.sweep.variants) beside the layer."""

    modeled: bool = False
    writes: bool = True
    runs_variants: bool = False

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


def batch_inputs(spec: SweepSpec, m: int, pf: str, tokens: bool = True):
    """The whole batch of a multi-rank case of `m` tokens through `pf` (identical on every rank,
    from the seed): (tokens in all, x, topk_weights, topk_ids). A prepare/finalize that moves
    tokens brings `m` per rank (unless the spec's tokens are global); one that keeps them, `m`.
    tokens=False: x is None (a modeled experts time needs the routing alone)."""
    s = spec.shape
    m_full = spec.batch_tokens(m, spec.pf_classes[pf].communicates)
    x = make_tokens(m_full, s.hidden, spec.dtype, spec.device, spec.seed + m) if tokens else None
    key = (spec.routing, m_full, s.num_experts, s.topk, spec.seed + m, spec.device, s.router_groups)
    if _ROUTING[0] != key or spec.routing.startswith("file:"):  # the layouts of one comparison route the same batch
        _ROUTING[:] = [key, make_routing(spec.routing, m_full, s.num_experts, s.topk, seed=spec.seed + m,
                                         device=spec.device, groups=s.router_groups)]
    wts, ids = _ROUTING[1]
    return m_full, x, wts, ids


#: The last batch's routing (key, (topk_weights, topk_ids)): read-only to every caller.
_ROUTING: list = [None, None]


def run_cases(spec: SweepSpec, store: RunStore, runner: CaseRunner,
              on_progress: Callable[[ResultRow], None] | None = None) -> list[ResultRow]:
    """The sweep loop of every mode: each (tokens, pair, all-reduce, variant) of `plan(spec)` not
    already in `store` becomes a row: skipped (with the plan's reason), run by `runner`, or failed (the exception's
    first line). Rows go to `store` as they are made (when the runner writes); returns them in
    plan order. `on_progress` sees each row that ran."""
    pairs = plan(spec)
    done = runner.done_keys(store)
    runner.start(spec, [(pf, ex) for pf, ex, reason in pairs if reason is None])
    rows: list[ResultRow] = []
    try:
        for m in spec.tokens:
            for pf, ex, reason in pairs:
                for ar, variant in ((a, v) for a in allreduce_choices(spec, pf) for v in spec.variants):
                    row = base_row(spec, m, pf, ex, ar, variant)
                    row.modeled = runner.modeled
                    if row.key() in done:
                        continue
                    why = reason
                    if why is None and variant and not runner.runs_variants:
                        why = (f"variant '{variant}' is timed on this device only (one process, or --simulate with the "
                               f"experts measured here), not on real ranks or with a modeled experts time")
                    if why is not None:
                        row.status, row.reason = "skipped", why
                    else:
                        inputs = runner.inputs(m, pf)
                        try:
                            runner.run_case(row, m, pf, ex, inputs)
                        except WriteError:
                            raise  # a full disk is no failure of the pair: the run stops, resumable
                        except MoebenchError as e:
                            row.status, row.reason = "failed", str(e)
                        except Exception as e:  # any backend failure (compile error, out of resources, OOM)
                            if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:  # a compile cache on a full disk
                                raise WriteError.from_os(e) from None
                            if spec.device == "cuda":
                                torch.cuda.synchronize()
                            row.status, row.reason = "failed", one_line(e)
                    if runner.writes:
                        store.add(row)
                    rows.append(row)
                    if on_progress is not None and why is None:
                        on_progress(row)
    finally:
        runner.finish()
    return rows
