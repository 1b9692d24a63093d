"""TP vs EP as engines deploy it: every layout vLLM, SGLang and TensorRT-LLM run on the GPUs
(moebench.deploy: TP, TP+EP over the all-reduce, DP+EP over each dispatch transport, EP x TP inside
the experts, TP across two nodes), whether each fits (moebench.footprint: the whole model's
weights and the KV cache left per rank), the batch each holds, and per token count the best of the
layouts that fit and that an engine runs, with its launch flags.

Every layout is timed the simulated way (one rank's share computed on this device, communication
from the cost model) so the answer speaks of the target GPUs; on a CPU machine the experts time is
the target GPU's roofline floor (labelled), and a real gloo run checks correctness (within one
node). A layout of replicas (TP8x4 past one node) computes each replica's share of the batch.
Each token count's answer carries the one-sided factors on the modeled communication at which it
would flip (`flip_columns`) and whether the published transports' spread covers the margin
(moebench.comm.robustness). Micro-batch overlap (`--overlap`) is applied to the summary: two halves,
the communication of one hidden behind the experts of the other.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from moebench.comm import robustness
from moebench.backends import check_named_experts_quant, get_prepare_finalize_class, prepare_finalize_names
from moebench.layout import ParallelLayout
from moebench.results import ResultRow, RunStore
from moebench import deploy, footprint
from moebench.bench.hardware import Ceilings, datasheet_ceilings, gpu_target, target_names
from moebench.errors import MoebenchError
from moebench.comm.links import DEFAULT_TARGET_GPU, check_world, nvlink_domain
from moebench.comm.model import CommModel
from moebench.sweep import SweepSpec, check_ranks_fit, default_experts, run_multirank, run_simulated
from moebench.sweep.driver import simulated_spec
from moebench.sweep.simulated import check_spec_for, experts_here


def layout_prepare_finalize(moves_tokens: bool) -> list[str]:
    """The prepare/finalize backends of one side of the comparison, from what each declares:
    those that move tokens between ranks (EP: each rank brings its own tokens), or those that keep
    them in place and run on many ranks (TP)."""
    out = []
    for name in prepare_finalize_names():
        cls = get_prepare_finalize_class(name)
        if cls.communicates == moves_tokens and (cls.max_world_size is None or cls.max_world_size > 1):
            out.append(name)
    return out


def modeled_experts(dtype, quant, activation, bias: bool, target: str) -> list[str]:
    """The experts a comparison considers when their time is the target GPU's floor: every backend
    would show the same floor, so one per activation format: the first (registry order) that runs
    this precision and layer on a GPU."""
    from moebench.backends import check_combination, experts_names, get_experts_class

    chosen: dict[str, str] = {}
    for name in experts_names():
        cls = get_experts_class(name)
        fmt = str(cls.activation_format)
        if not cls.timed or fmt in chosen:
            continue
        stand_in = next(pf for pf in prepare_finalize_names()
                        if str(get_prepare_finalize_class(pf).activation_format) == fmt
                        and not get_prepare_finalize_class(pf).communicates)
        if check_combination(stand_in, name, "cuda", dtype, 1, None, quant=quant, activation=activation, bias=bias,
                             comm_modeled=True, experts_modeled=target) is None:
            chosen[fmt] = name
    return list(chosen.values())


@dataclass
class CompareResult:
    """summary: one row per (tokens, layout) with the best correct pair and its breakdown;
    crossover: first token count where the winner differs from the winner at the smallest count;
    recommendation: one line with its reason; rows: every row behind the summary."""

    summary: pd.DataFrame
    crossover: int | None
    recommendation: str
    rows: list[ResultRow] = field(default_factory=list)


TP_MAX_RANKS = deploy.TP_MAX_RANKS


def tp_replicas(world_size: int, gpus_per_node: int | None) -> int:
    """TP replicas of a comparison over `world_size` ranks: one TP group per node (at most
    TP_MAX_RANKS ranks, the largest that divides the world), 1 within one such group."""
    return world_size // deploy._tp_group(world_size, gpus_per_node or world_size)


def ep_group(world_size: int, num_experts: int | None) -> int:
    """Ranks of one EP group: all of them, or - where the model has fewer experts than ranks - the
    largest divisor of the world that gets every rank an expert (the rest are replicas)."""
    if num_experts is None or world_size <= num_experts:
        return world_size
    return max(d for d in range(1, num_experts + 1) if world_size % d == 0)


def replicas(name: str) -> int:
    """The replicas of a layout name: 'TP8x4' -> 4, 'DP32+EP32' -> 1."""
    tail = name.rsplit("x", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else 1


def candidate_list(world_size: int, gpus_per_node: int | None, shape) -> list[deploy.Candidate]:
    return deploy.candidates(world_size, gpus_per_node or min(world_size, 8), shape.num_experts, shape.intermediate)


def layouts(world_size: int, gpus_per_node: int | None = None, num_experts: int | None = None,
            intermediate: int = 1 << 20) -> dict[str, ParallelLayout]:
    """Each candidate's name and one replica's layout (moebench.deploy.candidates)."""
    return {c.name: c.layout for c in deploy.candidates(world_size, gpus_per_node or min(world_size, 8),
                                                         num_experts or 1 << 20, intermediate)}


def spec_key(c: deploy.Candidate) -> str:
    """The name of a candidate's sweep: 'TP8', 'DP8+EP8 deepep-ll' (one sweep per transport)."""
    return f"{c.name} {c.transport()}" if c.kind == "dp-ep" else c.name


