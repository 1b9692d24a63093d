"""The tile config the Triton experts run with: the lookup of a layer's tuned file in the store
(moebench.kernels.tuned_files: names, folders, reading, the routing a file was tuned under) and
the default heuristic without one.

GEMM2 (down projection) configs: the `_down.json` file next to GEMM1's (same E, N, device, dtype),
entries with the BLOCK_SIZE_M of the GEMM1 file's entry at that token count (both GEMMs run on one
alignment), optionally "USE_TMA" (GEMM2 loads its w2 tiles through TMA or not; without the key GEMM2
follows GEMM1's TMA choice, `options.resolve_use_tma`). Without a `_down` file, or where its nearest
entry has another BLOCK_SIZE_M than GEMM1's config, GEMM2 runs with GEMM1's config, as vLLM does
(the experts' config source says which). `moebench tune --down` writes them.

Lookup order at run time: $MOEBENCH_CONFIG_DIR, then results/configs/ (relative to the current
directory), then the package's moebench/configs/moebench/, resolved when the experts are built
(`config_search_dirs`). The first folder holding the file wins; inside it the entry with the
nearest token count wins (ties go to the smaller count), its key read by the routing the file was
tuned under. Each file is read once per process (`tuned_files.find`). Without a file,
`default_config` (a documented heuristic) decides.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from moebench.kernels.tuned_files import (
    TileConfig,
    config_file_name,
    current_device_name,
    find,
    name_parts,
    nearest_entry,
    per_channel_quant,
    routed_tokens,
)

if TYPE_CHECKING:  # pragma: no cover
    from moebench.quant import QuantScheme


def _as_tokens(M: int, mk: int) -> str:
    return "" if mk == M else f" (its routing's load at {mk} tokens, here {M})"


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
    first file under the config roots `folders` (`config_search_dirs()` as resolved when the
    experts were built; the file is read once: `tuned_files.find`).

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
    found = find("moebench", folders, config_file_name(E, N, dev, tag, block, per_channel_quant=per_channel_quant(quant)))
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
    found = find("moebench", folders, config_file_name(E, N, dev, tag, block, down=True,
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
