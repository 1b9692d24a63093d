"""The choices of moebench's Triton kernels: one frozen `TritonOptions`, the rules that resolve it,
and the frozen `LayerPlan` a layer call's GEMMs run with.

Every code path the Triton experts can take is chosen here, by an argument, never by module
state: `TritonExperts(options=TritonOptions(...))`, `fused_moe(..., options=...)`. A benchmark
that compares two paths builds two options objects; a test names the path it checks. A field
set to "auto" is decided per call by a rule below, a pure function of the options and the shape,
config, dtype or device, and the numbers those rules compare against are fields too, so that a
benchmark can move them. The defaults are the paths measured fastest (PERF.md).

`plan_layer` resolves the options once per layer call into a `LayerPlan` (a `Gemm1Plan` and a
`Gemm2Plan`); the launchers (moebench.kernels.triton.launch) take the plan and derive no choice
of their own. The rules:

    resolve_use_tma     weight tiles through TMA descriptors
    gemm1_walk          GEMM1 as the paired walk (gate and up tiles, two dots per K step) or the
                        wide walk (one tile of both, one dot), and whether x comes through TMA
                        from a copy in sorted order (sorted_a; `use_sorted_a`)
    resolve_pdl         the alignment, GEMM1 and GEMM2 with programmatic dependent launch
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
from typing import Any, Mapping

import torch
import triton

from moebench.activation import SILU, Activation
from moebench.errors import MoebenchError
from moebench.kernels.triton.env import interpreting, num_sms, tma_ok
from moebench.kernels.triton.quant import check_block_config
from moebench.kernels.triton.wquant import check_wq_config
from moebench.quant import FP8_DTYPE, QuantScheme, scheme_of, stored

_AUTO_FIELDS = ("use_tma", "wide_gemm1", "sorted_a", "pdl", "direct_align", "token_rows", "pair_store", "swap_ab")
_ALIGN_METHODS = ("auto", "scan", "sort")
_16BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TritonOptions:
    """The Triton experts' choices (True / False / "auto" switches, then the thresholds of the
    "auto" rules)."""

    #: Weight tiles through TMA descriptors where the hardware has them (Hopper+). "auto"
    #: (`resolve_use_tma`): 16-bit inputs with BLOCK_SIZE_M >= 32; fp8 (w8a8) with
    #: tma_fp8_min_rows <= BLOCK_SIZE_M <= tma_fp8_max_rows.
    use_tma: bool | str = "auto"
    tma_fp8_min_rows: int = 64
    tma_fp8_max_rows: int = 64
    #: GEMM1's wide walk: gate and up as one (BK, BLOCK_SIZE_N) tile and one dot per K step (with TMA
    #: one (2, BN, BK) box of w13), instead of the paired walk's two tiles and two dots. "auto"
    #: (`gemm1_walk`): BLOCK_SIZE_M >= 64, unquantised, or fp8 with at least
    #: wide_fp8_block_min_rows (block scales) / wide_fp8_tensor_min_rows (tensor, token scales)
    #: pairs per expert. Weight-only: paired.
    wide_gemm1: bool | str = "auto"
    wide_fp8_block_min_rows: int = 128
    wide_fp8_tensor_min_rows: int = 32
    #: GEMM1 takes x's rows through TMA from a copy in sorted order (`sorted_rows`: one gather launch)
    #: instead of gathering them by pointer loads in its K loop; needs TMA, 16-bit inputs and the wide
    #: walk. "auto" (`use_sorted_a`): BLOCK_SIZE_M >= 64 and, expected per local expert, at least
    #: sorted_a_min_rows pairs, or sorted_a_wide_min_rows where I >= sorted_a_wide_inter (the copy's
    #: share of GEMM1 falls as 1 / I).
    sorted_a: bool | str = "auto"
    sorted_a_min_rows: int = 512
    sorted_a_wide_inter: int = 4096
    sorted_a_wide_min_rows: int = 256
    #: Programmatic dependent launch (Hopper+): the alignment, GEMM1 and GEMM2 launched with
    #: launch_pdl, each releasing the next as soon as its programs have started. "auto"
    #: (`resolve_pdl`): layers with intermediate size I <= pdl_max_inter. Never on other devices or
    #: under the interpreter.
    pdl: bool | str = "auto"
    pdl_max_inter: int = 1024
    #: `direct_align`: one block per pair, no alignment kernel. "auto" (`wants_direct_align`): one
    #: token (a token's top-k experts are distinct), except with an expert map where an fp8
    #: quantisation launch (block, token scales) sits between the GEMMs; more tokens up to
    #: direct_max_fill pairs per global expert without an expert map.
    direct_align: bool | str = "auto"
    direct_max_fill: float = 0.25
    #: `token_rows_align`: up to BLOCK_SIZE_M tokens, no alignment kernel: one block per local
    #: expert over all the tokens, each GEMM program finding its expert's tokens in topk_ids (one
    #: load of the routing tile). Blocks of experts no token reaches still launch, read the routing
    #: and exit. "auto" (`wants_token_rows`): where the direct alignment is not taken and
    #: M <= BLOCK_SIZE_M, by idle = E_local x exp(-M K / E), the local experts uniform routing
    #: leaves without a token in expectation: 16-bit weights up to token_rows_max_idle, or with at
    #: least token_rows_min_local local experts up to token_rows_max_idle_share of them; quantised
    #: weights up to token_rows_quant_max_idle. Never where pair_store or sorted_a is forced on
    #: (both need sorted pair rows).
    token_rows: bool | str = "auto"
    token_rows_max_idle: float = 1.0
    token_rows_min_local: int = 16
    token_rows_max_idle_share: float = 0.7
    token_rows_quant_max_idle: float = 4.0
    #: The alignment kernels (`align_kernels`): one launch up to one_launch_max_pairs pairs, above it
    #: two launches by align_method: "scan", "sort", or "auto" = sort where local experts x pairs
    #: >= sort_min_work.
    one_launch_max_pairs: int = 1024
    align_method: str = "auto"
    sort_min_work: int = 1 << 20
    #: GEMM2's K split where its grid runs in a few waves of long K loops (`wave_split`): a program's
    #: fixed cost (pipeline fill, epilogue, launch) in K steps of the main loop.
    wave_tile_overhead_steps: int = 7
    #: GEMM2 stores each pair's weighted row (M*K, H) in the output dtype and one more launch sums
    #: them over top-k (`topk_sum`), instead of adding them into an fp32 (M, H) accumulator by
    #: atomics (which GEMM1 then zeroes). "auto" (`use_pair_store`): where GEMM2's K loop is short
    #: (I <= pair_store_max_inter) and experts get at least pair_store_min_rows pairs each, with every
    #: pair local (no expert map) and GEMM2's K unsplit: there the atomic epilogue of every tile
    #: outweighs its few K steps.
    pair_store: bool | str = "auto"
    pair_store_max_inter: int = 1024
    pair_store_min_rows: int = 32
    #: fp8 GEMMs compute each tile as w^T x^T into a (BLOCK_SIZE_N, BLOCK_SIZE_M) accumulator, so the
    #: weight columns fill the MMA's M side (wgmma's M is 64) where a block has few rows. "auto"
    #: (`use_swap_ab`): block scales, 16-row tiles at least swap_ab_min_cols wide, pointer weight
    #: tiles.
    swap_ab: bool | str = "auto"
    swap_ab_min_cols: int = 128
    #: fp8 block scale groups each K step of GEMM1's paired walk takes (two: two BLOCK_SIZE_K-wide
    #: loads, dots and scalings per iteration, twice the bytes of each weight row per step). "auto"
    #: (`resolve_k_groups`): 2 at 16-row tiles with pointer weight tiles where H >=
    #: fp8_k_groups_min_hidden and is a multiple of 2 x BLOCK_SIZE_K, with at most
    #: fp8_k_groups_max_rows pairs per expert; else 1.
    fp8_k_groups: int | str = "auto"
    fp8_k_groups_min_hidden: int = 4096
    fp8_k_groups_max_rows: float = 0.5
    #: batched-triton's default heuristic keeps 64-row tiles up to this many rows per expert where
    #: the sorted-token heuristic takes 128-row ones (`batched.batched_default_config`).
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
# The plan of one layer call


@dataclass(frozen=True)
class Gemm1Plan:
    """GEMM1's resolved code paths (what `launch.launch_gemm1` runs)."""

    use_tma: bool = False  # weight tiles through TMA (the device checked)
    wide: bool = False  # the wide walk (one tile of gate and up, one dot), else the paired walk
    sorted_a: bool = False  # x copied into sorted order and read through TMA (the wide walk with TMA)
    swap_ab: bool = False  # fp8 dots as w^T x^T into a transposed accumulator
    k_groups: int = 1  # K steps per iteration of the paired walk
    pdl: bool = False  # launched with programmatic dependent launch


