"""Command line: parses, calls the Python API, prints. No logic a script could not reach."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moebench.errors import MoebenchError

console = Console()
err_console = Console(stderr=True)


# -- shared option parsing ---------------------------------------------------------------------

def parse_tokens(value: str) -> list[int]:
    """'1,16,64' -> [1, 16, 64]; each a non-negative integer."""
    out = []
    for part in str(value).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            n = int(part)
        except ValueError:
            raise MoebenchError(f"--tokens: '{part}' is not an integer; give a comma list like 1,16,64") from None
        if n < 0:
            raise MoebenchError(f"--tokens: {n} is negative; token counts are >= 0")
        out.append(n)
    if not out:
        raise MoebenchError("--tokens is empty; give a comma list like 1,16,64")
    return out


def resolve_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise MoebenchError("--device cuda asked for, but no CUDA GPU is visible here; use --device cpu")
    return device


def resolve_shape(model, num_experts, topk, hidden, intermediate):
    from moebench.models import custom_shape, get_model

    sizes = (num_experts, topk, hidden, intermediate)
    if model is not None:
        if any(v is not None for v in sizes):
            raise MoebenchError("give either --model or the four size flags (--num-experts --topk --hidden --intermediate), not both")
        return get_model(model)
    if all(v is None for v in sizes):
        return get_model("qwen3-30b-a3b")
    if any(v is None for v in sizes):
        missing = [f for f, v in zip(("--num-experts", "--topk", "--hidden", "--intermediate"), sizes) if v is None]
        raise MoebenchError(f"a custom shape needs all four size flags; missing {' '.join(missing)}")
    return custom_shape(num_experts, topk, hidden, intermediate)


def shape_options(f):
    """Options every command that runs kernels takes (design.md)."""
    opts = [
        click.option("--model", default=None, help="Preset name (see `moebench models`) or a local HuggingFace config.json."),
        click.option("--num-experts", "num_experts", type=int, default=None, help="E, for a custom shape."),
        click.option("--topk", type=int, default=None, help="Experts per token, for a custom shape."),
        click.option("--hidden", type=int, default=None, help="H, for a custom shape."),
        click.option("--intermediate", type=int, default=None, help="MoE intermediate size I, for a custom shape."),
        click.option("--tokens", default=None, help="Comma list of token counts per rank [cpu: 1,16,64; cuda: 1..4096]."),
        click.option("--tp", type=int, default=None, help="Tensor-parallel size."),
        click.option("--dp", type=int, default=None, help="Data-parallel size."),
        click.option("--ep", type=int, default=None, help="Expert parallelism over N ranks (N = dp * tp)."),
        click.option("--world-size", "world_size", type=int, default=None, help="Ranks to run (spawned processes)."),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda when present."),
        click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32", "fp8_w8a8"]), default=None,
                     help="Default: bf16 on cuda, fp32 on cpu. fp8_w8a8: fp8 weights and activations, bf16 output."),
        click.option("--block-shape", "block_shape", default=None,
                     help="fp8_w8a8 block-quantised weights, e.g. 128,128 (activations: 1 x 128 groups)."),
        click.option("--scales", type=click.Choice(["tensor", "token", "block"]), default=None,
                     help="fp8_w8a8 scales: tensor (static per tensor) | token (per token x per channel) | block "
                          "[tensor; block with --block-shape]."),
        click.option("--routing", default="uniform", show_default=True, help="uniform | zipf:S | hot:F | file:PATH"),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True, help="Results folder."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def cluster_options(f):
    """Node size and inter-node link of a simulated cluster (sweep --simulate, compare)."""
    f = click.option("--rdma", "rdma_name", default="rdma-400g", show_default=True,
                     help="RDMA link between nodes, per GPU: rdma-400g (50 GB/s) | rdma-800g (100 GB/s).")(f)
    f = click.option("--gpus-per-node", "gpus_per_node", type=int, default=8, show_default=True,
                     help="GPUs per node: past one node EP traffic to other nodes goes over RDMA; TP stays inside a node.")(f)
    return f


def comm_model(link, rdma_name: str, gpus_per_node: int, device_name: str | None):
    """The communication model over the chosen NVLink profile (published fits; measured fits of
    `device_name` where `moebench env --calibrate-link` wrote them)."""
    from moebench.runtime.comm_model import CommModel

    return CommModel.from_link(link, rdma=rdma_name, gpus_per_node=gpus_per_node, device_name=device_name)


def resolve_precision(dtype: str | None, block_shape: str | None, scales: str | None, device: str,
                      default: str) -> tuple[torch.dtype, object]:
    """--dtype/--block-shape/--scales -> (activation dtype, fp8 QuantScheme or None). fp8_w8a8 keeps
    bf16 activations around the quantised GEMMs (and as the output)."""
    from moebench.inputs import parse_dtype
    from moebench.quant import parse_quant

    quant = parse_quant(dtype, block_shape, scales)
    if quant is not None:
        return torch.bfloat16, quant
    return parse_dtype(dtype or default), None


def _progress() -> Progress:
    """A transient progress bar; off where stdout is not a terminal (a log keeps only the results)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


