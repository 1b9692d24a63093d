"""The one store of tuned tile-config files, keyed by the kernel they are for: moebench's own
`triton` kernel ("moebench"), vLLM's and SGLang's fused-MoE Triton kernel ("vllm", "sglang": the
`vllm-triton` experts, or vLLM's own). Their names, reading, the cached lookup, writing and merging.
A file is tuned for the kernel that measured it: moebench's make the engines' kernel slower, so
each kernel's files live in folders of their own.

    kernel    folder (under each config root)          file name
    moebench  the root itself (the package: moebench/)  E={E},N={N},device_name={dev}[,dtype=..][,block_shape=[bn,bk]][,per_channel_quant=True][_down].json
    vllm      vllm/                                    E={E},N={N},device_name={dev}[,dtype=fp8_w8a8][,block_shape=[bn,bk]].json
    sglang    sglang/triton_{X_Y_Z}/ (Triton version)  E={E},N={N},device_name={dev}[,dtype=fp8_w8a8][,block_shape=[bn, bk]].json

Names (as vLLM's and SGLang's `get_config_file_name`): E = experts on this rank (w2.shape[0]),
N = intermediate size per rank (w2.shape[2]), device = `torch.cuda.get_device_name()` with spaces
as underscores ("cpu" without CUDA). The dtype part is only there for quantised kernels
("fp8_w8a8", "int8_w8a16", "int4_w4a16", "mxfp4"); fp32/fp16/bf16 files carry none. int4_w4a16
files carry no group size (vLLM's names); mxfp4 has no vLLM fused_moe file name, moebench writes
`,dtype=mxfp4`. fp8 per-token activation x per-channel weight scales (`--scales token`) add SGLang's
`,per_channel_quant=True`. GEMM2's own configs (moebench's kernel): the same name with `_down`
before `.json` (SGLang's), entries with GEMM1's BLOCK_SIZE_M at each token count, optionally
"USE_TMA". The engines' differences are their own: vLLM names an H200-family device NVIDIA_H200 and
writes block_shape without a space; SGLang keeps Python's list spacing and one folder per Triton
version, and reads the installed Triton's folder first, then the others (newest first).

Content: {"<tokens>": {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps,
num_stages}}; moebench's files add "triton_version" (as vLLM's tuner writes); the engines' hold
token keys only (SGLang turns every key into an int). A folder of moebench's or vllm/'s files can be
handed to vLLM as VLLM_TUNED_CONFIG_FOLDER; a sglang/triton_X_Y_Z/ folder's files go into SGLang's
fused_moe_triton/configs/triton_X_Y_Z/.

Config roots, first hit wins: $MOEBENCH_CONFIG_DIR, results/configs (from the current directory),
the package's moebench/configs (`config_search_dirs`, resolved when the experts are built; each file
is read once per process: `find`). Inside a file the entry with the nearest token count wins (ties:
the smaller), as vLLM picks it.

The routing a moebench file was tuned under. A token key means a load of pairs per local expert only
under the routing of its tune: E=32,N=2048 tuned for DeepSeek-V3's EP8 shard (top-8 over 256
experts) holds tiles for 8x fewer pairs than a layer routing top-8 over the same 32 experts has.
vLLM's files cannot say which (token keys only), so each config folder may hold
`tuned_routing.json`, {file name: {"experts": E, "topk": K}}, which `moebench tune` fills for the
files it writes. The lookup then reads the file's keys as that routing's load: M tokens of a layer
routing top-k over n experts are looked up as M x (k / n) / (K / E) tokens (`routed_tokens`). A file
without an entry is read as tokens (vLLM's meaning).

Every write is atomic (a temporary file, then a rename) and makes this process's lookup look again.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, TypedDict

import torch

from moebench.errors import MoebenchError
from moebench.fileio import atomic_write_text

if TYPE_CHECKING:  # pragma: no cover
    from moebench.quant import QuantScheme

# ---------------------------------------------------------------------------------------------
# Entries


TILE_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


_POW2_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps")


#: Keys a GEMM2 (`_down`) entry may add to TILE_KEYS (SGLang's).
DOWN_KEYS = ("USE_TMA",)


class TileConfig(TypedDict):
    """One launch config of the fused MoE kernel (vLLM's keys; a GEMM2 entry may also hold
    USE_TMA, see DOWN_KEYS)."""

    BLOCK_SIZE_M: int
    BLOCK_SIZE_N: int
    BLOCK_SIZE_K: int
    GROUP_SIZE_M: int
    num_warps: int
    num_stages: int


def validate_tile_config(cfg: Any, where: str = "config", down: bool = False) -> TileConfig:
    """Check one entry: a dict with the six keys, positive ints, block sizes and warps powers of two.
    Extra keys are rejected (vLLM passes the entry to its kernel as keyword arguments), except
    "USE_TMA" (a bool) in a GEMM2 (`down`) entry, which is kept."""
    if not isinstance(cfg, Mapping):
        raise MoebenchError(f"{where}: expected an object with {', '.join(TILE_KEYS)}, got {type(cfg).__name__}")
    missing = [k for k in TILE_KEYS if k not in cfg]
    if missing:
        raise MoebenchError(f"{where}: missing {', '.join(missing)}")
    allowed = TILE_KEYS + (DOWN_KEYS if down else ())
    extra = [k for k in cfg if k not in allowed]
    if extra:
        raise MoebenchError(f"{where}: unknown key(s) {', '.join(map(str, extra))}; allowed: {', '.join(allowed)}")
    out = {}
    for k in TILE_KEYS:
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MoebenchError(f"{where}: {k} must be a positive integer, got {v!r}")
        if k in _POW2_KEYS and v & (v - 1):
            raise MoebenchError(f"{where}: {k} must be a power of two, got {v}")
        out[k] = v
    if "USE_TMA" in cfg:
        if not isinstance(cfg["USE_TMA"], bool):
            raise MoebenchError(f"{where}: USE_TMA must be true or false, got {cfg['USE_TMA']!r}")
        out["USE_TMA"] = cfg["USE_TMA"]
    return TileConfig(**out)  # type: ignore[typeddict-item]


# ---------------------------------------------------------------------------------------------
# Roots


PACKAGE_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


ENV_CONFIG_DIR = "MOEBENCH_CONFIG_DIR"


def config_search_dirs() -> tuple[Path, ...]:
    """The lookup's folders, in order, as they are now: $MOEBENCH_CONFIG_DIR (if set), results/configs
    (from the current directory), moebench/configs. Whoever builds experts resolves them once and
    passes them to the lookup; a MOEBENCH_CONFIG_DIR that is no folder is refused here."""
    dirs = []
    env = os.environ.get(ENV_CONFIG_DIR)
    if env:
        if not Path(env).is_dir():
            what = "is a file, not a folder" if Path(env).exists() else "does not exist"
            raise MoebenchError(f"{ENV_CONFIG_DIR}={env} {what}: point it at a folder of tuned configs, or unset it")
        dirs.append(Path(env))
    dirs.append(Path.cwd() / "results" / "configs")
    dirs.append(PACKAGE_CONFIG_DIR)
    return tuple(dirs)


# ---------------------------------------------------------------------------------------------
# Names


def device_name(device: torch.device | str | None = None) -> str:
    """The device part of a config file name: CUDA device name with spaces as underscores, or
    "cpu" when there is no CUDA device (or a CPU device is asked for)."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev).replace(" ", "_")
    return "cpu"


