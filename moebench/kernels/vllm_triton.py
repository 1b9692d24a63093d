"""The `vllm-triton` experts: a Triton fused MoE with the structure of vLLM's `fused_moe_kernel`
(and SGLang's, which shares it), so that tile configs tuned here are tuned for the kernel the
engines run.

What vLLM does, and this backend with it (moebench's own code; vLLM is not imported):

    quantise x      fp8_w8a8 block [bn, bk]: 1 x bk groups per row (per-token-group: scale =
                    max(amax, 1e-10) / 448, the last group of a row partial when H % bk != 0)
    align           (token, k) pairs sorted by *global* expert, each expert's run padded to a
                    multiple of BLOCK_SIZE_M with the sentinel M*K; expert_ids per block, then
                    mapped through expert_map (-1 = a remote expert: the block writes zeros);
                    num_tokens_post_padded = the used length. Per-pair path instead (vLLM's
                    "naive block assignment", taken when there is no expert_map and
                    M * K * 4 <= E): no alignment, block p holds pair p in its first row and
                    expert topk_ids.flat[p]
    GEMM1           one program per (BLOCK_SIZE_M block, BLOCK_SIZE_N tile of w13's 2I rows),
                    grid cdiv(EM, BLOCK_SIZE_M) * cdiv(2I, BLOCK_SIZE_N) with GROUP_SIZE_M row
                    blocks walked down one column tile before moving right; EM = the alignment's
                    buffer (M*K + E*(BLOCK_SIZE_M-1)), at most M*K*BLOCK_SIZE_M when
                    M < BLOCK_SIZE_M (per-pair: M*K*BLOCK_SIZE_M); rows gathered by pair // K;
                    output (M*K, 2I) in the activation dtype
    SiLU-and-mul    its own launch: (M*K, 2I) -> (M*K, I), then (fp8) quantised per token group
    GEMM2           the same kernel on the intermediate (rows = pairs), the router weight
                    multiplied into the fp32 accumulator before the store -> (M*K, H)
    top-k sum       its own launch: (M, K, H) -> (M, H)

fp8 block: each K step multiplies its partial product by the step's activation and weight
scales (BLOCK_SIZE_K is cut to min(BLOCK_SIZE_K, bn, bk) at launch, as vLLM does, so one step
never spans two scale groups); the weight scale is read per output column (column // bn).
Swap-AB (`VllmTritonOptions.swap_ab`): the fp8 block GEMM computes (w tile)^T-major, i.e.
dot(b^T, a^T) into a (BLOCK_SIZE_N, BLOCK_SIZE_M) accumulator transposed back before the
epilogue: SGLang's kernel does this on SM90 when BLOCK_SIZE_M < 64 and BLOCK_SIZE_N >= 64
("auto"); vLLM's kernel does not (the `vllm` flavour's default is off).

Tile configs: an explicit `config` (what a tune measures), else the engine file of the flavour
(`engine_configs.engine_config`, nearest token key, ties to the smaller) else vLLM's default
config (`engine_configs.vllm_default_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from moebench.errors import MoebenchError
from moebench.kernels.engine_configs import engine_config
from moebench.kernels.tuned_files import ENGINES
from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    PrepareResult,
    TopKWeightAndReduceNoOp,
    alloc_output,
)
from moebench.kernels.triton.align import moe_align_block_size
from moebench.kernels.triton.common import grouped_tile
from moebench.kernels.tuned_files import config_search_dirs, device_name, validate_tile_config
from moebench.kernels.triton.env import interpreter_compat, interpreting, triton_unavailable_reason
from moebench.kernels.triton.launch import topk_sum
from moebench.kernels.triton.quant import quantize_rows
from moebench.quant import FP8_DTYPE, QuantScheme, scheme_of  # noqa: F401 (QuantScheme: annotations)

#: vLLM's per-pair path: taken when M * K * PER_PAIR_SPARSITY <= E (and no expert_map).
PER_PAIR_SPARSITY = 4


@dataclass(frozen=True)
class VllmTritonOptions:
    """Code paths of the vllm-triton experts.

    engine: "vllm" | "sglang": whose config files the lookup reads (`tuned_files`) and whose
            swap-AB rule "auto" applies.
    per_pair: "auto" (vLLM's rule: no expert_map and M*K*4 <= E), True or False.
    swap_ab: fp8 block GEMMs only. False (vLLM's kernel), True, or "auto" (SGLang's rule: an SM90
             device, BLOCK_SIZE_M < 64 and BLOCK_SIZE_N >= 64). None: the engine's own (vllm:
             False, sglang: "auto")."""

    engine: str = "vllm"
    per_pair: str | bool = "auto"
    swap_ab: str | bool | None = None

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise MoebenchError(f"unknown engine kernel '{self.engine}'; use one of {', '.join(ENGINES)}")
        for name in ("per_pair", "swap_ab"):
            v = getattr(self, name)
            if v not in ("auto", True, False) and not (name == "swap_ab" and v is None):
                raise MoebenchError(f"VllmTritonOptions.{name} must be 'auto', True or False, got {v!r}")


def use_per_pair(options: VllmTritonOptions, m: int, topk: int, num_experts: int, expert_map) -> bool:
    """Whether the layer skips the alignment and gives each (token, expert) pair its own block."""
    if options.per_pair != "auto":
        if options.per_pair and expert_map is not None:
            raise MoebenchError("the per-pair path takes no expert_map (vLLM takes it only without one)")
        return bool(options.per_pair)
    return expert_map is None and m * topk * PER_PAIR_SPARSITY <= num_experts


def use_swap_ab(options: VllmTritonOptions, cfg: Mapping[str, int], block_quant: bool,
                device: torch.device) -> bool:
    """Whether an fp8 block GEMM runs swapped (see the module docstring)."""
    rule = options.swap_ab if options.swap_ab is not None else (False if options.engine == "vllm" else "auto")
    if not block_quant or rule is False:
        return False
    if rule is True:
        return True
    sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return sm90 and cfg["BLOCK_SIZE_M"] < 64 and cfg["BLOCK_SIZE_N"] >= 64


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def vllm_moe_gemm_kernel(
    a_ptr,  # (rows, K): x (GEMM1: row = pair // TOP_K) or the intermediate (GEMM2: row = pair)
    b_ptr,  # (E_local, N, K) weights (fp8 for block quant)
    c_ptr,  # (M*TOP_K_PAIRS, N) out, row = pair
    a_scale_ptr,  # (rows, G) fp32 (fp8 only)
    b_scale_ptr,  # (E_local, ceil(N/GROUP_N), ceil(K/GROUP_K)) fp32 (fp8 only)
    w_ptr,  # (pairs,) fp32 router weights (MUL_WEIGHT only)
    sorted_ids_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    N,
    K,
    EM,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bse,
    stride_bsn,
    stride_bsk,
    TOP_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PER_PAIR: tl.constexpr,
    SWAP_AB: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    # program -> (row block, column tile), GROUP_SIZE_M row blocks down each column tile
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(EM, BLOCK_SIZE_M), tl.cdiv(N, BLOCK_SIZE_N), GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(ntpp_ptr):
        return
    offs_m = tl.arange(0, BLOCK_SIZE_M)
    if PER_PAIR:  # block pid_m is pair pid_m alone
        pair = tl.where(offs_m == 0, pid_m, num_pairs).to(tl.int64)
    else:
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    c_mask = row_ok[:, None] & (offs_n[None, :] < N)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:  # a remote expert's block: its rows are zeros
        tl.store(c_ptrs, tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    # weight columns wrap around N (the stores past N are masked), so the weight loads need no N mask
    offs_bn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_rows = pair // TOP_K
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None]
    if FP8_BLOCK:
        a_s_ptrs = a_scale_ptr + a_rows * stride_asm
        b_s_ptrs = b_scale_ptr + expert * stride_bse + (offs_bn // GROUP_N) * stride_bsn
    if SWAP_AB:
        acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_ok = offs_k < K - k * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter's 16-bit / fp8 tl.dot is wrong: fp32 operands there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8_BLOCK:
            group = (k * BLOCK_SIZE_K) // GROUP_K  # BLOCK_SIZE_K <= GROUP_K: one scale group per step
            a_s = tl.load(a_s_ptrs + group, mask=row_ok, other=0.0)
            b_s = tl.load(b_s_ptrs + group * stride_bsk)
            if SWAP_AB:
                acc += tl.dot(tl.trans(b), tl.trans(a)) * b_s[:, None] * a_s[None, :]
            else:
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K
    if SWAP_AB:
        acc = tl.trans(acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def silu_and_mul_kernel(x_ptr, y_ptr, N_INTER, BLOCK: tl.constexpr):
    """One program per (row, column block): y[r, n] = silu(x[r, n]) * x[r, I + n], fp32 math."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N_INTER
    g = tl.load(x_ptr + row * 2 * N_INTER + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * N_INTER + N_INTER + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N_INTER + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Launchers


@dataclass
class PairBlocks:
    """The blocks both GEMMs walk: sorted_ids (or None on the per-pair path), expert_ids (local
    ids, -1 = remote), ntpp (1,) int32, em (the grid's row extent), per_pair."""

    sorted_ids: torch.Tensor | None
    expert_ids: torch.Tensor
    ntpp: torch.Tensor
    em: int
    per_pair: bool
    num_pairs: int


def vllm_align(topk_ids: torch.Tensor, block_m: int, num_experts: int, expert_map: torch.Tensor | None,
               per_pair: bool) -> PairBlocks:
    """The pair layout of the module docstring for topk_ids (M, K) global ids."""
    m, k = topk_ids.shape
    pairs = m * k
    if per_pair:
        ntpp = torch.full((1,), pairs * block_m, dtype=torch.int32, device=topk_ids.device)
        return PairBlocks(None, topk_ids.reshape(-1), ntpp, pairs * block_m, True, pairs)
    al = moe_align_block_size(topk_ids, block_m, num_experts)  # over the global experts, as vLLM aligns
    expert_ids = al.expert_ids
    if expert_map is not None:
        emap = expert_map.to(device=topk_ids.device, dtype=torch.int32)
        expert_ids = torch.where(expert_ids >= 0, emap[expert_ids.clamp(min=0).long()], expert_ids)
    em = pairs + num_experts * (block_m - 1)  # vLLM's buffer
    if m < block_m:
        em = min(em, pairs * block_m)
    return PairBlocks(al.sorted_token_ids, expert_ids, al.num_tokens_post_padded, em, False, pairs)


def _weight_parts(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    q = scheme_of(w)
    return (w.q, w.scale) if q is not None else (w, None)


def launch_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w, c: torch.Tensor, blocks: PairBlocks,
                topk: int, cfg: Mapping[str, int], topk_weights: torch.Tensor | None = None,
                options: VllmTritonOptions | None = None) -> None:
    """c[pair] = a[pair // topk] @ w[expert]^T (times the router weight when given), in c's dtype."""
    options = options or VllmTritonOptions()
    b, b_scale = _weight_parts(w)
    quant = scheme_of(w)
    block = quant is not None and quant.block_shape is not None
    if quant is not None and not block:
        raise MoebenchError("vllm-triton takes fp8_w8a8 block weights only (per-tensor / per-token: use triton)")
    n, kdim = b.shape[1], b.shape[2]
    bk = cfg["BLOCK_SIZE_K"]
    gn = gk = 0
    if block:
        gn, gk = quant.block_shape
        bk = min(bk, gn, gk)  # as vLLM cuts it
    swap = use_swap_ab(options, cfg, block, a.device)
    grid = (triton.cdiv(blocks.em, cfg["BLOCK_SIZE_M"]) * triton.cdiv(n, cfg["BLOCK_SIZE_N"]),)
    interp = interpreting()
    if interp:
        interpreter_compat()
    sorted_ids = blocks.sorted_ids if blocks.sorted_ids is not None else blocks.ntpp  # unread on the per-pair path
    a_s = a_scale if a_scale is not None else a
    bs = b_scale if b_scale is not None else b
    vllm_moe_gemm_kernel[grid](
        a, b, c, a_s, bs, topk_weights if topk_weights is not None else a, sorted_ids, blocks.expert_ids, blocks.ntpp,
        n, kdim, blocks.em, blocks.num_pairs, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        a_scale.stride(0) if a_scale is not None else 0,
        b_scale.stride(0) if block else 0, b_scale.stride(1) if block else 0, b_scale.stride(2) if block else 0,
        TOP_K=topk, GROUP_N=max(gn, 1), GROUP_K=max(gk, 1), FP8_BLOCK=block, MUL_WEIGHT=topk_weights is not None,
        PER_PAIR=blocks.per_pair, SWAP_AB=swap, UPCAST=interp and (block or a.dtype != torch.float32),
        BLOCK_SIZE_M=cfg["BLOCK_SIZE_M"], BLOCK_SIZE_N=cfg["BLOCK_SIZE_N"], BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=cfg["GROUP_SIZE_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def vllm_fused_experts(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Mapping[str, int],
    expert_map: torch.Tensor | None = None,
    num_experts: int | None = None,
    options: VllmTritonOptions | None = None,
) -> torch.Tensor:
    """x (M, H) bf16/fp16, w13 (E_local, 2I, H), w2 (E_local, H, I) (tensors, or fp8 block
    moebench.quant.QuantWeight), topk_* (M, K) global ids -> (M, H) in x's dtype, with the
    launches of the module docstring and one tile config for both GEMMs."""
    options = options or VllmTritonOptions()
    quant = scheme_of(w13)
    if scheme_of(w2) != quant:
        raise MoebenchError("w13 and w2 must be quantised with the same scheme (or both not at all)")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise MoebenchError(f"vllm-triton takes bf16/fp16 activations, got {x.dtype}")
    m, topk = topk_ids.shape
    h = x.shape[1]
    n_inter = w2.shape[2]
    if num_experts is None:
        num_experts = expert_map.shape[0] if expert_map is not None else w13.shape[0]
    if m == 0:
        return alloc_output((0, h), x.dtype, x.device)
    per_pair = use_per_pair(options, m, topk, num_experts, expert_map)
    blocks = vllm_align(topk_ids, config["BLOCK_SIZE_M"], num_experts, expert_map, per_pair)
    return vllm_gemms(x, w13, w2, topk_weights, blocks, topk, config, options, zero_remote=expert_map is not None)


def vllm_gemm1(x: torch.Tensor, w13, blocks: PairBlocks, topk: int, config: Mapping[str, int],
               options: VllmTritonOptions | None = None) -> torch.Tensor:
    """GEMM1 alone (x quantised first for fp8): -> (M*K, 2I) in x's dtype, rows by pair."""
    quant = scheme_of(w13)
    a1, a1_scale = (x, None) if quant is None else quantize_rows(x.contiguous(), quant)
    c1 = torch.empty(x.shape[0] * topk, w13.shape[1], dtype=x.dtype, device=x.device)
    launch_gemm(a1, a1_scale, w13, c1, blocks, topk, config, options=options)
    return c1


def vllm_gemms(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, blocks: PairBlocks, topk: int,
               config: Mapping[str, int], options: VllmTritonOptions | None = None,
               zero_remote: bool = False) -> torch.Tensor:
    """Everything after the alignment (`vllm_align`): quantise x (fp8), GEMM1, SiLU-and-mul,
    quantise (fp8), GEMM2 with the router weight, top-k sum -> (M, H) in x's dtype.
    zero_remote: GEMM2's buffer starts as zeros (vLLM does so under an expert map)."""
    quant = scheme_of(w13)
    m, h = x.shape
    n_inter = w2.shape[2]
    c1 = vllm_gemm1(x, w13, blocks, topk, config, options)
    act = torch.empty(m * topk, n_inter, dtype=x.dtype, device=x.device)
    if interpreting():
        interpreter_compat()
    silu_and_mul_kernel[(m * topk, triton.cdiv(n_inter, 1024))](c1, act, n_inter, BLOCK=1024)
    a2, a2_scale = (act, None) if quant is None else quantize_rows(act, quant)
    c2 = (torch.zeros if zero_remote else torch.empty)(m * topk, h, dtype=x.dtype, device=x.device)
    launch_gemm(a2, a2_scale, w2, c2, blocks, 1, config, topk_weights.reshape(-1).to(torch.float32).contiguous(),
                options=options)
    out = alloc_output((m, h), x.dtype, x.device)
    return topk_sum(c2, out, topk)


# ---------------------------------------------------------------------------------------------
# The experts backend


class VllmTritonExperts(Experts):
    """vLLM's fused-MoE structure (Standard). Returns (M, H), weighted and summed over top-k.

    config: a TileConfig used for every call (a tune's candidate) instead of the lookup;
    options: VllmTritonOptions (engine whose files the lookup reads, per-pair and swap-AB paths);
    config_dirs: the config roots the lookup reads (None: `config_search_dirs()`, resolved here, once).
    Takes bf16/fp16 activations and quantises them itself for fp8_w8a8 block weights (as vLLM's
    fused_experts does)."""

    name = "vllm-triton"
    activation_format = ActivationFormat.STANDARD
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_quant = ("block",)
    quantizes_input = True

    def __init__(self, config: Mapping[str, int] | None = None, options: VllmTritonOptions | None = None,
                 config_dirs: tuple[Path, ...] | None = None):
        self.config = validate_tile_config(dict(config), "VllmTritonExperts config") if config is not None else None
        self.options = options or VllmTritonOptions()
        self.config_dirs = tuple(config_dirs) if config_dirs is not None else \
            config_search_dirs() if self.config is None else ()

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return triton_unavailable_reason(device)

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    def config_for(self, m: int, w2, num_experts: int, dtype: torch.dtype) -> dict[str, Any]:
        """The config at m tokens; last_config_source says where it came from."""
        if self.config is not None:
            self.last_config_source = "explicit"
            return dict(self.config)
        cfg, self.last_config_source = engine_config(self.options.engine, m, w2.shape[0], w2.shape[2], num_experts,
                                                     device_name(w2.device), scheme_of(w2), roots=self.config_dirs)
        return dict(cfg)

    def apply(self, prep: PrepareResult, w13, w2) -> torch.Tensor:
        x = prep.a
        if x.dtype == FP8_DTYPE:
            raise MoebenchError("vllm-triton quantises its own input: hand it bf16/fp16 activations")
        m = prep.topk_ids.shape[0]
        cfg = self.config_for(m, w2, prep.num_experts, x.dtype)
        return vllm_fused_experts(x, w13, w2, prep.topk_weights, prep.topk_ids, cfg, prep.expert_map,
                                  prep.num_experts, self.options)