def _command_line() -> str:
    """This process's command, as a user would type it (names the holder of a run folder's lock)."""
    return shlex.join(["moebench", *sys.argv[1:]])


def _run_options(ctx: click.Context, **resolved) -> dict:
    """The options of this command as given (defaults filled in), with `resolved` values replacing
    those that depend on the machine (device, default token counts): saved in metadata.json, they
    rebuild the run on --resume."""
    opts = {k: (str(v) if isinstance(v, Path) else v) for k, v in ctx.params.items() if k != "resume"}
    opts.update(resolved)
    return opts


def _saved_options(ctx: click.Context, meta: dict, folder: Path) -> dict:
    """The options a run folder was started with: metadata.json's "options", or, in folders written
    before those were saved, its argv parsed again (device and token counts as the run resolved them)."""
    if isinstance(meta.get("options"), dict):
        return meta["options"]
    argv = meta.get("argv")
    if not (isinstance(argv, list) and argv and argv[0] == ctx.command.name):
        raise MoebenchError(f"--resume {folder}: metadata.json does not say how the run was started (no options, no argv)")
    old = ctx.command.make_context(ctx.command.name, [str(a) for a in argv[1:]], resilient_parsing=True)
    resolved = {"device": meta["device"]} if meta.get("device") else {}
    if isinstance(meta.get("tokens"), list):
        resolved["tokens"] = ",".join(str(t) for t in meta["tokens"])
    return _run_options(old, **resolved)


def _resume_defaults(ctx: click.Context, param: click.Parameter, value):
    """--resume DIR (processed before the other options): the options DIR was started with become
    the defaults of this command, so the run continues as it began (checked by `_check_resumed`)."""
    if value is None or ctx.resilient_parsing:
        return value
    from moebench.results import read_run_metadata

    saved = _saved_options(ctx, read_run_metadata(value, ctx.command.name), value)
    ctx.default_map = {**(ctx.default_map or {}), **saved}
    ctx.meta["moebench.saved_options"] = saved
    return value


#: Options that shape only what is printed or exported, not what is measured: free on --resume.
_OUTPUT_ONLY_OPTIONS = frozenset({"show_skipped", "formats"})