current_device_name = device_name  # alias for functions whose parameter is called device_name


def dtype_tag(dtype: torch.dtype | str | None) -> str | None:
    """The `dtype=` part of a file name. Unquantised floating types have none (as in vLLM)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return None
    return str(dtype) or None


def config_file_name(
    E: int,
    N: int,
    device_name: str,
    dtype: torch.dtype | str | None = None,
    block_shape: list[int] | tuple[int, int] | None = None,
    down: bool = False,
    *,
    per_channel_quant: bool = False,
) -> str:
    """`E={E},N={N},device_name={device_name}[,dtype=..][,block_shape=[..]][,per_channel_quant=True][_down].json`
    (down: GEMM2's file; per_channel_quant: fp8 per-token x per-channel scales; both SGLang's names)."""
    name = device_name.replace(" ", "_")
    tag = dtype_tag(dtype)
    parts = f"E={E},N={N},device_name={name}"
    if tag:
        parts += f",dtype={tag}"
    if block_shape:
        parts += ",block_shape=[" + ",".join(str(int(b)) for b in block_shape) + "]"
    if per_channel_quant:
        parts += ",per_channel_quant=True"
    return parts + ("_down" if down else "") + ".json"


def name_parts(dtype: torch.dtype | str | None, quant: "QuantScheme | None") -> tuple:
    """(dtype tag, block_shape) of a file name: the scheme's name and (fp8) scale block when quant
    is given, else (dtype, None). The per-channel part: `per_channel_quant(quant)`. Weight-only
    schemes name no block_shape (vLLM's int4_w4a16 block_shape [0, group] drops out of its name:
    `,dtype=int4_w4a16.json` whatever the group size or zero points; `,dtype=int8_w8a16.json`);
    mxfp4, which vLLM's fused_moe files do not name, is `,dtype=mxfp4.json`."""
    if quant is not None:
        return quant.name, quant.file_block_shape
    return dtype, None