def layout_specs(base: SweepSpec, world_size: int, gpus_per_node: int | None = None,
                 keep=None) -> dict[str, SweepSpec]:
    """The sweeps of `base` over `world_size` ranks, one per candidate (what run_compare
    simulates); keep: the candidates' spec_keys to keep (None: all). Tokens are the whole batch:
    ranks that keep tokens all see it, DP ranks each bring 1/N of it; a layout of replicas
    computes each replica's share of it."""
    specs = {}
    for c in candidate_list(world_size, gpus_per_node, base.shape):
        if keep is not None and spec_key(c) not in keep:
            continue
        spec = replace(base, layout=c.layout, tokens_are_global=True, prepare_finalize=list(c.prepare_finalize))
        if c.replicas > 1:
            spec = replace(spec, tokens=sorted({math.ceil(m / c.replicas) for m in spec.tokens}))
        specs[spec_key(c)] = spec
    return specs


#: Tokens per sequence the batch held is counted at, by default (--context).
DEFAULT_CONTEXT = 4096
OVERLAPS = ("engine", "none", "two-batch")


@dataclass
class ComparePlan:
    """How a comparison runs here, decided before its folder exists. spec: the base spec (its
    experts chosen: one per activation format where their time is modeled); link: the
    communication model and why that link; experts_model: the target GPU's datasheet ceilings where
    the experts time is its floor (None: measured here, on `measured_on`); check_ranks: correctness
    is also checked on real gloo ranks; fits: each candidate's fit (spec_key -> footprint.Fit; empty
    where the GPU's memory is unknown); candidates: spec_key -> deploy.Candidate."""

    spec: SweepSpec
    gpus_per_node: int
    link: CommModel
    link_why: str
    experts_model: Ceilings | None
    measured_on: str | None
    check_ranks: bool
    fits: dict = field(default_factory=dict)
    candidates: dict = field(default_factory=dict)
    context: int = DEFAULT_CONTEXT
    overlap: str = "engine"
    gpu: str | None = None
    fit_note: str = ""
    #: candidates the sweep's planner refused here (spec_key -> why): not run, named in the output
    dropped: dict = field(default_factory=dict)


def fit_candidates(spec: SweepSpec, cands, memory_gib: float, context: int) -> dict:
    """spec_key -> footprint.Fit of each candidate on a GPU of `memory_gib` GiB."""
    shape = spec.shape
    size = footprint.model_size(shape)
    only = footprint.experts_only(spec.quant, shape)
    return {spec_key(c): footprint.fit(shape, size, c.placement, spec.quant, memory_gib, context, spec.act_bytes, only)
            for c in cands}


def _fit_refusal(spec: SweepSpec, world: int, gpn: int, gpu: str, mem: float, fits: dict, context: int) -> str:
    """The one line that refuses a comparison no layout of which fits, naming what does."""
    shape = spec.shape
    worst = sorted({k.split(" ")[0]: f for k, f in fits.items()}.items(), key=lambda kv: kv[1].weights)
    need = ", ".join(f"{k} {f.weights / footprint.GiB:.0f}" for k, f in worst[:3])
    usable = next(iter(fits.values())).usable / footprint.GiB
    what = "its weights" if next(iter(fits.values())).whole_model else "one MoE layer's weights (the rest of the model unknown)"
    line = (f"{shape.name} in {spec.precision} does not fit {world} x {gpu} ({mem:g} GiB, {footprint.RESERVE:.0%} kept "
            f"free: {usable:.0f} GiB a rank): {what} need {need} GiB per rank")
    for k in (2, 4, 8, 16):
        n = world * k
        if n % gpn and n > gpn:
            continue
        more = fit_candidates(spec, candidate_list(n, gpn, shape), mem, context)
        ok = sorted({key.split(" ")[0] for key, f in more.items() if f.fits})
        if ok:
            return line + f"; {n} x {gpu} fit ({', '.join(ok)}): pass --world-size {n}, a GPU with more memory or a smaller precision"
    return line + "; no layout of up to 16x as many GPUs fits: a smaller shape or precision"


