"""The sweep's driver: how a spec runs here (one process, real ranks, simulated ranks) and the run
folder it writes. Each mode is a runner (moebench.sweep.local, .ranks, .simulated) driven by the one
loop (moebench.sweep.cases.run_cases) over the one measure step (moebench.sweep.measure)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from moebench.errors import MoebenchError
from moebench.inputs import check_fits, dtype_name
from moebench.layout import ParallelLayout
from moebench.results import ResultRow, RunStore, ensure_writable_dir, new_run_id, skip_kind
from moebench.comm.links import DEFAULT_TARGET_GPU, check_tp, check_world, link_for, nvlink_domain
from moebench.backends import declared_communication
from moebench.comm.model import CommModel
from moebench.runtime.distributed import is_main, place_ranks, spawn
from moebench.sweep.cases import cases_to_run, plan, run_cases
from moebench.sweep.local import LocalRunner
from moebench.sweep.ranks import SHARED_GPU_DEVICE, sweep_on_rank
from moebench.sweep.simulated import SimulatedRunner
from moebench.sweep.spec import SweepSpec


def run_local(
    spec: SweepSpec,
    store: RunStore,
    on_progress: Callable[[ResultRow], None] | None = None,
) -> list[ResultRow]:
    """Single-process sweep. Rows go to `store` as they are measured; rows already in the store
    (a resumed run) are skipped. Returns the rows of this sweep, in plan order."""
    if spec.layout.world_size > 1:
        raise MoebenchError("a multi-rank layout runs through run_multirank or run_simulated (CLI: --world-size / --simulate)")
    return run_cases(spec, store, LocalRunner(), on_progress)


def check_ranks_fit(spec: SweepSpec, world_size: int,
                    advice: str = "use --no-check, a smaller shape or fewer --tokens", ranks_per_gpu: int = 1) -> None:
    """Refuse (MoebenchError) before any rank starts when `world_size` ranks of `spec` would not fit
    together: CPU ranks share the host's memory, GPU ranks have one GPU each, or share one
    `ranks_per_gpu` at a time."""
    s, lay = spec.shape, spec.layout
    if lay.enable_ep:
        e_local = -(-s.num_experts // lay.ep_size)
        inter, tokens = s.intermediate, spec.batch_tokens(max(spec.tokens, default=1), True)
    else:
        e_local, inter, tokens = s.num_experts, lay.intermediate_per_rank(s.intermediate), max(spec.tokens, default=1)
    check_fits(e_local, s.hidden, inter, tokens, s.topk, spec.dtype, spec.device, advice,
               ranks=world_size if spec.device == "cpu" else ranks_per_gpu)


def run_multirank(spec: SweepSpec, folder, world_size: int | None = None, ctx=None) -> int:
    """Real ranks: join the torchrun group `ctx`, or spawn `world_size` processes (gloo on CPU,
    NCCL with one GPU each). Rank 0 appends rows to `folder`; returns the rows it wrote."""
    if ctx is not None:
        return sweep_on_rank(ctx, spec, str(folder))
    world = world_size or spec.layout.world_size
    gpus = torch.cuda.device_count() if spec.device == "cuda" else 0
    check_ranks_fit(spec, world, ranks_per_gpu=place_ranks(world, spec.device, gpus, share_gpus=True).ranks_per_gpu)
    return spawn(sweep_on_rank, world, spec.device, spec, str(folder), share_gpus=True)[0]


def run_simulated(spec: SweepSpec, store: RunStore, link, on_progress=None, experts_model=None) -> list[ResultRow]:
    """One device computes one rank's share; communication comes from the cost model (`link`);
    with `experts_model` (Ceilings), the experts time is that GPU's roofline floor instead."""
    return run_cases(simulated_spec(spec, experts_model), store, SimulatedRunner(link, experts_model), on_progress)