def per_channel_quant(quant: "QuantScheme | None") -> bool:
    """Whether a file name carries `,per_channel_quant=True`: fp8 per-token activation x
    per-channel weight scales (SGLang's per_channel_quant)."""
    return quant is not None and not quant.weight_only and quant.scales == "token"


def scheme_text(dtype_tag_: str | None, block_shape: list[int] | tuple[int, ...] | None, per_channel: bool) -> str:
    """'unquantised', 'fp8_w8a8 per-tensor', 'fp8_w8a8 per-token' or 'fp8_w8a8 block[128,128]':
    the scheme a file name stands for (from its dtype, block_shape and per_channel_quant parts)."""
    if not dtype_tag_:
        return "unquantised"
    from moebench.quant import WEIGHT_ONLY

    if dtype_tag_ in WEIGHT_ONLY:
        return dtype_tag_
    if block_shape:
        return f"{dtype_tag_} block[{','.join(str(int(b)) for b in block_shape)}]"
    return f"{dtype_tag_} {'per-token' if per_channel else 'per-tensor'}"


_NAME_RE = re.compile(
    r"^E=(?P<E>\d+),N=(?P<N>\d+),device_name=(?P<device>[^,]+?)"
    r"(?:,dtype=(?P<dtype>[^,]+?))?(?:,block_shape=\[(?P<block>[\d, ]*)\])?(?P<pc>,per_channel_quant=True)?"
    r"(?P<down>_down)?\.json$"
)


def parse_file_name(name: str | os.PathLike) -> dict[str, Any] | None:
    """'E=8,N=14336,device_name=NVIDIA_H200[,dtype=..][,block_shape=[..]][,per_channel_quant=True][_down].json'
    -> {"E", "N", "device", "dtype", "block_shape" ('128,128' or None), "per_channel_quant", "down"},
    or None when the name is not a tuned-config file name."""
    m = _NAME_RE.match(Path(name).name)
    if not m:
        return None
    return {"E": int(m["E"]), "N": int(m["N"]), "device": m["device"], "dtype": m["dtype"],
            "block_shape": m["block"].replace(" ", "") if m["block"] is not None else None,
            "per_channel_quant": m["pc"] is not None, "down": m["down"] is not None}


def file_scheme(path: str | os.PathLike) -> str | None:
    """The scheme a tuned-config file's name stands for (`scheme_text`); None for other names."""
    parts = parse_file_name(path)
    if parts is None:
        return None
    block = [int(b) for b in parts["block_shape"].split(",") if b] if parts["block_shape"] else None
    return scheme_text(parts["dtype"], block, parts["per_channel_quant"])


def is_down_file(path: str | os.PathLike) -> bool:
    """Whether `path` names a GEMM2 config file (`..._down.json`)."""
    return Path(path).name.endswith("_down.json")