def plan_compare(spec: SweepSpec, world_size: int, *, experts_given: bool, target_gpu: str | None,
                 device_name: str | None, link_name: str | None = None, link_gbps: float | None = None,
                 gpus_per_node: int | None = None, rdma_name: str = "rdma-400g", context: int = DEFAULT_CONTEXT,
                 overlap: str = "engine", num_sms: int | None = None) -> ComparePlan:
    """Plan a comparison of `spec` over `world_size` ranks through the sweep's planner (one
    `sweep.plan_run` per candidate: mode, link, what runs here), and refuse (MoebenchError) what
    cannot run: a world the nodes do not divide, a shape no layout can shard, a target GPU without
    a datasheet or a link, a model no layout of which fits the GPUs, real-rank checks that do not
    fit this machine. On a CPU the experts time is the target GPU's floor (default
    DEFAULT_TARGET_GPU); on a GPU it is measured unless `target_gpu`. num_sms: the SMs DeepEP's
    normal kernels run on in the EP rows' model (None: DeepEP's default)."""
    from moebench.sweep.driver import plan_run

    shape, device = spec.shape, spec.device
    if overlap not in OVERLAPS:
        raise MoebenchError(f"--overlap must be one of none, two-batch (or engine: what each layout's engine flags do), "
                            f"got {overlap!r}")
    if not isinstance(context, int) or context < 1:
        raise MoebenchError(f"--context must be a positive number of tokens per sequence, got {context!r}")
    gpu = target_gpu or (DEFAULT_TARGET_GPU if device == "cpu" else None)
    target = gpu_target(gpu or device_name)
    if gpu is not None and target is None:
        raise MoebenchError(f"no datasheet profile for GPU '{gpu}'; try {target_names()}")
    if gpus_per_node is None:
        gpus_per_node = target.domain if target is not None else nvlink_domain(device_name)
    check_world(world_size, gpus_per_node)
    cands = candidate_list(world_size, gpus_per_node, shape)
    if not cands:
        for lay in (ParallelLayout(tp=min(world_size, gpus_per_node)), ParallelLayout(dp=world_size, enable_ep=True)):
            lay.validate_shape(shape.num_experts, shape.intermediate)  # says which number does not divide
        raise MoebenchError(f"no layout of {world_size} ranks splits {shape.describe()}")
    fits, fit_note = {}, ""
    if target is not None and target.memory_gib:
        fits = fit_candidates(spec, cands, target.memory_gib, context)
        if not any(f.fits for f in fits.values()):
            raise MoebenchError(_fit_refusal(spec, world_size, gpus_per_node, gpu or target.profile, target.memory_gib,
                                             fits, context))
    else:
        fit_note = f"fit not assessed: no datasheet memory for {gpu or device_name or device}"
    experts_model = None
    if gpu is not None:
        experts_model = datasheet_ceilings(gpu)
        from moebench.backends import gpu_vendor

        if spec.quant is not None and spec.quant.modeled_only and (
                "fp4" not in experts_model.matmul_tflops or gpu_vendor(gpu) != "nvidia"):
            raise MoebenchError(f"{spec.quant.describe()} runs on NVIDIA GPUs with 4-bit tensor cores, not {gpu}: pass "
                                f"--target-gpu B200, B300, GB200 or GB300, or another --dtype")
        if not experts_given:  # every backend shows the same floor: one per activation format
            spec = replace(spec, experts=modeled_experts(spec.dtype, spec.quant, spec.activation, spec.bias, gpu))
    if experts_given:
        check_named_experts_quant(spec.experts, spec.quant)
    measured_on = gpu or device_name
    if target_gpu is not None and not link_name:  # the target's own link, or a one-line refusal
        if target.link is None or not known_link(target.link):
            raise MoebenchError(f"moebench has no link profile of {target.profile}'s own GPU-to-GPU link "
                                f"({target.link or 'none'}): pass --link NAME or --link-gbps with --link")
        link_name = target.link
    by_key = {spec_key(c): c for c in cands}
    specs = layout_specs(spec, world_size, gpus_per_node)
    run_plan, dropped, first = None, {}, None
    for key, sp in specs.items():  # the sweep's planner decides how each candidate runs here
        try:
            run_plan = plan_run([simulated_spec(sp, experts_model)], simulate=True, device_name=measured_on,
                                link_name=link_name, link_gbps=link_gbps, gpus_per_node=gpus_per_node,
                                rdma_name=rdma_name, tp_across_nodes=True, num_sms=num_sms,
                                model_device=device_name if device == "cuda" and target_gpu is None else measured_on)
        except MoebenchError as e:  # e.g. no named experts backend takes this transport's format
            dropped[key] = str(e)
            first = first or e
    if run_plan is None:
        raise first
    for key in dropped:
        by_key.pop(key)
    link, why = run_plan.link, run_plan.link_why
    if target_gpu is not None and link_name == target.link and link_gbps is None:
        why = f"the profile of {target.profile}'s own link ({link_name}, from --target-gpu); change with --link / --link-gbps"
    check_ranks = (device == "cpu" and spec.check and world_size <= gpus_per_node and spec.shared != "fused"
                   and shape.num_experts >= world_size)
    if check_ranks:  # all ranks of each layout at once on this host: refuse before anything is written
        for key, sp in specs.items():
            if key not in by_key or by_key[key].kind == "ep-tp" or by_key[key].replicas > 1:
                continue
            check_ranks_fit(check_spec_for(sp) if experts_model is not None else sp, world_size,
                            "the real-rank check of compare tp-vs-ep does not fit this machine: use --no-check (the "
                            "simulated check still runs), a smaller shape or fewer --tokens")
    return ComparePlan(spec, gpus_per_node, link, why, experts_model, measured_on, check_ranks, fits, by_key, context,
                       overlap, gpu, fit_note, dropped)