def simulated_spec(spec: SweepSpec, experts_model=None) -> SweepSpec:
    """`spec` as a simulated run plans it: communication modeled (every declared transport a
    candidate), and the experts time too where `experts_model` (a target GPU's Ceilings) is given."""
    return replace(spec, model_comm=True, model_experts=experts_model is not None,
                   target_gpu=getattr(experts_model, "device_name", "") or "")


def choose_mode(layout: ParallelLayout, device: str, simulate: bool = False, world_size: int | None = None,
                ctx=None) -> tuple[str, str | None]:
    """How a sweep of `layout` runs here: "single", "torchrun" (joined group `ctx`), "spawn"
    (--world-size real processes) or "simulate"; plus a notice for the user, or None.

    A multi-rank layout asked for without --world-size is simulated (one device computes one
    rank's share); --world-size larger than the visible GPUs on CUDA runs the ranks on the GPUs
    there are, several to a GPU over a gloo group (`shared_gpu_note` says so; the rows say so)."""
    if ctx is not None:
        if ctx.world_size != layout.world_size:
            raise MoebenchError(f"torchrun started {ctx.world_size} ranks but the layout needs {layout.world_size} "
                                f"(dp {layout.dp} x tp {layout.tp})")
        return "torchrun", None
    if layout.world_size == 1:
        note = "--simulate with a single rank changes nothing: running it for real" if simulate else None
        return "single", note
    if simulate:
        return "simulate", None
    if world_size is not None:
        return "spawn", shared_gpu_note(world_size, device)
    return "simulate", (f"{layout.describe()} asked for without --world-size: simulating it (one rank's share "
                        f"computed here, communication modeled); pass --world-size {layout.world_size} to run real ranks")


def shared_gpu_note(world_size: int, device: str, gpu_count: int | None = None) -> str | None:
    """The notice for `world_size` real ranks on fewer GPUs (they share them; gloo group), None
    when each rank has its own device. A MoebenchError where no GPU is visible."""
    if device != "cuda":
        return None
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count
    p = place_ranks(world_size, device, gpus, share_gpus=True)
    if not p.shared:
        return None
    return (f"--world-size {world_size} on {gpus} GPU{'s' if gpus > 1 else ''}: up to {p.ranks_per_gpu} ranks share "
            f"a GPU (gloo group; NCCL takes one rank per GPU). Their rows say device {SHARED_GPU_DEVICE}: checked like "
            f"any row, but their times are not those of one GPU per rank and are never ranked against them")


def run(spec: SweepSpec, store: RunStore, mode: str, link=None, ctx=None,
        on_progress: Callable[[ResultRow], None] | None = None) -> RunStore:
    """Run `spec` the way `choose_mode` decided; returns the store holding every row (for real
    ranks, re-read from the folder rank 0 appended to)."""
    if mode in ("spawn", "torchrun"):
        run_multirank(spec, store.folder, world_size=spec.layout.world_size, ctx=ctx)
        return RunStore(store.folder)
    if mode == "simulate":
        run_simulated(spec, store, link, on_progress=on_progress)
    else:
        run_local(spec, store, on_progress=on_progress)
    return store