#: Engines whose kernel the vllm-triton experts follow (`moebench tune --kernel`).
ENGINES = ("vllm", "sglang")


#: `--kernel` values of `moebench tune` / `configs commit`: moebench's own `triton`, or an engine's.
KERNELS = ("moebench",) + ENGINES


_TRITON_DIR_RE = re.compile(r"^triton_\d+_\d+_\d+$")


def triton_folder(version: str | None = None) -> str:
    """'triton_3_6_0' for Triton 3.6.0 (default: the installed one), SGLang's folder name."""
    if version is None:
        import triton

        version = triton.__version__
    base = re.match(r"\d+\.\d+\.\d+", version)
    if base is None:
        raise MoebenchError(f"Triton version {version!r} is not X.Y.Z")
    return "triton_" + base[0].replace(".", "_")


def engine_device_name(engine: str, device_name: str) -> str:
    """The device part of the engine's file name: vLLM names every H200-family device NVIDIA_H200."""
    name = device_name.replace(" ", "_")
    if engine == "vllm" and "H200" in name.split("_"):
        return "NVIDIA_H200"
    return name


def engine_file_name(engine: str, E: int, N: int, device_name: str, quant: QuantScheme | None = None) -> str:
    """The file name `engine` looks up for (E local experts, N = I per rank, device, scheme)."""
    if engine not in ENGINES:
        raise MoebenchError(f"unknown engine '{engine}'; use one of {', '.join(ENGINES)}")
    tag, block = name_parts(None, quant)
    name = config_file_name(E, N, engine_device_name(engine, device_name), tag, block)
    if engine == "sglang" and block:
        name = name.replace(",block_shape=[" + ",".join(map(str, block)) + "]",
                            ",block_shape=[" + ", ".join(map(str, block)) + "]")
    return name


def engine_dirs(engine: str, roots: tuple[Path, ...]) -> list[Path]:
    """Folders the lookup reads for `engine` under the config roots `roots` (`config_search_dirs()`),
    in order (sglang: each root's triton_* folders, the installed Triton's first, then the others
    newest first)."""
    folders = [Path(d) / engine for d in roots]
    if engine != "sglang":
        return folders
    mine = triton_folder()
    out: list[Path] = []
    for r in folders:
        out.append(r / mine)
        others = sorted((p for p in r.glob("triton_*") if p.is_dir() and _TRITON_DIR_RE.match(p.name) and p.name != mine),
                        key=lambda p: tuple(int(v) for v in p.name.split("_")[1:]), reverse=True)
        out += others
    return out


def file_name(kernel: str, E: int, N: int, device_name: str, dtype: torch.dtype | str | None = None,
              quant: "QuantScheme | None" = None, down: bool = False) -> str:
    """The name `kernel`'s lookup reads for (E local experts, N = I per rank, device, precision): moebench's
    (`config_file_name`, `_down` for GEMM2's own file) or an engine's (`engine_file_name`)."""
    if kernel != "moebench":
        return engine_file_name(kernel, E, N, device_name, quant)
    return config_file_name(E, N, device_name, *name_parts(dtype, quant), down=down,
                            per_channel_quant=per_channel_quant(quant))


def default_out_dir(kernel: str, root: str | os.PathLike = Path("results") / "configs") -> Path:
    """Where `tune --kernel KERNEL` writes without --out: results/configs (moebench), results/configs/vllm,
    or results/configs/sglang/triton_X_Y_Z (the installed Triton's)."""
    if kernel == "moebench":
        return Path(root)
    d = Path(root) / kernel
    return d / triton_folder() if kernel == "sglang" else d


def package_dir(kernel: str, triton_version_folder: str | None = None) -> Path:
    """The package folder `configs commit --kernel KERNEL` ships files in: moebench/configs/<kernel>
    (sglang: its triton_X_Y_Z/ below)."""
    d = PACKAGE_CONFIG_DIR / kernel
    return d / (triton_version_folder or triton_folder()) if kernel == "sglang" else d


# ---------------------------------------------------------------------------------------------
# Reading