def known_link(name: str) -> bool:
    from moebench.comm.links import LINK_PROFILES

    return name in LINK_PROFILES


def run_compare(base: SweepSpec, world_size: int, store: RunStore, link, experts_model=None,
                check_ranks: bool = False, on_progress=None, gpus_per_node: int | None = None,
                plan: ComparePlan | None = None) -> CompareResult:
    """Run every candidate layout of `base` (shape, tokens, dtype, routing...) over `world_size` ranks.

    link: a comm.model.CommModel (or a comm.links.LinkProfile); gpus_per_node: node size (default:
    the model's). check_ranks: also run the layouts of one replica that run on real gloo/NCCL ranks
    for correctness (their rows have modeled = false and CPU times; the answer uses the simulated
    rows only). plan: the ComparePlan (fits, overlap, context) the summary reports."""
    gpn = gpus_per_node if gpus_per_node is not None else getattr(link, "gpus_per_node", None)
    specs = layout_specs(base, world_size, gpn, keep=set(plan.candidates) if plan is not None else None)
    cands = {spec_key(c): c for c in candidate_list(world_size, gpn, base.shape)}
    for spec in specs.values():
        run_simulated(spec, store, link, on_progress=on_progress, experts_model=experts_model)
    if check_ranks:
        done = set()
        for key, spec in specs.items():
            c = cands[key]
            if c.kind == "ep-tp" or c.replicas > 1:
                continue
            # with the experts time modeled, the ranks check what this machine runs (check_spec_for)
            checked = spec
            if experts_model is not None:
                checked = check_spec_for(spec)
                names = [experts_here(ex, checked)[0] for ex in spec.experts]
                checked = replace(checked, experts=list(dict.fromkeys(n for n in names if n)))
            from moebench.sweep.cases import plan as sweep_plan

            if not any(reason is None for _, _, reason in sweep_plan(checked)):
                continue  # nothing of this transport runs on real ranks here
            sig = (checked.layout, tuple(checked.prepare_finalize))
            if sig in done:
                continue
            done.add(sig)
            run_multirank(replace(checked, reps=1, warmup=0), store.folder, world_size=world_size)
        store = RunStore(store.folder)
    return summarize(store.rows, world_size, gpus_per_node=gpn, tokens=list(base.tokens), plan=plan)


def _layout_name(r: ResultRow, world_size: int | None = None) -> str:
    """The candidate a row belongs to, from its layout columns (moebench.deploy's names)."""
    n = world_size // r.world_size if world_size is not None and world_size > r.world_size else 1
    if r.dp > 1 and r.ep > 1:
        base = f"DP{r.ep}+EP{r.ep}"
    elif r.ep > 1 and r.ep == r.world_size:
        base = f"TP{r.world_size}+EP{r.ep}"
    elif r.ep > 1:
        base = f"EP{r.ep}/TP{r.world_size // r.ep}"
    else:
        base = f"TP{r.world_size}"
    return base if n == 1 else f"{base}x{n}"


def _key_of(r: ResultRow, world_size: int | None) -> str:
    name = _layout_name(r, world_size)
    return f"{name} {r.prepare_finalize}" if name.startswith("DP") else name


def _kind(name: str) -> str:
    return "dp-ep" if name.startswith("DP") else ("tp-ep" if "+EP" in name else ("ep-tp" if "/" in name else "tp"))


