"""`triton` experts: moebench's sorted-token fused MoE kernel (Standard format).

    align   moe_align_block_size: (token, k) pairs grouped by local expert in blocks of
            BLOCK_SIZE_M (moebench.kernels.moe_align; 2 small kernels, no host sync)
    GEMM1   per (block, intermediate tile): gate and up tiles of w13 in the same K loop, then
            SiLU(gate) * up in the epilogue -> inter (max_padded, I), rows in sorted order
    GEMM2   per (block, hidden tile[, K split]): inter @ w2[e]^T, times the router weight, then a
            relaxed fp32 atomic add into ws (M, H): the sum over top-k happens here
    cast    ws -> output dtype

So the experts return (M, H), weighted and summed (TopKWeightAndReduceNoOp): one write of the
output instead of (M, K, H) plus a reduction pass. Pairs whose expert is remote are left out by
the alignment and add nothing; ws starts at zero, so every token's row is written, also when all
its experts are remote. Accumulation is fp32 for every input dtype; fp32 inputs use IEEE dots
(no tf32). Under the Triton interpreter, 16-bit operands are upcast to fp32 before `tl.dot`.

Tile configs: `moebench.tuning.configs.lookup_config` (tuned file, else the default heuristic),
or an explicit `config=` given to `TritonExperts`. In GEMM1, BLOCK_SIZE_N is the total width of
one program's output tile: half gate, half up columns (the same register budget as vLLM's
unfused GEMM1 with that config). GEMM2 may split its K loop (I) over programs when there are too
few output tiles to fill the GPU (`split_k`, chosen from the SM count unless given).

fp8_w8a8 (QuantWeight weights, every scale kind of moebench.quant): x arrives quantised
(float8_e4m3fn + per-row scales, from prepare or `fused_moe`); the GEMMs dot fp8 operands with
fp32 accumulation. tensor/token scales multiply the accumulator in the epilogue (x's row scale
times the weight's channel scale, gate row n and up row I + n each their own); block scales
multiply each K step's dot (BLOCK_SIZE_K divides bk, so one scale column per step; any
BLOCK_SIZE_N, the scale is read per column n // bn). The intermediate is stored in the layer's
dtype (bf16/fp16), quantised with the same scheme by moebench.kernels.fp8_quant (w2.input_scale
for per tensor; only rows < num_tokens_post_padded, read on the device), then GEMM2 as before;
the output is in the layer's dtype. No TMA for fp8. Accuracy on Hopper: tensor/token scales
accumulate the whole K loop in the fp8 MMA accumulator, which wgmma keeps at reduced precision
(as vLLM's Triton kernel does; about 1-1.5e-2 from the emulating reference at Qwen3 / DeepSeek
shapes with M >= 64 tiles, H200); block scales add each K step's dot in fp32 (<= 5e-3). Under
the interpreter, fp8 operands are upcast like 16-bit ones and the bf16 stores round to nearest
even explicitly (the interpreter's cast truncates), so the kernels match the reference's
rounding points.

Options (kept as constexpr variants, measured in PERF.md section 3): `use_tma` loads the
weight tiles through TMA tensor descriptors on Hopper+ (default "auto": 16-bit inputs with
BLOCK_SIZE_M >= 32); `atomic=False` writes weighted rows per pair and sums over K with torch
instead of the atomic epilogue; `half` gives blocks whose pairs fit in their first half a
half-height tile (DEFAULT_HALF_BLOCKS, off: measured a loss); `sorted_a` copies x's rows into
sorted order first (`sorted_rows`, one launch) so that GEMM1 loads its A tiles through TMA too
(DEFAULT_SORTED_A "auto": prefill with many pairs per expert); where TMA is on, GEMM1's wide walk
takes its gate+up weight tile as one TMA box (DEFAULT_WIDE_TMA, on), with sorted_a its A tiles
too. GEMM2's K split (`layer_split_k`) also splits where its grid runs in a few waves of long K
loops (DEFAULT_WAVE_SPLIT, on). Also here: `fused_topk_softmax`, softmax top-k routing in one
launch (the benchmark's routing step).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moebench.errors import MoebenchError
from moebench.kernels.fp8_quant import check_block_config, quant_group, quant_meta, quantize_rows
from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    PrepareResult,
    TopKWeightAndReduceNoOp,
    alloc_output,
)
from moebench.kernels.moe_align import (
    AlignResult,
    direct_align,
    interpreter_compat,
    interpreting,
    moe_align_block_size,
    triton_unavailable_reason,
    use_direct_align,
)
from moebench.kernels.registry import register_experts
from moebench.kernels.triton_common import (
    block_expert,
    cast_rne,
    dequant,
    gate_up_mainloop,
    grouped_tile,
    pdl_launch_args,
    pdl_release,
    pdl_wait,
    scale_ptrs,
    scaled_mma,
    second_half_empty,
    tile_rows,
)
from moebench.quant import FP8_DTYPE, SCALES, QuantWeight, scheme_of
from moebench.tuning.configs import TileConfig, device_name, lookup_config, lookup_down_config, validate_tile_config

#: Weight tiles through TMA descriptors where the hardware has them (fused_moe_gemms): True,
#: False, or "auto" = for 16-bit inputs with BLOCK_SIZE_M >= 32 (on an H200, same-config A/B:
#: 1-13% faster at >= 1024 tokens with 128-row tiles, one point 5% slower; within +-1% for
#: BLOCK_SIZE_M = 32; mixed for 16; PERF.md section 3).
DEFAULT_USE_TMA: bool | str = "auto"
#: Sum over top-k by fp32 atomic adds in GEMM2 (else per-pair rows + a torch sum over K).
DEFAULT_ATOMIC = True
#: Launch trimming for decode (timed on the H200 2026-11-29, PERF.md section 3):
#: - alignment: True / False / "auto" = `direct_align` (one block per pair, no alignment kernels)
#:   where `use_direct_align` says the pairs hit nearly distinct experts (one token): -12% of the
#:   layer at Qwen3-30B-A3B M=1, -1.6% at Mixtral M=1;
#: - GEMM2's atomic accumulator zeroed by GEMM1's programs instead of a memset launch (-0.3 to -5%).
DEFAULT_DIRECT_ALIGN: bool | str = "auto"
DEFAULT_ZERO_IN_GEMM1 = True
#: GEMM1 loads the gate and up tiles as one (BK, BLOCK_SIZE_N) tile and does one dot (`wide`; its
#: weights then load without TMA). "auto": for 16-bit inputs with BLOCK_SIZE_M >= 64, where it
#: measured 1-4% faster layers (GEMM1 alone up to 6% faster: it closes the gap to the vLLM-style
#: GEMM1); at BLOCK_SIZE_M 16/32 it measured -0.1% to +1%.
DEFAULT_WIDE_GEMM1: bool | str = "auto"
#: With TMA, GEMM2 also loads its A tiles (inter's rows of a block are contiguous) through TMA:
#: measured mixed (-3% at Mixtral 256, +1 to +6% at 4096 tokens), so off.
DEFAULT_TMA_GEMM2_A = False
#: fp8 with per-tensor scales: GEMM1 stores the intermediate as fp8 with w2's static input scale
#: (bit for bit the two-step result) instead of a bf16 store and a quantisation launch: -4 to -39%
#: of the layer at 1 and 16 tokens.
DEFAULT_FUSE_FP8_INTER = True
#: Programmatic dependent launch (Hopper+): GEMM1 and GEMM2 are launched with launch_pdl and GEMM1
#: releases GEMM2 as soon as all its programs have started, so GEMM2's launch and first index work
#: overlap GEMM1's last wave. True / False / "auto" = on CUDA devices of compute capability >= 9
#: for layers with intermediate size I <= PDL_MAX_INTER. Same-run A/B on an H200 (PERF.md section
#: 3): 0.94-0.998 of the layer at 1-256 tokens of Qwen3-30B-A3B (I = 768) and Qwen3-Next (512),
#: a loss at 1-4 tokens of Mixtral (14336: 1.03-1.12) and DeepSeek-V3 EP8 (2048, 1-2 tokens:
#: 1.03-1.07). Prefetching GEMM2's weights into L2 before the wait, and releasing GEMM2 only after
#: GEMM1's epilogue, both measured slower (not kept).
DEFAULT_PDL: bool | str = "auto"
PDL_MAX_INTER = 1024
#: Where PDL is on, the routing and the one-launch alignment join the chain: the routing kernel
#: lets the next kernel launch as soon as it starts (GEMM1 after a direct alignment, which waits
#: for it), and the alignment kernel is launched with PDL, waits for the routing, then lets GEMM1
#: launch. (The alignment's used-length buffer is no longer zeroed by a memset launch either way.)
DEFAULT_PDL_EARLY = True
#: The lookup reads GEMM2's own config from a `_down.json` file when there is one (False: GEMM2
#: always runs with GEMM1's config, as vLLM does).
DEFAULT_DOWN_FILES = True
#: Half-height tiles for part-filled blocks (`HALF` in both GEMM kernels): a block whose pairs fit
#: in its first BLOCK_SIZE_M / 2 rows (an expert's last block; every block where an expert gets
#: about BLOCK_SIZE_M / 2 pairs, e.g. 128-row tiles at ~64 pairs per expert) runs a tile of half
#: the rows: half the MMAs, the same weight tiles. The check reads the block's second half of
#: sorted ids. 16-bit inputs with BLOCK_SIZE_M >= 32 only; GEMM2 keeps whole tiles when its A
#: tiles come through TMA. Measured on an H200 (PERF.md section 3, tenth session): -4% of the
#: layer at Qwen3-30B 1024 / 4096 tokens, but +4% / +10% at 1024 tokens of Mixtral / DeepSeek-V3's
#: 32 experts, where nearly no block is half-height: so off.
DEFAULT_HALF_BLOCKS = False
#: GEMM1 takes x's rows through TMA from a copy in sorted order (`sorted_rows`: one gather launch,
#: 2 x rows x H elements of traffic) with the paired walk's TMA weight tiles, instead of gathering
#: them by pointer loads in the K loop. True / False / "auto" = 16-bit inputs with TMA,
#: BLOCK_SIZE_M >= 64 and, expected per local expert, at least SORTED_A_MIN_ROWS pairs, or
#: SORTED_A_WIDE_MIN_ROWS where I >= SORTED_A_WIDE_INTER (the copy's share of GEMM1 falls as 1 / I).
#: Layer with / without, same run, H200 (PERF.md section 3, tenth session): Mixtral (I = 14336)
#: 0.923-0.953 at 1024 tokens (256 pairs per expert), 0.937-0.939 at 4096; DeepSeek-V3's 32 experts
#: (I = 2048) 0.926-0.946 at 4096 tokens (1024 per expert) but 1.006-1.037 at 1024 (256);
#: Qwen3-30B (I = 768) 0.94-1.09 over four runs at 4096 tokens (256: neutral within its noise),
#: 1.08-1.10 at 1024 (64).
DEFAULT_SORTED_A: bool | str = "auto"
SORTED_A_MIN_ROWS = 512
SORTED_A_WIDE_INTER = 4096
SORTED_A_WIDE_MIN_ROWS = 256


#: The wide GEMM1 (one (BK, 2 BN) weight tile of gate and up, one dot) loads that tile through TMA
#: where TMA is on, as one (2, BN, BK) box of w13 viewed as (2 E_local, I, H), instead of by pointer
#: loads; with `sorted_a` its A tiles come through TMA as well, so GEMM1 runs one 128 x 256 MMA per
#: K step from shared memory instead of the paired walk's two 128 x 128 ones (which read A twice).
#: Layer with / without, H200, eleventh session (PERF.md section 3; medians of 5 interleaved
#: rounds, noise 1-4% at prefill): Mixtral 1024 / 4096 tokens 0.967 / 0.979, Qwen3-30B 4096 0.961,
#: DeepSeek-V3's 32 experts 1024 0.936 (0.948 in a second run), EP8 4096 0.961; 0.988-0.996 at
#: 256-1024 tokens elsewhere; decode (16- and 32-row tiles) unchanged.
DEFAULT_WIDE_TMA = True


def use_sorted_a(sorted_a: bool | str | None, config: Mapping[str, int], dtype: torch.dtype, n_inter: int,
                 rows_per_expert: float) -> bool:
    """Resolve the sorted_a option (None: DEFAULT_SORTED_A) for one layer of intermediate size
    n_inter; rows_per_expert is the expected number of pairs per local expert (M * K / E global)."""
    sorted_a = DEFAULT_SORTED_A if sorted_a is None else sorted_a
    if sorted_a == "auto":
        rows = SORTED_A_WIDE_MIN_ROWS if n_inter >= SORTED_A_WIDE_INTER else SORTED_A_MIN_ROWS
        return dtype in (torch.float16, torch.bfloat16) and config["BLOCK_SIZE_M"] >= 64 and rows_per_expert >= rows
    return bool(sorted_a)


def gemm1_walk(config: Mapping[str, int], dtype: torch.dtype, quantized: bool, use_tma: bool, n_inter: int,
               rows_per_expert: float, wide: bool | str | None = None,
               sorted_a: bool | str | None = None) -> tuple[bool, bool]:
    """(wide, sorted_a) that GEMM1 runs with, from the options (None: DEFAULT_WIDE_GEMM1 /
    DEFAULT_SORTED_A). "auto" wide: unquantised with BLOCK_SIZE_M >= 64; "auto" sorted_a:
    `use_sorted_a`, where TMA is on (use_tma), the weights are not quantised and no wide GEMM1 was
    asked for by name. sorted_a=True where it cannot run raises MoebenchError. With
    DEFAULT_WIDE_TMA the wide walk loads through TMA and runs with sorted_a (both are kept);
    without it sorted_a takes the paired walk."""
    wide = DEFAULT_WIDE_GEMM1 if wide is None else wide
    wide_tma = bool(DEFAULT_WIDE_TMA) and use_tma and not quantized
    wide_asked = wide is True and not wide_tma  # a wide pointer-load GEMM1 asked for by name: "auto" sorted_a yields
    if wide == "auto":
        wide = not quantized and config["BLOCK_SIZE_M"] >= 64
    asked = DEFAULT_SORTED_A if sorted_a is None else sorted_a
    sorted_a = use_sorted_a(asked, config, dtype, n_inter, rows_per_expert)
    if sorted_a and (quantized or not use_tma or wide_asked):
        if asked != "auto":
            raise MoebenchError("sorted_a needs 16-bit inputs on a device with TMA (use_tma), and not wide=True")
        sorted_a = False
    return bool(wide) and (wide_tma or not sorted_a), sorted_a


@triton.jit
def _silu_mul_gemm1_kernel(
    x_ptr,  # (M, H)
    x_desc,  # A_TMA: TMA descriptor of x's rows in sorted order (max_padded, H), block (BLOCK_SIZE_M, BLOCK_SIZE_K)
    w13_ptr,  # (E_local, 2I, H)
    w13_desc,  # TMA descriptor of w13 as (E_local * 2I, H), block (BLOCK_SIZE_N, BLOCK_SIZE_K); USE_TMA only
    inter_ptr,  # (max_padded, I) out, rows in sorted order
    sorted_ids_ptr,  # (max_padded,) flat pair ids, sentinel = num_pairs
    expert_ids_ptr,  # (max_blocks,) local expert per block (MAPPED: global id)
    expert_map_ptr,  # MAPPED: (E,) global -> local expert, -1 = remote
    ntpp_ptr,  # (1,) used length of sorted_ids
    a_scale_ptr,  # QUANT: (M, G) fp32 dequantisation scales of x's rows (stride 0 over rows: per tensor)
    w_scale_ptr,  # QUANT: scales of w13 (see stride_ws*)
    zero_ptr,  # ZERO_OUT: fp32 buffer zeroed here (GEMM2's atomic accumulator), zero_numel elements
    zero_numel,
    out_scale_ptr,  # QUANT_OUT: (1,) fp32 static scale of the intermediate (per-tensor fp8)
    num_pairs,
    N_INTER,  # I
    H,
    num_blocks_m,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_im,
    stride_in,
    stride_asm,
    stride_asg,
    stride_wse,  # w13 scale of (expert, row n, K group): e * stride_wse + n' * stride_wsn + g * stride_wsk,
    stride_wsn,  # n' = n (QUANT 1) or n // GROUP_N (QUANT 2); 0 for broadcast dimensions
    stride_wsk,
    TOPK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,  # intermediate columns per program (gate and up each)
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: 16-bit operands -> fp32 before tl.dot
    IEEE_DOT: tl.constexpr,  # fp32 operands: full-precision dot, no tf32
    USE_TMA: tl.constexpr,  # weight tiles through the tensor-memory accelerator (Hopper+)
    QUANT: tl.constexpr = 0,  # fp8: 0 none; 1 per-row x per-channel scales (tensor/token) in the
    #                           epilogue; 2 block scales [GROUP_N, GROUP_K] applied per K step
    GROUP_N: tl.constexpr = 1,
    GROUP_K: tl.constexpr = 1,  # QUANT 2: a multiple of BLOCK_SIZE_K
    ZERO_OUT: tl.constexpr = False,
    WIDE: tl.constexpr = False,  # gate and up tiles loaded as one (BK, 2 BN) tile, one dot (no TMA)
    QUANT_OUT: tl.constexpr = False,  # store the intermediate as per-tensor fp8 (inter_ptr is fp8)
    ACT_DTYPE: tl.constexpr = tl.bfloat16,  # QUANT_OUT: the activation dtype it is rounded to first
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see pdl_wait)
    MAPPED: tl.constexpr = False,  # expert_ids are global ids, mapped through expert_map (direct_align)
    HALF: tl.constexpr = False,  # a block whose pairs fit in its first half runs a half-height tile
    A_TMA: tl.constexpr = False,  # with USE_TMA: A tiles from x_desc (x gathered into sorted order), not x_ptr
):
    # Program id -> (block of sorted pairs, intermediate tile), grouped for L2 reuse of weights.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N_INTER, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_SIZE_M)
    # Everything here reads the routing or alignment just before: wait for it (PDL), then let
    # GEMM2 launch while this kernel runs.
    pdl_wait(PDL)
    pdl_release(PDL)

    # GEMM2's accumulator is zeroed here, 1024 elements per program in a grid-stride loop, instead
    # of by a memset launch of its own; before the early exit, so that every program takes part.
    if ZERO_OUT:
        offs_z = tl.arange(0, 1024)
        for z in range(pid * 1024, zero_numel, tl.num_programs(0) * 1024):
            tl.store(zero_ptr + z + offs_z, tl.zeros((1024,), tl.float32), mask=z + offs_z < zero_numel)

    # Blocks past the used length (padding of the worst-case grid) and blocks of a remote expert
    # (direct_align) have nothing to do.
    expert = block_expert(pid_m, ntpp_ptr, expert_ids_ptr, expert_map_ptr, BLOCK_SIZE_M, False, MAPPED)
    if expert < 0:
        return

    # HALF: the block's pairs may fill only part of it (an expert's last block); when its second
    # half holds only sentinels, a half-height tile does the same work with half the MMAs.
    if HALF and second_half_empty(pid_m, sorted_ids_ptr, num_pairs, BLOCK_SIZE_M):
        _gemm1_tile(x_ptr, x_desc, w13_ptr, w13_desc, inter_ptr, sorted_ids_ptr, a_scale_ptr, w_scale_ptr, out_scale_ptr,
                    num_pairs, N_INTER, H, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
                    stride_asm, stride_asg, stride_wse, stride_wsn, stride_wsk, expert, pid_m * BLOCK_SIZE_M, pid_n,
                    TOPK, BLOCK_SIZE_M // 2, BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K, UPCAST, IEEE_DOT, USE_TMA, QUANT, GROUP_N,
                    GROUP_K, WIDE, QUANT_OUT, ACT_DTYPE, A_TMA)
    else:
        _gemm1_tile(x_ptr, x_desc, w13_ptr, w13_desc, inter_ptr, sorted_ids_ptr, a_scale_ptr, w_scale_ptr, out_scale_ptr,
                    num_pairs, N_INTER, H, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
                    stride_asm, stride_asg, stride_wse, stride_wsn, stride_wsk, expert, pid_m * BLOCK_SIZE_M, pid_n,
                    TOPK, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K, UPCAST, IEEE_DOT, USE_TMA, QUANT, GROUP_N,
                    GROUP_K, WIDE, QUANT_OUT, ACT_DTYPE, A_TMA)


@triton.jit
def _gemm1_tile(
    x_ptr, x_desc, w13_ptr, w13_desc, inter_ptr, sorted_ids_ptr, a_scale_ptr, w_scale_ptr, out_scale_ptr, num_pairs, N_INTER, H,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_im, stride_in, stride_asm, stride_asg,
    stride_wse, stride_wsn, stride_wsk,
    expert,  # local expert of the rows
    row0,  # first sorted row of the tile
    pid_n,  # intermediate tile
    TOPK: tl.constexpr,
    ROWS: tl.constexpr,  # rows of the tile (BLOCK_SIZE_M, or half of it)
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    WIDE: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    A_TMA: tl.constexpr,
):
    """GEMM1's work on ROWS sorted rows from row0 (arguments as _silu_mul_gemm1_kernel's)."""
    # Rows: the pairs of this block; token = pair // K; sentinel rows load zeros.
    offs_m, pair, row_ok, token = tile_rows(row0, sorted_ids_ptr, num_pairs, TOPK, ROWS)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < N_INTER
    offs_k = tl.arange(0, BLOCK_SIZE_K)

    # A (BM, BK): the rows of x; x's row scales (fp8). Then the K loop over w13's gate and up rows.
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    as_ptrs = a_scale_ptr + token * stride_asm
    acc_g, acc_u = gate_up_mainloop(
        a_ptrs, stride_xk, row_ok, x_desc, row0, w13_ptr, w13_desc, expert, stride_we, stride_wn, stride_wk,
        pid_n * BLOCK_SIZE_N, N_INTER, H, as_ptrs, stride_asg, w_scale_ptr, stride_wse, stride_wsn, stride_wsk,
        ROWS, BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K, UPCAST, IEEE_DOT, USE_TMA, WIDE, QUANT, GROUP_N, GROUP_K, A_TMA)

    # Epilogue: SiLU(gate) * up, stored at the block's sorted rows (sentinel rows hold zeros).
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    i_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_n[None, :] * stride_in
    if QUANT_OUT:
        # Per-tensor fp8 intermediate, quantised here instead of by its own launch: rounded to the
        # activation dtype first, as the two-step path stores it, then clamp(h / s) to e4m3.
        h = cast_rne(h, ACT_DTYPE, UPCAST).to(tl.float32)
        s = tl.full((ROWS,), 1.0, tl.float32) * tl.load(out_scale_ptr)
        quant_group(h, s, i_ptrs, (offs_m >= 0)[:, None] & col_ok[None, :], UPCAST)
    else:
        tl.store(i_ptrs, cast_rne(h, inter_ptr.dtype.element_ty, QUANT != 0 and UPCAST), mask=col_ok[None, :])


@triton.jit
def _gemm2_weighted_sum_kernel(
    inter_ptr,  # (max_padded, I)
    inter_desc,  # TMA descriptor of inter, block (BLOCK_SIZE_M, BLOCK_SIZE_K); A_TMA only
    w2_ptr,  # (E_local, H, I)
    w2_desc,  # TMA descriptor of w2 as (E_local * H, I), block (BLOCK_SIZE_N, BLOCK_SIZE_K); USE_TMA only
    ws_ptr,  # ATOMIC: (M, H) fp32, zeroed; else (M*K, H) in the input dtype, one row per pair; out
    topk_weights_ptr,  # (M*K,) router weights of the flat pairs
    sorted_ids_ptr,
    expert_ids_ptr,
    expert_map_ptr,  # MAPPED: as in GEMM1
    ntpp_ptr,
    a_scale_ptr,  # QUANT: (max_padded, G) fp32 scales of inter's sorted rows (stride 0 over rows: per tensor)
    w_scale_ptr,  # QUANT: scales of w2
    num_pairs,
    H,
    N_INTER,  # I, the K dimension of this GEMM
    num_blocks_m,
    k_per_split,  # multiple of BLOCK_SIZE_K
    stride_im,
    stride_ik,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wsm,
    stride_wsn,
    stride_asm,
    stride_asg,
    stride_bse,  # w2 scales, as stride_ws* in GEMM1
    stride_bsn,
    stride_bsk,
    TOPK: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    ATOMIC: tl.constexpr,  # sum over top-k by atomic add (else: weighted rows per pair, summed later)
    QUANT: tl.constexpr = 0,  # as in GEMM1
    GROUP_N: tl.constexpr = 1,
    GROUP_K: tl.constexpr = 1,
    A_TMA: tl.constexpr = False,  # with USE_TMA: inter's tiles through TMA too (k_per_split % BLOCK_SIZE_K == 0)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see pdl_wait)
    MAPPED: tl.constexpr = False,  # as in GEMM1
    HALF: tl.constexpr = False,  # as in GEMM1 (not with A_TMA: its descriptor's block is BLOCK_SIZE_M rows)
):
    # Program id -> (block, hidden tile) grouped as in GEMM1; axis 1 = K split.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(H, BLOCK_SIZE_N)
    pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_SIZE_M)

    # With PDL this runs while GEMM1 finishes. The alignment (two kernels back) is complete, since
    # GEMM1 waited for it before letting this kernel launch: read the block's expert from L2.
    # Nothing GEMM1 writes is touched before pdl_wait.
    expert = block_expert(pid_m, ntpp_ptr, expert_ids_ptr, expert_map_ptr, BLOCK_SIZE_M, PDL, MAPPED)
    if expert < 0:  # unused padding block, or a remote expert (direct_align)
        return
    pdl_wait(PDL)
    pdl_release(PDL)

    if HALF and second_half_empty(pid_m, sorted_ids_ptr, num_pairs, BLOCK_SIZE_M):
        _gemm2_tile(inter_ptr, inter_desc, w2_ptr, w2_desc, ws_ptr, topk_weights_ptr, sorted_ids_ptr, a_scale_ptr,
                    w_scale_ptr, num_pairs, H, N_INTER, k_per_split, stride_im, stride_ik, stride_we, stride_wn,
                    stride_wk, stride_wsm, stride_wsn, stride_asm, stride_asg, stride_bse, stride_bsn, stride_bsk,
                    expert, pid_m * BLOCK_SIZE_M, pid_n, pid_k, TOPK, BLOCK_SIZE_M // 2, BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K,
                    UPCAST, IEEE_DOT, USE_TMA, ATOMIC, QUANT, GROUP_N, GROUP_K, A_TMA)
    else:
        _gemm2_tile(inter_ptr, inter_desc, w2_ptr, w2_desc, ws_ptr, topk_weights_ptr, sorted_ids_ptr, a_scale_ptr,
                    w_scale_ptr, num_pairs, H, N_INTER, k_per_split, stride_im, stride_ik, stride_we, stride_wn,
                    stride_wk, stride_wsm, stride_wsn, stride_asm, stride_asg, stride_bse, stride_bsn, stride_bsk,
                    expert, pid_m * BLOCK_SIZE_M, pid_n, pid_k, TOPK, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, EVEN_K,
                    UPCAST, IEEE_DOT, USE_TMA, ATOMIC, QUANT, GROUP_N, GROUP_K, A_TMA)


@triton.jit
def _gemm2_tile(
    inter_ptr, inter_desc, w2_ptr, w2_desc, ws_ptr, topk_weights_ptr, sorted_ids_ptr, a_scale_ptr, w_scale_ptr,
    num_pairs, H, N_INTER, k_per_split, stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_wsm,
    stride_wsn, stride_asm, stride_asg, stride_bse, stride_bsn, stride_bsk,
    expert,
    row0,  # first sorted row of the tile
    pid_n,  # hidden tile
    pid_k,  # K split
    TOPK: tl.constexpr,
    ROWS: tl.constexpr,  # rows of the tile (BLOCK_SIZE_M, or half of it)
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    ATOMIC: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    A_TMA: tl.constexpr,
):
    """GEMM2's work on ROWS sorted rows from row0 (arguments as _gemm2_weighted_sum_kernel's)."""
    offs_m, pair, row_ok, token = tile_rows(row0, sorted_ids_ptr, num_pairs, TOPK, ROWS)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    col_ok = offs_n < H
    # This program's slice of the K dimension: [k_lo, k_lo + k_per_split) within I.
    k_lo = pid_k * k_per_split
    offs_k = k_lo + tl.arange(0, BLOCK_SIZE_K)

    # A = inter rows of the block (contiguous, sorted order); B (BK, BN) = w2[e, n, k]^T.
    a_ptrs = inter_ptr + offs_m[:, None].to(tl.int64) * stride_im + offs_k[None, :] * stride_ik
    b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk

    b_row = (expert * H + pid_n * BLOCK_SIZE_N).to(tl.int32)

    # Scales: inter's sorted rows (all rows of a used block are written, sentinels as zeros) and
    # w2's output channels n.
    as_ptrs = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = scale_ptrs(w_scale_ptr, expert, stride_bse, stride_bsn, offs_n, QUANT, GROUP_N)

    acc = tl.zeros((ROWS, BLOCK_SIZE_N), dtype=tl.float32)
    k_hi = min(k_lo + k_per_split, N_INTER)
    for k in range(k_lo, k_hi, BLOCK_SIZE_K):
        if USE_TMA:
            if A_TMA:  # the block's rows of inter are contiguous; past I the descriptor reads zeros
                a = inter_desc.load([row0, k])
            else:
                k_ok = offs_k < k_hi - (k - k_lo)
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = w2_desc.load([b_row, k]).T
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < k_hi - (k - k_lo)
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = scaled_mma(a, b, acc, k, as_ptrs, bs_ptrs, row_ok, col_ok, stride_asg, stride_bsk,
                         QUANT, GROUP_K, UPCAST, IEEE_DOT)
        a_ptrs += BLOCK_SIZE_K * stride_ik
        b_ptrs += BLOCK_SIZE_K * stride_wk

    acc = dequant(acc, as_ptrs, bs_ptrs, row_ok, col_ok, QUANT)

    # Epilogue: router weight of each pair, then the sum over top-k as an fp32 atomic add into
    # the pair's token row (sentinel rows are masked off).
    w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    if ATOMIC:
        o_ptrs = ws_ptr + token[:, None] * stride_wsm + offs_n[None, :] * stride_wsn
        tl.atomic_add(o_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")
    else:
        o_ptrs = ws_ptr + pair[:, None].to(tl.int64) * stride_wsm + offs_n[None, :] * stride_wsn
        acc = cast_rne(acc, ws_ptr.dtype.element_ty, QUANT != 0 and UPCAST)
        tl.store(o_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # (M, E) router logits
    weights_ptr,  # (M, K) float32 out
    ids_ptr,  # (M, K) int32 out
    M,
    E,
    stride_lm,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,  # next power of two of TOPK (register tile of the winners)
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr,
    RELEASE: tl.constexpr = False,  # let a kernel launched next with PDL start at once (it must wait)
):
    # ROWS tokens per program: softmax over the E logits of each, then K rounds of one max each.
    pdl_release(RELEASE)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < M
    ok = row_ok[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_lm + cols[None, :], mask=ok, other=-float("inf"))
    x = x.to(tl.float32)
    x = tl.where(ok, x, -float("inf"))
    p = tl.exp(x - tl.where(row_ok, tl.max(x, axis=1), 0.0)[:, None])
    p = tl.where(ok, p, 0.0)
    p = p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]
    # One int64 key per (row, expert) so that a single max finds value and index together:
    # p >= 0, so its float bits order like integers (high half); the low half is the reversed
    # column, so of equal probabilities the lower expert id wins. Padding (-1) never wins.
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(ok, (bits << 32) | (BLOCK_E - 1 - cols)[None, :].to(tl.int64), -1)
    slot = tl.arange(0, TOPK_P2)
    vals = tl.zeros((ROWS, TOPK_P2), dtype=tl.float32)
    ids = tl.zeros((ROWS, TOPK_P2), dtype=tl.int32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        best = tl.max(key, axis=1)
        key = tl.where(key == best[:, None], -1, key)  # keys are distinct: removes the winner only
        v = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        i = (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32)
        total += v
        vals = tl.where(slot[None, :] == k, v[:, None], vals)
        ids = tl.where(slot[None, :] == k, i[:, None], ids)
    if RENORMALIZE:
        vals = vals / tl.where(row_ok, total, 1.0)[:, None]
    out = rows[:, None] * TOPK + slot[None, :]
    mask = row_ok[:, None] & (slot < TOPK)[None, :]
    tl.store(weights_ptr + out, vals, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def topk_softmax_launch(m: int, e: int) -> tuple[int, int]:
    """(tokens per program, num_warps) of the routing kernel for m tokens over e experts.

    About 512 logits per program, one warp per token up to 4 warps, never more tokens per
    program than m, twice the tokens from 1024 on (up to 256 experts). From a sweep of 10 launch
    shapes on an H200 (benchmarks/routing_configs.py, PERF.md section 3): within 1.17x (0.3 us,
    Mixtral) of the best shape at every point, and 0.63-0.78x the time of the earlier fixed 2048
    logits / 4 warps for 128-512 experts up to 256 tokens (Qwen3-30B M=1: 4.13 -> 2.68 us)."""
    block_e = max(16, triton.next_power_of_2(e))
    rows = max(1, min(16, 512 // block_e))
    if m >= 1024 and block_e <= 256:
        rows = min(16, 2 * rows)
    rows = min(rows, triton.next_power_of_2(max(m, 1)))
    return rows, min(rows, 4)


def fused_topk_softmax(
    logits: torch.Tensor, topk: int, renormalize: bool = True, *, rows: int | None = None, num_warps: int | None = None,
    release: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in one launch: logits (M, E) -> weights (M, K) float32, ids (M, K)
    int32, winners in descending order (ties: lower expert id). Same result as
    `softmax(logits).topk(k)` (+ division by the winners' sum when renormalize).
    rows (tokens per program) and num_warps: powers of two; None = `topk_softmax_launch`.
    release (None: DEFAULT_PDL_EARLY, on Hopper+): a kernel launched next with programmatic dependent
    launch (GEMM1, the alignment) may start while this one runs; it waits for it before reading."""
    m, e = logits.shape
    weights = torch.empty((m, topk), dtype=torch.float32, device=logits.device)
    ids = torch.empty((m, topk), dtype=torch.int32, device=logits.device)
    if m == 0:
        return weights, ids
    if interpreting():
        interpreter_compat()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    default_rows, default_warps = topk_softmax_launch(m, e)
    rows, num_warps = rows or default_rows, num_warps or default_warps
    if rows & (rows - 1) or num_warps & (num_warps - 1):
        raise ValueError(f"rows and num_warps must be powers of two, got {rows} and {num_warps}")
    _topk_softmax_kernel[(triton.cdiv(m, rows),)](
        logits, weights, ids, m, e, logits.stride(0),
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), RENORMALIZE=renormalize,
        BLOCK_E=max(16, triton.next_power_of_2(e)), ROWS=rows, num_warps=num_warps,
        RELEASE=resolve_pdl(DEFAULT_PDL_EARLY if release is None else release, logits.device, 0),
    )
    return weights, ids


