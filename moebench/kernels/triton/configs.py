"""Tuned tile configs for the Triton experts, in the files vLLM reads; the lookup and the default heuristic.

File name (as vLLM's and SGLang's `get_config_file_name`):

    E={E},N={N},device_name={device}[,dtype={dtype}][,block_shape=[{bn},{bk}]][,per_channel_quant=True].json

E = experts on this rank (w2.shape[0]), N = intermediate size per rank (w2.shape[2]), device =
`torch.cuda.get_device_name()` with spaces as underscores ("cpu" without CUDA). The dtype part is
only there for quantised kernels ("fp8_w8a8", "int8_w8a16", "int4_w4a16", "mxfp4"); fp32/fp16/bf16
files carry none. int4_w4a16 files carry no group size (vLLM's names): one file per layer whatever
the group; mxfp4 has no vLLM fused_moe file name, moebench writes `,dtype=mxfp4`. fp8 with
per-token activation x per-channel weight scales (`--scales token`) adds SGLang's
`,per_channel_quant=True`, so its entries never share a file with the per-tensor ones.

Content: {"<tokens>": {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
"num_stages"}, ..., "triton_version": "3.6.0"}. A folder of such files can be handed to vLLM as
VLLM_TUNED_CONFIG_FOLDER.

GEMM2 (down projection) configs, as SGLang reads them: the same name with `_down` before `.json`
(`E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]]_down.json`), the same token keys and
entries, each with the BLOCK_SIZE_M of the GEMM1 file's entry at that token count (both GEMMs run
on one alignment), optionally "USE_TMA" (bool: GEMM2 loads its w2 tiles through TMA or not; its A
tiles, the intermediate, are always pointer loads; without the key GEMM2 follows GEMM1's TMA
choice, `options.resolve_use_tma`). Without a `_down` file, or where its nearest entry has another
BLOCK_SIZE_M than GEMM1's config, GEMM2 runs with GEMM1's config, as vLLM does (the experts'
config source says which). `moebench tune --down` writes them.

Lookup order at run time: $MOEBENCH_CONFIG_DIR, then results/configs/ (relative to the current
directory), then the package's moebench/configs/, resolved when the experts are built
(`config_search_dirs`). The first folder holding the file wins; inside it the entry with the
nearest token count wins (ties go to the smaller count). Each file is read once per process
(`found_table`). Without a file, `default_config` (a documented heuristic) decides.

The routing a file was tuned under. A token key means a load of pairs per local expert only under
the routing of its tune: E=32,N=2048 tuned for DeepSeek-V3's EP8 shard (top-8 over 256 experts,
about M local pairs at M tokens) holds tiles for 8x fewer pairs than a layer routing top-8 over the
same 32 experts (vLLM's tuner) has. vLLM's files cannot say which (token keys only), so each config
folder may hold `tuned_routing.json`, {file name: {"experts": E, "topk": K}} (tokens routed top-K
over E experts), which `moebench tune` fills for the files it writes. The lookup then reads the
file's keys as that routing's load: M tokens of a layer routing top-k over n experts are looked up
as M x (k / n) / (K / E) tokens. A file without an entry is read as tokens (vLLM's meaning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import functools
import json
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, TypedDict

import torch

from moebench.errors import MoebenchError

TILE_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
_POW2_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps")
PACKAGE_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
ENV_CONFIG_DIR = "MOEBENCH_CONFIG_DIR"
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


# ---------------------------------------------------------------------------------------------
# Names


if TYPE_CHECKING:  # pragma: no cover
    from moebench.quant import QuantScheme


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


# ---------------------------------------------------------------------------------------------
# Reading


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


def is_down_file(path: str | os.PathLike) -> bool:
    """Whether `path` names a GEMM2 config file (`..._down.json`)."""
    return Path(path).name.endswith("_down.json")


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


# ---------------------------------------------------------------------------------------------
# Lookup


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


def find_config_file(
    E: int, N: int, device_name: str, dtype: torch.dtype | str | None = None, block_shape: list[int] | None = None,
    down: bool = False, *, per_channel_quant: bool = False, folders: tuple[Path, ...] | None = None,
) -> Path | None:
    """The first existing file for (E, N, device, dtype[, block_shape][, per_channel_quant][, down]) along
    `folders` (None: `config_search_dirs()` now), looked for now (not cached: for tools that list files)."""
    name = config_file_name(E, N, device_name, dtype, block_shape, down, per_channel_quant=per_channel_quant)
    for d in config_search_dirs() if folders is None else folders:
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
def found_table(folders: tuple[Path, ...], name: str) -> FoundTable | None:
    """The first file called `name` along `folders`, read and validated, or None. Cached: the
    experts' lookup reads each (folders, file name) once per process, so a steady-state call does
    no file-system work; `clear_lookup_cache` forgets what was read (moebench.tuning.files calls
    it after each write)."""
    for d in folders:
        p = d / name
        if p.is_file():
            return FoundTable(p, MappingProxyType(load_config_file(p)), tuned_routing(p))
    return None


def clear_lookup_cache() -> None:
    """Forget the files the lookup has read (and not found): the next lookup looks again."""
    found_table.cache_clear()


def _as_tokens(M: int, mk: int) -> str:
    return "" if mk == M else f" (its routing's load at {mk} tokens, here {M})"


def nearest_entry(table: Mapping[int, TileConfig], M: int) -> tuple[int, TileConfig]:
    """The entry whose token count is nearest to M (ties: the smaller count)."""
    key = min(table, key=lambda t: (abs(t - M), t))
    return key, table[key]


def lookup_config(
    E: int,
    N: int,
    M: int,
    dtype: torch.dtype | str | None = None,
    device_name: str | None = None,
    *,
    folders: tuple[Path, ...],
    hidden: int | None = None,
    topk: int | None = None,
    num_experts_global: int | None = None,
    quant: "QuantScheme | None" = None,
    default: TileConfig | None = None,
) -> tuple[TileConfig, str]:
    """Tile config for M tokens of an (E local experts, N = intermediate per rank) layer, from the
    first file along `folders` (`config_search_dirs()` as resolved when the experts were built;
    the file is read once: `found_table`).

    quant: an fp8 scheme: the file is `...,dtype=fp8_w8a8[,block_shape=[bn,bk]].json` (vLLM's
    name; per-token scales: `...,dtype=fp8_w8a8,per_channel_quant=True.json`, SGLang's) and the
    default heuristic keeps BLOCK_SIZE_K / BLOCK_SIZE_N inside the scale block.

    Returns (config, source) where source is "<file path>[<tokens>]" (then " (its routing's load at
    K tokens, here M)" where the file's tuned routing reads M tokens as K: `file_tokens`) or
    "default heuristic".
    Without a file, `default_config(M, E_for_heuristic, N, hidden, topk, dtype)` decides, with
    E_for_heuristic = num_experts_global (tokens spread over all experts) or E; hidden and topk
    default to 4096 and 1 when unknown; `default` given: that config instead (another kernel's
    heuristic, e.g. the batched kernel's).
    """
    dev = device_name if device_name is not None else current_device_name()
    tag, block = name_parts(dtype, quant)
    found = found_table(folders, config_file_name(E, N, dev, tag, block, per_channel_quant=per_channel_quant(quant)))
    if found is not None:
        mk = routed_tokens(found.routing, M, topk, num_experts_global or E)
        key, cfg = nearest_entry(found.table, mk)
        return TileConfig(**cfg), f"{found.path}[{key}]" + _as_tokens(M, mk)  # type: ignore[typeddict-item]
    if default is not None:
        return TileConfig(**default), "default heuristic"  # type: ignore[typeddict-item]
    return heuristic_config(M, num_experts_global or E, N, hidden or 4096, topk or 1,
                            dtype if isinstance(dtype, torch.dtype) else torch.bfloat16, quant), "default heuristic"


def layer_config(
    M: int,
    *,
    local_experts: int,
    inter: int,
    hidden: int,
    topk: int,
    num_experts: int,
    dtype: torch.dtype | str | None,
    folders: tuple[Path, ...],
    device_name: str | None = None,
    quant: "QuantScheme | None" = None,
) -> tuple[TileConfig, str]:
    """The config the `triton` experts run GEMM1 with at M tokens of a layer (local_experts of
    num_experts global experts here, intermediate size `inter` per rank): `lookup_config` on the
    layer's file (E = local experts, N = inter) along `folders`, else `heuristic_config` over the
    global experts. The one lookup the experts and the tuner share."""
    return lookup_config(local_experts, inter, max(M, 1), dtype, device_name, folders=folders, hidden=hidden,
                         topk=topk, num_experts_global=num_experts, quant=quant)


def heuristic_config(M: int, E: int, N: int, H: int, topk: int, dtype: torch.dtype = torch.bfloat16,
                     quant: "QuantScheme | None" = None) -> TileConfig:
    """The config without a tuned file: `default_config`, for an fp8 scheme adapted by
    `quant_default` (twice the BLOCK_SIZE_K, fitted inside the scale block; block scales: the
    tiles of M * topk / E pairs per expert that tunes pick)."""
    cfg = default_config(M, E, N, H, topk, dtype)
    if quant is None:
        return cfg
    cfg = quant_default(cfg, quant, M * topk / max(E, 1))
    cfg["BLOCK_SIZE_N"] = min(cfg["BLOCK_SIZE_N"], max(32, _next_pow2(N)))  # as default_config caps it
    return cfg


def lookup_down_config(
    E: int,
    N: int,
    M: int,
    gemm1: Mapping[str, int],
    dtype: torch.dtype | str | None = None,
    device_name: str | None = None,
    *,
    folders: tuple[Path, ...],
    quant: "QuantScheme | None" = None,
    topk: int | None = None,
    num_experts_global: int | None = None,
) -> tuple[TileConfig | None, str]:
    """GEMM2's config for M tokens from the `_down.json` file next to GEMM1's (same E, N, device,
    dtype) along `folders`, nearest token key (read by the file's tuned routing, as in
    `lookup_config`). (None, why) when GEMM2 runs with GEMM1's config instead: there is no such
    file, or its entry has another BLOCK_SIZE_M than GEMM1's `gemm1` (both GEMMs run on one
    alignment; the reason names the entry, and shows in the experts' config source)."""
    dev = device_name if device_name is not None else current_device_name()
    tag, block = name_parts(dtype, quant)
    found = found_table(folders, config_file_name(E, N, dev, tag, block, down=True,
                                                  per_channel_quant=per_channel_quant(quant)))
    if found is None:
        return None, "GEMM1's config"
    mk = routed_tokens(found.routing, M, topk, num_experts_global or E)
    key, cfg = nearest_entry(found.table, mk)
    if cfg["BLOCK_SIZE_M"] != gemm1["BLOCK_SIZE_M"]:
        return None, (f"GEMM1's config ({found.path}[{key}] has BLOCK_SIZE_M {cfg['BLOCK_SIZE_M']}, GEMM1's config "
                      f"{gemm1['BLOCK_SIZE_M']} at {M} tokens)")
    return TileConfig(**cfg), f"{found.path}[{key}]" + _as_tokens(M, mk)  # type: ignore[typeddict-item]


def quant_default(cfg: TileConfig, quant: "QuantScheme", pairs_per_expert: float | None = None) -> TileConfig:
    """A 16-bit default config adapted to fp8: twice the BLOCK_SIZE_K (fp8 elements are half the
    bytes, so a pipeline stage holds as many bytes, and block scales are multiplied in half as
    often), then fitted inside the scale block (`fit_to_quant_block`). Block scales: at most 128
    wide, 64-row tiles in groups of 16 for prefill; with pairs_per_expert (the sorted-token
    layer's M * topk / E) also the tiles H200 tunes picked (`fp8_block_tile`). Weight-only
    schemes: `weight_only_default`."""
    if quant.weight_only:
        return weight_only_default(cfg, quant)
    out = TileConfig(**{**cfg, "BLOCK_SIZE_K": min(2 * cfg["BLOCK_SIZE_K"], 256)})  # type: ignore[typeddict-item]
    if quant.block_shape is not None:
        # block scales: the per-K-step scaled partial product doubles the live accumulators;
        # 256-wide tiles then spill (2.5-2.9x slower than 128 at >= 256 tokens on an H200, PERF.md)
        out["BLOCK_SIZE_N"] = min(out["BLOCK_SIZE_N"], 128)
        if out["BLOCK_SIZE_M"] == 128:
            # prefill: 64-row tiles in groups of 16, the tile H200 tunes picked at 1024-4096 tokens of
            # Qwen3-30B-A3B, Qwen3-235B-A22B TP8 and DeepSeek-V3 TP8 (the 128-row default 1.16-1.21x
            # slower than tuned there)
            out["BLOCK_SIZE_M"], out["GROUP_SIZE_M"] = 64, 16
        if pairs_per_expert is not None:
            out = fp8_block_tile(out, pairs_per_expert)
    return fit_to_quant_block(out, quant)


def fp8_block_tile(cfg: TileConfig, pairs_per_expert: float) -> TileConfig:
    """The sorted-token layer's fp8 block-scale tile at `pairs_per_expert` (M * topk / E), from the
    H200 tunes of Qwen3-30B-A3B and DeepSeek-V3 TP8 at vLLM's 18 token counts (PERF.md section 2,
    where the bands' tiles were 1.05-1.21x slower than tuned):
    - 64-row tiles take 4 warps (8: 1.05-1.18x slower at 512-4096 tokens of Qwen3-30B, 1.06-1.14x
      at 3072-4096 of DeepSeek-V3 TP8);
    - from a quarter of a pair to 16 pairs per expert, 16-row tiles 128 wide in 3 stages (which
      `swap_ab` runs as w^T x^T): the winners at 4-256 tokens of Qwen3-30B and 8-512 of
      DeepSeek-V3 TP8, where the 64-wide 16-row tile and the 32-row band were 1.04-1.21x slower;
      below a quarter (1-2 tokens) the 64-wide tile stays, tuned best there."""
    out = TileConfig(**cfg)  # type: ignore[typeddict-item]
    if out["BLOCK_SIZE_M"] == 64:
        out["num_warps"] = 4
    elif 0.25 <= pairs_per_expert <= 16:
        out.update(BLOCK_SIZE_M=16, BLOCK_SIZE_N=128, num_warps=4, num_stages=3)  # type: ignore[typeddict-item]
    return out


def weight_only_default(cfg: TileConfig, quant: "QuantScheme") -> TileConfig:
    """A 16-bit default config adapted to a weight-only scheme (int8_w8a16, int4_w4a16, mxfp4).
    The GEMMs hold each dequantised (BLOCK_SIZE_K, BLOCK_SIZE_N) weight tile in registers beside
    the accumulators, so the tile is kept small: BLOCK_SIZE_N <= 128, BLOCK_SIZE_K 64, 4 warps,
    3 stages; in decode (BLOCK_SIZE_M 16) BLOCK_SIZE_K 128 where one scale covers at least 128
    values along K (int8 per channel, int4 group 128: one scale row per tile). These are the
    winners an H200 tune picked at 1-4096 tokens for gpt-oss-20b mxfp4 and Qwen3-30B-A3B
    int4_w4a16 (PERF.md), 1.04-1.68x faster there than the 16-bit bands' tiles."""
    g = quant.group_size
    bk = 128 if cfg["BLOCK_SIZE_M"] == 16 and (g is None or g >= 128) else 64
    return TileConfig(**{**cfg, "BLOCK_SIZE_N": min(cfg["BLOCK_SIZE_N"], 128),  # type: ignore[typeddict-item]
                         "BLOCK_SIZE_K": min(bk, cfg["BLOCK_SIZE_K"]), "num_warps": 4, "num_stages": 3})


def fit_to_quant_block(cfg: TileConfig, quant: "QuantScheme") -> TileConfig:
    """Block-quantised weights: BLOCK_SIZE_K must divide bk (one scale column per K step), as
    vLLM's tuner requires of its fp8 block configs. BLOCK_SIZE_N is free: the kernels (vLLM's and
    moebench's) read one weight scale per output column. Other schemes: as is."""
    if quant.block_shape is None:
        return cfg
    bk = quant.block_shape[1]
    out = TileConfig(**cfg)  # type: ignore[typeddict-item]
    while bk % out["BLOCK_SIZE_K"] and out["BLOCK_SIZE_K"] > 16:
        out["BLOCK_SIZE_K"] //= 2
    return out


def default_config(M: int, E: int, N: int, H: int, topk: int, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """Default tile config when no tuned file exists, from the tokens per expert T = M * topk / E.

    The layer streams every hit expert's weights; an expert with more tokens than BLOCK_SIZE_M is
    covered by several row blocks, which re-read its weight tiles. GROUP_SIZE_M > 1 schedules
    neighbouring row blocks (the same expert when it has several) on the same weight tile one
    after the other, so those re-reads mostly hit L2. Bands, from a sweep of 20 configs at the
    18 points of design.md's table on an H200 (bf16; benchmarks/bench_triton.py --sweep, results
    in PERF.md):

    | T (tokens/expert) | M  | N   | K       | GROUP | warps | stages | regime |
    |---|---|---|---|---|---|---|---|
    | <= 8              | 16 | 64  | 256/128 | 16 | 4 | 3/4 | memory-bound decode: smallest MMA M, long K loads |
    | <= 24             | 32 | 128 | 128     | 16 | 4 | 3   | memory-bound, about one block per expert |
    | <= 48             | 64 | 128 | 64      | 16 | 8 | 4   | transition |
    | > 48              | 128| 256 | 64      | 8  | 8 | 4   | compute-bound: large wgmma tiles, deep pipeline |

    K = 256 (3 stages) in the first band when both H and N are >= 2048 (long K loops), else 128
    (4 stages). Measured on an H200 (2026-11-29, PERF.md): at the 24 points
    (3 shapes of design.md + a DeepSeek EP8 shard with expert_map, tokens 1..4096) these bands
    were within 1.05x (median 1.007x) of the best of a 20-config sweep. BLOCK_SIZE_N is the width of one program's output tile;
    in GEMM1 the moebench kernel splits it evenly into gate and up columns (the register budget
    of vLLM's unfused GEMM1 with the same config). For fp32 inputs BLOCK_SIZE_K is halved (shared
    memory) and stages capped at 3. BLOCK_SIZE_N <= next power of two >= N (min 32) and
    BLOCK_SIZE_K likewise for H, so tiny test shapes do not launch mostly-masked tiles.
    """
    tpe = M * topk / max(E, 1)
    if tpe <= 8:
        long_k = min(H, N) >= 2048
        bm, bn, bk, g, w, s = 16, 64, 256 if long_k else 128, 16, 4, 3 if long_k else 4
    elif tpe <= 24:
        bm, bn, bk, g, w, s = 32, 128, 128, 16, 4, 3
    elif tpe <= 48:
        bm, bn, bk, g, w, s = 64, 128, 64, 16, 8, 4
    else:
        bm, bn, bk, g, w, s = 128, 256, 64, 8, 8, 4
    if dtype == torch.float32:
        bk, s = max(bk // 2, 32), min(s, 3)
    bn = min(bn, max(32, _next_pow2(N)))
    bk = min(bk, max(32, _next_pow2(H)))
    return TileConfig(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=g, num_warps=w, num_stages=s)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