def _check_resumed(ctx: click.Context, folder: Path) -> None:
    """Options given beside --resume must agree with the saved ones (except those that shape only
    the output); an error names those that do not."""
    saved = ctx.meta.get("moebench.saved_options", {})

    def norm(name, v):
        if v is None:
            return None
        if name == "tokens":
            return parse_tokens(v)
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    bad = []
    for p in ctx.command.params:
        if p.name == "resume" or p.name in _OUTPUT_ONLY_OPTIONS or p.name not in saved:
            continue
        if ctx.get_parameter_source(p.name) not in (click.core.ParameterSource.COMMANDLINE,
                                                     click.core.ParameterSource.ENVIRONMENT):
            continue
        given = ctx.params[p.name]
        was = None if saved[p.name] is None else p.type_cast_value(ctx, saved[p.name])
        if norm(p.name, given) == norm(p.name, was):
            continue
        opt = p.opts[0] if getattr(p, "opts", None) else p.name
        if getattr(p, "is_flag", False):
            bad.append(f"{opt} (the saved run {'had' if was else 'did not have'} it)")
        else:
            bad.append(f"{opt} {given} (saved: {'none' if was is None else was})")
    if bad:
        raise MoebenchError(f"--resume {folder}: {'; '.join(bad)} contradict{'s' if len(bad) == 1 else ''} the saved "
                            f"settings; resume with the same options or none (they are read from {folder / 'metadata.json'})")


# -- commands ----------------------------------------------------------------------------------

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moebench")
def cli():
    """moebench: benchmark and tune Mixture-of-Experts kernels (TP vs EP, backends, Triton configs)."""


@cli.command()
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
    from moebench.kernels.registry import backend_infos

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
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    t = Table(title="device", show_header=False)
    for k, v in info["device"].items():
        t.add_row(k, str(v))
    if ceilings is not None:
        for k, v in ceilings.describe_lines():
            t.add_row(k, v)
    else:
        t.add_row("ceilings", "none known; run `moebench env --calibrate`")
    console.print(t)
    bt = Table(title="backends")
    for c in ("kind", "name", "format", "dtypes", "devices", "usable", "reason"):
        bt.add_column(c)
    for b in info["backends"]:
        bt.add_row(b["kind"], b["name"], b["activation_format"], b["dtypes"], b["devices"],
                   "[green]yes[/]" if b["usable"] else "[red]no[/]", b["reason"])
    console.print(bt)
    if link_line is not None:
        console.print(link_line)


def _calibrate_link(device: str, world_size: int | None) -> str:
    import datetime

    from moebench.bench.hardware import device_summary
    from moebench.runtime.link_calibration import measure_link
    from moebench.runtime.simulate import write_measured_link

    n = world_size or (torch.cuda.device_count() if device == "cuda" else 2)
    if n < 2:
        raise MoebenchError(f"--calibrate-link needs at least 2 ranks (have {n} on {device}); the link is between GPUs")
    link, raw = measure_link(n, device)
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


@cli.command()
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


@cli.command()
@shape_options
@click.option("--experts", "experts", default="all", show_default=True, help="Comma list of experts backends, or all.")
@click.option("--prepare-finalize", "prepare_finalize", default="all", show_default=True, help="Comma list, or all.")
@click.option("--simulate", is_flag=True, help="Compute one rank's share on one device; model communication.")
@click.option("--link", "link_name", default=None, help="Link profile for --simulate (h200-nvlink, a100-nvlink, pcie-gen5, ib-400g, ...).")
@click.option("--link-gbps", type=float, default=None, help="Override the link bandwidth (GB/s per direction) for --simulate.")
@click.option("--format", "formats", default="csv,json,md", show_default=True, help="Exports: csv,json,md,parquet,html.")
@click.option("--no-check", is_flag=True, help="Skip the float64 reference check.")
@click.option("--resume", "resume", type=click.Path(path_type=Path), default=None, is_eager=True, callback=_resume_defaults,
              help="Continue an interrupted run folder with the settings it was started with.")
@click.option("--reps", type=int, default=None, help="Timed repetitions per row.")
@click.option("--routings", type=int, default=1, show_default=True,
              help="Distinct routings cycled through the timed calls (fresh routing per call, as vLLM's tuner).")
