"""`compare tp-vs-ep`: both layouts, breakdown, crossover, recommendation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from moebench.cli.options import (
    _command_line,
    _progress,
    check_routing,
    cluster_options,
    console,
    err_console,
    parse_tokens,
    resolve_device,
    resolve_layer,
    resolve_model_precision,
    resolve_shape,
    shape_options,
)
from moebench.errors import MoebenchError, interrupt_status, interrupted_by
from moebench.report import say


@click.group()
def compare():
    """Compare layouts (tp-vs-ep)."""


@compare.command("tp-vs-ep")
@shape_options
@click.option("--experts", "experts", default="all", show_default=True, help="Experts backends to consider.")
@click.option("--link", "link_name", default=None, help="Link profile (h200-nvlink, a100-nvlink, pcie-gen5, ib-400g, ...).")
@click.option("--link-gbps", type=float, default=None, help="Override the link bandwidth (GB/s per direction).")
@click.option("--target-gpu", "--gpu", "target_gpu", default=None,
              help="Model the experts time as this GPU's roofline floor (datasheet) instead of timing it here, and "
                   "its link; default on CPU: H200 (--gpu is the same).")
@click.option("--no-check", is_flag=True, help="Skip the reference checks (simulated share and real ranks).")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="PNG file for the plots.")
@click.option("--reps", type=int, default=None, help="Timed repetitions per row.")
@click.option("--shared-experts", "shared", default=None,
              help="Shared experts in both layouts: fused | separate | none [separate where the model has them].")
@click.option("--context", type=int, default=4096, show_default=True,
              help="Tokens per sequence the batch each layout holds is counted at (KV cache left per rank).")
@click.option("--overlap", type=click.Choice(["engine", "none", "two-batch"]), default="engine", show_default=True,
              help="Micro-batch overlap of dispatch/combine with the experts (SGLang's two-batch, vLLM's dual-batch "
                   "overlap); engine: what each layout's recommended engine flags do.")
@cluster_options
def tp_vs_ep(model, num_experts, topk, hidden, intermediate, tokens, tp, dp, ep, world_size, device, dtype,
             block_shape, scales, group_size, zero_points, activation, routing, seed, out, experts, link_name, link_gbps,
             target_gpu, no_check, plot_path, reps, shared, context, overlap, gpus_per_node, rdma_name, num_sms):
    """Every layout engines deploy over --world-size GPUs (TP, TP+EP, DP+EP per transport, EP x TP, TP across
    nodes): fit, batch held, breakdown, crossover, the answer and its launch flags."""
    from moebench.bench.hardware import device_summary
    from moebench.compare import layouts, plan_compare, run_compare, write_summary
    from moebench.plots import compare_plot
    from moebench.report import write_exports
    from moebench.plots import check_plot_file
    from moebench.results import RunStore, ensure_writable_dir, new_run_id
    from moebench.sweep import SweepSpec, cases_to_run, default_experts, resolve_names

    if tp is not None or dp is not None or ep is not None:
        raise MoebenchError("compare tp-vs-ep builds both layouts itself: give --world-size N, not --tp/--dp/--ep")
    if world_size is None or world_size < 2:
        raise MoebenchError("compare tp-vs-ep needs --world-size N with N >= 2")
    device = resolve_device(device)
    shape = resolve_shape(model, num_experts, topk, hidden, intermediate)
    tok = parse_tokens(tokens) if tokens is not None else [1, 4, 16, 64, 256, 1024, 4096]
    check_routing(routing, shape)
    dt, quant, quant_line = resolve_model_precision(shape, dtype, block_shape, scales, device, "bf16", group_size,
                                                    zero_points)
    ex_names = resolve_names(experts, default_experts(), "experts", default_experts())
    act, bias, modes = resolve_layer(shape, activation, shared, ex_names, experts != "all")
    if len(modes) != 1:
        raise MoebenchError("compare tp-vs-ep takes one --shared-experts form (fused, separate or none); "
                            "run it once per form to compare them")
    spec = SweepSpec(shape=shape, tokens=tok, experts=ex_names,
                     dtype=dt, device=device, routing=routing, seed=seed, check=not no_check, reps=reps, quant=quant,
                     activation=act, bias=bias, shared=modes[0])
    if plot_path is not None:
        check_plot_file(plot_path)
    cmp = plan_compare(spec, world_size, experts_given=experts not in (None, "", "all"), target_gpu=target_gpu,
                       device_name=device_summary(device).get("name"), link_name=link_name, link_gbps=link_gbps,
                       gpus_per_node=gpus_per_node, rdma_name=rdma_name, context=context, overlap=overlap,
                       num_sms=num_sms)
    spec, link, link_why, experts_model = cmp.spec, cmp.link, cmp.link_why, cmp.experts_model
    gpus_per_node, check_ranks, dev_name = cmp.gpus_per_node, cmp.check_ranks, cmp.measured_on
    folder = ensure_writable_dir(out) / new_run_id("compare", shape.name)
    meta = {"command": "compare tp-vs-ep", "argv": sys.argv[1:], "shape": shape.to_dict(), "world_size": world_size,
            "tokens": tok, "dtype": spec.dtype_label, "quant": spec.quant_label, "device": device, "routing": routing,
            "seed": seed, "num_sms": num_sms,
            "link": link.as_dict(), "link_why": link_why,
            "experts_model": None if experts_model is None else experts_model.as_dict(),
            "device_summary": device_summary(device)}
    store = RunStore(folder, metadata=meta, lock=True, command=_command_line())
    how = (f"experts time = {experts_model.device_name} roofline floor (datasheet), not measured"
           if experts_model is not None else f"experts time measured on {dev_name}")
    console.print(f"[bold]moebench compare tp-vs-ep[/] {shape.name} over {world_size} ranks, {spec.precision}, "
                  f"routing {routing}: simulated ({how}; communication: {link.describe()})")
    console.print(f"link: {link_why}", markup=False, highlight=False)
    if quant_line:
        console.print(quant_line, markup=False, highlight=False)
    console.print(f"layer: activation {act.describe()}{' with expert biases' if bias else ''}, shared experts "
                  f"{modes[0]}", markup=False, highlight=False)
    if check_ranks:
        console.print("correctness also checked on real gloo ranks")
    if shape.num_experts < world_size:
        from moebench.compare import ep_group

        g = ep_group(world_size, shape.num_experts)
        console.print(f"{shape.num_experts} experts spread over at most {g} ranks: EP is one EP{g} group per "
                      f"replica ({world_size // g} replicas), each on its share of the batch")
    if world_size > gpus_per_node:
        console.print("past one node TP is one TP replica per node on its share of the batch; correctness is "
                      "checked on the simulated share only")
    from moebench.compare import layout_specs
    from moebench.sweep import simulated_spec

    try:
        with _progress() as prog:  # counts the simulated cases that run (skipped pairs are not counted)
            total = sum(cases_to_run(simulated_spec(s, experts_model), store, modeled=True)
                        for s in layout_specs(spec, world_size, gpus_per_node, keep=set(cmp.candidates)).values())
            task = prog.add_task("compare", total=total)
            result = run_compare(spec, world_size, store, link, experts_model=experts_model,
                                 check_ranks=check_ranks, gpus_per_node=gpus_per_node, plan=cmp,
                                 on_progress=lambda r: r.status == "skipped" or prog.update(
                                     task, advance=1, description=f"M={r.tokens} {r.prepare_finalize}+{r.experts}"))
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: the rows so far stay, exported
        kept = RunStore(folder)
        write_exports(kept, ["csv", "json", "md"])
        say(err_console, f"{interrupted_by(stop)}: {len(kept.rows)} finished rows kept in {folder} (compare has no --resume: "
                         f"run it again for the answer)")
        sys.exit(interrupt_status(stop))
    write_exports(RunStore(folder), ["csv", "json", "md"])
    if result.summary.empty:  # no answer: say why in one line, keep the rows, exit non-zero
        raise MoebenchError(f"{result.recommendation}; every row is in {folder}")
    written = write_summary(result, folder)
    _print_compare(result, world_size, link, cmp)
    if not result.summary.empty:
        names = ", ".join(dict.fromkeys(result.summary.layout))
        shown = result.summary[result.summary.eligible.astype(bool)]
        png = compare_plot(shown.assign(layout=shown.candidate), result.crossover, f"{shape.name}: {names} ({how})",
                           plot_path or folder / "compare.png")
        written.append(png)
    say(console, f"wrote {', '.join(str(p) for p in written)}")


def _print_compare(result, n: int, link=None, plan=None) -> None:
    from moebench.report import compare_table, print_table, say

    if result.summary.empty:
        say(console, result.recommendation, "bold")
        return
    left = print_table(console, compare_table(result.summary, "Layouts (simulated: experts of one rank + modeled "
                                                               "communication)"))
    say(console, result.recommendation, "bold")
    for line in _flag_lines(result.summary):
        say(console, line)
    ctx = f" at {plan.context} tokens per sequence" if plan is not None else ""
    notes = ["* = the fastest layout that fits and that an engine runs; holds = sequences the GPUs hold"
             f"{ctx} (KV cache left per rank after the weights, {_reserve()} of memory kept free), no fit = its "
             "weights do not fit, no engine = no engine ships its transport; other = total minus the parts shown; "
             "ovl = two-batch overlap applied; flip x = how many times faster than modeled a losing layout's own "
             "communication must run to win, for the winner how many times slower its own may run before the "
             "runner-up wins (close: the published transports' band covers the margin)."]
    if plan is not None and plan.fit_note:
        notes.append(plan.fit_note + ".")
    if plan is not None and plan.dropped:
        notes.append("not priced: " + "; ".join(f"{k} ({v})" for k, v in plan.dropped.items()) + ".")
    if left:
        notes.append(f"not shown at {console.width} columns: {', '.join(left)} (compare.csv holds every column).")
    rows = [r for r in result.rows if r.modeled and r.status == "ok"]
    not_run = sorted({f"{r.prepare_finalize} ({r.extra['comm_not_run']})" for r in rows if r.extra.get("comm_not_run")})
    if not_run:
        notes.append(f"priced without running here: {'; '.join(not_run)}.")
    if link is not None and hasattr(link, "extrapolated"):
        used = sorted({t for r in rows for t in str(r.extra.get("comm_transports", "")).split(",") if t})
        far = link.extrapolated(used)
        if far:
            notes.append(f"extrapolated: no published point of {', '.join(far)} on a {link.nvlink_gbps:g} GB/s NVLink "
                         f"(their fitted efficiency times its peak; docs/comm-model.md).")
    for note in notes:
        say(console, note, "dim")


def _reserve() -> str:
    from moebench.footprint import RESERVE

    return f"{RESERVE:.0%}"


def _flag_lines(summary) -> list[str]:
    """The launch flags of every layout that fits and that an engine runs, per engine."""
    lines = []
    for _, w in summary[summary.eligible.astype(bool)].drop_duplicates("candidate").iterrows():
        name = f"{w.layout} over {w.prepare_finalize}" if w.kind == "dp-ep" else w.layout
        eng = [f"{e} {w[col]}" for e, col in (("vLLM", "vllm"), ("SGLang", "sglang"), ("TRT-LLM", "trt_llm"))
               if isinstance(w[col], str) and w[col]]
        lines.append(f"{name}: " + " | ".join(eng))
    return ["launch flags:"] + lines if lines else []


# compare counts the whole batch, not tokens per rank as sweep does: its own words for --tokens
for _param in tp_vs_ep.params:
    if _param.name == "tokens":
        _param.help = ("Whole-batch token counts, comma list (TP ranks all see the batch, EP ranks each bring 1/N "
                       "of it) [1,4,16,64,256,1024,4096].")