def overlapped(d: float, e: float, c: float, e_half: float) -> float:
    """Two-batch overlap of one layer: each half dispatches, computes and combines, one half's
    communication behind the other's experts: d/2 + max(e', d/2) + max(c/2, e') + c/2, where e' is
    the experts time of half the batch (`e_half`; it reads the same weights, so at decode sizes it
    is close to the whole batch's time, which is why overlap helps little there)."""
    d2, c2 = d / 2, c / 2
    return d2 + max(e_half, d2) + max(c2, e_half) + c2


def summarize(rows: list[ResultRow], world_size: int, gpus_per_node: int | None = None,
              tokens: list[int] | None = None, plan: ComparePlan | None = None) -> CompareResult:
    """Best correct simulated pair per (tokens, candidate), the winner among the candidates that fit
    and that an engine runs, crossover and recommendation.

    The rows of a layout of replicas (TP past one node; EP with fewer experts than ranks) are per
    replica: the summary row of a batch of M tokens is that layout's row of ceil(M / replicas)
    tokens (`tokens`: the batch sizes asked for; default: the rows' own)."""
    checked: dict[tuple, bool] = {}
    for r in rows:
        if not r.modeled and r.status == "ok" and r.correct is not None:
            key = (r.tokens, _key_of(r, world_size), r.prepare_finalize)  # any experts that ran here
            checked[key] = checked.get(key, True) and bool(r.correct)
    best: dict[tuple[int, str], ResultRow] = {}
    for r in rows:
        if not (r.modeled and r.status == "ok" and r.latency_us is not None and r.correct is not False):
            continue
        k = (r.tokens, _key_of(r, world_size))
        if k not in best or r.latency_us < best[k].latency_us:
            best[k] = r
    per_replica = {k: v for k, v in best.items() if replicas(k[1].split(" ")[0]) > 1}
    if per_replica:  # replica rows were run at ceil(M / n) tokens: file them under the batch size M
        best = {k: v for k, v in best.items() if replicas(k[1].split(" ")[0]) == 1}
        batch = tokens if tokens is not None else sorted({t for t, _ in best})
        for m in batch:
            for (t, name), r in per_replica.items():
                if t == math.ceil(m / replicas(name.split(" ")[0])):
                    best[(m, name)] = r
    overlap = plan.overlap if plan is not None else "engine"
    fits = plan.fits if plan is not None else {}
    recs = []
    for (tokens_, key), r in sorted(best.items()):
        lname = key.split(" ")[0]
        pf_cls = get_prepare_finalize_class(r.prepare_finalize)
        cand = (plan.candidates.get(key) if plan is not None else None)
        d, c, ar = (v or 0.0 for v in (r.dispatch_us, r.combine_us, r.allreduce_us))
        comm = d + c + ar
        other = r.latency_us - comm - (r.experts_us or 0.0)  # what the parts leave out
        use_overlap = pf_cls.overlaps and overlap != "none"  # where engines ship it (and by default run it)
        latency = r.latency_us
        if use_overlap and r.experts_us is not None:
            e_half = float(r.extra.get("experts_half_us") or r.experts_us / 2)
            latency = overlapped(d, r.experts_us, c, e_half) + ar + other
        f = fits.get(key)
        flags = cand.flags(gpus_per_node or 8, overlap=use_overlap) if cand is not None else {}
        deployable = bool(pf_cls.engine_flags) and (cand is None or cand.deployable)
        recs.append({
            "tokens": tokens_, "layout": lname, "candidate": key, "kind": _kind(lname),
            "prepare_finalize": r.prepare_finalize, "experts": r.experts,
            "allreduce": r.allreduce or "", "transports": r.extra.get("comm_transports", ""),
            "not_run_here": r.extra.get("comm_not_run", ""),
            "latency_us": latency, "latency_serial_us": r.latency_us, "overlap": "two-batch" if use_overlap else "none",
            "dispatch_us": r.dispatch_us, "experts_us": r.experts_us,
            "combine_us": r.combine_us, "allreduce_us": r.allreduce_us, "comm_us": comm, "other_us": other,
            "floor_us": r.floor_us, "imbalance": r.imbalance, "rank_imbalance": r.rank_imbalance,
            "checked_on_ranks": checked.get((tokens_, key, r.prepare_finalize)),
            "timing": r.timing_method, "experts_source": r.extra.get("experts_source", ""),
            "fits": None if f is None else f.fits, "weights_gib": None if f is None else f.weights / footprint.GiB,
            # sequences all the GPUs hold: one replica's times the replicas
            "sequences": None if f is None or f.sequences is None else f.sequences * replicas(lname),
            "deployable": deployable,
            "vllm": flags.get("vllm", ""), "sglang": flags.get("sglang", ""), "trt_llm": flags.get("trt-llm", ""),
        })
    df = pd.DataFrame(recs)
    if df.empty:
        why = Counter(r.reason.split(";")[0] for r in rows if r.status != "ok" or r.correct is False)
        top = f": {why.most_common(1)[0][0]} ({why.most_common(1)[0][1]} of {len(rows)} rows)" if why else ""
        return CompareResult(df, None, f"no layout could be priced{top}", rows)
    df["replicas"] = [replicas(lname) for lname in df.layout]
    df["runs"] = df.deployable.astype(bool) & df.fits.map(lambda v: v is not False)  # fits, an engine runs it
    # like for like: where some of them are priced from measured kernel tables, the answer is among those
    # (a floor is a lower bound); the floor-priced ones are named beside it (`_floor_caveat`)
    measured = df.experts_source.astype(str).str.startswith("measured")
    has_measured = (df.runs & measured).groupby(df.tokens).transform("any")
    df["eligible"] = df.runs & (measured | ~has_measured)
    elig = df[df.eligible].copy()
    if elig.empty:
        return CompareResult(df, None, "no layout that fits and that an engine runs could be priced", rows)
    rows_of = {(rec.tokens, rec.candidate): best[(rec.tokens, rec.candidate)] for rec in elig.itertuples()}
    elig = elig.rename(columns={"candidate": "_c", "layout": "_l"}).assign(layout=elig.candidate.values)
    robustness.add_columns(elig, rows_of)
    shift = elig.latency_us - elig.latency_serial_us  # a band around the overlapped total, not the plain sum
    elig["latency_lo_us"] = elig.latency_lo_us.astype(float) + shift
    elig["latency_hi_us"] = elig.latency_hi_us.astype(float) + shift
    for t, g in elig.groupby("tokens"):
        g = g.sort_values("latency_us")
        if len(g) < 2:
            continue
        w, l = g.iloc[0], g.iloc[1]
        # the same communication on both sides moves both alike: no band between them
        same = math.isclose(float(w.comm_us), float(l.comm_us), rel_tol=1e-6)
        elig.loc[g.index, "too_close"] = bool(not same and w.latency_hi_us >= l.latency_lo_us)
    flip_columns(elig)
    elig = elig.drop(columns=["layout"]).rename(columns={"_c": "candidate", "_l": "layout"})
    df = df.merge(elig[["tokens", "candidate"] + [c for c in elig.columns if c not in df.columns]],
                  on=["tokens", "candidate"], how="left")
    df["too_close"] = df.too_close.map(lambda v: bool(v) if v == v and v is not None else False)
    winners = df[df.eligible].loc[lambda x: x.groupby("tokens").latency_us.idxmin()].set_index("tokens")
    df["winner"] = [bool(t in winners.index and winners.loc[t, "candidate"] == c) for t, c in zip(df.tokens, df.candidate)]
    # A winner inside the published transports' band is no winner: the answer skips those counts.
    decisive = winners[~winners.too_close.astype(bool)]
    crossover = None
    order = list(decisive.index)
    for t in order[1:]:
        if decisive.loc[t, "candidate"] != decisive.loc[order[0], "candidate"]:
            crossover = int(t)
            break
    if decisive.empty:
        t = winners.index[-1]
        w, r = winners.loc[t], _runner_up(df, t, winners.loc[t].candidate)
        fastest = "" if r is None else (f"; fastest {display(w)} ({w.latency_us:.0f} vs {r.latency_us:.0f} us for "
                                        f"{display(r)} at {t} tokens){flip_clause(df, t)}")
        rec = (f"{robustness.TOO_CLOSE} at every token count ({order_text(winners.index)}): the layouts' bands "
               f"between the fastest and the slowest published transport for this link overlap{fastest}")
    else:
        scope = "every token count where the answer is clear" if len(decisive) < len(winners) else None
        rec = _recommend(df, decisive, crossover, world_size, scope) + robustness.close_line(df[df.eligible])
        rec += _holds_more(df, decisive, plan.context if plan is not None else None)

    rec += _floor_caveat(df, winners)
    out_of = sorted(set(df[df.fits.map(lambda v: v is False)].layout))
    if out_of:
        rec += f"; {', '.join(out_of)} do{'es' if len(out_of) == 1 else ''} not fit"
    return CompareResult(df, crossover, rec, rows)


