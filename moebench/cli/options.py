"""What the commands share, declared once: the consoles, the option blocks (shape, cluster), the
parsing of tokens, device, shape and precision, the progress bar and --resume's saved options."""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Callable, Iterator

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moebench.errors import MoebenchError, WriteError

console = Console()
err_console = Console(stderr=True)
# Their width follows COLUMNS (else the terminal's) at each print, not at import: the entry point
# can run more than once in a process (`moebench.cli.main` called from Python), each time with its own.
console.width = err_console.width = None


# -- shared option parsing ---------------------------------------------------------------------

def oom_text(e: BaseException) -> str:
    """The first sentence of an out-of-memory error ("CUDA out of memory"), for a one-line message."""
    lines = str(e).strip().splitlines()
    return lines[0].split(". ")[0] if lines else "out of memory"


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
        if n in out:
            raise MoebenchError(f"--tokens: {n} is given more than once; give each token count once")
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


def check_routing(routing: str, shape) -> None:
    """--routing parsed, and a file: routing's ids read and checked against the shape, before any
    run folder exists (a refused command writes nothing)."""
    from moebench.routing import load_topk_ids, parse_routing

    rs = parse_routing(routing)
    if rs.kind == "file":
        load_topk_ids(rs.path, shape.num_experts, shape.topk, 1)


#: --dtype's choices: the float dtypes and the quantised schemes (moebench.quant.QUANT_DTYPES).
DTYPE_CHOICES = ["bf16", "fp16", "fp32", "fp8_w8a8", "int8_w8a16", "int4_w4a16", "mxfp4", "nvfp4"]