def load_config_file(path: str | os.PathLike) -> dict[int, TileConfig]:
    """Read and validate a tuned-config file -> {tokens: TileConfig}. "triton_version" is skipped;
    entries of a `_down.json` file may hold USE_TMA.

    Raises MoebenchError (naming the file and the entry) when the file is unreadable, not JSON,
    has a non-integer token key, a bad entry, or no entries at all.
    """
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except OSError as e:
        raise MoebenchError(f"cannot read config file {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise MoebenchError(f"config file {p} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise MoebenchError(f"config file {p}: expected a JSON object of token counts, got {type(raw).__name__}")
    table: dict[int, TileConfig] = {}
    for key, val in raw.items():
        if key == "triton_version":
            continue
        try:
            tokens = int(key)
        except ValueError:
            raise MoebenchError(f"config file {p}: key {key!r} is not a token count") from None
        if tokens < 1:
            raise MoebenchError(f"config file {p}: token count {tokens} must be positive")
        table[tokens] = validate_tile_config(val, f"config file {p}, entry {key!r}", down=is_down_file(p))
    if not table:
        raise MoebenchError(f"config file {p} has no token-count entries")
    return dict(sorted(table.items()))


#: In a config folder: the routing each file there was tuned under (module docstring).
ROUTING_FILE = "tuned_routing.json"


def read_tuned_routing(folder: str | os.PathLike) -> dict[str, dict[str, int]]:
    """{file name: {"experts": E, "topk": K}} of a config folder's ROUTING_FILE ({} without one).
    Raises MoebenchError for a file that is not that."""
    p = Path(folder) / ROUTING_FILE
    try:
        st = p.stat()  # one system call per lookup: the experts look a file up at every call
    except OSError:
        return {}
    key = (str(p), st.st_mtime_ns, st.st_size)
    if key not in _ROUTING_CACHE:
        try:
            doc = json.loads(p.read_text())
            table = {str(name): {"experts": int(r["experts"]), "topk": int(r["topk"])} for name, r in doc.items()}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise MoebenchError(f"{p}: not a tuned-routing file ({{file name: {{\"experts\": E, \"topk\": K}}}}): "
                                f"{e}; fix or delete it") from None
        if any(r["experts"] < 1 or not 1 <= r["topk"] <= r["experts"] for r in table.values()):
            raise MoebenchError(f"{p}: an entry with topk outside 1..experts; fix or delete it")
        _ROUTING_CACHE[key] = table
    return _ROUTING_CACHE[key]


def tuned_routing(path: str | os.PathLike) -> tuple[int, int] | None:
    """(experts, topk) the config file at `path` was tuned under, None where its folder does not say."""
    p = Path(path)
    r = read_tuned_routing(p.parent).get(p.name)
    return None if r is None else (r["experts"], r["topk"])


def file_tokens(path: str | os.PathLike, M: int, topk: int | None, num_experts: int | None) -> int:
    """The token key of the file at `path` that M tokens of a layer routing top-`topk` over
    `num_experts` experts correspond to: the same pairs per local expert under the file's tuned
    routing (module docstring); M itself where the routing of either is unknown."""
    return routed_tokens(tuned_routing(path), M, topk, num_experts)


def routed_tokens(routing: tuple[int, int] | None, M: int, topk: int | None, num_experts: int | None) -> int:
    """`file_tokens` for a file tuned under `routing` ((experts, topk), None: unknown)."""
    if routing is None or not topk or not num_experts:
        return M
    experts, k = routing
    return max(1, round(M * topk * experts / (num_experts * k)))


_ROUTING_CACHE: dict[tuple[str, int, int], dict[str, dict[str, int]]] = {}


def load_engine_file(path: str | os.PathLike) -> dict[int, TileConfig]:
    """Read an engine file: token keys only (a "triton_version" key is refused: SGLang cannot read it)."""
    p = Path(path)
    table = load_config_file(p)
    raw = json.loads(p.read_text())
    extra = [k for k in raw if not str(k).lstrip("-").isdigit()]
    if extra:
        raise MoebenchError(f"{p}: key(s) {', '.join(map(repr, extra))} are not token counts; an engine file holds "
                            "token counts only (SGLang reads every key as one)")
    return table


def read(kernel: str, path: str | os.PathLike) -> dict[int, TileConfig]:
    """A file of `kernel` -> {tokens: TileConfig} (an engine's: token keys only)."""
    return load_config_file(path) if kernel == "moebench" else load_engine_file(path)


# ---------------------------------------------------------------------------------------------
# Lookup


def kernel_dirs(kernel: str, roots: tuple[Path, ...]) -> list[Path]:
    """The folders `kernel`'s files are read from under the config roots `roots`
    (`config_search_dirs()`), in lookup order: moebench's at the top of a root of the user's (where
    `tune` writes them) and in the package's moebench/ folder; an engine's in its own folder under
    each root (`engine_dirs`)."""
    if kernel == "moebench":
        return [Path(r) / "moebench" if Path(r) == PACKAGE_CONFIG_DIR else Path(r) for r in roots]
    return engine_dirs(kernel, roots)


def find_config_file(
    E: int, N: int, device_name: str, dtype: torch.dtype | str | None = None, block_shape: list[int] | None = None,
    down: bool = False, *, per_channel_quant: bool = False, folders: tuple[Path, ...] | None = None,
) -> Path | None:
    """The first existing moebench file for (E, N, device, dtype[, block_shape][, per_channel_quant][, down])
    under the roots `folders` (None: `config_search_dirs()` now), looked for now (not cached: for
    tools that list files)."""
    name = config_file_name(E, N, device_name, dtype, block_shape, down, per_channel_quant=per_channel_quant)
    for d in kernel_dirs("moebench", config_search_dirs() if folders is None else folders):
        p = d / name
        if p.is_file():
            return p
    return None


class FoundTable(NamedTuple):
    """A tuned file the lookup found: its path, its entries and the routing its folder records."""

    path: Path
    table: Mapping[int, TileConfig]
    routing: tuple[int, int] | None


@functools.lru_cache(maxsize=1024)
def find(kernel: str, roots: tuple[Path, ...], name: str) -> FoundTable | None:
    """The first file of `kernel` called `name` under the config roots `roots` (`kernel_dirs`),
    read and validated, or None. Cached: the experts' lookup reads each file once per process, so a
    steady-state call does no file-system work; `clear_lookup_cache` forgets what was read (every
    write of this module calls it)."""
    for d in kernel_dirs(kernel, roots):
        p = d / name
        if p.is_file():
            return FoundTable(p, MappingProxyType(read(kernel, p)), tuned_routing(p) if kernel == "moebench" else None)
    return None


def clear_lookup_cache() -> None:
    """Forget the files the lookup has read (and not found): the next lookup looks again."""
    find.cache_clear()


def nearest_entry(table: Mapping[int, TileConfig], M: int) -> tuple[int, TileConfig]:
    """The entry whose token count is nearest to M (ties: the smaller count)."""
    key = min(table, key=lambda t: (abs(t - M), t))
    return key, table[key]


# ---------------------------------------------------------------------------------------------
# Writing and merging


def write_config_file(
    path: str | os.PathLike, table: Mapping[int | str, Mapping[str, int]], triton_version: str | None = None
) -> Path:
    """Write {tokens: config} as vLLM's JSON (keys sorted by token count, plus "triton_version"),
    atomically: a temporary file in the same folder, then a rename."""
    p = Path(path)
    entries = {int(k): validate_tile_config(v, f"entry {k!r}", down=is_down_file(p))
               for k, v in table.items() if k != "triton_version"}
    if triton_version is None:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:  # pragma: no cover - triton is a dependency
            triton_version = "unknown"
    doc: dict[str, Any] = {"triton_version": triton_version}
    doc.update({str(k): dict(entries[k]) for k in sorted(entries)})
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(doc, indent=4) + "\n")
    clear_lookup_cache()
    return p