def _floor_caveat(df: pd.DataFrame, winners: pd.DataFrame) -> str:
    """'; priced at the roofline floor only (no measured table of their shard), so not ranked
    against measured times: EP4/TP2 at 1024 tokens (422 us at its floor)' for the layouts that fit
    and run, priced at the floor where others are measured, and faster at their floor than the answer."""
    if "runs" not in df.columns:
        return ""
    out = []
    for t, w in winners.iterrows():
        g = df[(df.tokens == t) & df.runs & ~df.eligible & (df.latency_us < w.latency_us)]
        out += [f"{display(r)} at {t} tokens ({r.latency_us:.0f} us at its floor)" for r in g.itertuples()]
    if not out:
        return ""
    more = f" and {len(out) - 3} more" if len(out) > 3 else ""
    return (f"; priced at the roofline floor only (no measured table of their shard), so not ranked against measured "
            f"times: {', '.join(out[:3])}{more}")


def flip_columns(df: pd.DataFrame) -> pd.DataFrame:
    """One-sided flip factors of a summary of eligible rows, per token count (W the winner, R the
    runner-up, each row's other = latency - experts - communication):
    - a losing row's comm_flip_factor: how many times faster than modeled its own communication
      alone must run for it to match W, comm / (latency_W - experts - other) (inf: never, it loses
      even with free communication);
    - the winner's: how many times slower its own communication alone may run before R matches
      it, (latency_R - experts - other) / comm (inf: it has none);
    comm_flip_by names the communication scaled (that row's: 'dispatch+combine' or 'the
    all-reduce'), comm_flip_gbps the bandwidth it then runs at (its bytes / its scaled time)."""
    df["comm_flip_factor"] = math.inf
    df["comm_flip_gbps"] = float("nan")
    df["comm_flip_by"] = ""
    for t, g in df.groupby("tokens"):
        g = g.sort_values("latency_us")
        w = g.iloc[0]
        for i, r in g.iterrows():
            comm = float(r.comm_us)
            fixed = float(r.latency_us) - comm
            if i == w.name:
                if len(g) < 2 or comm <= 0:
                    continue
                f = (float(_opponent(g, w, key="layout").latency_us) - fixed) / comm
                scaled = comm * f
            else:
                room = float(w.latency_us) - fixed
                if room <= 0 or comm <= 0:
                    continue
                f = comm / room
                scaled = comm / f
            df.at[i, "comm_flip_factor"] = f
            df.at[i, "comm_flip_by"] = robustness.comm_name(str(r.layout)).removeprefix("the ")
            if r.get("comm_bytes"):
                df.at[i, "comm_flip_gbps"] = float(r.comm_bytes) / scaled / 1e3
    return df