#: Every option a command that runs kernels can take, declared once: flag -> (click.option's
#: positional arguments after the flag, its keyword arguments). A command picks its subset with
#: `options(...)`, replacing a help text or default where its meaning differs (tune's --tp names
#: the file's N; its --routing / --seed default to the resumed run's).
OPTION_TABLE: dict[str, tuple[tuple, dict]] = {
    "--model": ((), dict(default=None, help="Preset name (see `moebench models`) or a local HuggingFace config.json.")),
    "--num-experts": (("num_experts",), dict(type=int, default=None, help="E, for a custom shape.")),
    "--topk": ((), dict(type=int, default=None, help="Experts per token, for a custom shape.")),
    "--hidden": ((), dict(type=int, default=None, help="H, for a custom shape.")),
    "--intermediate": ((), dict(type=int, default=None, help="MoE intermediate size I, for a custom shape.")),
    "--tokens": ((), dict(default=None, help="Comma list of token counts per rank [cpu: 1,16,64; cuda: 1..4096].")),
    "--tp": ((), dict(type=int, default=None, help="Tensor-parallel size.")),
    "--dp": ((), dict(type=int, default=None, help="Data-parallel size.")),
    "--ep": ((), dict(type=int, default=None, help="Expert parallelism over N ranks (N = dp * tp).")),
    "--world-size": (("world_size",), dict(type=int, default=None, help="Ranks to run (spawned processes).")),
    "--device": ((), dict(type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda when present.")),
    "--dtype": ((), dict(type=click.Choice(DTYPE_CHOICES), default=None,
                         help="Default: bf16 on cuda, fp32 on cpu. fp8_w8a8: fp8 weights and activations, bf16 "
                              "output; int8_w8a16 / int4_w4a16 / mxfp4: weight-only quantised, bf16 activations.")),
    "--block-shape": (("block_shape",), dict(default=None, help="fp8_w8a8 block-quantised weights, e.g. 128,128 "
                                                                  "(activations: 1 x 128 groups).")),
    "--scales": ((), dict(type=click.Choice(["tensor", "token", "block"]), default=None,
                          help="fp8_w8a8 scales: tensor (static per tensor) | token (per token x per channel) | "
                               "block [tensor; block with --block-shape].")),
    "--group-size": (("group_size",), dict(type=int, default=None,
                                           help="int4_w4a16: values per scale along K, 32 | 64 | 128 [128].")),
    "--zero-points": (("zero_points",), dict(is_flag=True, default=False,
                                             help="int4_w4a16: a uint4 zero point per group (asymmetric, GPTQ/AWQ style).")),
    "--activation": ((), dict(default=None, help="Experts' activation: silu | gelu (exact) | swigluoai (gpt-oss, with "
                                                 "its biases) [the model's].")),
    "--routing": ((), dict(default="uniform", show_default=True, help="uniform | zipf:S | hot:F | file:PATH")),
    "--seed": ((), dict(type=int, default=0, show_default=True)),
    "--out": ((), dict(type=click.Path(path_type=Path), default=Path("results"), show_default=True,
                       help="Results folder.")),
}
#: --model or the four size flags: the shape (resolve_shape), the same for every command.
MODEL_FLAGS = ("--model", "--num-experts", "--topk", "--hidden", "--intermediate")
#: --dtype and what refines it.
PRECISION_FLAGS = ("--dtype", "--block-shape", "--scales", "--group-size", "--zero-points")


def options(*flags: str, **overrides: dict):
    """A decorator adding the OPTION_TABLE options `flags`, in that order; overrides: flag name
    without dashes, '-' as '_' (tp=, block_shape=...) -> keyword arguments replacing the table's."""
    def deco(f):
        for flag in reversed(flags):
            args, kw = OPTION_TABLE[flag]
            f = click.option(flag, *args, **{**kw, **overrides.get(flag.lstrip("-").replace("-", "_"), {})})(f)
        return f
    return deco


#: Options every command that runs kernels takes (design.md).
shape_options = options(*MODEL_FLAGS, "--tokens", "--tp", "--dp", "--ep", "--world-size", "--device", *PRECISION_FLAGS,
                        "--activation", "--routing", "--seed", "--out")


def cluster_options(f):
    """Node size and inter-node link of a simulated cluster (sweep --simulate, compare)."""
    f = click.option("--rdma", "rdma_name", default="rdma-400g", show_default=True,
                     help="RDMA link between nodes, per GPU: rdma-400g (InfiniBand, 50 GB/s) | roce-400g | efa-400g (AWS EFA, "
                          "2 x 200 Gb/s) | rdma-800g (100 GB/s, no published point).")(f)
    f = click.option("--gpus-per-node", "gpus_per_node", type=int, default=None,
                     help="GPUs per NVLink domain [8; 72 for a GB200 NVL72 target]: past it EP traffic goes over "
                          "RDMA; TP stays inside it.")(f)
    f = click.option("--num-sms", "num_sms", type=int, default=None,
                     help="SMs DeepEP's normal kernels run on in the modeled EP rows [DeepEP's default, "
                          "Buffer.num_sms = 20].")(f)
    return f


def resolve_precision(dtype: str | None, block_shape: str | None, scales: str | None, device: str,
                      default: str, group_size: int | None = None,
                      zero_points: bool = False) -> tuple[torch.dtype, object]:
    """--dtype/--block-shape/--scales/--group-size/--zero-points -> (activation dtype, QuantScheme
    or None). fp8_w8a8 keeps bf16 activations around the quantised GEMMs (and as the output); the
    weight-only schemes (int8_w8a16, int4_w4a16, mxfp4) keep bf16 activations throughout."""
    from moebench.inputs import parse_dtype
    from moebench.quant import parse_quant

    quant = parse_quant(dtype, block_shape, scales, group_size, zero_points)
    if quant is not None:
        return torch.bfloat16, quant
    return parse_dtype(dtype or default), None


def resolve_model_precision(shape, dtype: str | None, block_shape: str | None, scales: str | None, device: str,
                            default: str, group_size: int | None = None,
                            zero_points: bool = False) -> tuple[torch.dtype, object, str | None]:
    """`resolve_precision` for a model whose checkpoint ships quantised (MoEShape.quantization,
    from its config.json quantization_config or the preset): without --dtype (and --block-shape /
    --scales) that quantisation is applied; plus the line saying what was applied and from where
    (None for a checkpoint without quantization_config)."""
    from moebench.models import checkpoint_scheme

    cq = getattr(shape, "quantization", None)
    src = "preset" if cq is not None and cq.source == "preset" else "config.json"
    if cq is None:
        return (*resolve_precision(dtype, block_shape, scales, device, default, group_size, zero_points), None)
    if dtype is None and not block_shape and not scales and group_size is None and not zero_points:
        quant = checkpoint_scheme(cq)
        return torch.bfloat16, quant, f"applied quantization_config: {cq.describe()} (from {src}; --dtype overrides)"
    dt, quant = resolve_precision(dtype, block_shape, scales, device, default, group_size, zero_points)
    return dt, quant, f"quantization_config {cq.describe()} (from {src}) not applied: --dtype {dtype or default} given"


def parse_shared_modes(value: str | None, has_shared: bool) -> list[str]:
    """`--shared-experts` (a comma list of none / fused / separate, or all) -> modes; None: separate
    where the model has shared experts, else none. Asking for fused / separate of a model without
    shared experts is an error."""
    from moebench.kernels.layer import SHARED_MODES

    if value is None or value == "":
        return ["separate" if has_shared else "none"]
    modes = list(SHARED_MODES) if value.strip() == "all" else [v.strip() for v in value.split(",") if v.strip()]
    bad = [m for m in modes if m not in SHARED_MODES]
    if bad or not modes:
        raise MoebenchError(f"--shared-experts: unknown {', '.join(bad) or '(empty)'}; use a comma list of "
                            f"{', '.join(SHARED_MODES)}, or all")
    if not has_shared and any(m != "none" for m in modes):
        raise MoebenchError("--shared-experts fused/separate: this model has no shared experts (shared_intermediate 0); "
                            "use --shared-experts none or a model with shared experts")
    return list(dict.fromkeys(modes))


def check_kernel(kernel: str) -> str:
    """`--kernel` of `tune` / `configs commit`: moebench's own, or an engine's (tuned_files.KERNELS)."""
    from moebench.kernels.tuned_files import KERNELS

    if kernel not in KERNELS:
        raise MoebenchError(f"unknown --kernel '{kernel}'; use one of {', '.join(KERNELS)}")
    return kernel


def resolve_layer(shape, activation: str | None, shared: str | None, experts: list[str], experts_given: bool):
    """--activation / --shared-experts against the model -> (Activation, bias, shared modes).
    The activation comes from the model unless given (biases only with the model's own
    swigluoai). Experts named explicitly that cannot compute it are an error."""
    from moebench.activation import Activation, parse_activation
    from moebench.backends import get_experts_class

    act = parse_activation(activation) or Activation(shape.activation, limit=shape.swiglu_limit)
    bias = bool(shape.expert_bias) and act.name == shape.activation
    modes = parse_shared_modes(shared, bool(shape.shared_intermediate))
    if experts_given:
        for name in experts:
            why = get_experts_class(name).activation_unavailable_reason(act, bias)
            if why:
                raise MoebenchError(f"{why}; choose other --experts or another --activation")
    return act, bias, modes


@contextlib.contextmanager
def way_on(command: str, run_folder: Callable[[], Path | None] = lambda: None,
           settings: str = "metadata.json") -> Iterator[None]:
    """Inside: a disk fault (WriteError) ends with what to run once it is fixed: `moebench COMMAND
    --resume RUN` where `run_folder()` names a folder that holds its `settings` file (the run can
    be continued), else the command again."""
    try:
        yield
    except WriteError as e:
        run = run_folder()
        if run is not None and (Path(run) / settings).is_file():
            raise e.then(f"continue with `moebench {command} --resume {run}`") from None
        raise e.then("run the command again") from None


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
