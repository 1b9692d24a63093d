"""The search space of the sorted-token fused MoE kernel's tile configs, and its pruning.

The full space is the grid vLLM's and SGLang's tuners walk (their value lists, moebench's code):

    BLOCK_SIZE_M 16, 32, 64, 128, 256      BLOCK_SIZE_N 32, 64, 128, 256
    BLOCK_SIZE_K 64, 128, 256              GROUP_SIZE_M 1, 16, 32, 64
    num_warps 4, 8                         num_stages 2, 3, 4, 5          = 1920 configs

`prune` drops, for one problem (token count, experts, sizes, dtype, device), the configs that
cannot run or cannot win, and counts each reason:

    fp8 block       block-quantised fp8 weights ([bn, bk] scale blocks): BLOCK_SIZE_K must divide
                    bk (one scale column per K step, as vLLM's tuner prunes); BLOCK_SIZE_N is free
                    (both kernels read one weight scale per output column)
    weight-only group  int4 / mxfp4 weights: BLOCK_SIZE_K must divide the K group or be a
                    multiple of it (the kernels read one scale column per tile, or one per K
                    index; moebench.kernels.triton.wquant); powers of two always are
    shared memory   num_stages * (BM*BK + BK*BN) * dtype bytes > the device's per-block limit
                    (fp8: 1 byte per element)
                    (both GEMMs stage an A tile (BM, BK) and B tiles totalling (BK, BN) per stage;
                    GEMM1's BN is split into gate and up halves of the same total)
    BLOCK_SIZE_M    far above the tokens per expert: BM > max(16, 2 * next_pow2(M*topk/E)) means
                    most rows of every block are padding (the factor 2 leaves room for imbalance)
    tile > problem  BLOCK_SIZE_N above both output widths (next_pow2 of I and H, min 32) or
                    BLOCK_SIZE_K above both reduction lengths (next_pow2 of H and I, min 64): the
                    extra columns are masked loads
    num_stages      more pipeline stages than the longer K loop has steps (+1): the extra stages
                    only cost shared memory (2 stages always stay)
    GROUP_SIZE_M    duplicates: every GROUP_SIZE_M >= the grid's row-block count maps programs
                    identically, so only the smallest such value stays

`neighbours` gives the configs one step away in one parameter, used to seed a token count's
search with the winners of the neighbouring count.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from moebench.kernels.triton.align import max_padded_size
from moebench.kernels.tuned_files import TILE_KEYS, TileConfig

#: Values per parameter, in order (the order `neighbours` steps along).
SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}

#: Per-block shared memory (opt-in) of H100/H200, used when the device cannot be asked
#: (CPU, the Triton interpreter).
DEFAULT_SMEM_BYTES = 227 * 1024

ConfigKey = tuple[int, int, int, int, int, int]

#: Pruning reason of a config whose tile does not fit inside the fp8 scale block.
FP8_BLOCK_REASON = "BLOCK_SIZE_K not dividing the fp8 scale block"
WQ_GROUP_REASON = "BLOCK_SIZE_K not aligned with the weight-only group"


def config_key(cfg: Mapping[str, int]) -> ConfigKey:
    """Hashable identity of a config: its six values in TILE_KEYS order."""
    return tuple(int(cfg[k]) for k in TILE_KEYS)  # type: ignore[return-value]


def key_str(cfg: Mapping[str, int]) -> str:
    """Short text form, e.g. 'M64,N128,K64,G16,w8,s4' (journal keys, tables)."""
    m, n, k, g, w, s = config_key(cfg)
    return f"M{m},N{n},K{k},G{g},w{w},s{s}"


def from_key(key: Iterable[int]) -> TileConfig:
    return TileConfig(**dict(zip(TILE_KEYS, (int(v) for v in key))))  # type: ignore[typeddict-item]


def full_space(space: Mapping[str, Iterable[int]] | None = None) -> list[TileConfig]:
    """Every combination of `space` (default SPACE: 1920 configs), in a fixed order."""
    sp = {k: tuple((space or SPACE)[k]) for k in TILE_KEYS}
    return [from_key(vals) for vals in itertools.product(*(sp[k] for k in TILE_KEYS))]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def smem_bytes(cfg: Mapping[str, int], elem_bytes: int) -> int:
    """Shared memory the pipelined K loop needs: stages * (BM*BK + BK*BN) * element bytes.

    (Under the interpreter, 16-bit operands are upcast after loading; the estimate is for the GPU.)
    """
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    return cfg["num_stages"] * (bm * bk + bk * bn) * elem_bytes


def smem_limit(device: torch.device | str | None) -> int:
    """Per-block shared memory of the device (opt-in maximum); DEFAULT_SMEM_BYTES off CUDA."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        for attr in ("shared_memory_per_block_optin", "max_shared_memory_per_block_optin"):
            v = getattr(props, attr, None)
            if v:
                return int(v)
    return DEFAULT_SMEM_BYTES