@click.option("--show-skipped", is_flag=True, help="List every skipped pair with its reason (default: a count by reason).")
@cluster_options
def sweep(model, num_experts, topk, hidden, intermediate, tokens, tp, dp, ep, world_size, device, dtype, block_shape,
          scales, routing, seed, out, experts, prepare_finalize, simulate, link_name, link_gbps, formats, no_check, resume, reps,
          routings, show_skipped, gpus_per_node, rdma_name):
    """Run every valid prepare/finalize x experts pair; check, time, and write results."""
    from moebench.kernels.registry import prepare_finalize_names
    from moebench.layout import ParallelLayout
    from moebench.report import EXPORT_FORMATS, print_rows, write_exports
    from moebench.results import RunStore, ensure_writable_dir, new_run_id
    from moebench.routing import parse_routing
    from moebench.sweep import SweepSpec, default_experts, resolve_names

    if resume is not None:
        _check_resumed(click.get_current_context(), resume)
    device = resolve_device(device)
    shape = resolve_shape(model, num_experts, topk, hidden, intermediate)
    tok = parse_tokens(tokens) if tokens is not None else ([1, 16, 64] if device == "cpu" else [1, 16, 64, 256, 1024, 4096])
    layout = ParallelLayout.from_args(tp, dp, ep, world_size)
    layout.validate_shape(shape.num_experts, shape.intermediate)
    parse_routing(routing)
    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    bad = [f for f in fmts if f not in EXPORT_FORMATS]
    if bad:
        raise MoebenchError(f"--format: unknown {', '.join(bad)}; valid: {', '.join(EXPORT_FORMATS)}")
    if "parquet" in fmts and importlib.util.find_spec("pyarrow") is None:
        raise MoebenchError("--format parquet needs pyarrow (pip install pyarrow), or drop parquet from --format")
    dt, quant = resolve_precision(dtype, block_shape, scales, device, "bf16" if device == "cuda" else "fp32")
    if reps is not None and reps < 1:
        raise MoebenchError("--reps must be >= 1")
    if routings < 1:
        raise MoebenchError("--routings must be >= 1")
    spec = SweepSpec(
        shape=shape, tokens=tok, layout=layout,
        experts=resolve_names(experts, default_experts() + ["reference"], "experts", default_experts()),
        prepare_finalize=resolve_names(prepare_finalize, prepare_finalize_names(), "prepare_finalize", prepare_finalize_names()),
        dtype=dt, device=device, routing=routing, seed=seed, check=not no_check, reps=reps, routings=routings,
        quant=quant,
    )
    from moebench.bench.hardware import device_summary
    from moebench.runtime.distributed import is_main, join_torchrun, leave_torchrun
    from moebench.sweep import choose_mode, run, run_multirank

    ctx = join_torchrun() if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None
    mode, notice = choose_mode(layout, device, simulate, world_size, ctx)
    if notice:
        console.print(f"[yellow]notice:[/] {notice}")
    link = link_why = None
    if mode == "simulate":
        from moebench.runtime.simulate import link_for

        from moebench.runtime.comm_model import check_tp, check_world

        dev_name = device_summary(device).get("name") if device == "cuda" else None
        link, link_why = link_for(device, dev_name, link_name, link_gbps)
        check_world(layout.world_size, gpus_per_node)
        if not layout.enable_ep:
            check_tp(layout.moe_tp_size, gpus_per_node)
        link = comm_model(link, rdma_name, gpus_per_node, dev_name)
    elif link_gbps is not None or link_name:
        raise MoebenchError("--link/--link-gbps only apply to simulated runs (--simulate)")
    main_rank = ctx is None or is_main(ctx)
    if not main_rank:  # rank 0 owns the run folder; the others only compute
        run_multirank(spec, out, ctx=ctx)
        leave_torchrun(ctx)
        return
    folder = resume if resume is not None else ensure_writable_dir(out) / new_run_id("sweep", shape.name)
    meta = {"command": "sweep", "argv": sys.argv[1:],
            "options": _run_options(click.get_current_context(), device=device, tokens=",".join(map(str, tok))),
            "mode": mode, "shape": shape.to_dict(),
            "layout": layout.__dict__, "tokens": tok, "dtype": spec.dtype_label, "quant": spec.quant_label,
            "activation_dtype": str(dt), "device": device, "routing": routing,
            "seed": seed, "link": None if link is None else link.as_dict(), "link_why": link_why,
            "device_summary": device_summary(device)}
    # One writer per folder, for the whole sweep (a resume never rewrites the saved settings).
    store = owner = RunStore(folder, metadata=None if resume is not None else meta, lock=True, command=_command_line())
    if resume is not None:
        store.record_resume(sys.argv[1:])
    for n in store.notices:
        err_console.print(f"notice: {n}", markup=False, highlight=False, soft_wrap=True)
    from moebench.sweep import cases_to_run

    n_total = cases_to_run(spec, store, modeled=mode == "simulate")  # skipped pairs are not counted
    console.print(f"[bold]moebench sweep[/] {shape.name} (E={shape.num_experts}, topk={shape.topk}, H={shape.hidden}, "
                  f"I={shape.intermediate}) {layout.describe()}, {mode} run, on {device}, {spec.precision}, "
                  f"routing {routing} -> {folder}")
    if link is not None:
        console.print(f"communication: {link.describe()}; link: {link_why}", markup=False, highlight=False)
    try:
        if mode in ("spawn", "torchrun"):  # rank 0 shows the progress bar
            store = run(spec, store, mode, ctx=ctx)
        else:
            with _progress() as prog:
                task = prog.add_task("sweep", total=n_total)

                def tick(row):
                    if row.status != "skipped":  # the bar counts and names only what runs
                        prog.update(task, advance=1, description=f"M={row.tokens} {row.prepare_finalize}+{row.experts}")

                store = run(spec, store, mode, link=link, on_progress=tick)
    except KeyboardInterrupt:
        store = RunStore(folder)
        write_exports(store, fmts)
        err_console.print(f"interrupted: {len(store.rows)} finished rows kept in {folder} (continue with --resume {folder})")
        owner.close()
        sys.exit(130)
    written = write_exports(store, fmts)
    owner.close()
    print_rows(store.rows, console, show_skipped=show_skipped)
    if store.rows and not any(r.status == "ok" for r in store.rows):
        hint = (" On a CPU, `TRITON_INTERPRET=1 moebench sweep ...` runs the Triton experts under the interpreter"
                " (slowly; for correctness)." if device == "cpu" and "TRITON_INTERPRET" not in os.environ else "")
        console.print(f"[yellow]notice:[/] no pair could run here; the reasons are listed above.{hint}")
    console.print(f"wrote {', '.join(str(p) for p in written)}")
    leave_torchrun(ctx)


