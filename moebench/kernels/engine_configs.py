"""The serving engines' fused-MoE Triton kernel (`moebench tune --kernel vllm|sglang`): which experts
time it here, vLLM's default config without a tuned file, and the config its lookup picks from the
engine's file in the store (moebench.kernels.tuned_files: the engines' names and folders). Lookup:
the entry with the token count nearest to M (ties: the smaller), as vLLM picks it; without a file,
vLLM's default config (`vllm_default_config`).
"""

from __future__ import annotations

from pathlib import Path

from moebench.kernels.tuned_files import TileConfig, engine_file_name, find, nearest_entry
from moebench.quant import QuantScheme


def engine_experts(engine: str, device: str) -> str:
    """The experts backend that times `engine`'s kernel on `device`: vLLM's own fused_experts
    (`vllm`) where vllm imports on a GPU, else moebench's implementation of the engines' structure
    (`vllm-triton`; SGLang's kernel always)."""
    if engine == "vllm":
        from moebench.kernels.vllm_native import vllm_unavailable_reason

        if vllm_unavailable_reason(device) is None:
            return "vllm"
    return "vllm-triton"


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
    found = find(engine, roots, name)
    if found is None:
        return vllm_default_config(m, E, quant), f"vLLM's default config (no {name})"
    key, cfg = nearest_entry(found.table, max(m, 1))
    return TileConfig(**cfg), f"{found.path}[{key}]"  # type: ignore[typeddict-item]


