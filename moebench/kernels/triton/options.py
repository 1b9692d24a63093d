"""The choices of moebench's Triton kernels: one frozen `TritonOptions`, and the rules that resolve it.

Every code path the Triton experts can take is chosen here, by an argument, never by module
state: `TritonExperts(options=TritonOptions(...))`, `fused_moe(..., options=...)`. A benchmark
that compares two paths builds two options objects; a test names the path it checks. The defaults
are the measured winners (PERF.md, each field's comment names the measurement); a field
set to "auto" is decided per call by a rule below, a pure function of the options and the shape,
config, dtype or device, and the numbers those rules compare against are fields too, so that a
benchmark can move them.

    resolve_use_tma     weight tiles through TMA descriptors
    gemm1_walk          GEMM1 as the paired walk (gate and up tiles, two dots per K step) or the
                        wide walk (one tile of both, one dot), and whether x comes through TMA
                        from a copy in sorted order (sorted_a; `use_sorted_a`)
    resolve_pdl         GEMM1 and GEMM2 with programmatic dependent launch
    wants_direct_align  one block per pair and no alignment kernel
    wants_token_rows    one block per local expert over all tokens, no alignment kernel
    align_kernels       the alignment's kernels: one launch, or two by "scan" or "sort"
    layer_split_k       GEMM2's K split (`choose_split_k`, `wave_split`: the split-K cost model)
    resolve_pair_store  GEMM2's sum over top-k: fp32 atomics into (M, H), or each pair's weighted
                        row stored and summed by a second launch (`use_pair_store`)
    resolve_swap_ab     fp8 dots as w^T x^T into a transposed accumulator (`use_swap_ab`)
    resolve_k_groups    fp8 block scale groups per K step of GEMM1's paired walk
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

import torch
import triton

from moebench.errors import MoebenchError
from moebench.kernels.triton.env import interpreting
from moebench.quant import QuantScheme

_AUTO_FIELDS = ("use_tma", "wide_gemm1", "sorted_a", "pdl", "direct_align", "token_rows", "pair_store", "swap_ab")
_ALIGN_METHODS = ("auto", "scan", "sort")
_16BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TritonOptions:
    """The Triton experts' choices (True / False / "auto" switches, then the thresholds of the
    "auto" rules). Defaults are what the kernels measured fastest on an H200 (PERF.md)."""

    #: Weight tiles through TMA descriptors where the hardware has them (Hopper+). "auto": 16-bit
    #: inputs with BLOCK_SIZE_M >= 32 (same-config A/B: 1-13% faster at >= 1024 tokens with 128-row
    #: tiles; within +-1% at 32 rows; mixed at 16), fp8 (w8a8) with tma_fp8_min_rows <= BLOCK_SIZE_M
    #: <= tma_fp8_max_rows (fp8 block layers at 1024 / 4096 tokens: 0.979-1.000 at all 7 points with
    #: 64-row tiles, 1.039 at the one 128-row tile; 0.87-1.22 at 16-row tiles).
    use_tma: bool | str = "auto"
    tma_fp8_min_rows: int = 64
    tma_fp8_max_rows: int = 64
    #: GEMM1's wide walk: gate and up as one (BK, BLOCK_SIZE_N) tile and one dot per K step (with TMA
    #: one (2, BN, BK) box of w13), instead of the paired walk's two tiles and two dots. "auto":
    #: BLOCK_SIZE_M >= 64, unquantised (1-4% faster layers; -0.1% to +1% at 16 / 32 rows); fp8 with
    #: block scales from wide_fp8_block_min_rows pairs per expert (layers at 128-256 pairs: Qwen3-30B
    #: 0.939-0.950, Qwen3-235B TP8 0.951-0.952, DeepSeek-V3 TP8 1.009; at 64 pairs mixed,
    #: 0.961-1.027; at 16 DeepSeek-V3 TP8 1.038); fp8 with tensor / token scales from
    #: wide_fp8_tensor_min_rows (per tensor at 32-256 pairs, the same three shapes: 0.928-0.996, 9 of 9;
    #: per token untimed). Weight-only: paired.
    wide_gemm1: bool | str = "auto"
    wide_fp8_block_min_rows: int = 128
    wide_fp8_tensor_min_rows: int = 32
    #: GEMM1 takes x's rows through TMA from a copy in sorted order (`sorted_rows`: one gather launch)
    #: instead of gathering them by pointer loads in its K loop; needs TMA, 16-bit inputs and the wide
    #: walk. "auto" (`use_sorted_a`): BLOCK_SIZE_M >= 64 and, expected per local expert, at least
    #: sorted_a_min_rows pairs, or sorted_a_wide_min_rows where I >= sorted_a_wide_inter (the copy's
    #: share of GEMM1 falls as 1 / I). Mixtral 0.92-0.95 of the layer at 1024 / 4096 tokens;
    #: DeepSeek-V3's 32 experts 0.93-0.95 at 4096 but 1.01-1.04 at 1024; Qwen3-30B 1.08-1.10 at 1024.
    sorted_a: bool | str = "auto"
    sorted_a_min_rows: int = 512
    sorted_a_wide_inter: int = 4096
    sorted_a_wide_min_rows: int = 256
    #: Programmatic dependent launch (Hopper+): the alignment, GEMM1 and GEMM2 launched with
    #: launch_pdl, each releasing the next as soon as its programs have started. "auto": layers with
    #: intermediate size I <= pdl_max_inter (0.94-0.998 of the layer at 1-256 tokens of Qwen3-30B
    #: (I = 768) and Qwen3-Next (512); a loss at 1-4 tokens of Mixtral (14336) and DeepSeek-V3 EP8
    #: (2048)). Never on other devices or under the interpreter.
    pdl: bool | str = "auto"
    pdl_max_inter: int = 1024
    #: `direct_align`: one block per pair, no alignment kernel. "auto" (`wants_direct_align`): one
    #: token (a token's top-k experts are distinct), except with an expert map where an fp8
    #: quantisation launch (block, token scales) sits between the GEMMs (DeepSeek-V3 EP8 fp8 block
    #: 1.32 of the layer); more tokens up to direct_max_fill pairs per global expert (vLLM's
    #: per-pair rule at 0.25) without an expert map. One token: -12% of the layer at Qwen3-30B
    #: bf16, 0.57-0.91 at fp8 block (which it also spares the alignment's worst-case rows in the
    #: quantisation launch); 2-4 tokens of Qwen3-235B TP8 / Qwen3-30B bf16 0.88-1.01, fp8 block
    #: (and 2-8 of DeepSeek-V3 TP8) 0.96-0.99; past the rule 1.03-1.27.
    direct_align: bool | str = "auto"
    direct_max_fill: float = 0.25
    #: `token_rows_align`: up to BLOCK_SIZE_M tokens, no alignment kernel: one block per local
    #: expert over all the tokens, each GEMM program finding its expert's tokens in topk_ids (one
    #: load of the routing tile). Blocks of experts no token reaches still launch, read the routing
    #: and exit; at one block per SM (the large decode tiles' shared memory) each such program
    #: holds an SM for about half a microsecond. Against the alignment kernels (`decode_launches
    #: --variants tokenrows,notokenrows`; PERF.md section 6), 16-bit weights: 0.915-0.99 with
    #: 32-256 local experts and about 61% of them idle (8-16 tokens); 0.97-1.0 at 78-88% (the EP8
    #: shard at 4-8 tokens), 1.003-1.012 at 73% (E 512), 1.99 at 94% (DeepSeek-V3's EP8 shard at 2
    #: tokens: 20 against 7 us in GEMM2 alone); Mixtral
    #: TP8 (8 experts) 0.975 at 16 tokens, but 1.04-1.055 at 2-8. fp8 block: 0.967-0.992 on
    #: Mixtral at 4-16 tokens (up to 3.7 idle), 0.994-1.069 with 20-155 idle experts.
    #: "auto" (`wants_token_rows`): where the direct alignment is not taken and M <= BLOCK_SIZE_M,
    #: by idle = E_local x exp(-M K / E), the local experts uniform routing leaves without a token
    #: in expectation: 16-bit weights up to token_rows_max_idle, or with at least
    #: token_rows_min_local local experts up to token_rows_max_idle_share of them; quantised weights
    #: up to token_rows_quant_max_idle. Never where pair_store or sorted_a is forced on (both need
    #: sorted pair rows).
    token_rows: bool | str = "auto"
    token_rows_max_idle: float = 1.0
    token_rows_min_local: int = 16
    token_rows_max_idle_share: float = 0.7
    token_rows_quant_max_idle: float = 4.0
    #: The alignment kernels: one launch up to this many pairs (0.96-1.005 of the layer from 2 to 64
    #: tokens against two launches), above it two launches by align_method: "scan", "sort", or "auto"
    #: = sort where local experts x pairs >= sort_min_work (Qwen3-30B 4096 tokens 20.1 -> 8.5 us;
    #: the scan is faster below, E=8: always).
    one_launch_max_pairs: int = 1024
    align_method: str = "auto"
    sort_min_work: int = 1 << 20
    #: GEMM2's K split where its grid runs in a few waves of long K loops (`wave_split`): a program's
    #: fixed cost (pipeline fill, epilogue, launch) in K steps of the main loop, fitted to GEMM2's
    #: times (~0.8 us per 128 x 256 x 64 step, ~6 us per tile): Mixtral 1024 tokens 0.965 of the layer.
    wave_tile_overhead_steps: int = 7
    #: GEMM2 stores each pair's weighted row (M*K, H) in the output dtype and one more launch sums
    #: them over top-k (`topk_sum`), instead of adding them into an fp32 (M, H) accumulator by
    #: atomics (which GEMM1 then zeroes). "auto" (`use_pair_store`): where GEMM2's K loop is short
    #: (I <= pair_store_max_inter) and experts get at least pair_store_min_rows pairs each, with every
    #: pair local (no expert map) and GEMM2's K unsplit: there the atomic epilogue of every tile
    #: outweighs its few K steps. Layer at 32-256 pairs per expert: Qwen3-235B TP8 (I = 192) 0.79-0.92,
    #: DeepSeek-V3 TP8 (256) 0.83-0.94, Qwen3-30B (768) 0.95-0.96, bf16 and fp8 block; 16 pairs
    #: 0.98-1.006; Mixtral (14336) 1.00.
    pair_store: bool | str = "auto"
    pair_store_max_inter: int = 1024
    pair_store_min_rows: int = 32
    #: fp8 GEMMs compute each tile as w^T x^T into a (BLOCK_SIZE_N, BLOCK_SIZE_M) accumulator, so the
    #: weight columns fill the MMA's M side (wgmma's M is 64) where a block has few rows (vLLM's
    #: kernel swaps for fp8 on Hopper at BLOCK_SIZE_M < 64 with BLOCK_SIZE_N >= 64). "auto"
    #: (`use_swap_ab`): block scales, 16-row tiles at least swap_ab_min_cols wide, pointer weight tiles:
    #: the only tiles where it measured faster (DeepSeek-V3 TP8 48-512 tokens 0.91-0.94, Qwen3-30B
    #: 16 tokens 0.96, all 128-256 wide); 64 wide 1.02-1.83x, per-tensor scales slower at 17 of 20.
    swap_ab: bool | str = "auto"
    swap_ab_min_cols: int = 128
    #: fp8 block scale groups each K step of GEMM1's paired walk takes (two: two BLOCK_SIZE_K-wide
    #: loads, dots and scalings per iteration, twice the bytes of each weight row per step). The
    #: experts' weight stream alone (`fp8_k_step`) moved 3923 -> 4103 GB/s (K 7168) and 3867 -> 3937
    #: (K 2048) with two at 16 rows per expert, nothing or a loss at GEMM2's short K. In the layer
    #: (`decode_launches --variants kg1` / `kg2`) two took DeepSeek-V3 TP8 (H 7168) to 0.942-0.987 at
    #: 1-16 tokens (at most half a pair per expert), 0.995-1.003 at 64-256; Qwen3-235B TP8 and Mixtral
    #: TP8 (H 4096) to 0.878-0.996 at 1-4 tokens, 1.001-1.011 at Qwen3-235B's 16 (one pair per expert),
    #: 1.07-1.14 at 64 (4-16 pairs per expert); Qwen3-30B (H 2048) 1.004-1.030 everywhere. "auto"
    #: (`resolve_k_groups`): 2 at 16-row tiles with pointer weight tiles where H >=
    #: fp8_k_groups_min_hidden and is a multiple of 2 x BLOCK_SIZE_K, with at most
    #: fp8_k_groups_max_rows pairs per expert; else 1.
    fp8_k_groups: int | str = "auto"
    fp8_k_groups_min_hidden: int = 4096
    fp8_k_groups_max_rows: float = 0.5
    #: batched-triton's default heuristic keeps 64-row tiles up to this many rows per expert where
    #: the sorted-token heuristic takes 128-row ones (128 x 256 tiles 10-30% faster at 192 and 768
    #: mean rows per expert, 4-9% slower at 48).
    batched_wide_rows: int = 128

    def __post_init__(self):
        for name in _AUTO_FIELDS:
            v = getattr(self, name)
            if not (isinstance(v, bool) or v == "auto"):
                raise MoebenchError(f"TritonOptions.{name} must be True, False or \"auto\", got {v!r}")
        if self.align_method not in _ALIGN_METHODS:
            raise MoebenchError(f"TritonOptions.align_method must be one of {', '.join(_ALIGN_METHODS)}, "
                                f"got {self.align_method!r}")
        if self.fp8_k_groups not in ("auto", 1, 2) or isinstance(self.fp8_k_groups, bool):
            raise MoebenchError(f"TritonOptions.fp8_k_groups must be 1, 2 or \"auto\", got {self.fp8_k_groups!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in (*_AUTO_FIELDS, "align_method", "fp8_k_groups") and (isinstance(v, bool) or v < 0):
                raise MoebenchError(f"TritonOptions.{f.name} must be a number >= 0, got {v!r}")


# ---------------------------------------------------------------------------------------------
# GEMM code paths


def resolve_k_groups(options: TritonOptions, config: Mapping[str, int], scheme: QuantScheme | None, use_tma: bool,
                     wide: bool, hidden: int, rows_per_expert: float) -> int:
    """options.fp8_k_groups for GEMM1 of a layer with fp8 scheme `scheme`, tile `config` and
    `rows_per_expert` pairs per (global) expert: 1 unless block scales, the paired walk with pointer
    weight tiles and H a multiple of 2 x BLOCK_SIZE_K; there "auto" = 2 at BLOCK_SIZE_M 16 with
    H >= options.fp8_k_groups_min_hidden and rows_per_expert <= options.fp8_k_groups_max_rows. A 2
    that cannot run raises MoebenchError."""
    fits = (scheme is not None and scheme.block_shape is not None and not scheme.weight_only and not use_tma
            and not wide and hidden % (2 * config["BLOCK_SIZE_K"]) == 0)
    if options.fp8_k_groups == "auto":
        return 2 if (fits and config["BLOCK_SIZE_M"] == 16 and hidden >= options.fp8_k_groups_min_hidden
                     and rows_per_expert <= options.fp8_k_groups_max_rows) else 1
    if options.fp8_k_groups == 2 and not fits:
        raise MoebenchError("fp8_k_groups=2 needs fp8 block scales, GEMM1's paired walk with pointer weight tiles "
                            f"and H a multiple of 2 x BLOCK_SIZE_K (H {hidden}, BLOCK_SIZE_K {config['BLOCK_SIZE_K']})")
    return int(options.fp8_k_groups)


def resolve_use_tma(options: TritonOptions, config: Mapping[str, int], dtype: torch.dtype) -> bool:
    """options.use_tma for a layer of `dtype` (x's: float8_e4m3fn for fp8 w8a8) with GEMM1's `config`:
    "auto" = 16-bit inputs with BLOCK_SIZE_M >= 32, fp8 with BLOCK_SIZE_M in [options.tma_fp8_min_rows,
    options.tma_fp8_max_rows].
    (Whether the device can do TMA is checked where the descriptors are made.)"""
    if options.use_tma == "auto":
        if dtype == torch.float8_e4m3fn:
            return options.tma_fp8_min_rows <= config["BLOCK_SIZE_M"] <= options.tma_fp8_max_rows
        return config["BLOCK_SIZE_M"] >= 32 and dtype in _16BIT
    return bool(options.use_tma)


def use_sorted_a(options: TritonOptions, config: Mapping[str, int], dtype: torch.dtype, n_inter: int,
                 rows_per_expert: float) -> bool:
    """options.sorted_a for a layer of intermediate size n_inter; rows_per_expert is the expected
    number of pairs per local expert (M * K / E global). Whether it can run is `gemm1_walk`'s."""
    if options.sorted_a == "auto":
        rows = options.sorted_a_wide_min_rows if n_inter >= options.sorted_a_wide_inter else options.sorted_a_min_rows
        return dtype in _16BIT and config["BLOCK_SIZE_M"] >= 64 and rows_per_expert >= rows
    return bool(options.sorted_a)


def gemm1_walk(options: TritonOptions, config: Mapping[str, int], dtype: torch.dtype, scheme: QuantScheme | None,
               use_tma: bool, n_inter: int, rows_per_expert: float) -> tuple[bool, bool]:
    """(wide, sorted_a) that GEMM1 runs with, for weights quantised with `scheme` (None: 16-bit).
    wide: options.wide_gemm1, "auto" = BLOCK_SIZE_M >= 64, unquantised or fp8 (w8a8) with at least
    options.wide_fp8_block_min_rows (block scales) / wide_fp8_tensor_min_rows (tensor, token scales)
    pairs per expert. sorted_a (`use_sorted_a`) runs only with TMA on (use_tma: resolved and
    device-checked), unquantised weights and the wide walk, which it then implies; an "auto" that
    cannot run is off, a True that cannot raises MoebenchError."""
    wide = options.wide_gemm1
    if wide == "auto":
        if scheme is None:
            wide = True
        elif scheme.weight_only:
            wide = False
        else:
            min_rows = options.wide_fp8_tensor_min_rows if scheme.block_shape is None else options.wide_fp8_block_min_rows
            wide = rows_per_expert >= min_rows
        wide = wide and config["BLOCK_SIZE_M"] >= 64
    sorted_a = use_sorted_a(options, config, dtype, n_inter, rows_per_expert)
    if sorted_a and (scheme is not None or not use_tma or options.wide_gemm1 is False):
        if options.sorted_a != "auto":
            raise MoebenchError("sorted_a needs 16-bit inputs on a device with TMA (use_tma) and the wide GEMM1 "
                                "(wide_gemm1 not False)")
        sorted_a = False
    return bool(wide) or sorted_a, sorted_a


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can use programmatic dependent launch: CUDA devices of compute
    capability >= 9, not under the interpreter (which cannot run the griddepcontrol PTX)."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def resolve_pdl(options: TritonOptions, device: torch.device, inter: int) -> bool:
    """options.pdl for a layer of intermediate size inter on `device`: "auto" = inter <=
    options.pdl_max_inter; on only where `pdl_supported`."""
    pdl = options.pdl
    if pdl == "auto":
        pdl = inter <= options.pdl_max_inter
    return bool(pdl) and pdl_supported(device)


# ---------------------------------------------------------------------------------------------
# Alignment


def wants_direct_align(options: TritonOptions, num_tokens: int, topk: int, num_experts: int, scheme=None,
                       mapped: bool = False) -> bool:
    """options.direct_align for num_tokens x topk pairs over num_experts global experts with fp8
    scheme `scheme` (None: 16-bit; mapped: an expert map is given). "auto": always for one token,
    unless an expert map meets an fp8 scheme whose intermediate a launch of its own quantises
    (block, token scales); for more tokens without an expert map, up to
    options.direct_max_fill pairs per global expert (pairs sharing an expert each read its
    weights, which the alignment's launch is worth beyond that)."""
    if options.direct_align != "auto":
        return bool(options.direct_align)
    if num_tokens <= 0:
        return False
    quant_launch = scheme is not None and not scheme.weight_only and scheme.scales != "tensor"
    if num_tokens == 1 and not (mapped and quant_launch):
        return True
    return not mapped and num_tokens * topk <= options.direct_max_fill * num_experts


def wants_token_rows(options: TritonOptions, num_tokens: int, topk: int, num_experts: int, num_local: int,
                     block_size_m: int, scheme=None) -> bool:
    """options.token_rows for num_tokens x topk pairs over num_experts global experts (num_local
    here), tiles of block_size_m rows and weights of `scheme` (None: 16-bit); asked after
    `wants_direct_align` said no. "auto": num_tokens <= block_size_m with few enough local experts
    expected idle, num_local x exp(-num_tokens x topk / num_experts) (the bounds of
    TritonOptions.token_rows), unless options.pair_store or options.sorted_a is True. A True that
    cannot hold (num_tokens > block_size_m) is refused by `token_rows_align`."""
    if options.token_rows != "auto":
        return bool(options.token_rows)
    if not 0 < num_tokens <= block_size_m or options.pair_store is True or options.sorted_a is True:
        return False
    idle = num_local * math.exp(-num_tokens * topk / max(num_experts, 1))
    if scheme is not None:
        return idle <= options.token_rows_quant_max_idle
    many = num_local >= options.token_rows_min_local and idle <= options.token_rows_max_idle_share * num_local
    return idle <= options.token_rows_max_idle or many


def align_kernels(options: TritonOptions, num_local: int, num_pairs: int) -> str:
    """The alignment kernels for num_pairs pairs over num_local experts: "one_launch" up to
    options.one_launch_max_pairs pairs, else options.align_method, "auto" = "sort" where
    num_local x num_pairs >= options.sort_min_work, else "scan"."""
    if num_pairs <= options.one_launch_max_pairs:
        return "one_launch"
    if options.align_method == "auto":
        return "sort" if num_local * num_pairs >= options.sort_min_work else "scan"
    return options.align_method


def use_pair_store(options: TritonOptions, inter: int, rows_per_expert: float, mapped: bool) -> bool:
    """The "auto" rule of options.pair_store for a layer of intermediate size inter with
    rows_per_expert expected pairs per local expert (M * K / E global); mapped: an expert map is
    given (remote pairs would leave rows unwritten)."""
    return (not mapped and inter <= options.pair_store_max_inter
            and rows_per_expert >= options.pair_store_min_rows)


def resolve_pair_store(options: TritonOptions, inter: int, rows_per_expert: float, mapped: bool,
                       split_k: int) -> bool:
    """options.pair_store for one layer call: "auto" = `use_pair_store` with GEMM2's K unsplit
    (split_k == 1). Stored rows cannot be split over K, so True with split_k > 1 raises."""
    if options.pair_store == "auto":
        return split_k == 1 and use_pair_store(options, inter, rows_per_expert, mapped)
    if options.pair_store and split_k > 1:
        raise MoebenchError(f"pair_store stores whole rows: GEMM2 cannot split K ({split_k} splits asked); "
                            "give split_k=1 or pair_store=False")
    return bool(options.pair_store)


def use_swap_ab(options: TritonOptions, config: Mapping[str, int]) -> bool:
    """The "auto" rule of options.swap_ab for a block-scaled fp8 GEMM with tile `config`:
    BLOCK_SIZE_M 16 and BLOCK_SIZE_N >= options.swap_ab_min_cols."""
    return config["BLOCK_SIZE_M"] == 16 and config["BLOCK_SIZE_N"] >= options.swap_ab_min_cols


def resolve_swap_ab(options: TritonOptions, config: Mapping[str, int], scheme, use_tma: bool) -> bool:
    """options.swap_ab for one GEMM of a layer with fp8 scheme `scheme` (None: 16-bit) and tile
    `config`: fp8 (w8a8) weights only, and not with TMA weight tiles; "auto" = `use_swap_ab` for
    block scales, never for per-tensor / per-token ones."""
    if scheme is None or scheme.weight_only or use_tma:
        return False
    if options.swap_ab == "auto":
        return scheme.block_shape is not None and use_swap_ab(options, config)
    return bool(options.swap_ab)


# ---------------------------------------------------------------------------------------------
# GEMM2's K split: the cost model


def ctas_per_sm(cfg: Mapping[str, int], elem_bytes: int = 2) -> int:
    """Programs of a GEMM tile config resident per SM (Hopper: 228 KB shared memory, 64K registers),
    estimated from the pipeline's shared memory and the accumulator's registers."""
    bm, bn, bk, warps = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"], cfg["num_warps"]
    smem = cfg["num_stages"] * (bm + bn) * bk * elem_bytes
    regs = min(255, bm * bn // (32 * warps) + 48)  # fp32 accumulator + addressing
    return max(1, min(228 * 1024 // max(smem, 1), 65536 // (32 * warps * regs)))


def wave_split(tiles: int, steps: int, slots: int, max_split: int, overhead_steps: int) -> int:
    """The K split s (1..max_split) that minimises waves x (steps / s + overhead_steps) for `tiles`
    programs of `steps` K steps on `slots` resident programs; 1 unless it saves >= 3%.

    Example (Mixtral-8x7B, 1024 tokens): about 20 blocks x 16 hidden tiles = 320 programs of 224 K
    steps, one per SM at the 128 x 256 tile, run as 3 waves of which the last is 40% full; split in
    2 they are 5 waves of half the steps. Where the per-tile overhead outweighs the idle SMs (short
    K: Qwen3-30B, DeepSeek-V3) or the grid has many waves (Mixtral 4096) the split stays 1."""
    def cost(s: int) -> float:
        return math.ceil(tiles * s / slots) * (triton.cdiv(steps, s) + overhead_steps)

    best = min(range(1, max(1, max_split) + 1), key=lambda s: (cost(s), s))
    return best if cost(best) < 0.97 * cost(1) else 1


def choose_split_k(
    options: TritonOptions, est_blocks: int, hidden: int, inter: int, cfg: Mapping[str, int], num_sms: int,
    expected_blocks: float | None = None,
) -> int:
    """K splits of GEMM2 so that about 2 programs per SM run when the (block, hidden tile) grid
    alone is smaller (est_blocks: an upper estimate of the used blocks); each split keeps at least
    4 BLOCK_SIZE_K steps. A larger grid: 1, or with the expected block count the split `wave_split`
    picks for its waves (at least 16 steps per split)."""
    n_tiles = triton.cdiv(hidden, cfg["BLOCK_SIZE_N"])
    tiles = max(1, est_blocks) * n_tiles
    want = 2 * num_sms
    if tiles >= want:
        if expected_blocks is None:
            return 1
        steps = triton.cdiv(inter, cfg["BLOCK_SIZE_K"])
        return wave_split(max(1, math.ceil(expected_blocks)) * n_tiles, steps, num_sms * ctas_per_sm(cfg),
                          min(8, steps // 16), options.wave_tile_overhead_steps)
    max_split = max(1, inter // (4 * cfg["BLOCK_SIZE_K"]))
    return max(1, min(want // tiles, max_split))


def expected_blocks(pairs: int, num_local: int, block_size_m: int) -> float:
    """Blocks the alignment is expected to use for `pairs` pairs spread evenly over num_local
    experts: where an expert gets a block or more, its pairs / BLOCK_SIZE_M plus half a block of
    padding; below that one block per expert hit (Poisson: 1 - exp(-pairs per expert))."""
    n = pairs / max(num_local, 1)
    if n >= block_size_m:
        return num_local * (n / block_size_m + 0.5)
    return num_local * (1.0 - math.exp(-n))


def layer_split_k(options: TritonOptions, m: int, topk: int, num_experts: int, num_local: int, hidden: int,
                  inter: int, cfg: Mapping[str, int], max_blocks: int, num_sms: int) -> int:
    """GEMM2's K split for a layer of m tokens, top-k routing over num_experts (num_local here), from
    the expected pairs per local expert (no host sync: the routing is not read); `choose_split_k`,
    whose wave rule applies where experts fill their blocks (>= BLOCK_SIZE_M pairs each: the tiles
    are compute-bound, so an idle SM is lost time; below that the weights' stream sets the pace)."""
    pairs = triton.cdiv(m * topk * num_local, max(num_experts, 1))
    bm = cfg["BLOCK_SIZE_M"]
    est_blocks = min(max_blocks, triton.cdiv(pairs, bm) + min(num_local, pairs))
    expected = expected_blocks(pairs, num_local, bm) if pairs >= num_local * bm else None
    return choose_split_k(options, est_blocks, hidden, inter, cfg, num_sms, expected)