def merge_config_file(
    path: str | os.PathLike, entries: Mapping[int, Mapping[str, int]], dtype: torch.dtype | str | None = None,
    quant: "QuantScheme | None" = None,
) -> Path:
    """Merge `entries` ({tokens: config}, tuned with `dtype` / `quant`) into the file at `path`
    (its entries for other token counts are kept; an unreadable old file is replaced), atomically.
    Refused (MoebenchError) when the file's name stands for another scheme than the entries'
    (per-tensor and per-token fp8 entries never share a file)."""
    p = Path(path)
    tag, block = name_parts(dtype, quant)
    mine = scheme_text(dtype_tag(tag), block, per_channel_quant(quant))
    theirs = file_scheme(p)
    if theirs is None:
        raise MoebenchError(f"{p.name} is not a tuned-config file name "
                            "(E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]][,per_channel_quant=True][_down].json)")
    if mine != theirs:
        raise MoebenchError(f"refusing to merge {mine} entries into {p}: its name is that of a {theirs} file")
    merged: dict[int, Any] = {}
    if p.is_file():
        try:
            merged.update(load_config_file(p))
        except MoebenchError:
            pass  # an unreadable old file is replaced
    merged.update({int(k): dict(v) for k, v in entries.items()})
    return write_config_file(p, merged)


