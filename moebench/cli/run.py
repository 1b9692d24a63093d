"""`env`, `models`, `sweep`: the machine, the shape presets, a sweep over (tokens, pair)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import click
import torch
from rich.table import Table
from rich.text import Text

from moebench.cli.options import (
    _check_resumed,
    _command_line,
    _progress,
    _resume_defaults,
    _run_options,
    check_routing,
    way_on,
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
from moebench.kernels.tuned_files import config_search_dirs
from moebench.report import print_fitted, say


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--calibrate", is_flag=True, help="Measure memory and matmul ceilings on this device and cache them.")
@click.option("--calibrate-link", is_flag=True,
              help="Measure NCCL all-reduce, all-to-all and the dispatch/combine backends between --world-size real "
                   "ranks and fit the communication model; simulated runs on these GPUs then use the fits.")
@click.option("--world-size", "world_size", type=int, default=None, help="Ranks for --calibrate-link [GPUs; cpu: 2].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None)
def env(as_json: bool, calibrate: bool, calibrate_link: bool, world_size: int | None, device: str | None):
    """What this machine has: device, versions, ceilings, and which backends can run (and why not)."""
    from moebench.bench.hardware import calibrate as do_calibrate, device_summary, get_ceilings
    from moebench.backends import backend_infos
    from moebench.cli.vendor import status_lines
    from moebench.vendor import statuses as vendor_statuses

    device = resolve_device(device)
    link_line = _calibrate_link(device, world_size) if calibrate_link else None
    world = torch.cuda.device_count() if device == "cuda" else 1
    ceilings = do_calibrate(device) if calibrate else get_ceilings(device)
    info = {
        "device": device_summary(device),
        "ceilings": ceilings.as_dict() if ceilings is not None else None,
        "backends": [b.as_dict() for b in backend_infos(device, max(world, 1))],
    }
    if link_line is not None:
        info["link"] = link_line
    info["vendor"] = [v.as_dict() for v in vendor_statuses()]
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    say(console, "device", "bold")
    for k, v in info["device"].items():
        say(console, f"  {k}: {v}")
    if ceilings is not None:
        for k, v in ceilings.describe_lines():
            say(console, f"  {k}: {v}")
    else:
        say(console, "  ceilings: none known; run `moebench env --calibrate`")
    console.print()
    print_fitted(console, backends_table(info["backends"]))
    for b in info["backends"]:  # the reasons in full, as prose: a table would cut them
        if b["reason"]:
            say(console, Text.assemble((b["name"], "bold"), (" (not usable)" if not b["usable"] else ""),
                                       f": {b['reason']}"))
    console.print()
    say(console, "vendor libraries (`moebench vendor install NAME` installs the index build for this torch)", "bold")
    for line in status_lines(info["vendor"]):
        say(console, line)
    if link_line is not None:
        say(console, link_line)


def backends_table(backends: list[dict]):
    """`env`'s backends (TextTable): kind, name, format, devices, usable, dtypes; the reasons
    follow the table as prose."""
    from moebench.report import Column, TextTable

    def cells(key):
        return [str(b[key]) for b in backends]

    usable = ["yes" if b["usable"] else "no" for b in backends]
    return TextTable("backends", [
        Column("kind", "kind", ["p/f" if b["kind"] == "prepare_finalize" else b["kind"] for b in backends], right=False),
        Column("name", "name", cells("name"), right=False),
        Column("format", "format", cells("activation_format"), right=False, drop=40),
        Column("devices", "devices", cells("devices"), right=False, drop=50),
        Column("usable", "usable", usable, right=False, styles=["green" if u == "yes" else "red" for u in usable]),
        Column("note", "note", ["see below" if b["reason"] else "" for b in backends], right=False, drop=30),
        Column("dtypes", "dtypes", cells("dtypes"), right=False, drop=60),
    ])


def _calibrate_link(device: str, world_size: int | None) -> str:
    import datetime

    from moebench.backends import get_prepare_finalize_class, prepare_finalize_names
    from moebench.bench.hardware import device_summary
    from moebench.runtime.link_calibration import measure_link
    from moebench.comm.links import write_measured_link

    n = world_size or (torch.cuda.device_count() if device == "cuda" else 2)
    if n < 2:
        raise MoebenchError(f"--calibrate-link needs at least 2 ranks (have {n} on {device}); the link is between GPUs")
    link, raw = measure_link(n, device, {name: get_prepare_finalize_class(name) for name in prepare_finalize_names()})
    name = device_summary(device).get("name") if device == "cuda" else "cpu"
    path = write_measured_link(link, device_name=name, world_size=n, device=device,
                              measured_at=datetime.datetime.now().isoformat(timespec="seconds"),
                              method="per transport: message-size sweep, slowest rank, median; alpha + bytes / GB/s "
                                     "fitted on relative error", **raw)
    note = "" if device == "cuda" else " (gloo on CPU: a plumbing check, not a GPU link)"
    fits = "; ".join(f"{k} {v['alpha_us']:g} us + bytes / {v['gbps']:g} GB/s (worst x{v['worst_ratio']:g})"
                     for k, v in raw["transports"].items())
    skipped = "".join(f"; {k} not measured: {why}" for k, why in raw["skipped"].items())
    return (f"link over {n} ranks: all-to-all {link.bandwidth_gbps:g} GB/s per direction, {link.latency_us:g} us "
            f"per call{note}; fits: {fits}{skipped} -> {path}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
def models(as_json: bool):
    """MoE shape presets (E, topk, hidden, moe intermediate)."""
    from moebench.models import list_models

    ms = list_models()
    if as_json:
        click.echo(json.dumps([m.__dict__ for m in ms], indent=2, default=str))
        return
    t = Table(title="MoE presets (pass --model NAME, or --model path/to/config.json)")
    for c in ("name", "experts", "topk", "hidden", "intermediate"):
        t.add_column(c, justify="left" if c == "name" else "right")
    for m in ms:
        t.add_row(m.name, str(m.num_experts), str(m.topk), str(m.hidden), str(m.intermediate))
    console.print(t)


@click.command()
@shape_options
@click.option("--experts", "experts", default="all", show_default=True, help="Comma list of experts backends, or all.")
@click.option("--prepare-finalize", "prepare_finalize", default="all", show_default=True, help="Comma list, or all.")
@click.option("--simulate", is_flag=True, help="Compute one rank's share on one device; model communication.")
@click.option("--link", "link_name", default=None, help="Link profile for --simulate (h200-nvlink, a100-nvlink, pcie-gen5, ib-400g, ...).")
@click.option("--link-gbps", type=float, default=None, help="Override the link bandwidth (GB/s per direction) for --simulate.")
@click.option("--target-gpu", "--gpu", "target_gpu", default=None,
              help="The GPU whose link --simulate models (H100, H200, B200, ...) [this machine's GPU; cpu: H200]; "
                   "--gpu is the same.")
@click.option("--format", "formats", default="csv,json,md", show_default=True, help="Exports: csv,json,md,parquet,html.")
@click.option("--no-check", is_flag=True, help="Skip the float64 reference check.")
@click.option("--resume", "resume", type=click.Path(path_type=Path), default=None, is_eager=True, callback=_resume_defaults,
              help="Continue an interrupted run folder with the settings it was started with.")
@click.option("--reps", type=int, default=None, help="Timed repetitions per row.")
@click.option("--routings", type=int, default=1, show_default=True,
              help="Distinct routings cycled through the timed calls (fresh routing per call, as vLLM's tuner).")
@click.option("--show-skipped", is_flag=True, help="List every skipped pair with its reason (default: a count by reason).")
@click.option("--shared-experts", "shared", default=None,
              help="Shared experts in the timed layer, a comma list of fused | separate | none, or all "
                   "[separate where the model has them, else none].")
@cluster_options
def sweep(model, num_experts, topk, hidden, intermediate, tokens, tp, dp, ep, world_size, device, dtype, block_shape,
          scales, group_size, zero_points, activation, routing, seed, out, experts, prepare_finalize, simulate, link_name,
          link_gbps, target_gpu, formats, no_check, resume, reps, routings, show_skipped, shared, gpus_per_node, rdma_name,
          num_sms):
    """Run every valid prepare/finalize x experts pair; check, time, and write results."""
    from moebench.backends import prepare_finalize_names
    from moebench.layout import ParallelLayout
    from moebench.report import EXPORT_FORMATS, print_rows, write_exports
    from moebench.results import RunStore
    from moebench.sweep import SweepSpec, default_experts, resolve_names

    if resume is not None:
        _check_resumed(click.get_current_context(), resume)
    device = resolve_device(device)
    shape = resolve_shape(model, num_experts, topk, hidden, intermediate)
    tok = parse_tokens(tokens) if tokens is not None else ([1, 16, 64] if device == "cpu" else [1, 16, 64, 256, 1024, 4096])
    layout = ParallelLayout.from_args(tp, dp, ep, world_size)
    layout.validate_shape(shape.num_experts, shape.intermediate)
    check_routing(routing, shape)
    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    bad = [f for f in fmts if f not in EXPORT_FORMATS]
    if bad:
        raise MoebenchError(f"--format: unknown {', '.join(bad)}; valid: {', '.join(EXPORT_FORMATS)}")
    if "parquet" in fmts and importlib.util.find_spec("pyarrow") is None:
        raise MoebenchError("--format parquet needs pyarrow (pip install pyarrow), or drop parquet from --format")
    dt, quant, quant_line = resolve_model_precision(shape, dtype, block_shape, scales, device,
                                                    "bf16" if device == "cuda" else "fp32", group_size, zero_points)
    for flag, value in (("--experts", experts), ("--prepare-finalize", prepare_finalize)):
        if not value.replace(",", "").strip():
            raise MoebenchError(f"{flag} is empty; give a comma list of names, or all (`moebench env` lists them)")
    ex_names = resolve_names(experts, default_experts() + ["reference"], "experts", default_experts())
    act, bias, shared_modes = resolve_layer(shape, activation, shared, ex_names, experts != "all")
    if reps is not None and reps < 1:
        raise MoebenchError("--reps must be >= 1")
    if routings < 1:
        raise MoebenchError("--routings must be >= 1")
    spec = SweepSpec(
        shape=shape, tokens=tok, layout=layout,
        experts=ex_names,
        prepare_finalize=resolve_names(prepare_finalize, prepare_finalize_names(), "prepare_finalize", prepare_finalize_names()),
        dtype=dt, device=device, routing=routing, seed=seed, check=not no_check, reps=reps, routings=routings,
        quant=quant, activation=act, bias=bias, shared=shared_modes[0],
    )
    if experts not in (None, "", "all"):
        from moebench.backends import check_named_experts_quant

        check_named_experts_quant(spec.experts, quant)
    specs = [dataclasses.replace(spec, shared=sm) for sm in shared_modes]
    from moebench.bench.hardware import device_summary
    from moebench.runtime.distributed import join_torchrun, leave_torchrun
    from moebench.sweep import plan_run, run_in_folder

    ctx = join_torchrun()  # None outside torchrun
    dev_name = device_summary(device).get("name") if device == "cuda" else None
    run_plan = plan_run(specs, simulate=simulate, world_size=world_size, ctx=ctx, device_name=dev_name,
                        link_name=link_name, link_gbps=link_gbps, gpus_per_node=gpus_per_node, rdma_name=rdma_name,
                        target_gpu=target_gpu, num_sms=num_sms)
    mode, link, link_why = run_plan.mode, run_plan.link, run_plan.link_why
    if run_plan.notice:
        say(console, Text.assemble(("notice:", "yellow"), f" {run_plan.notice}"))
    config_search_dirs()  # a MOEBENCH_CONFIG_DIR that is no folder is refused now, not at each lookup
    meta = {"command": "sweep", "argv": sys.argv[1:],
            "options": _run_options(click.get_current_context(), device=device, tokens=",".join(map(str, tok))),
            "mode": mode, "shape": shape.to_dict(),
            "layout": layout.__dict__, "tokens": tok, "dtype": spec.dtype_label, "quant": spec.quant_label,
            "activation_dtype": str(dt), "device": device, "routing": routing,
            "activation": act.describe(), "expert_bias": bias, "shared_experts": shared_modes, "quantization": quant_line,
            "seed": seed, "link": None if link is None else link.as_dict(), "link_why": link_why,
            "device_summary": device_summary(device)}
    opened: list = []  # the run's store, once open

    def start(store, n_total):
        opened.append(store)
        for n in store.notices:
            say(err_console, f"notice: {n}")
        say(console, Text.assemble(("moebench sweep", "bold"), f" {shape.name} (E={shape.num_experts}, "
                                   f"topk={shape.topk}, H={shape.hidden}, I={shape.intermediate}) {layout.describe()}, "
                                   f"{mode} run, on {device}, {spec.precision}, routing {routing} -> {store.folder}"))
        if link is not None:
            say(console, f"communication: {link.describe()}; link: {link_why}")
        if quant_line:
            say(console, quant_line)
        say(console, f"layer: activation {act.describe()}{' with expert biases' if bias else ''}; shared experts "
                     f"{', '.join(shared_modes)}")
        if prog is not None:
            prog.update(task, total=n_total)
            prog.start()

    def tick(row):
        if row.status != "skipped":  # the bar counts and names only what runs
            prog.update(task, advance=1, description=f"M={row.tokens} {row.prepare_finalize}+{row.experts}")

    # real ranks: rank 0 shows its own progress bar
    prog = None if mode in ("spawn", "torchrun") else _progress()
    task = prog.add_task("sweep", total=None) if prog is not None else None
    try:
        with way_on("sweep", lambda: opened[0].folder if opened else None):
            store = run_in_folder(specs, mode, out, resume=resume, metadata=meta, argv=sys.argv[1:],
                                  command=_command_line(), ctx=ctx, link=link, on_start=start,
                                  on_progress=tick if prog is not None else None)
    except KeyboardInterrupt as stop:
        if prog is not None:
            prog.stop()
        folder = opened[0].folder if opened else getattr(stop, "run_folder", None)
        if folder is None:
            raise
        with way_on("sweep", lambda: folder):
            store = RunStore(folder)
            write_exports(store, fmts)
        say(err_console, f"{interrupted_by(stop)}: {len(store.rows)} finished rows kept in {store.folder} "
                         f"(continue with --resume {store.folder})")
        sys.exit(interrupt_status(stop))
    finally:
        if prog is not None:
            prog.stop()
    if store is None:  # a torchrun rank other than 0: rank 0 writes and reports
        leave_torchrun(ctx)
        return
    with way_on("sweep", lambda: store.folder):
        written = write_exports(store, fmts)
    print_rows(store.rows, console, show_skipped=show_skipped)
    if store.rows and not any(r.status == "ok" for r in store.rows):
        hint = (" On a CPU, `TRITON_INTERPRET=1 moebench sweep ...` runs the Triton experts under the interpreter"
                " (slowly; for correctness)." if device == "cpu" and "TRITON_INTERPRET" not in os.environ else "")
        say(console, Text.assemble(("notice:", "yellow"), f" no pair could run here; the reasons are listed above.{hint}"))
    say(console, f"wrote {', '.join(str(p) for p in written)}")
    leave_torchrun(ctx)
    if store.rows and not any(r.status == "ok" for r in store.rows):
        sys.exit(1)  # nothing was measured: a script must not take this run for a result