def run_in_folder(specs: list[SweepSpec], mode: str, out: Path | str, *, resume: Path | str | None = None,
                  metadata: dict | None = None, argv: list[str] | tuple = (), command: str = "", ctx=None, link=None,
                  on_start: Callable[[RunStore, int], None] | None = None,
                  on_progress: Callable[[ResultRow], None] | None = None) -> RunStore | None:
    """A whole sweep into one run folder: `specs` one after another (one per shared-experts mode),
    run the way `choose_mode` decided (`mode`, `ctx`, `link`). The folder is a new one below `out`
    named after the shape (its settings = `metadata`), or `resume`, continued: its saved settings
    kept, the resume recorded (`argv`), its finished rows skipped. One writer holds the folder for
    the whole sweep; rows are written as they are measured, so an interrupted or failing sweep
    keeps every finished row. Under torchrun rank 0 owns the folder and the other ranks only
    compute: they return None. on_start(store, cases): once the folder is open, with the number of
    cases left to run. Returns the store holding every row. A KeyboardInterrupt (Ctrl-C, SIGTERM,
    SIGHUP) while the folder opens carries it as `run_folder` (None: it holds no settings yet)."""
    if ctx is not None and not is_main(ctx):
        for sp in specs:
            run_multirank(sp, out, ctx=ctx)
        return None
    folder = Path(resume) if resume is not None else ensure_writable_dir(Path(out)) / new_run_id("sweep", specs[0].shape.name)
    try:
        store = owner = RunStore(folder, metadata=None if resume is not None else metadata, lock=True, command=command)
    except KeyboardInterrupt as stop:  # stopped as the folder opened: the caller can still name it
        stop.run_folder = folder if (folder / "metadata.json").is_file() else None
        raise
    try:
        if resume is not None:
            store.record_resume(list(argv))
        if on_start is not None:
            on_start(store, sum(cases_to_run(sp, store, modeled=mode == "simulate") for sp in specs))
        for sp in specs:
            store = run(sp, store, mode, link=link, ctx=ctx, on_progress=on_progress)
    except KeyboardInterrupt as stop:
        stop.run_folder = folder
        raise
    finally:
        owner.close()
    return store


@dataclass
class RunPlan:
    """How a sweep runs here, decided before its folder exists: the mode (`choose_mode`), the
    notice the user gets, and for a simulated run the communication model and why that link."""

    mode: str
    notice: str | None = None
    link: CommModel | None = None
    link_why: str | None = None


def simulation_link(device: str, device_name: str | None, link_name: str | None, link_gbps: float | None,
                    gpus_per_node: int, rdma_name: str, model_device: str | None,
                    requested_gpu: str | None = None, num_sms: int | None = None) -> tuple[CommModel, str]:
    """The communication model of a simulated run over --link (else the target GPU's link, as
    `link_for` chooses) with `gpus_per_node` GPUs per NVLink domain and `rdma_name` between them;
    measured fits of `model_device` are used where `env --calibrate-link` wrote them; num_sms: the
    SMs DeepEP's normal kernels run on (None: DeepEP's default). Returns the model and why that link."""
    link, why = link_for(device, device_name, link_name, link_gbps, requested_gpu=requested_gpu)
    return CommModel.from_link(link, declared_communication(), rdma=rdma_name, gpus_per_node=gpus_per_node,
                               device_name=model_device, num_sms=num_sms), why


def plan_run(specs: list[SweepSpec], *, simulate: bool = False, world_size: int | None = None, ctx=None,
             device_name: str | None = None, link_name: str | None = None, link_gbps: float | None = None,
             gpus_per_node: int | None = None, rdma_name: str = "rdma-400g", target_gpu: str | None = None,
             tp_across_nodes: bool = False, model_device: str | None = None, num_sms: int | None = None) -> RunPlan:
    """Decide how `specs` (one per shared-experts form, one layout) run here, and refuse
    (MoebenchError) what cannot, before any folder exists: a fused shared MLP on real ranks, link
    options without a simulation, a world the nodes do not divide, a run that does not fit, a run
    none of whose pairs can run here. target_gpu: the GPU whose link a simulated run models
    (--target-gpu; default this machine's, on a CPU DEFAULT_TARGET_GPU). tp_across_nodes: a TP
    group may span nodes (its all-reduce over NVLink and RDMA: compare's TP16 on two nodes);
    model_device: the GPU whose measured link fits stand in (default: the target's). num_sms: the
    SMs DeepEP's normal kernels run on in the model (--num-sms; None: DeepEP's default)."""
    spec = specs[0]
    layout = spec.layout
    mode, notice = choose_mode(layout, spec.device, simulate, world_size, ctx)
    if mode in ("spawn", "torchrun") and any(sp.shared == "fused" for sp in specs):
        raise MoebenchError("real ranks (--world-size / torchrun) run shared experts as a separate MLP, not fused into "
                            "the routed experts: use --shared-experts separate (or none), or add --simulate")
    run_plan = RunPlan(mode, notice)
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
        raise MoebenchError(f"--num-sms must be a positive number of SMs, got {num_sms!r}")
    if mode == "simulate":
        gpn = gpus_per_node if gpus_per_node is not None else nvlink_domain(target_gpu or device_name or DEFAULT_TARGET_GPU)
        check_world(layout.world_size, gpn)
        if not layout.enable_ep and not tp_across_nodes:
            check_tp(layout.moe_tp_size, gpn)
        run_plan.link, run_plan.link_why = simulation_link(spec.device, device_name, link_name, link_gbps, gpn,
                                                           rdma_name, model_device or target_gpu or device_name,
                                                           requested_gpu=target_gpu, num_sms=num_sms)
    elif link_gbps is not None or link_name or target_gpu or num_sms is not None:
        raise MoebenchError("--link/--link-gbps/--target-gpu/--num-sms only apply to simulated runs (--simulate)")
    check_fits_for(spec, mode)
    # what cannot run here is known now (a simulated run as it plans: every transport modeled)
    check_some_pair_runs([simulated_spec(sp) if mode == "simulate" and not sp.model_comm else sp for sp in specs])
    return run_plan