# ---------------------------------------------------------------------------------------------
# Host side


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


#: GEMM2's K split also where its (block, hidden tile) grid fills the GPU, but in few waves of long
#: K loops (`wave_split`): at Mixtral-8x7B's 1024 tokens about 20 blocks x 16 hidden tiles = 320
#: programs of 224 K steps, one per SM at the 128 x 256 tile, run as 3 waves of which the last is
#: 40% full. Split in 2 they are 5 waves of half the steps. Predicted -5% of the layer there;
#: measured on an H200 (eleventh session, PERF.md section 3) 0.965 (and 0.976 with the TMA wide
#: GEMM1; 0.89 in a noisier single pass). The rule keeps one split where the per-tile overhead
#: outweighs the idle SMs (short K: Qwen3-30B, DeepSeek-V3) or the grid has many waves (Mixtral 4096).
DEFAULT_WAVE_SPLIT = True
#: A program's fixed cost (pipeline fill, epilogue, launch) in K steps of the main loop: fitted to
#: GEMM2's times of r10 (PERF.md section 3): ~0.8 us per 128 x 256 x 64 step, ~6 us per tile.
WAVE_TILE_OVERHEAD_STEPS = 7


def ctas_per_sm(cfg: Mapping[str, int], elem_bytes: int = 2) -> int:
    """Programs of a GEMM tile config resident per SM (Hopper: 228 KB shared memory, 64K registers),
    estimated from the pipeline's shared memory and the accumulator's registers."""
    bm, bn, bk, warps = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"], cfg["num_warps"]
    smem = cfg["num_stages"] * (bm + bn) * bk * elem_bytes
    regs = min(255, bm * bn // (32 * warps) + 48)  # fp32 accumulator + addressing
    return max(1, min(228 * 1024 // max(smem, 1), 65536 // (32 * warps * regs)))


def wave_split(tiles: int, steps: int, slots: int, max_split: int) -> int:
    """The K split s (1..max_split) that minimises waves x (steps / s + WAVE_TILE_OVERHEAD_STEPS) for
    `tiles` programs of `steps` K steps on `slots` resident programs; 1 unless it saves >= 3%."""
    def cost(s: int) -> float:
        return math.ceil(tiles * s / slots) * (triton.cdiv(steps, s) + WAVE_TILE_OVERHEAD_STEPS)

    best = min(range(1, max(1, max_split) + 1), key=lambda s: (cost(s), s))
    return best if cost(best) < 0.97 * cost(1) else 1


def choose_split_k(
    est_blocks: int, hidden: int, inter: int, cfg: Mapping[str, int], num_sms: int,
    expected_blocks: float | None = None, wave: bool | None = None,
) -> int:
    """K splits of GEMM2 so that about 2 programs per SM run when the (block, hidden tile) grid
    alone is smaller (est_blocks: an upper estimate of the used blocks); each split keeps at least
    4 BLOCK_SIZE_K steps. A larger grid: 1, or with `wave` (None: DEFAULT_WAVE_SPLIT) and the
    expected block count the split `wave_split` picks for its waves (at least 16 steps per split)."""
    n_tiles = triton.cdiv(hidden, cfg["BLOCK_SIZE_N"])
    tiles = max(1, est_blocks) * n_tiles
    want = 2 * num_sms
    if tiles >= want:
        wave = DEFAULT_WAVE_SPLIT if wave is None else wave
        if not wave or expected_blocks is None:
            return 1
        steps = triton.cdiv(inter, cfg["BLOCK_SIZE_K"])
        return wave_split(max(1, math.ceil(expected_blocks)) * n_tiles, steps, num_sms * ctas_per_sm(cfg),
                          min(8, steps // 16))
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


def layer_split_k(m: int, topk: int, num_experts: int, num_local: int, hidden: int, inter: int,
                  cfg: Mapping[str, int], max_blocks: int, num_sms: int, wave: bool | None = None) -> int:
    """GEMM2's K split for a layer of m tokens, top-k routing over num_experts (num_local here), from
    the expected pairs per local expert (no host sync: the routing is not read); `choose_split_k`,
    whose wave rule applies where experts fill their blocks (>= BLOCK_SIZE_M pairs each: the tiles
    are compute-bound, so an idle SM is lost time; below that the weights' stream sets the pace)."""
    pairs = triton.cdiv(m * topk * num_local, max(num_experts, 1))
    bm = cfg["BLOCK_SIZE_M"]
    est_blocks = min(max_blocks, triton.cdiv(pairs, bm) + min(num_local, pairs))
    expected = expected_blocks(pairs, num_local, bm) if pairs >= num_local * bm else None
    return choose_split_k(est_blocks, hidden, inter, cfg, num_sms, expected, wave)


def _tma_ok(t: torch.Tensor) -> bool:
    """Hopper or newer (or the interpreter, which emulates descriptors), and rows of the 2-D
    weight view 16-byte aligned (TMA's rules)."""
    if t.device.type == "cuda":
        hw = torch.cuda.get_device_capability(t.device)[0] >= 9
    else:
        hw = interpreting()
    return (
        hw
        and t.is_contiguous()
        and (t.shape[-1] * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def _scale_args(scale: torch.Tensor | None, w) -> tuple:
    """Kernel arguments of the fp8 scales: (a_scale, w_scale, a strides (2), w strides (3)); dummy
    pointers and zeros without quantisation (the QUANT=0 variant never reads them)."""
    if not isinstance(w, QuantWeight):
        return (w, w, 0, 0, 0, 0, 0)
    return (scale, w.scale, scale.stride(0), scale.stride(1), *w.scale_strides())


def resolve_pdl(pdl: bool | str | None, device: torch.device, inter: int) -> bool:
    """None -> DEFAULT_PDL; "auto" -> True for intermediate size inter <= PDL_MAX_INTER; True is
    on for CUDA devices of compute capability >= 9 (the instruction exists from Hopper on; ignored
    elsewhere and under the interpreter)."""
    pdl = DEFAULT_PDL if pdl is None else pdl
    if pdl == "auto":
        pdl = inter <= PDL_MAX_INTER
    if not pdl or device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _flat_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    """(M, K) router weights -> (M*K,) contiguous fp32, one per flat pair (the kernels' layout)."""
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    return weights


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _sorted_rows_kernel(x_ptr, xs_ptr, sorted_ids_ptr, ntpp_ptr, num_pairs, H, stride_xm, stride_xk, stride_sm,
                        TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    # Program (r, c): sorted rows r * ROWS .. of the used length, columns c * BLOCK_H ..; a row
    # holds its pair's token row of x, a sentinel row zeros. Rows past the used length stay unset.
    row0 = tl.program_id(0) * ROWS
    if row0 >= tl.load(ntpp_ptr):
        return
    offs_m, pair, row_ok, token = tile_rows(row0, sorted_ids_ptr, num_pairs, TOPK, ROWS)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    v = tl.load(x_ptr + token[:, None] * stride_xm + offs_h[None, :] * stride_xk, mask=row_ok[:, None] & h_ok[None, :],
                other=0.0)
    tl.store(xs_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_h[None, :], v, mask=h_ok[None, :])


def sorted_rows(x: torch.Tensor, align: AlignResult, topk: int) -> torch.Tensor:
    """x (M, H) -> (max_padded, H): row r = x[sorted_token_ids[r] // topk] for the used rows,
    zeros for sentinels; rows past num_tokens_post_padded are left unset (no kernel reads them)."""
    rows, h = align.sorted_token_ids.numel(), x.shape[1]
    xs = torch.empty((rows, h), dtype=x.dtype, device=x.device)
    r, bh = min(32, align.block_size_m), 256  # up to 16 KB of bf16 per program; r divides every block
    _sorted_rows_kernel[(triton.cdiv(rows, r), triton.cdiv(h, bh))](
        x, xs, align.sorted_token_ids, align.num_tokens_post_padded, align.num_pairs, h, x.stride(0), x.stride(1),
        xs.stride(0), TOPK=topk, ROWS=r, BLOCK_H=bh, num_warps=4)
    return xs


def launch_gemm1(
    x: torch.Tensor,
    w13,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    use_tma: bool = False,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    zero: torch.Tensor | None = None,
    wide: bool = False,
    out_scale: torch.Tensor | None = None,
    pdl: bool = False,
    half: bool = False,
    sorted_a: bool = False,
    wide_tma: bool | None = None,
) -> torch.Tensor:
    """GEMM1 + SiLU-and-mul on aligned pairs -> inter (max_padded, I), sorted rows, in x's dtype.
    wide: gate and up tiles as one tile and one dot (DEFAULT_WIDE_GEMM1), loaded through TMA when
    use_tma and wide_tma (None: DEFAULT_WIDE_TMA), else by pointer loads.
    pdl: launch with programmatic dependent launch (`resolve_pdl`; CUDA, Hopper+).
    half: half-height tiles for blocks whose pairs fit in their first half (DEFAULT_HALF_BLOCKS;
    the other rows of such a block are left unwritten: GEMM2 masks them).
    sorted_a: x's rows are first copied into sorted order (`sorted_rows`, one launch) so that
    both operands come through TMA (DEFAULT_SORTED_A; 16-bit, needs use_tma; not with half, nor
    with a pointer-load wide walk).
    out_scale: (1,) fp32 static scale: inter comes back as float8_e4m3fn, bit for bit what
    `quantize_rows(inter, per-tensor scheme, out_scale)` makes of the out_dtype intermediate.

    fp8: w13 a QuantWeight, x (M, H) float8_e4m3fn with a_scale (M, G) fp32 (any row stride, 0 for
    per tensor); inter is then in out_dtype (default bf16). zero: a contiguous fp32 tensor that the
    kernel also sets to zero (GEMM2's atomic accumulator: one launch fewer)."""
    m, h = x.shape
    n_inter = w13.shape[1] // 2
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    assert align.block_size_m == bm, "alignment block size differs from BLOCK_SIZE_M"
    quant = quant_meta(w13)
    interp = interpreting()
    if interp:
        interpreter_compat()
    upcast = interp and x.dtype != torch.float32
    num_blocks = align.max_blocks
    bn1 = max(16, bn // 2)  # BLOCK_SIZE_N columns = half gate, half up
    act_dtype = (out_dtype or torch.bfloat16) if quant["QUANT"] else x.dtype
    inter = torch.empty((num_blocks * bm, n_inter), dtype=FP8_DTYPE if out_scale is not None else act_dtype,
                        device=x.device)
    wq = w13.q if quant["QUANT"] else w13
    desc = wq
    wide_tma = DEFAULT_WIDE_TMA if wide_tma is None else wide_tma
    use_tma = use_tma and (not wide or bool(wide_tma))
    if use_tma and wide:  # one (2, BN, BK) box: gate rows of slice 2e, up rows of slice 2e + 1
        desc = TensorDescriptor.from_tensor(wq.view(-1, n_inter, h), [2, bn1, bk])
    elif use_tma:
        desc = TensorDescriptor.from_tensor(wq.view(-1, h), [bn1, bk])
    x_desc = x
    if sorted_a:
        if not use_tma or quant["QUANT"]:
            raise MoebenchError("sorted_a needs 16-bit inputs with TMA weight tiles (use_tma; wide only with wide_tma)")
        x = sorted_rows(x, align, topk)
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        half = False  # the descriptor's block is BLOCK_SIZE_M rows
    sc = _scale_args(a_scale, w13)
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.is_contiguous()
    grid1 = (num_blocks * triton.cdiv(n_inter, bn1),)
    _silu_mul_gemm1_kernel[grid1](
        x, x_desc, wq, desc, inter, align.sorted_token_ids, align.expert_ids, _map_arg(align), align.num_tokens_post_padded,
        *sc[:2], inter if zero is None else zero, 0 if zero is None else zero.numel(),
        inter if out_scale is None else out_scale.to(device=x.device, dtype=torch.float32).reshape(1),
        align.num_pairs, n_inter, h, num_blocks,
        x.stride(0), x.stride(1), wq.stride(0), wq.stride(1), wq.stride(2), inter.stride(0), inter.stride(1),
        *sc[2:],
        TOPK=topk, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn1, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"],
        EVEN_K=h % bk == 0, UPCAST=upcast, IEEE_DOT=x.dtype == torch.float32 or upcast, USE_TMA=use_tma,
        ZERO_OUT=zero is not None, WIDE=wide, QUANT_OUT=out_scale is not None, ACT_DTYPE=_TL_DTYPES[act_dtype],
        MAPPED=align.expert_map is not None, HALF=half, A_TMA=sorted_a, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **quant, **pdl_launch_args(pdl),
    )
    return inter


def launch_gemm2(
    inter: torch.Tensor,
    w2,
    topk_weights: torch.Tensor,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    split_k: int = 1,
    use_tma: bool = False,
    atomic: bool = True,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    ws: torch.Tensor | None = None,
    tma_a: bool = False,
    pdl: bool = False,
    half: bool = False,
) -> torch.Tensor:
    """GEMM2 + router weight on aligned pairs. tma_a (with use_tma): inter's tiles load through
    TMA as well as w2's (DEFAULT_TMA_GEMM2_A). pdl: launch with programmatic dependent launch
    (after a launch_gemm1 with pdl; `resolve_pdl`). half: as launch_gemm1's (ignored with TMA
    A tiles). atomic: returns ws (M, H) fp32 with the sum over
    top-k done by atomic adds (split_k allowed; `ws` given = already zeroed, e.g. by GEMM1);
    else (M*K, H) weighted rows per pair in inter's dtype (out_dtype for fp8; rows of remote pairs
    zero), to be summed over K by the caller.

    fp8: w2 a QuantWeight, inter (max_padded, I) float8_e4m3fn with a_scale (max_padded, G)."""
    m, k = topk_weights.shape
    e_local, h, n_inter = w2.shape
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    quant = quant_meta(w2)
    interp = interpreting()
    upcast = interp and inter.dtype != torch.float32
    num_blocks = align.max_blocks
    if atomic:
        if ws is None:
            ws = torch.zeros((m, h), dtype=torch.float32, device=inter.device)
        split_k = max(1, min(int(split_k), triton.cdiv(n_inter, bk)))
    else:
        ws_dtype = (out_dtype or torch.bfloat16) if quant["QUANT"] else inter.dtype
        ws = torch.zeros((m * k, h), dtype=ws_dtype, device=inter.device)
        split_k = 1
    k_per_split = triton.cdiv(triton.cdiv(n_inter, split_k), bk) * bk
    split_k = triton.cdiv(n_inter, k_per_split)
    weights = _flat_weights(topk_weights)
    wq = w2.q if quant["QUANT"] else w2
    desc = wq
    if use_tma:
        desc = TensorDescriptor.from_tensor(wq.view(-1, n_inter), [bn, bk])
    a_tma = bool(use_tma and tma_a and _tma_ok(inter))
    a_desc = TensorDescriptor.from_tensor(inter, [bm, bk]) if a_tma else inter
    sc = _scale_args(a_scale, w2)
    grid2 = (num_blocks * triton.cdiv(h, bn), split_k)
    _gemm2_weighted_sum_kernel[grid2](
        inter, a_desc, wq, desc, ws, weights, align.sorted_token_ids, align.expert_ids, _map_arg(align),
        align.num_tokens_post_padded, *sc[:2], align.num_pairs, h, n_inter, num_blocks, k_per_split,
        inter.stride(0), inter.stride(1), wq.stride(0), wq.stride(1), wq.stride(2), ws.stride(0), ws.stride(1),
        *sc[2:],
        TOPK=topk, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"],
        EVEN_K=(n_inter % k_per_split == 0) and (k_per_split % bk == 0), UPCAST=upcast,
        IEEE_DOT=inter.dtype == torch.float32 or upcast, USE_TMA=use_tma, ATOMIC=atomic, A_TMA=a_tma,
        MAPPED=align.expert_map is not None, HALF=half and not a_tma, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **quant, **pdl_launch_args(pdl),
    )
    return ws


def _map_arg(align: AlignResult) -> torch.Tensor:
    """The GEMMs' expert_map pointer: the map of a mapped direct alignment, else a dummy."""
    return align.expert_map if align.expert_map is not None else align.expert_ids


def _fuses_fp8_inter(scheme, fuse_fp8_inter: bool | None = None) -> bool:
    """Whether GEMM1 stores the intermediate as fp8 itself: per-tensor fp8 with the switch on
    (None: DEFAULT_FUSE_FP8_INTER)."""
    on = DEFAULT_FUSE_FP8_INTER if fuse_fp8_inter is None else fuse_fp8_inter
    return scheme is not None and scheme.scales == "tensor" and bool(on)


def fused_moe_gemms(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    split_k: int = 1,
    out: torch.Tensor | None = None,
    use_tma: bool = False,
    atomic: bool = True,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    zero_in_gemm1: bool | None = None,
    wide: bool | str | None = None,
    tma_a: bool | None = None,
    fuse_fp8_inter: bool | None = None,
    pdl: bool | str | None = None,
    down_config: Mapping[str, Any] | None = None,
    half: bool | None = None,
    sorted_a: bool | str | None = None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """The GEMM part on aligned pairs: x (M, H), w13 (E_local, 2I, H), w2 (E_local, H, I),
    topk_weights (M, K) -> out (M, H) in x's dtype, weighted and summed over top-k.

    use_tma: weight tiles through TMA descriptors (CUDA, compute capability >= 9; ignored
    elsewhere). atomic: sum over top-k by fp32 atomics in GEMM2's epilogue (then a cast, except
    for an fp32 output, which is the accumulator itself), else
    weighted rows per pair and a torch sum over K. zero_in_gemm1 (None: DEFAULT_ZERO_IN_GEMM1):
    the atomic accumulator is zeroed by GEMM1's programs, not by a memset launch. wide (None:
    DEFAULT_WIDE_GEMM1): GEMM1 with one (BK, BLOCK_SIZE_N) weight tile and one dot per K step.
    tma_a (None: DEFAULT_TMA_GEMM2_A): with use_tma, GEMM2's inter tiles through TMA too.
    fuse_fp8_inter (None: DEFAULT_FUSE_FP8_INTER): per-tensor fp8 intermediate quantised in GEMM1.
    pdl (None: DEFAULT_PDL): GEMM1 and GEMM2 with programmatic dependent launch (`resolve_pdl`).
    down_config: GEMM2's own tile config (same BLOCK_SIZE_M as `config`; split_k is GEMM2's for
    it); its optional USE_TMA decides GEMM2's TMA loads (weights and inter) instead of use_tma /
    tma_a. None: GEMM2 runs with `config`. half (None: DEFAULT_HALF_BLOCKS): half-height tiles for
    blocks whose pairs fit in their first half (16-bit inputs, BLOCK_SIZE_M >= 32). sorted_a (None:
    DEFAULT_SORTED_A; `gemm1_walk`): GEMM1 reads x through TMA from a copy in sorted order (16-bit
    with use_tma; GEMM1 then walks gate and up as two tiles, not wide). num_experts: the global
    expert count, for "auto"'s pairs per expert (M * K / num_experts; None: E_local).

    fp8 (w13, w2 QuantWeights of one scheme): x float8_e4m3fn (M, H) with a_scale (M, G); out is
    in out_dtype (default bf16). The intermediate is stored in out_dtype, then quantised with the
    scheme (w2.input_scale for per tensor) before GEMM2, as moebench.quant describes. No TMA."""
    m, h = x.shape
    zero_in_gemm1 = DEFAULT_ZERO_IN_GEMM1 if zero_in_gemm1 is None else zero_in_gemm1
    scheme = scheme_of(w13)
    if scheme is not None:
        out_dtype = out_dtype or torch.bfloat16
        check_block_config(config, scheme, "triton experts")
        if a_scale is None or x.dtype != FP8_DTYPE:
            raise MoebenchError("fp8 triton experts need x as float8_e4m3fn with its a_scale")
        if scheme.scales == "tensor" and w2.input_scale is None:
            raise MoebenchError("per-tensor fp8 needs w2.input_scale (moebench.quant.quantize_weights sets it)")
        use_tma = False
    else:
        out_dtype = x.dtype
    if out is None:
        out = alloc_output((m, h), out_dtype, x.device)
    if m == 0:
        return out
    use_tma = bool(use_tma) and _tma_ok(w13) and _tma_ok(w2)
    # GEMM2's fp32 accumulator (atomic path), zeroed by GEMM1 or by a memset
    acc = None
    if atomic and out.dtype == torch.float32 and out.is_contiguous():
        acc = out if zero_in_gemm1 else out.zero_()  # an fp32 output is the accumulator: no cast
    elif atomic:
        acc = torch.empty((m, h), dtype=torch.float32, device=x.device) if zero_in_gemm1 else torch.zeros(
            (m, h), dtype=torch.float32, device=x.device)
    fuse = _fuses_fp8_inter(scheme, fuse_fp8_inter)
    pdl = resolve_pdl(pdl, x.device, w2.shape[2])
    half = DEFAULT_HALF_BLOCKS if half is None else half
    half = bool(half) and scheme is None and config["BLOCK_SIZE_M"] >= 32
    wide, sorted_a = gemm1_walk(config, x.dtype, scheme is not None, use_tma, w2.shape[2],
                                m * topk / (num_experts or w13.shape[0]), wide, sorted_a)
    inter = launch_gemm1(x, w13, align, topk, config, use_tma, a_scale, out_dtype, zero=acc if zero_in_gemm1 else None,
                         wide=wide, out_scale=w2.input_scale if fuse else None, pdl=pdl, half=half, sorted_a=sorted_a)
    inter_scale = None
    if fuse:
        inter_scale = w2.input_scale.to(device=x.device, dtype=torch.float32).reshape(1, 1).expand(inter.shape[0], 1)
    elif scheme is not None:
        # Only rows < num_tokens_post_padded are in use (read on the device).
        inter, inter_scale = quantize_rows(inter, scheme, w2.input_scale, row_limit=align.num_tokens_post_padded)
    cfg2, tma2 = config, use_tma
    tma_a = DEFAULT_TMA_GEMM2_A if tma_a is None else tma_a
    if down_config is not None:
        if down_config["BLOCK_SIZE_M"] != config["BLOCK_SIZE_M"]:
            raise MoebenchError(f"GEMM2's config has BLOCK_SIZE_M {down_config['BLOCK_SIZE_M']}, GEMM1's "
                                f"{config['BLOCK_SIZE_M']}: both GEMMs share one alignment")
        cfg2 = down_config
        if "USE_TMA" in down_config:
            tma2 = tma_a = bool(down_config["USE_TMA"]) and scheme is None and _tma_ok(w2)
    ws = launch_gemm2(inter, w2, topk_weights, align, topk, cfg2, split_k, tma2, atomic, inter_scale, out_dtype,
                      ws=acc, tma_a=tma_a, pdl=pdl, half=half)
    if atomic:
        if ws is not out:
            out.copy_(ws)
    else:
        torch.sum(ws.view(m, topk, h), dim=1, out=out)
    return out


def resolve_use_tma(use_tma: bool | str | None, config: Mapping[str, int], dtype: torch.dtype) -> bool:
    """None -> DEFAULT_USE_TMA; "auto" -> 16-bit inputs with BLOCK_SIZE_M >= 32. (Whether the
    device can do TMA is checked again where the descriptors are made.)"""
    if use_tma is None:
        use_tma = DEFAULT_USE_TMA
    if use_tma == "auto":
        return config["BLOCK_SIZE_M"] >= 32 and dtype in (torch.float16, torch.bfloat16)
    return bool(use_tma)


def select_config(
    m: int, topk: int, w13, w2, num_experts: int, dtype: torch.dtype
) -> tuple[TileConfig, str]:
    """Tuned file (E = local experts, N = I) else the default heuristic over global experts.
    Quantised weights look up the scheme's file (dtype=fp8_w8a8[,block_shape=[..]]) and fit the
    default to the scale block."""
    e_local, h, n_inter = w2.shape
    return lookup_config(
        e_local, n_inter, max(m, 1), dtype, hidden=h, topk=topk, num_experts_global=num_experts,
        device_name=device_name(w2.device), quant=scheme_of(w2),
    )


def select_down_config(
    m: int, w2, gemm1: Mapping[str, int], dtype: torch.dtype
) -> tuple[TileConfig | None, str]:
    """GEMM2's own config from a `_down.json` file (moebench.tuning.configs.lookup_down_config), or
    (None, "GEMM1's config") without one (or with DEFAULT_DOWN_FILES off)."""
    if not DEFAULT_DOWN_FILES:
        return None, "GEMM1's config"
    e_local, _, n_inter = w2.shape
    return lookup_down_config(e_local, n_inter, max(m, 1), gemm1, dtype,
                              device_name=device_name(w2.device), quant=scheme_of(w2))


def align_pairs(
    topk_ids: torch.Tensor,
    block_size_m: int,
    num_local_experts: int,
    expert_map: torch.Tensor | None,
    num_experts: int,
    scheme=None,
    direct: bool | str | None = None,
    pdl: bool = False,
) -> AlignResult:
    """The block alignment `fused_moe` uses for topk_ids (M, K): `direct_align` or the alignment
    kernels (pdl: the one-launch kernel with programmatic dependent launch). direct: True / False /
    "auto" (None: DEFAULT_DIRECT_ALIGN); "auto" takes direct_align where `use_direct_align` says
    so, for 16-bit weights (scheme None) and the fused per-tensor fp8 path: fp8 with a separate
    quantisation launch measured slower with it once (DeepSeek-V3 EP8 M=1: 23 -> 33 us)."""
    direct = DEFAULT_DIRECT_ALIGN if direct is None else direct
    if direct == "auto":
        m, k = topk_ids.shape
        direct = (scheme is None or _fuses_fp8_inter(scheme)) and use_direct_align(m, k, num_experts)
    if direct:
        return direct_align(topk_ids, block_size_m, expert_map)
    return moe_align_block_size(topk_ids, block_size_m, num_local_experts, expert_map, pdl=pdl)


def fused_moe(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    num_experts: int | None = None,
    config: Mapping[str, int] | None = None,
    split_k: int | None = None,
    use_tma: bool | None = None,
    atomic: bool | None = None,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    direct: bool | str | None = None,
    zero_in_gemm1: bool | None = None,
    wide: bool | str | None = None,
    pdl: bool | str | None = None,
    down_config: Mapping[str, Any] | None = None,
    half: bool | None = None,
    sorted_a: bool | str | None = None,
) -> torch.Tensor:
    """Whole experts step: x (M, H), w13 (E_local, 2I, H), w2 (E_local, H, I), topk_weights (M, K)
    float32, topk_ids (M, K) global ids, expert_map (E,) or None -> (M, H) in x's dtype.
    use_tma / atomic: see `fused_moe_gemms` (None: DEFAULT_USE_TMA / DEFAULT_ATOMIC). direct:
    True / False / "auto" (None: DEFAULT_DIRECT_ALIGN), see moebench.kernels.moe_align.direct_align;
    zero_in_gemm1, wide, pdl, down_config, half, sorted_a: see `fused_moe_gemms`. Without `config`, both configs
    come from the lookup (`select_config`, `select_down_config`); an explicit `config` is used for
    both GEMMs unless `down_config` is given too.

    fp8: w13 and w2 moebench.quant.QuantWeight of one scheme, and either
      - x float8_e4m3fn with a_scale (M, G) fp32 (as prepare makes them); the output is in
        out_dtype (default bf16), or
      - x bf16/fp16/fp32: quantised here (`quantize_rows`, w13.input_scale for per tensor); the
        output is in x's dtype (or out_dtype)."""
    m, k = topk_ids.shape
    e_local = w13.shape[0]
    scheme = scheme_of(w13)
    if scheme_of(w2) != scheme:
        raise MoebenchError("w13 and w2 must be quantised with the same scheme (or both not at all)")
    if scheme is None:
        if a_scale is not None:
            raise MoebenchError("a_scale is for fp8 weights (moebench.quant.QuantWeight) only")
        out_dtype = x.dtype
    elif x.dtype == FP8_DTYPE:
        if a_scale is None:
            raise MoebenchError("fp8 x needs its a_scale (rows, groups) float32")
        out_dtype = out_dtype or torch.bfloat16
    else:
        out_dtype = out_dtype or x.dtype
        x, a_scale = quantize_rows(x, scheme, w13.input_scale)
    if num_experts is None:
        num_experts = expert_map.shape[0] if expert_map is not None else e_local
    if config is None:
        config, _ = select_config(m, k, w13, w2, num_experts, out_dtype)
        if down_config is None:
            down_config, _ = select_down_config(m, w2, config, out_dtype)
    if m == 0:
        return alloc_output((0, x.shape[1]), out_dtype, x.device)
    pdl = resolve_pdl(pdl, x.device, w2.shape[2])  # once, for the alignment and both GEMMs
    align = align_pairs(topk_ids, config["BLOCK_SIZE_M"], e_local, expert_map, num_experts, scheme, direct,
                        pdl and DEFAULT_PDL_EARLY)
    if split_k is None:
        split_k = layer_split_k(m, k, num_experts, e_local, x.shape[1], w2.shape[2], down_config or config,
                                align.max_blocks, _num_sms(x.device))
    use_tma = resolve_use_tma(use_tma, config, x.dtype)
    atomic = DEFAULT_ATOMIC if atomic is None else atomic
    return fused_moe_gemms(
        x, w13, w2, topk_weights, align, k, config, split_k, use_tma=use_tma, atomic=atomic,
        a_scale=a_scale, out_dtype=out_dtype, zero_in_gemm1=zero_in_gemm1, wide=wide, pdl=pdl,
        down_config=down_config, half=half, sorted_a=sorted_a, num_experts=num_experts,
    )


@register_experts
class TritonExperts(Experts):
    """Sorted-token fused MoE (Standard). Returns (M, H), weighted and summed over top-k.

    config: a TileConfig (vLLM keys) used for every call instead of the lookup; down_config:
    GEMM2's own (with config, same BLOCK_SIZE_M; without config the lookup also reads a `_down.json`
    file); split_k: GEMM2 K splits (None = from the SM count). fp8_w8a8 weights (all scales of moebench.quant) take the
    activations prepare quantised (prep.a fp8 + prep.a_scale); the output is in prep.out_dtype.
    """

    name = "triton"
    activation_format = ActivationFormat.STANDARD
    supported_quant = SCALES
    quantizes_input = False

    def __init__(
        self,
        config: Mapping[str, int] | None = None,
        split_k: int | None = None,
        use_tma: bool | None = None,
        atomic: bool | None = None,
        down_config: Mapping[str, Any] | None = None,
    ):
        self.config = validate_tile_config(dict(config), "TritonExperts config") if config is not None else None
        self.down_config = (validate_tile_config(dict(down_config), "TritonExperts down_config", down=True)
                            if down_config is not None else None)
        if self.config is not None and self.down_config is not None and \
                self.config["BLOCK_SIZE_M"] != self.down_config["BLOCK_SIZE_M"]:
            raise MoebenchError("TritonExperts: down_config's BLOCK_SIZE_M must equal config's (one alignment)")
        self.split_k = split_k
        self.use_tma = use_tma
        self.atomic = atomic

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return triton_unavailable_reason(device)

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    def config_for(self, m: int, topk: int, w13, w2, num_experts: int, dtype) -> tuple[dict[str, Any], dict | None]:
        """(GEMM1's config, GEMM2's own or None); last_config_source says where they came from."""
        if self.config is not None:
            self.last_config_source = "explicit" + ("; GEMM2: explicit" if self.down_config is not None else "")
            return dict(self.config), (dict(self.down_config) if self.down_config is not None else None)
        cfg, src = select_config(m, topk, w13, w2, num_experts, dtype)
        down, down_src = (dict(self.down_config), "explicit") if self.down_config is not None else \
            select_down_config(m, w2, cfg, dtype)
        self.last_config_source = src + (f"; GEMM2: {down_src}" if down_src != "GEMM1's config" else "")
        return dict(cfg), (dict(down) if down is not None else None)

    def apply(self, prep: PrepareResult, w13, w2) -> torch.Tensor:
        x = prep.a
        m, k = prep.topk_ids.shape
        out_dtype = None
        dtype = x.dtype
        if scheme_of(w13) is not None:
            out_dtype = prep.out_dtype or (torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype)
            dtype = out_dtype
        cfg, down = self.config_for(m, k, w13, w2, prep.num_experts, dtype)
        return fused_moe(
            x, w13, w2, prep.topk_weights, prep.topk_ids, prep.expert_map, prep.num_experts, cfg, self.split_k,
            self.use_tma, self.atomic, a_scale=prep.a_scale, out_dtype=out_dtype, down_config=down,
        )
