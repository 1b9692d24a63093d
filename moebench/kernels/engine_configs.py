"""Tuned-config files for the serving engines' own fused-MoE Triton kernel (the `vllm-triton`
experts), kept apart from moebench's files (moebench.kernels.triton.configs), which are tuned for
moebench's `triton` kernel and make the engines' kernel slower.

    kernel   folder (under each config root)         file name
    vllm     vllm/                                   E={E},N={N},device_name={dev}[,dtype=fp8_w8a8][,block_shape=[bn,bk]].json
    sglang   sglang/triton_{X_Y_Z}/ (Triton version) E={E},N={N},device_name={dev}[,dtype=fp8_w8a8][,block_shape=[bn, bk]].json

Config roots, first hit wins: $MOEBENCH_CONFIG_DIR, results/configs (from the current directory),
the package's moebench/configs (`C.config_search_dirs`, resolved when the experts are built; each
file is read once per process). A vllm/ folder can be handed to vLLM as VLLM_TUNED_CONFIG_FOLDER
(or its files copied into vLLM's model_executor/layers/fused_moe/configs/); a sglang/triton_X_Y_Z/
folder's files go into SGLang's fused_moe_triton/configs/triton_X_Y_Z/. The differences are the
engines' own: vLLM names an H200-family device NVIDIA_H200 and writes block_shape without a space;
SGLang keeps Python's list spacing and one folder per Triton version, and reads the installed
Triton's folder first, then the others (newest first).

Content, as both engines read it: {"<tokens>": {BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
GROUP_SIZE_M, num_warps, num_stages}}, nothing else (SGLang turns every key into an int, so a
"triton_version" key would break it; the version is in the folder name and the tune report).
Lookup: the entry with the token count nearest to M (ties: the smaller), as vLLM picks it; without
a file, vLLM's default config (`vllm_default_config`).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from types import MappingProxyType

from moebench.errors import MoebenchError
from moebench.kernels.triton import configs as C
from moebench.kernels.triton.configs import TileConfig
from moebench.quant import QuantScheme

#: Engines whose kernel the vllm-triton experts follow (`moebench tune --kernel`).
ENGINES = ("vllm", "sglang")
#: `--kernel` values of `moebench tune` / `configs commit`: moebench's own `triton`, or an engine's.
KERNELS = ("moebench",) + ENGINES
_TRITON_DIR_RE = re.compile(r"^triton_\d+_\d+_\d+$")


def engine_experts(engine: str, device: str) -> str:
    """The experts backend that times `engine`'s kernel on `device`: vLLM's own fused_experts
    (`vllm`) where vllm imports on a GPU, else moebench's implementation of the engines' structure
    (`vllm-triton`; SGLang's kernel always)."""
    if engine == "vllm":
        from moebench.kernels.vllm_native import vllm_unavailable_reason

        if vllm_unavailable_reason(device) is None:
            return "vllm"
    return "vllm-triton"


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
    tag, block = C.name_parts(None, quant)
    name = C.config_file_name(E, N, engine_device_name(engine, device_name), tag, block)
    if engine == "sglang" and block:
        name = name.replace(",block_shape=[" + ",".join(map(str, block)) + "]",
                            ",block_shape=[" + ", ".join(map(str, block)) + "]")
    return name


def engine_dirs(engine: str, roots: tuple[Path, ...]) -> list[Path]:
    """Folders the lookup reads for `engine` under the config roots `roots` (`C.config_search_dirs()`),
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


def default_out_dir(engine: str, root: str | os.PathLike = Path("results") / "configs") -> Path:
    """Where `tune --kernel ENGINE` writes without --out: results/configs/vllm, or
    results/configs/sglang/triton_X_Y_Z (the installed Triton's)."""
    d = Path(root) / engine
    return d / triton_folder() if engine == "sglang" else d


def package_dir(engine: str, triton_version_folder: str | None = None) -> Path:
    """The package folder `configs commit --kernel ENGINE` ships files in."""
    d = C.PACKAGE_CONFIG_DIR / engine
    return d / (triton_version_folder or triton_folder()) if engine == "sglang" else d


@functools.lru_cache(maxsize=256)
def found_engine_table(engine: str, roots: tuple[Path, ...], name: str) -> C.FoundTable | None:
    """The first `engine` file called `name` under `roots`, read, or None. Cached as
    `C.found_table` is: a steady-state call of the vllm-triton experts does no file-system work;
    `clear_lookup_cache` forgets what was read."""
    for d in engine_dirs(engine, roots):
        if (d / name).is_file():
            return C.FoundTable(d / name, MappingProxyType(C.load_config_file(d / name)), None)
    return None


def clear_lookup_cache() -> None:
    """Forget the engine files the lookup has read (and not found): the next lookup looks again."""
    found_engine_table.cache_clear()


def vllm_default_config(m: int, num_experts: int, quant: QuantScheme | None) -> TileConfig:
    """vLLM's config without a tuned file: fp8 block [bn, bk]: M 64, N bn, K bk, GROUP 32, 4
    warps, 3 stages; else M <= E: 16/32/64, GROUP 1; else 64/64/32, GROUP 8 (vLLM gives no warps
    or stages there: Triton's defaults, 4 and 3, are what runs)."""
    if quant is not None and quant.block_shape is not None:
        bn, bk = quant.block_shape
        return TileConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=32, num_warps=4, num_stages=3)
    if m <= num_experts:
        return TileConfig(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3)
    return TileConfig(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4, num_stages=3)


def engine_config(engine: str, m: int, E: int, N: int, num_experts: int, device_name: str,
                  quant: QuantScheme | None = None, *, roots: tuple[Path, ...]) -> tuple[TileConfig, str]:
    """(config, where from) at m tokens for the layer of E local experts, N = I per rank, from the
    engine's file under the config roots `roots` (resolved when the experts were built)."""
    name = engine_file_name(engine, E, N, device_name, quant)
    found = found_engine_table(engine, roots, name)
    if found is None:
        return vllm_default_config(m, E, quant), f"vLLM's default config (no {name})"
    key, cfg = C.nearest_entry(found.table, max(m, 1))
    return TileConfig(**cfg), f"{found.path}[{key}]"  # type: ignore[typeddict-item]


def load_engine_file(path: str | os.PathLike) -> dict[int, TileConfig]:
    """Read an engine file: token keys only (a "triton_version" key is refused: SGLang cannot read it)."""
    p = Path(path)
    table = C.load_config_file(p)
    raw = json.loads(p.read_text())
    extra = [k for k in raw if not str(k).lstrip("-").isdigit()]
    if extra:
        raise MoebenchError(f"{p}: key(s) {', '.join(map(repr, extra))} are not token counts; an engine file holds "
                            "token counts only (SGLang reads every key as one)")
    return table