def check_fits_for(spec: SweepSpec, mode: str) -> None:
    """The memory check of a run, made before anything is allocated and before its folder
    exists; the one place sweep and compare tp-vs-ep refuse a shape that cannot fit (compare: for
    each layout's spec as it simulates it, `simulated_spec(sp, experts_model)`, mode "simulate").
    The busiest rank of `spec` run as `mode` ("single", "spawn", "torchrun", "simulate") must fit
    this device (what its case runner checks again before it allocates); where the experts time
    is modeled (spec.model_experts) no weights are made here: that rank's weights must fit the
    target GPU (`check_target_fits`). The error says how much is needed and what to do."""
    s, lay = spec.shape, spec.layout
    top = max(spec.tokens, default=0)
    if spec.model_experts:
        check_target_fits(spec)
        return
    if mode == "simulate":
        advice = "shard it over more ranks (--tp/--ep), use a smaller shape or fewer --tokens"
        if lay.enable_ep:
            check_fits(len(lay.local_experts(0, s.num_experts)), s.hidden, s.intermediate,
                       spec.batch_tokens(top, True), s.topk, spec.dtype, spec.device, advice)
        else:
            check_fits(s.num_experts, s.hidden, lay.intermediate_per_rank(s.intermediate), top, s.topk, spec.dtype,
                       spec.device, advice)
        return
    if mode == "spawn":  # every rank at once: on a CPU they share the host's memory, on fewer GPUs than ranks a GPU
        gpus = torch.cuda.device_count() if spec.device == "cuda" else 0
        check_ranks_fit(spec, lay.world_size, "shard it differently, use --simulate, or use fewer --tokens",
                        ranks_per_gpu=place_ranks(lay.world_size, spec.device, gpus, share_gpus=True).ranks_per_gpu)
        return
    if mode == "single":
        check_fits(s.num_experts, s.hidden, s.intermediate, top, s.topk, spec.dtype, spec.device)
    elif lay.enable_ep:
        check_fits(len(lay.local_experts(0, s.num_experts)), s.hidden, s.intermediate, spec.batch_tokens(top, True),
                   s.topk, spec.dtype, spec.device)
    else:
        check_fits(s.num_experts, s.hidden, lay.intermediate_per_rank(s.intermediate), spec.batch_tokens(top, True),
                   s.topk, spec.dtype, spec.device)


