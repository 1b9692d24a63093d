"""Click commands `tune` and `configs` (list, show, diff, commit); moebench.cli attaches them.

    moebench tune --model NAME [--tp N] [--ep N] [--tokens ...] [--search grid|random|halving]
                  [--budget N] [--gpus all|0,1] [--compile-workers N] [--resume RUN_DIR] [--out DIR] [--device]
                  [--dtype bf16|fp16|fp32|fp8_w8a8] [--block-shape BN,BK] [--scales tensor|token|block]
                  [--kernel moebench|vllm|sglang]
    moebench configs list | show FILE|E,N | diff A B | commit [--kernel moebench|vllm|sglang] FILE...
                  (show / diff of E,N: --dtype fp8_w8a8 [--block-shape BN,BK] pick the fp8 file)

Commands parse and print; the work is in `moebench.tuning` (tuner, files) and `moebench.kernels.triton.configs`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click
import torch
from rich.table import Table
from rich.text import Text

from moebench.cli.options import (
    MODEL_FLAGS,
    PRECISION_FLAGS,
    check_kernel,
    check_routing,
    console,
    err_console,
    oom_text,
    options,
    parse_tokens,
    resolve_device,
    resolve_precision,
    resolve_shape,
    way_on,
)
from moebench.errors import MoebenchError, interrupt_status, interrupted_by
from moebench.report import Column, TextTable, print_fitted, say
from moebench.tuning import files
from moebench.tuning.files import commit_files as files_commit
from moebench.kernels import tuned_files as TF

TUNE_TOKENS_CPU = [1, 4]


# ---------------------------------------------------------------------------------------------
# tune


@click.command("tune")
@options(*MODEL_FLAGS, "--tokens", "--tp", "--dp", "--ep", "--device", *PRECISION_FLAGS, "--routing", "--seed",
         tokens=dict(help="Comma list of token counts per rank [cpu: 1,4; cuda: vLLM's 18 counts 1..4096]."),
         tp=dict(help="Tensor-parallel size: N of the file = I / tp."),
         dp=dict(help="Data-parallel size (with --ep)."),
         ep=dict(help="Expert parallelism over N ranks: E of the file = local experts."),
         dtype=dict(help="Default: bf16 on cuda, fp32 on cpu. fp8_w8a8: fp8 weights and activations (bf16 around "
                         "them); writes the ...,dtype=fp8_w8a8[,block_shape=[BN,BK]][,per_channel_quant=True].json "
                         "file. int8_w8a16 / int4_w4a16 / mxfp4: weight-only (bf16 activations), ...,dtype=<name>.json."),
         block_shape=dict(help="fp8_w8a8 block-quantised weights, e.g. 128,128 (prunes BLOCK_SIZE_K/N to divide it)."),
         # None: a --resume'd run's saved value, else uniform / 0
         routing=dict(default=None, show_default=False, help="uniform | zipf:S | hot:F | file:PATH  [uniform]"),
         seed=dict(default=None, show_default=False, help="Inputs and sampling seed [0]."))
@click.option("--search", "strategy", type=click.Choice(["grid", "random", "halving"]), default=None,
              help="grid: every pruned config; random: --budget samples; halving (default): successive halving "
                   "seeded by the neighbouring token count's winners.")
@click.option("--budget", type=int, default=None, help="Configs per token count for random / halving [auto: 5% of the pruned space, 6-48].")
@click.option("--gpus", default="all", show_default=True, help="GPUs to spread token counts over: all, or 0,1,...")
@click.option("--compile-workers", "compile_workers", type=int, default=0, show_default=True,
              help="Processes per GPU that compile each batch of candidate configs before it is timed "
                   "(Triton's compile is most of a candidate's cost; 12 on a 16-core H200 host: 2.3x less "
                   "search time); 0 = compile while timing.")
@click.option("--resume", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Continue an interrupted run folder (its settings are read from it).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder of the vLLM-format config file [results/configs; with --resume: the run's own].")
@click.option("--results-dir", "results_dir", type=click.Path(path_type=Path), default=Path("results"),
              show_default=True, help="Where the run folder (candidate rows, report) is created.")
@click.option("--reps", type=int, default=None, help="Timer repetitions while screening [cuda 20, cpu 2].")
@click.option("--final-reps", "final_reps", type=int, default=None, help="Repetitions of the final stage [cuda 50, cpu 3].")
@click.option("--dry-run", "dry_run", is_flag=True, help="Only show the search space after pruning, per token count.")
@click.option("--kernel", "kernel", type=str, default=None,
              help="Whose kernel the configs are for: moebench (the triton experts, moebench's file) | vllm | sglang "
                   "(the vllm-triton experts: vLLM's kernel structure; the engine's file in results/configs/<kernel>/) "
                   "[moebench].")
@click.option("--down", is_flag=True,
              help="Tune GEMM2's own config against the GEMM1 config the layer looks up (tuned file or default "
                   "heuristic; same BLOCK_SIZE_M) and write SGLang's ..._down.json file next to it.")
@click.option("--against", "against", multiple=True, type=click.Path(path_type=Path),
              help="A config file to beat (repeatable), e.g. the engine's shipped file for this shape: at each token "
                   "count its nearest entry seeds the search and runs in the final stage, so the winner is never "
                   "slower there; the report gives winner / file.")
def tune(model, num_experts, topk, hidden, intermediate, tokens, tp, dp, ep, device, dtype, block_shape, scales,
         group_size, zero_points, routing, seed, strategy, budget, gpus, compile_workers, resume, out, results_dir, reps,
         final_reps, dry_run, kernel, down, against):
    """Find the fastest Triton tile config per token count; write the vLLM-format file."""
    from moebench.inputs import dtype_name
    from moebench.layout import ParallelLayout
    from moebench.results import new_run_id
    from moebench.tuning import tuner as T

    for name, v in (("--budget", budget), ("--reps", reps), ("--final-reps", final_reps)):
        if v is not None and v < 1:
            raise MoebenchError(f"{name} must be >= 1, got {v}")
    if compile_workers < 0:
        raise MoebenchError(f"--compile-workers must be >= 0, got {compile_workers}")
    if kernel is not None:
        check_kernel(kernel)
    rivals = against_tables(against)
    sizes_given = model is not None or any(v is not None for v in (num_experts, topk, hidden, intermediate))
    if resume is not None:
        spec = T.load_run_spec(resume)
        if sizes_given:
            spec.shape = resolve_shape(model, num_experts, topk, hidden, intermediate)
        if any(v is not None for v in (tp, dp, ep)):
            spec.layout = ParallelLayout.from_args(tp, dp, ep)
        if device is not None:
            spec.device = plan_device(device, dry_run)
        else:
            plan_device(spec.device, dry_run)
        if any(v is not None for v in (dtype, block_shape, scales, group_size)) or zero_points:
            saved = spec.quant.name if spec.quant is not None else dtype_name(spec.dtype)
            if not (spec.quant is not None and dtype in (None, spec.quant.name) and block_shape is None
                    and scales is None and group_size is None
                    and not zero_points):  # a bare --dtype fp8_w8a8 keeps the saved scheme
                spec.dtype, spec.quant = resolve_precision(dtype or saved, block_shape, scales, spec.device,
                                                           dtype_name(spec.dtype), group_size, zero_points)
        if tokens is not None:
            spec.tokens = parse_tokens(tokens)
        if down:
            spec.down = True  # the saved run must have been a --down run (checked against it)
        if kernel is not None:
            spec.kernel = kernel  # must be the saved one (checked against it)
        if rivals is not None:
            spec.against = rivals  # must be the saved ones (checked against them)
        for attr, v in (("routing", routing), ("seed", seed), ("strategy", strategy), ("budget", budget),
                        ("reps", reps), ("final_reps", final_reps)):
            if v is not None:
                setattr(spec, attr, v)
        run_dir = resume
        if out is None:
            out = T.load_run_out_dir(resume)  # the folder the run was started with
    else:
        dev = plan_device(device, dry_run)
        kernel = kernel or "moebench"
        # the engines' kernel takes 16-bit activations only: bf16 on a CPU too
        act_dtype, quant = resolve_precision(dtype, block_shape, scales, dev,
                                             "bf16" if dev == "cuda" or kernel != "moebench" else "fp32",
                                             group_size, zero_points)
        spec = T.TuneSpec(
            shape=resolve_shape(model, num_experts, topk, hidden, intermediate),
            layout=ParallelLayout.from_args(tp, dp, ep),
            tokens=parse_tokens(tokens) if tokens is not None else (files.TUNE_TOKENS_CUDA if dev == "cuda" else TUNE_TOKENS_CPU),
            dtype=act_dtype, device=dev,
            strategy=strategy or "halving", budget=budget, seed=seed or 0, routing=routing or "uniform",
            reps=reps, final_reps=final_reps, quant=quant, down=down, kernel=kernel, against=rivals,
        )
        run_dir = Path(results_dir) / new_run_id("tune", spec.shape.name)
    check_routing(spec.routing, spec.shape)
    TF.config_search_dirs()  # a MOEBENCH_CONFIG_DIR that is no folder is refused before any work
    spec.tokens = sorted(set(spec.tokens))
    cannot_run = T._validate(spec, plan_only=dry_run)
    if not dry_run:  # before any folder or file exists: a refused tune writes nothing
        from moebench.inputs import check_fits

        check_fits(spec.local_experts, spec.shape.hidden, spec.inter_per_rank, max(spec.tokens), spec.shape.topk,
                   spec.dtype, spec.device, advice="shard it with --tp/--ep, or tune fewer --tokens")
    s = spec.shape
    gpu_unknown = spec.device == "cuda" and not torch.cuda.is_available()  # a dry run on a machine without one
    say(console, Text.assemble(("moebench tune", "bold"), f" {s.name} (E={s.num_experts}, topk={s.topk}, H={s.hidden}, "
                               f"I={s.intermediate}) {spec.layout.describe()}, {spec.precision}, kernel {spec.kernel} -> "
                               f"{T.config_path_for(spec, out, 'GPU_NAME' if gpu_unknown else None)} on {spec.device}, search {spec.strategy}"
                               + (" (GEMM2 against GEMM1's config)" if spec.down else "")))
    counts = T.prune_counts(spec)
    pt = Table(title="search space after pruning")
    pt.add_column("tokens", justify="right")
    pt.add_column("kept", justify="right")
    pt.add_column("pruned (why)")
    for m, rep in counts.items():
        pt.add_row(str(m), f"{len(rep.kept)} / {rep.total}",
                   ", ".join(f"{n} {r}" for r, n in sorted(rep.pruned.items(), key=lambda kv: -kv[1])))
    console.print(pt)
    if dry_run:
        if gpu_unknown:
            say(console, f"dry run without a GPU: pruned for {T.smem_limit('cuda') // 1024} KiB of shared memory per "
                         "block (an H100 / H200); GPU_NAME is the name of the GPU the tune runs on.")
        if cannot_run:
            say(console, f"notice: {cannot_run} (a dry run only plans the search)")
        return

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    try:
        with way_on("tune", lambda: run_dir, settings=T.SETTINGS), progress:
            task = progress.add_task("tune", total=len(spec.tokens))

            def on_measure(row):
                lat = f"{row.latency_us:.1f} us" if row.latency_us is not None else T.verdict(row)
                progress.update(task, description=f"M={row.tokens} {row.variant}: {lat}")

            def on_tokens(r):
                progress.update(task, advance=1)

            outcome = T.tune(spec, out_dir=out, resume=resume, gpus=gpus, run_dir=run_dir, results_dir=results_dir,
                             on_measure=on_measure, on_tokens=on_tokens, compile_workers=compile_workers)
    except KeyboardInterrupt as stop:
        say(err_console, f"{interrupted_by(stop)}: finished measurements are kept in {run_dir} "
                         f"(continue with: moebench tune --resume {run_dir})")
        sys.exit(interrupt_status(stop))
    except torch.OutOfMemoryError as e:
        raise MoebenchError(f"out of GPU memory ({oom_text(e)}) with {compile_workers} "
                            f"compile workers beside the timing process: give fewer --compile-workers; finished "
                            f"measurements are kept (continue with: moebench tune --resume {run_dir})") from None
    if not outcome.is_main:
        return  # a torchrun rank other than 0: rank 0 prints and writes
    print_fitted(console, T.report_table(outcome.results), f"{outcome.run_dir / 'report.md'} has every column")
    if spec.against:
        say(console, T.against_summary(outcome.results))
    if torch_device_is_cpu(spec.device):
        say(console, "CPU / Triton-interpreter times test the plumbing, not kernel speed.", "dim")
    say(console, f"run folder: {outcome.run_dir}")
    if outcome.config_path is not None:
        say(console, f"wrote {outcome.config_path}")
    else:
        raise MoebenchError(f"no token count found a working config; see {outcome.run_dir / 'report.md'}")


def plan_device(device: str | None, dry_run: bool) -> str:
    """--device for tune: as resolve_device, except that a dry run (which measures nothing) plans a
    GPU tune on any machine."""
    if dry_run and device == "cuda":
        return "cuda"
    return resolve_device(device)


def against_tables(paths) -> dict[str, dict[int, dict[str, int]]] | None:
    """--against FILE...: {folder/file name: {tokens: config}} (a bad file is a one-line error), or None."""
    if not paths:
        return None
    tables = {}
    for p in paths:
        name = f"{p.parent.name}/{p.name}" if p.parent.name else p.name
        if name in tables:
            raise MoebenchError(f"--against {p}: {name} is given twice; give each file once")
        tables[name] = {t: dict(c) for t, c in TF.load_config_file(p).items()}
    return tables


def torch_device_is_cpu(device: str) -> bool:
    return not str(device).startswith("cuda")


# ---------------------------------------------------------------------------------------------
# configs


@click.group("configs")
def configs():
    """Tuned-config files: list, show, diff, commit into the package."""


def _resolve_file(arg: str, device: str | None, dtype: str | None, block_shape: str | None = None,
                  down: bool = False) -> Path:
    """A path, or 'E,N' looked up along the lookup order for `device` (default: this machine),
    `dtype` (the file name's dtype tag, e.g. fp8_w8a8), `block_shape` ('128,128') and `down`
    (GEMM2's `_down.json` file)."""
    from moebench.quant import parse_block_shape

    bs = parse_block_shape(block_shape)
    if bs is not None and not dtype:
        raise MoebenchError("--block-shape picks an fp8 file: give --dtype fp8_w8a8 with it")
    p = Path(arg)
    if p.is_file():
        return p
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", arg)
    if m is None:
        if p.suffix == ".json" or "/" in arg:
            raise MoebenchError(f"config file {arg!r} does not exist")
        raise MoebenchError(f"{arg!r} is neither a config file nor 'E,N' (e.g. 8,14336)")
    e, n = int(m[1]), int(m[2])
    dev = device or TF.current_device_name()
    found = TF.find_config_file(e, n, dev, dtype, list(bs) if bs else None, down=down)
    if found is None:
        name = TF.config_file_name(e, n, dev, dtype, list(bs) if bs else None, down=down)
        raise MoebenchError(f"no {name} in {', '.join(str(d) for d in TF.config_search_dirs())}")
    return found


def _cfg_text(cfg) -> str:
    return "/".join(str(cfg[k]) for k in TF.TILE_KEYS)


@configs.command("list")
@click.option("--dir", "dirs", multiple=True, type=click.Path(path_type=Path), help="Extra folder(s) to list.")
@click.option("--json", "as_json", is_flag=True)
def configs_list(dirs, as_json):
    """Config files along the lookup order ($MOEBENCH_CONFIG_DIR, results/configs, moebench/configs),
    with the kernel each is for: moebench (the folder itself; the package's moebench/), vllm (its
    vllm/), sglang (its sglang/triton_X_Y_Z/)."""
    rows = []
    seen: set[Path] = set()
    roots: list[Path] = []  # the folders listed, in lookup order
    for order, d in enumerate([*TF.config_search_dirs(), *map(Path, dirs)]):
        if not d.is_dir() or d.resolve() in seen:
            continue
        seen.add(d.resolve())
        roots.append(d)
        # each kernel's files in its folders of this root (tuned_files.kernel_dirs)
        found = [(kernel, folder, f) for kernel in TF.KERNELS for folder in TF.kernel_dirs(kernel, (d,))
                 for f in folder.glob("*.json")]
        for kernel, folder, f in found:
            parts = TF.parse_file_name(f.name)
            if parts is None:
                continue
            try:
                table = TF.read(kernel, f)
                toks, status = list(table), "ok"
            except MoebenchError as e:
                toks, status = [], f"invalid: {e}"
            try:
                routing = TF.tuned_routing(f) if kernel == "moebench" else None
            except MoebenchError as e:
                routing, status = None, f"invalid: {e}"
            rows.append({"dir": str(folder), "root": len(roots), "file": f.name, "kernel": kernel, **parts, "tokens": toks,
                         "routing": None if routing is None else {"experts": routing[0], "topk": routing[1]},
                         "status": status, "_order": order})
    # by E, then N, as numbers; the same file's folders next to each other, in lookup order
    rows.sort(key=lambda r: (r["E"], r["N"], r["device"], r["dtype"] or "", r["block_shape"] or "",
                             r["per_channel_quant"], r["down"], r["kernel"], r["_order"]))
    for r in rows:
        del r["_order"]
    if as_json:
        for r in rows:
            del r["root"]
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        say(console, "no tuned-config files in " + ", ".join(str(d) for d in TF.config_search_dirs()))
        return
    print_fitted(console, configs_list_table(rows, roots))
    say(console, "folders, the first holding a file wins at lookup: " + "; ".join(
        f"[{i}] {d}" for i, d in enumerate(roots, 1)))
    say(console, "GEMM 1,2: the file serves GEMM2 too where no _down file is found; 2: a _down file (GEMM2 alone). "
                 "token counts: how many, smallest-largest (configs show FILE lists them).", "dim")
    for r in rows:
        if r["status"] != "ok":
            say(console, f"{Path(r['dir']) / r['file']}: {r['status']}")


@configs.command("show")
@click.argument("target")
@click.option("--device", "device", default=None, help="Device name for an E,N target (default: this machine's).")
@click.option("--dtype", default=None, help="dtype tag of the file name (quantised kernels only, e.g. fp8_w8a8).")
@click.option("--block-shape", "block_shape", default=None, help="block_shape of the file name (fp8 block scales, e.g. 128,128).")
@click.option("--down", is_flag=True, help="For an E,N target: GEMM2's `_down.json` file.")
@click.option("--json", "as_json", is_flag=True)
def configs_show(target, device, dtype, block_shape, down, as_json):
    """One file's entries: TARGET is a path or E,N (looked up for this device)."""
    path = _resolve_file(target, device, dtype, block_shape, down)
    table = TF.load_config_file(path)
    if as_json:
        click.echo(json.dumps({str(k): dict(v) for k, v in table.items()}, indent=2))
        return
    keys = TF.TILE_KEYS + tuple(k for k in TF.DOWN_KEYS if any(k in cfg for cfg in table.values()))
    cols = [Column("tokens", "tokens", [str(m) for m in table])]
    cols += [Column(k, SHORT_KEYS.get(k, k), [str(cfg.get(k, "-")) for cfg in table.values()]) for k in keys]
    say(console, str(path))
    print_fitted(console, TextTable("", cols))
    say(console, "; ".join(f"{SHORT_KEYS[k]} = {k}" for k in keys if k in SHORT_KEYS), "dim")


#: Short column headers of a config's keys (configs show, configs list).
SHORT_KEYS = {"BLOCK_SIZE_M": "BM", "BLOCK_SIZE_N": "BN", "BLOCK_SIZE_K": "BK", "GROUP_SIZE_M": "GM",
              "num_warps": "warps", "num_stages": "stages", "USE_TMA": "TMA"}


def configs_list_table(rows: list[dict], roots: list[Path]) -> TextTable:
    """`configs list` as a TextTable: the folder as [its place in the lookup order] plus the engine's
    subfolder, then the file's name parts, its token counts (how many, smallest-largest), status."""
    def where(r):
        sub = Path(r["dir"]).relative_to(roots[r["root"] - 1]) if r["dir"] != str(roots[r["root"] - 1]) else None
        return f"[{r['root']}]" + (f" {sub}" if sub else "")

    def counts(toks):
        return f"{len(toks)}: {min(toks)}-{max(toks)}" if toks else "-"

    def cells(f):
        return [f(r) for r in rows]

    return TextTable("tuned configs", [
        Column("folder", "folder", cells(where), right=False),
        Column("kernel", "kernel", cells(lambda r: r["kernel"]), right=False, drop=70),
        Column("E", "E", cells(lambda r: str(r["E"]))),
        Column("N", "N", cells(lambda r: str(r["N"]))),
        Column("device", "device", cells(lambda r: str(r["device"])), right=False, drop=30),
        Column("dtype", "dtype", cells(lambda r: (r["dtype"] or "-") + (" per-channel" if r["per_channel_quant"] else "")),
               right=False),
        Column("block", "block", cells(lambda r: r["block_shape"] or "-"), right=False, drop=20),
        Column("GEMM", "GEMM", cells(lambda r: "2" if r["down"] else "1,2"), right=False),  # tells _down files apart
        Column("tokens", "token\ncounts", cells(lambda r: counts(r["tokens"])), name="token counts"),
        Column("routing", "tuned\nrouting", cells(lambda r: "-" if r["routing"] is None else
                                                  f"top-{r['routing']['topk']}/{r['routing']['experts']}"),
               drop=50, name="tuned routing"),
        Column("status", "status", cells(lambda r: "ok" if r["status"] == "ok" else "invalid"), right=False),
    ])


@configs.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--device", "device", default=None, help="Device name for E,N targets.")
@click.option("--dtype", default=None, help="dtype tag of the file names for E,N targets (e.g. fp8_w8a8).")
@click.option("--block-shape", "block_shape", default=None, help="block_shape of the file names for E,N targets.")
def configs_diff(a, b, device, dtype, block_shape):
    """Per token count, which fields differ between two files (paths or E,N)."""
    pa, pb = _resolve_file(a, device, dtype, block_shape), _resolve_file(b, device, dtype, block_shape)
    diffs = files.diff_tables(TF.load_config_file(pa), TF.load_config_file(pb))
    say(console, f"A = {pa}\nB = {pb}")
    if not diffs:
        console.print("identical entries")
        return
    t = Table()
    t.add_column("tokens", justify="right")
    t.add_column("difference")
    for m, d in diffs:
        t.add_row(str(m), d)
    console.print(t)


@configs.command("coverage")
@click.option("--device", "device", default="NVIDIA_H200", show_default=True,
              help="Device name of the files (as in their names; spaces as underscores).")
@click.option("--shards", "as_shards", is_flag=True,
              help="Print only the missing shards as MODEL:FLAGS;... (the shards the `presets` device job tunes).")
@click.option("--fill", "as_fill", is_flag=True,
              help="Print the tune commands that add vLLM's missing token counts to the files found.")
@click.option("--json", "as_json", is_flag=True)
def configs_coverage(device, as_shards, as_fill, as_json):
    """Which preset models' usual layouts (TP1 and their TP/EP shards) have a tuned bf16 file, and
    how many of vLLM's 18 token counts it holds (between counts the lookup takes the nearest)."""
    from moebench.tuning import tuner as T

    rows = T.deploy_coverage(device.replace(" ", "_"))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if as_fill:
        seen: set[str] = set()  # one command per file (deepseek-v3 and -r1 share theirs)
        for r in rows:
            if r["found"] is not None and r["missing_counts"] and r["file"] not in seen:
                seen.add(r["file"])
                tokens = ",".join(map(str, r["missing_counts"]))
                click.echo(" ".join(filter(None, ("moebench tune --model", r["model"], r["tune_flags"],
                                                  "--tokens", tokens, "--out", r["found"]))))
        return
    if as_shards:
        missing: dict[str, str] = {}  # one shard per missing file (deepseek-v3 and -r1 share theirs)
        for r in rows:
            if r["found"] is None:
                missing.setdefault(r["file"], f"{r['model']}:{r['tune_flags']}")
        click.echo(";".join(missing.values()))
        return
    full = len(files.TUNE_TOKENS_CUDA)
    print_fitted(console, coverage_table(rows, device, full))
    folders = list(dict.fromkeys(r["found"] for r in rows if r["found"] is not None))
    if folders:
        say(console, "found in: " + "; ".join(f"[{i}] {d}" for i, d in enumerate(folders, 1)))
    n_missing = sum(r["found"] is None for r in rows)
    n_sparse = len({r["file"] for r in rows if r["found"] is not None and r["missing_counts"]})
    say(console, f"{len(rows) - n_missing} of {len(rows)} covered; tune the rest with "
                 "`moebench tune --model MODEL [--tp N | --ep N]` (or `configs coverage --shards`).")
    if n_sparse:
        say(console, f"{n_sparse} file(s) hold fewer than vLLM's {full} token counts: between counts the "
                     "nearest entry was up to 1.18x slower than the default heuristic on an H200 "
                     "(PERF.md section 2); `configs coverage --fill` prints the tunes that add them.")


def coverage_table(rows: list[dict], device: str, full: int) -> TextTable:
    """`configs coverage` as a TextTable: per preset layout the file's E and N, how many of the
    `full` token counts it holds, and the folder it was found in as [its number] (the folders
    follow the table whole, never cut)."""
    folders = list(dict.fromkeys(r["found"] for r in rows if r["found"] is not None))
    found = ["missing" if r["found"] is None else f"[{folders.index(r['found']) + 1}]" for r in rows]
    return TextTable(f"tuned bf16 configs for the presets' usual layouts on {device}", [
        Column("model", "model", [r["model"] for r in rows], right=False),
        Column("layout", "layout", [r["layout"] for r in rows], right=False),
        Column("E", "E", [str(r["E"]) for r in rows]),
        Column("N", "N", [str(r["N"]) for r in rows]),
        Column("tokens", "token counts", ["-" if r["found"] is None else f"{full - len(r['missing_counts'])} of {full}"
                                          for r in rows]),
        Column("found", "found in", found, right=False, styles=["red" if f == "missing" else "" for f in found]),
    ])


@configs.command("commit")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--kernel", "kernel", default="moebench", show_default=True,
              help="Whose kernel the files are for: moebench -> moebench/configs/; vllm -> moebench/configs/vllm/; "
                   "sglang -> moebench/configs/sglang/triton_X_Y_Z/ (the file's own triton_X_Y_Z folder, else the "
                   "installed Triton's).")
@click.option("--allow-cpu", "allow_cpu", is_flag=True,
              help="Commit files tuned on a CPU (device_name=cpu: Triton-interpreter times, for plumbing checks).")
def configs_commit(files, kernel, allow_cpu):
    """Validate FILES and copy them into the package's config folder of KERNEL (shipped with moebench)."""
    check_kernel(kernel)
    for verb, dest in files_commit(files, kernel, allow_cpu):
        say(console, f"{verb} {dest}")