@cli.group()
def compare():
    """Compare layouts (tp-vs-ep)."""


@compare.command("tp-vs-ep")
@shape_options
@click.option("--experts", "experts", default="all", show_default=True, help="Experts backends to consider.")
@click.option("--link", "link_name", default=None, help="Link profile (h200-nvlink, a100-nvlink, pcie-gen5, ib-400g, ...).")
@click.option("--link-gbps", type=float, default=None, help="Override the link bandwidth (GB/s per direction).")
@click.option("--target-gpu", default=None,
              help="Model the experts time as this GPU's roofline floor (datasheet) instead of timing it here; "
                   "default on CPU: H200.")
@click.option("--no-check", is_flag=True, help="Skip the reference checks (simulated share and real ranks).")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="PNG file for the plots.")
@click.option("--reps", type=int, default=None, help="Timed repetitions per row.")
@cluster_options
def tp_vs_ep(model, num_experts, topk, hidden, intermediate, tokens, tp, dp, ep, world_size, device, dtype,
             block_shape, scales, routing, seed, out, experts, link_name, link_gbps, target_gpu, no_check, plot_path, reps,
             gpus_per_node, rdma_name):
    """TP (all-reduce) vs EP (dispatch/combine) over --world-size ranks: breakdown, crossover, advice."""
    from moebench.bench.hardware import datasheet_ceilings, device_summary
    from moebench.compare import layouts, run_compare, write_summary
    from moebench.plots import compare_plot
    from moebench.report import write_exports
    from moebench.results import RunStore, check_output_file, ensure_writable_dir, new_run_id
    from moebench.routing import parse_routing
    from moebench.runtime.simulate import DEFAULT_TARGET_GPU, link_for
    from moebench.sweep import SweepSpec, cases_to_run, default_experts, resolve_names

    if tp is not None or dp is not None or ep is not None:
        raise MoebenchError("compare tp-vs-ep builds both layouts itself: give --world-size N, not --tp/--dp/--ep")
    if world_size is None or world_size < 2:
        raise MoebenchError("compare tp-vs-ep needs --world-size N with N >= 2")
    device = resolve_device(device)
    shape = resolve_shape(model, num_experts, topk, hidden, intermediate)
    from moebench.runtime.comm_model import check_world

    check_world(world_size, gpus_per_node)
    for lay in layouts(world_size, gpus_per_node).values():
        lay.validate_shape(shape.num_experts, shape.intermediate)
    tok = parse_tokens(tokens) if tokens is not None else [1, 4, 16, 64, 256, 1024, 4096]
    parse_routing(routing)
    dt, quant = resolve_precision(dtype, block_shape, scales, device, "bf16")
    experts_model = None
    gpu = target_gpu or (DEFAULT_TARGET_GPU if device == "cpu" else None)
    if gpu is not None:
        experts_model = datasheet_ceilings(gpu)
        if experts_model is None:
            raise MoebenchError(f"no datasheet profile for GPU '{gpu}'; try H200, H100, A100, B200, MI300X")
    dev_name = gpu or device_summary(device).get("name")
    link, link_why = link_for(device, device_summary(device).get("name"), link_name, link_gbps, requested_gpu=target_gpu)
    # a measurement of this machine's links stands in only when its GPUs are the target
    link = comm_model(link, rdma_name, gpus_per_node,
                      device_summary(device).get("name") if device == "cuda" and target_gpu is None else dev_name)
    spec = SweepSpec(shape=shape, tokens=tok, experts=resolve_names(experts, default_experts(), "experts", default_experts()),
                     dtype=dt, device=device, routing=routing, seed=seed, check=not no_check, reps=reps, quant=quant)
    if plot_path is not None:
        check_output_file(plot_path, "--plot")
    folder = ensure_writable_dir(out) / new_run_id("compare", shape.name)
    meta = {"command": "compare tp-vs-ep", "argv": sys.argv[1:], "shape": shape.to_dict(), "world_size": world_size,
            "tokens": tok, "dtype": spec.dtype_label, "quant": spec.quant_label, "device": device, "routing": routing,
            "seed": seed,
            "link": link.as_dict(), "link_why": link_why,
            "experts_model": None if experts_model is None else experts_model.as_dict(),
            "device_summary": device_summary(device)}
    store = RunStore(folder, metadata=meta, lock=True, command=_command_line())
    how = (f"experts time = {experts_model.device_name} roofline floor (datasheet), not measured"
           if experts_model is not None else f"experts time measured on {dev_name}")
    check_ranks = device == "cpu" and not no_check and world_size <= gpus_per_node
    console.print(f"[bold]moebench compare tp-vs-ep[/] {shape.name} over {world_size} ranks, {spec.precision}, "
                  f"routing {routing}: simulated ({how}; communication: {link.describe()})")
    console.print(f"link: {link_why}", markup=False, highlight=False)
    if check_ranks:
        console.print("correctness also checked on real gloo ranks")
    if world_size > gpus_per_node:
        console.print("past one node TP is one TP replica per node on its share of the batch; correctness is "
                      "checked on the simulated share only")
    from moebench.compare import layout_specs

    with _progress() as prog:  # counts the simulated cases that run (skipped pairs are not counted)
        task = prog.add_task("compare", total=sum(cases_to_run(s, store, modeled=True)
                                                  for s in layout_specs(spec, world_size, gpus_per_node).values()))
        result = run_compare(spec, world_size, store, link, experts_model=experts_model,
                             check_ranks=check_ranks, gpus_per_node=gpus_per_node,
                             on_progress=lambda r: r.status == "skipped" or prog.update(
                                 task, advance=1, description=f"M={r.tokens} {r.prepare_finalize}+{r.experts}"))
    write_exports(RunStore(folder), ["csv", "json", "md"])
    written = write_summary(result, folder)
    _print_compare(result, world_size)
    if not result.summary.empty:
        names = " vs ".join(layouts(world_size, gpus_per_node))
        png = compare_plot(result.summary, result.crossover, f"{shape.name}: {names} ({how})",
                           plot_path or folder / "compare.png")
        written.append(png)
    console.print(f"wrote {', '.join(str(p) for p in written)}")