def check_target_fits(spec: SweepSpec) -> None:
    """A run whose experts time is the target GPU's floor (spec.model_experts, spec.target_gpu):
    refuse (MoebenchError, with the sizes) where the busiest rank's weights would not fit that
    GPU's memory (its datasheet), or the batch's routing, which is made here, this device."""
    from moebench.bench.hardware import datasheet_ceilings
    from moebench.bench.metrics import expert_weight_bytes

    s, lay = spec.shape, spec.layout
    el = spec.act_bytes
    if lay.enable_ep:
        e_local, inter = len(lay.local_experts(0, s.num_experts)), s.intermediate
    else:
        e_local, inter = s.num_experts, lay.intermediate_per_rank(s.intermediate)
    weights = e_local * expert_weight_bytes(s.hidden, inter, el, spec.quant)
    if spec.shared != "none" and s.shared_intermediate:
        weights += 3 * s.hidden * s.shared_intermediate * el / (1 if lay.enable_ep else lay.moe_tp_size)
    gpu = datasheet_ceilings(spec.target_gpu) if spec.target_gpu else None
    gb = lambda b: f"{b / 1e9:.4g} GB"  # noqa: E731
    if gpu is not None and gpu.memory_gb and weights > gpu.memory_gb * 1e9:
        experts = f"{e_local} expert{'s' if e_local != 1 else ''}"
        raise MoebenchError(
            f"this shape's experts need {gb(weights)} of weights per rank ({experts} of H={s.hidden}, "
            f"I={inter} on {lay.describe()}) but one {spec.target_gpu} holds {gpu.memory_gb:g} GB; spread it over more "
            f"ranks, use a smaller shape or quantised weights (--dtype)")
    # made here: the batch's routing alone (no tokens and no weights: the runner outlines them)
    check_routing_fits(spec, max(spec.tokens, default=0))


def check_quantised_runs(specs: list[SweepSpec]) -> None:
    """Where no pair of quantised `specs` runs here but some would with the weights unquantised
    (a checkpoint's fp8 / mxfp4 quantization_config on a CPU), refuse with that reason and what
    to do: --dtype bf16 (the layer in the activation dtype)."""
    quantised = [sp for sp in specs if sp.quant is not None]
    for sp in quantised:
        plain = replace(sp, quant=None)
        runs = [(pf, ex) for pf, ex, reason in plan(plain) if reason is None]
        if runs:
            pf, ex = runs[0]
            why = next(reason for p, e, reason in plan(sp) if (p, e) == (pf, ex))
            raise MoebenchError(f"no experts backend runs {sp.precision} on {sp.device} here (e.g. {pf}+{ex}: {why}); "
                                f"add --dtype {dtype_name(sp.dtype)} to run the layer unquantised, or run on a GPU")


def check_routing_fits(spec: SweepSpec, tokens: int) -> None:
    """A run whose experts time is modeled makes only the batch's routing (its logits, top-k ids
    and weights, the busiest rank's share): refuse a batch whose routing would not fit here."""
    from moebench.inputs import available_memory

    s = spec.shape
    m = spec.batch_tokens(tokens, spec.layout.use_all2all)
    need = m * s.num_experts * 4 * 3 + m * s.topk * 8 * 6
    have = available_memory(spec.device)
    if need > 0.9 * have:
        raise MoebenchError(f"the routing of {m} tokens over {s.num_experts} experts needs about {need / 2**30:.1f} GiB "
                            f"here but {have / 2**30:.1f} GiB is free; use fewer --tokens")


def check_some_pair_runs(specs: list[SweepSpec]) -> None:
    """Refuse a sweep none of whose pairs can run here (every one would be skipped); the error
    counts the pairs by reason."""
    reasons = [reason for sp in specs for _, _, reason in plan(sp)]
    if reasons and all(reasons):
        check_quantised_runs(specs)
        kinds: dict[str, int] = {}
        for r in reasons:
            kinds[skip_kind(r)] = kinds.get(skip_kind(r), 0) + 1
        counts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        commonest = max(kinds, key=kinds.get)
        example = reasons[0] if len(set(reasons)) == 1 else next(r for r in reasons if skip_kind(r) == commonest)
        raise MoebenchError(f"no pair of --experts and --prepare-finalize can run here ({counts}; e.g. {example}); "
                            f"`moebench env` says what runs here")