def _next_pow2(n: float) -> int:
    n = max(1, int(math.ceil(n)))
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Problem:
    """What the pruning rules look at: one layer call on one rank.

    tokens: M on this rank; num_experts: E global (routing spreads over these); local_experts:
    experts on this rank (w13.shape[0]); hidden: H; inter: I per rank (w2.shape[2]);
    elem_bytes: bytes per GEMM operand element (1 for fp8); quant_block: (bn, bk) of
    block-quantised fp8 weights, else None; wq_group: the K group of weight-only int4 / mxfp4
    weights (None: none); block_m_fixed: BLOCK_SIZE_M is given (GEMM2's configs
    take GEMM1's), so the BLOCK_SIZE_M rule does not apply.
    """

    tokens: int
    num_experts: int
    local_experts: int
    topk: int
    hidden: int
    inter: int
    elem_bytes: int = 2
    smem_limit: int = DEFAULT_SMEM_BYTES
    quant_block: tuple[int, int] | None = None
    wq_group: int | None = None
    block_m_fixed: bool = False

    @property
    def tokens_per_expert(self) -> float:
        return self.tokens * self.topk / max(self.num_experts, 1)

    def max_blocks(self, block_m: int) -> int:
        """Row blocks of the kernel's grid for BLOCK_SIZE_M = block_m (the worst-case count the
        launch uses; GROUP_SIZE_M groups these)."""
        return max(1, max_padded_size(self.tokens * self.topk, self.local_experts, block_m) // block_m)


@dataclass
class PruneReport:
    """kept: configs left, in space order; pruned: reason -> count; total: size before pruning."""

    kept: list[TileConfig]
    pruned: dict[str, int] = field(default_factory=dict)
    total: int = 0

    @property
    def n_pruned(self) -> int:
        return sum(self.pruned.values())

    def summary(self) -> str:
        why = ", ".join(f"{n} {r}" for r, n in sorted(self.pruned.items(), key=lambda kv: -kv[1]))
        return f"{len(self.kept)} of {self.total} configs kept" + (f"; pruned {why}" if why else "")


def prune_reason(cfg: Mapping[str, int], p: Problem) -> str | None:
    """Why `cfg` cannot run or cannot win on `p` (None: keep). Duplicated GROUP_SIZE_M values
    are handled by `prune` (they depend on the other values present)."""
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    if p.quant_block is not None and p.quant_block[1] % bk:
        return FP8_BLOCK_REASON
    if p.wq_group is not None and bk % p.wq_group and p.wq_group % bk:
        return WQ_GROUP_REASON
    if smem_bytes(cfg, p.elem_bytes) > p.smem_limit:
        return "shared memory"
    if not p.block_m_fixed and bm > max(16, 2 * _next_pow2(p.tokens_per_expert)):
        return "BLOCK_SIZE_M above tokens per expert"
    if bn > max(32, _next_pow2(p.inter), _next_pow2(p.hidden)):
        return "BLOCK_SIZE_N above output widths"
    if bk > max(64, _next_pow2(p.hidden), _next_pow2(p.inter)):
        return "BLOCK_SIZE_K above reduction lengths"
    k_steps = max(math.ceil(p.hidden / bk), math.ceil(p.inter / bk))
    if cfg["num_stages"] > 2 and cfg["num_stages"] > k_steps + 1:
        return "num_stages above K-loop steps"
    return None


def prune(configs: Iterable[Mapping[str, int]], p: Problem) -> PruneReport:
    """Apply the rules of the module docstring; returns what is kept and the count per reason."""
    configs = [TileConfig(**{k: int(c[k]) for k in TILE_KEYS}) for c in configs]  # type: ignore[typeddict-item]
    reasons: Counter[str] = Counter()
    survivors: list[TileConfig] = []
    for c in configs:
        r = prune_reason(c, p)
        if r is None:
            survivors.append(c)
        else:
            reasons[r] += 1
    # GROUP_SIZE_M >= row blocks: identical schedules; keep the smallest such value per rest-of-config.
    kept: list[TileConfig] = []
    seen: set[tuple] = set()
    by_rest: dict[tuple, list[TileConfig]] = {}
    for c in survivors:
        rest = tuple(c[k] for k in TILE_KEYS if k != "GROUP_SIZE_M")
        by_rest.setdefault(rest, []).append(c)
    for c in survivors:
        blocks = p.max_blocks(c["BLOCK_SIZE_M"])
        if c["GROUP_SIZE_M"] < blocks:
            kept.append(c)
            continue
        rest = tuple(c[k] for k in TILE_KEYS if k != "GROUP_SIZE_M")
        smallest = min(o["GROUP_SIZE_M"] for o in by_rest[rest] if o["GROUP_SIZE_M"] >= blocks)
        if c["GROUP_SIZE_M"] == smallest and rest not in seen:
            seen.add(rest)
            kept.append(c)
        else:
            reasons["GROUP_SIZE_M duplicate (one group covers all row blocks)"] += 1
    return PruneReport(kept=kept, pruned=dict(reasons), total=len(configs))


def neighbours(cfg: Mapping[str, int], space: Mapping[str, Iterable[int]] | None = None) -> list[TileConfig]:
    """Configs one step away from `cfg` in exactly one parameter (along SPACE's value order).
    A value not in the list (e.g. GROUP_SIZE_M 8 of a hand-written config) steps to the nearest
    listed values on either side."""
    sp = {k: sorted((space or SPACE)[k]) for k in TILE_KEYS}
    out: list[TileConfig] = []
    for k in TILE_KEYS:
        vals = sp[k]
        v = int(cfg[k])
        lower = [x for x in vals if x < v]
        upper = [x for x in vals if x > v]
        for nv in ([lower[-1]] if lower else []) + ([upper[0]] if upper else []):
            d = {kk: int(cfg[kk]) for kk in TILE_KEYS}
            d[k] = nv
            out.append(TileConfig(**d))  # type: ignore[typeddict-item]
    return out