def _print_compare(result, n: int) -> None:
    from moebench.report import compare_table, print_table, say

    if result.summary.empty:
        say(console, result.recommendation, "bold")
        return
    left = print_table(console, compare_table(result.summary, "TP vs EP (simulated: experts of one rank + modeled communication)"))
    say(console, result.recommendation, "bold")
    notes = ["* = the faster layout at that token count; other = total minus the parts shown; band = the layer "
             "under the fastest and the slowest published transport for this link; flip x = the factor on the "
             "modeled communication at which the winner would flip (close: the band covers it, too close to call)."]
    if left:
        notes.append(f"not shown at {console.width} columns: {', '.join(left)} (compare.csv holds every column).")
    for note in notes:
        say(console, note, "dim")


@cli.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["md", "csv", "html"]), default="md", show_default=True)
@click.option("--out", "out_file", type=click.Path(path_type=Path), default=None,
              help="Report file (default: report.<format> in the first results folder).")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="PNG of latency vs tokens.")
def report(results, fmt, out_file, plot_path):
    """Merge result folders: pivot (tokens x backend pairs), fastest correct entry highlighted, export."""
    from moebench.plots import latency_plot
    from moebench.report import frame, html_report, pivot, pivot_markdown, pivot_table_text, print_table, say
    from moebench.results import atomic_write_text, check_output_file, load_rows

    rows = load_rows(results)
    if not rows:
        raise MoebenchError("the results hold no rows")
    df = frame(rows)
    table, fastest = pivot(df)
    common = table.attrs.get("common", []) if not table.empty else []
    title = "moebench report" + (": " + ", ".join(common) if common else "")
    first = results[0] if results[0].is_dir() else results[0].parent
    out_file = out_file or first / f"report.{fmt}"
    check_output_file(out_file, "--out")  # before the plot and the report are made
    if plot_path is not None:
        check_output_file(plot_path, "--plot")
    png = None
    if plot_path is not None or fmt == "html":
        import tempfile

        target = plot_path or Path(tempfile.mkdtemp()) / "latency.png"
        latency_plot(df, title, target)
        png = target.read_bytes()
    if fmt == "md":
        atomic_write_text(out_file, f"# {title}\n\n" + (pivot_markdown(table, fastest) if not table.empty else "no correct rows\n"))
    elif fmt == "csv":
        atomic_write_text(out_file, table.to_csv(index=False))
    else:
        atomic_write_text(out_file, html_report(df, table, fastest, png, title))
    if not table.empty:
        left = print_table(console, pivot_table_text(table, fastest, title))
        if table.attrs.get("repeats"):
            say(console, f"{table.attrs['repeats']} cells hold more than one run of the same setting: "
                         "the fastest is shown.", "dim")
        if left:
            say(console, f"not shown at {console.width} columns: {', '.join(left)} (the report file has them).", "dim")
    console.print(f"wrote {out_file}" + (f" and {plot_path}" if plot_path else ""))


from moebench.tuning.commands import configs, tune  # noqa: E402  (they import cli's helpers lazily)

cli.add_command(tune)
cli.add_command(configs)


def main() -> None:
    """Entry point: bad input -> one line on stderr, exit status 2, no traceback."""
    try:
        cli.main(standalone_mode=False)
    except MoebenchError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        err_console.print(f"error: {e.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