def _comm_kind(rec) -> str:
    return "dispatch+combine" if rec.kind == "dp-ep" else "all-reduce"


def _opponent(g: pd.DataFrame, w, key: str = "candidate"):
    """The layout the answer is weighed against: the fastest other one whose communication is of
    the other kind (all-reduce vs dispatch+combine), else the fastest other one."""
    others = g[g[key] != w[key]].sort_values("latency_us")
    other_kind = others[[_comm_kind(r) != _comm_kind(w) for r in others.itertuples()]]
    return (other_kind if not other_kind.empty else others).iloc[0]


def _holds_more(df: pd.DataFrame, winners: pd.DataFrame, context: int | None) -> str:
    """'; DP8+EP8 holds 5.5x the batch of TP8 (984 vs 180 sequences of 4096 tokens): ...' where a
    layout that fits holds at least 1.5x the winner's batch."""
    if "sequences" not in df.columns or df.sequences.isna().all():
        return ""
    t = winners.index[-1]
    w = winners.loc[t]
    g = df[(df.tokens == t) & df.eligible & df.sequences.notna()]
    if g.empty or not w.sequences:
        return ""
    top = g.loc[g.sequences.astype(float).idxmax()]
    if float(top.sequences) < 1.5 * float(w.sequences) or top.layout == w.layout:
        return ""
    return (f"; {top.layout} holds {float(top.sequences) / float(w.sequences):.1f}x the batch of {w.layout} "
            f"({int(top.sequences)} vs {int(w.sequences)} sequences of {context} tokens): where KV memory bounds "
            f"concurrency it serves more at once")


def order_text(tokens) -> str:
    t = list(tokens)
    return f"{t[0]}..{t[-1]}" if len(t) > 1 else str(t[0])


def display(rec) -> str:
    """'TP8', 'TP8+EP8', 'DP8+EP8 over deepep-ll': a summary row's candidate in words."""
    return f"{rec.layout} over {rec.prepare_finalize}" if rec.kind == "dp-ep" else str(rec.layout)


def _runner_up(df: pd.DataFrame, t: int, winner_key: str):
    """The layout the winner at `t` is weighed against (`_opponent`), None where it is alone."""
    g = df[(df.tokens == t) & df.eligible]
    w = g[g.candidate == winner_key]
    if w.empty or len(g) < 2:
        return None
    return _opponent(g, w.iloc[0])