@dataclass(frozen=True)
class Gemm2Plan:
    """GEMM2's resolved code paths (what `launch.launch_gemm2` runs)."""

    use_tma: bool = False  # w2's tiles through TMA (the device checked)
    swap_ab: bool = False
    pair_store: bool = False  # each pair's row stored and summed by `topk_sum`, not the fp32 atomics
    split_k: int = 1  # K splits asked (the launcher clamps them to whole BLOCK_SIZE_K steps)
    pdl: bool = False


@dataclass(frozen=True)
class LayerPlan:
    """Everything the two GEMMs of one layer call run with, resolved once by `plan_layer`."""

    gemm1: Gemm1Plan
    gemm2: Gemm2Plan
    config: Mapping[str, Any]  # GEMM1's tile config
    down_config: Mapping[str, Any]  # GEMM2's (GEMM1's where it has none of its own)
    out_dtype: torch.dtype  # the layer's output (and, for fp8, its intermediate's) dtype
    fp8_out: bool  # per-tensor fp8: GEMM1 stores the intermediate quantised with w2.input_scale
    activation: Activation = SILU


def plan_layer(options: TritonOptions | None, x: torch.Tensor, w13, w2, align, topk: int, config: Mapping[str, Any],
               down_config: Mapping[str, Any] | None = None, split_k: int | None = None, *,
               a_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               num_experts: int | None = None, activation: Activation = SILU, pdl: bool | None = None) -> LayerPlan:
    """The LayerPlan of a layer call on aligned pairs (`align`: an align.AlignResult): x (M, H),
    w13 (E_local, 2I, H), w2 (E_local, H, I), top-k routing over num_experts global experts (None:
    E_local), GEMM1's tile `config` and GEMM2's own `down_config` (None: `config`; its optional
    USE_TMA decides GEMM2's TMA instead of the options). split_k: GEMM2's K splits (None:
    `layer_split_k`, 1 where pair_store is forced on); pdl: the choice the alignment was launched
    with (None: `resolve_pdl`). Raises MoebenchError for inputs the kernels cannot run.

    Resolved here: TMA weight tiles (`resolve_use_tma` on GEMM1's config, where the device has
    TMA), GEMM1's walk and sorted_a (`gemm1_walk`; pairs per expert M * K / num_experts), PDL,
    GEMM2's sum over top-k (`resolve_pair_store`), the fp8 dots' operand order (`resolve_swap_ab`),
    GEMM1's K groups (`resolve_k_groups`). swigluoai's interleaved w13 runs the paired walk
    without TMA (GEMM2 keeps its choice), unquantised or weight-only. The token-rows layout has no
    sorted pair rows: pair_store and sorted_a are off there (forced on: an error).

    fp8 (w13, w2 QuantWeights of one scheme): x float8_e4m3fn with a_scale (M, G); out_dtype
    defaults to bf16. Weight-only and unquantised: the output in x's dtype."""
    options = options or TritonOptions()
    m, h = x.shape
    e_local, n_inter = w13.shape[0], w2.shape[2]
    scheme = scheme_of(w13)
    if scheme is not None and scheme.weight_only:
        check_wq_config(config, scheme, "triton experts")
        if down_config is not None:
            check_wq_config(down_config, scheme, "triton experts (GEMM2)")
        if x.dtype != w13.act_dtype or a_scale is not None:
            raise MoebenchError(f"{scheme.name} triton experts take unquantised {w13.act_dtype} x (the dtype its "
                                f"weights were quantised for), got {x.dtype}")
        out_dtype = x.dtype
        use_tma = False
    elif scheme is not None:
        out_dtype = out_dtype or torch.bfloat16
        check_block_config(config, scheme, "triton experts", x.device)
        if down_config is not None:
            check_block_config(down_config, scheme, "triton experts (GEMM2)", x.device)
        if a_scale is None or x.dtype != FP8_DTYPE:
            raise MoebenchError("fp8 triton experts need x as float8_e4m3fn with its a_scale")
        if scheme.scales == "tensor" and w2.input_scale is None:
            raise MoebenchError("per-tensor fp8 needs w2.input_scale (moebench.quant.quantize_weights sets it)")
        use_tma = resolve_use_tma(options, config, x.dtype)
    else:
        out_dtype = x.dtype
        use_tma = resolve_use_tma(options, config, x.dtype)
    if down_config is not None and down_config["BLOCK_SIZE_M"] != config["BLOCK_SIZE_M"]:
        raise MoebenchError(f"GEMM2's config has BLOCK_SIZE_M {down_config['BLOCK_SIZE_M']}, GEMM1's "
                            f"{config['BLOCK_SIZE_M']}: both GEMMs share one alignment")
    fp8 = scheme is not None and not scheme.weight_only
    if activation.interleaved and fp8:
        raise MoebenchError("triton experts: swigluoai's interleaved w13 runs unquantised or weight-only (not fp8)")
    use_tma = use_tma and tma_ok(stored(w13)) and tma_ok(stored(w2))
    num_experts = num_experts or e_local
    rows_per_expert = m * topk / num_experts
    cfg2 = down_config if down_config is not None else config
    if split_k is None:
        split_k = 1 if options.pair_store is True else layer_split_k(
            options, m, topk, num_experts, e_local, h, n_inter, cfg2, align.max_blocks, num_sms(x.device))
    pair_store = resolve_pair_store(options, n_inter, rows_per_expert, align.remote, split_k)
    if align.token_rows and pair_store:
        if options.pair_store is True:
            raise MoebenchError("pair_store stores one row per pair, which the token-rows layout does not have: "
                                "give token_rows=False or pair_store=False")
        pair_store = False
    if pdl is None:
        pdl = resolve_pdl(options, x.device, n_inter)
    wide, sorted_a = gemm1_walk(options, config, x.dtype, scheme, use_tma, n_inter, rows_per_expert)
    if align.token_rows and sorted_a:
        if options.sorted_a is True:
            raise MoebenchError("sorted_a copies x into sorted pair order, which the token-rows layout does not have: "
                                "give token_rows=False or sorted_a=False")
        sorted_a = False
    tma1 = use_tma
    if activation.interleaved:
        wide = sorted_a = tma1 = False
    gemm1 = Gemm1Plan(use_tma=tma1, wide=wide, sorted_a=sorted_a, swap_ab=resolve_swap_ab(options, config, scheme, tma1),
                      k_groups=resolve_k_groups(options, config, scheme, tma1, wide, h, rows_per_expert), pdl=pdl)
    tma2 = use_tma
    if down_config is not None and "USE_TMA" in down_config:
        tma2 = bool(down_config["USE_TMA"]) and not (scheme is not None and scheme.weight_only) and tma_ok(stored(w2))
    gemm2 = Gemm2Plan(use_tma=tma2, swap_ab=resolve_swap_ab(options, cfg2, scheme, tma2), pair_store=pair_store,
                      split_k=split_k, pdl=pdl)
    return LayerPlan(gemm1, gemm2, config, cfg2, out_dtype, fp8 and scheme.scales == "tensor", activation)


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