def write_tuned_routing(path: str | os.PathLike, routing: tuple[int, int] | None) -> None:
    """Record (experts, topk) for the config file at `path` in its folder's ROUTING_FILE (None:
    drop its entry), atomically."""
    p = Path(path)
    table = dict(read_tuned_routing(p.parent))
    if routing is None:
        if table.pop(p.name, None) is None:
            return
    else:
        table[p.name] = {"experts": int(routing[0]), "topk": int(routing[1])}
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p.parent / ROUTING_FILE, json.dumps(dict(sorted(table.items())), indent=4) + "\n")
    clear_lookup_cache()


def claim_tuned_routing(path: str | os.PathLike, experts: int, topk: int) -> None:
    """Before a tune writes into the file at `path`: record that it routes top-`topk` over
    `experts`, where the file is new or already says so. Refused (MoebenchError) for a file tuned
    under another routing (its entries would mix two meanings of a token key); a file whose
    routing is unknown is left so."""
    p = Path(path)
    have = tuned_routing(p)
    if have is not None and have != (experts, topk):
        raise MoebenchError(f"{p} holds entries tuned for routing top-{have[1]} over {have[0]} experts; this tune "
                            f"routes top-{topk} over {experts}: give another --out")
    if have is None and not p.exists():
        write_tuned_routing(p, (experts, topk))


def write_engine_file(path: str | os.PathLike, table: Mapping[int | str, Mapping[str, int]]) -> Path:
    """Write {tokens: config} in the engines' format (sorted token keys, the six keys, nothing else), atomically."""
    p = Path(path)
    entries = {int(k): validate_tile_config(v, f"entry {k!r}") for k, v in table.items() if k != "triton_version"}
    doc = {str(k): {kk: int(entries[k][kk]) for kk in TILE_KEYS} for k in sorted(entries)}
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(doc, indent=4) + "\n")
    clear_lookup_cache()
    return p


def merge_engine_file(path: str | os.PathLike, entries: Mapping[int, Mapping[str, int]]) -> Path:
    """Merge `entries` into the engine file at `path` (other token counts kept; an unreadable
    old file is replaced)."""
    p = Path(path)
    merged: dict[int, Mapping[str, int]] = {}
    if p.is_file():
        try:
            merged.update(load_config_file(p))
        except MoebenchError:
            pass
    merged.update({int(k): dict(v) for k, v in entries.items()})
    return write_engine_file(p, merged)


def merge(kernel: str, path: str | os.PathLike, entries: Mapping[int, Mapping[str, int]],
          dtype: torch.dtype | str | None = None, quant: "QuantScheme | None" = None) -> Path:
    """Merge `entries` into `kernel`'s file at `path`, in that kernel's format (`merge_config_file`:
    moebench's, with its scheme checked; `merge_engine_file`: an engine's)."""
    if kernel == "moebench":
        return merge_config_file(path, entries, dtype, quant)
    return merge_engine_file(path, entries)