def flip_clause(df: pd.DataFrame, t: int) -> str:
    """'; at T tokens it holds unless DP8+EP8 over deepep-ll's dispatch+combine alone run 1.7x faster
    than modeled (above 129 GB/s); or TP8's own all-reduce runs 2.6x slower (below 80 GB/s)'."""
    g = df[(df.tokens == t) & df.eligible]
    if len(g) < 2:
        return ""
    w = g.loc[g.latency_us.idxmin()]
    r = _opponent(g, w)
    parts = []
    f = float(r.comm_flip_factor)
    if math.isfinite(f):
        bw = "" if pd.isna(r.comm_flip_gbps) else f" (above {r.comm_flip_gbps:.3g} GB/s)"
        parts.append(f"unless {display(r)}'s {r.comm_flip_by} alone run{'s' if 'all-reduce' in r.comm_flip_by else ''} "
                     f"{f:.2f}x faster than modeled{bw}")
    else:
        parts.append(f"even if {display(r)}'s communication were free")
    fw = float(w.comm_flip_factor)
    if math.isfinite(fw):
        bw = "" if pd.isna(w.comm_flip_gbps) else f" (below {w.comm_flip_gbps:.3g} GB/s)"
        parts.append(f"or {display(w)}'s own {w.comm_flip_by} run{'s' if 'all-reduce' in w.comm_flip_by else ''} "
                     f"{fw:.2f}x slower{bw}")
    return f"; at {t} tokens it holds " + ", ".join(parts)


def _recommend(df: pd.DataFrame, winners: pd.DataFrame, crossover: int | None, n: int, scope: str | None = None) -> str:
    def at(t: int, key: str):
        sel = df[(df.tokens == t) & (df.candidate == key)]
        return None if sel.empty else sel.iloc[0]

    tokens = list(winners.index)
    if crossover is None:
        t = tokens[-1]
        a = at(t, winners.iloc[-1].candidate)
        b = _runner_up(df, t, a.candidate)
        if b is None:
            return f"{display(a)} is the only layout that fits, runs in an engine and was priced (tokens {tokens[0]}..{tokens[-1]})"
        return (f"{display(a)} wins at {scope or 'every token count measured'} ({tokens[0]}..{tokens[-1]}): at {t} tokens "
                f"{a.latency_us:.0f} us vs {b.latency_us:.0f} us for {display(b)}, {_why(a, b)}{flip_clause(df, t)}")
    a = at(crossover, winners.loc[crossover].candidate)
    first = at(tokens[0], winners.loc[tokens[0]].candidate)
    b = at(crossover, first.candidate)
    line = (f"{display(a)} wins from {crossover} tokens ({display(first)} below): at {crossover} tokens {a.latency_us:.0f} us vs "
            f"{b.latency_us:.0f} us, {_why(a, b)}{flip_clause(df, crossover)}")
    later = [t for t in tokens if t > crossover and winners.loc[t].candidate != a.candidate]
    if later:  # the answer moves again: say where, so nobody reads one crossover as the whole story
        t = later[0]
        c, d = at(t, winners.loc[t].candidate), at(t, a.candidate)
        if d is not None:
            line += f"; {display(c)} wins from {t} tokens ({c.latency_us:.0f} vs {d.latency_us:.0f} us), {_why(c, d)}"
    return line


def _why(win, lose) -> str:
    """The reason in the terms users weigh: the experts GEMM per rank against the communication."""
    a, b = win.experts_us, lose.experts_us
    comm = f"communication costs {win.comm_us:.0f} vs {lose.comm_us:.0f} us"
    if a and b / a > 1.05:
        return f"the experts GEMM takes {b / a:.1f}x less per rank ({a:.0f} vs {b:.0f} us) while {comm}"
    if a and b / a < 0.95:
        return f"{comm}, which outweighs its experts GEMM being {a / b:.1f}x slower per rank ({a:.0f} vs {b:.0f} us)"
    return f"the experts GEMM costs about the same per rank ({a:.0f} vs {b:.0f} us), so communication decides: {comm}"


def write_summary(result: CompareResult, folder: Path) -> list[Path]:
    """compare.csv and compare.md (with the recommendation) in the run folder."""
    from moebench.report import export_frame, markdown
    from moebench.results import atomic_write_text

    csv = folder / "compare.csv"
    export_frame(result.summary, csv, "csv")
    md = folder / "compare.md"
    text = (f"**{result.recommendation}**\n\ncrossover: {result.crossover if result.crossover is not None else 'none'}"
            f"\n\n{markdown(result.summary)}")
    atomic_write_text(md, text)
    return [csv, md]


__all__ = ["CompareResult", "layout_specs", "run_compare", "summarize", "layouts", "write_summary", "default_experts"]
