"""The launchers of the sorted-token fused MoE layer's GEMMs (moebench.kernels.triton.gemm1, gemm2).

On pairs aligned by moebench.kernels.triton.align (BLOCK_SIZE_M pairs of one expert per block):

    GEMM1   per (block, intermediate tile): x's rows times w13's gate and up rows in the same K
            loop, SiLU(gate) * up in the epilogue -> inter (max_padded, I), rows in sorted order
    GEMM2   per (block, hidden tile[, K split]): inter @ w2[e]^T, times the router weight, then a
            relaxed fp32 atomic add into the (M, H) accumulator: the sum over top-k happens here;
            or (pair_store) a plain store of each pair's row into (M*K, H), which `topk_sum`
            then sums over top-k in one more launch

`fused_moe_gemms` runs both (and the fp8 quantisation of the intermediate between them) as a
`LayerPlan` says (moebench.kernels.triton.options.plan_layer: the options resolved once per call);
`launch_gemm1` and `launch_gemm2` take their GEMM's part of it. The launchers choose nothing: they
check what they are given and build the kernels' arguments.

GEMM1 walks K in one of two ways (`Gemm1Plan.wide`): the paired walk (`gemm1_paired_kernel`) loads
a gate and an up tile of BLOCK_SIZE_N columns each and does two dots; the wide walk
(`gemm1_wide_kernel`) loads both as one (BK, 2 BN) tile (with TMA one (2, BN, BK) box of w13 viewed
as (2 E_local, I, H)) and does one dot. The launchers take BLOCK_SIZE_N as the config's total width
(half gate, half up: vLLM's unfused GEMM1 register budget). With `sorted_a`, GEMM1's A tiles come
through TMA from x copied into sorted order (`sorted_rows`).

fp8_w8a8 (QuantWeight weights, every scale kind of moebench.quant): x arrives quantised
(float8_e4m3fn + per-row scales); the GEMMs dot fp8 operands with fp32 accumulation. tensor/token
scales multiply the accumulator in the epilogue (x's row scale times the weight's channel scale);
block scales multiply each K step's dot (BLOCK_SIZE_K divides bk, one scale column per step; the
weight scale is read per output column n // bn). The intermediate is stored in the layer's dtype,
quantised with the scheme by moebench.kernels.triton.quant (only rows < num_tokens_post_padded,
read on the device); for per-tensor scales GEMM1 quantises it itself with w2's static input scale
(bit for bit the two-step result). On Hopper tensor/token scales accumulate the whole K loop in the
fp8 MMA accumulator, which wgmma keeps at reduced precision (as vLLM's Triton kernel does); block
scales add each K step's dot in fp32 (where a 16-row tile is swapped, `swap_ab`, its weight columns
fill wgmma's M side and the step's fp8 products are summed at wgmma's reduced precision).
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moebench.activation import SILU, Activation
from moebench.errors import MoebenchError
from moebench.kernels.modular import ExpertBias, alloc_output
from moebench.kernels.triton.align import AlignResult
from moebench.kernels.triton.common import Rows, bias_arg, gate_up_args, pdl_launch_args
from moebench.kernels.triton.env import interpreter_compat, interpreting
from moebench.kernels.triton.gemm1 import Fp8Out, ZeroFill, gemm1_paired_kernel, gemm1_wide_kernel, sorted_rows_kernel
from moebench.kernels.triton.gemm2 import gemm2_weighted_sum_kernel, topk_sum_kernel
from moebench.kernels.triton.options import Gemm1Plan, Gemm2Plan, LayerPlan
from moebench.kernels.triton.quant import gemm_scales, quant_meta, quantize_rows
from moebench.quant import FP8_DTYPE, scheme_of, stored

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _rows_arg(align: AlignResult, topk: int) -> Rows:
    """The GEMMs' Rows argument: the alignment's tensors (the expert map of a mapped direct
    alignment, else a dummy pointer) and its constexprs."""
    emap = align.expert_map if align.expert_map is not None else align.expert_ids
    return Rows(align.sorted_token_ids, align.expert_ids, emap, align.num_tokens_post_padded, tl.constexpr(topk),
                tl.constexpr(triton.next_power_of_2(topk)), tl.constexpr(align.expert_map is not None),
                tl.constexpr(align.token_rows))


def _flat_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    """(M, K) router weights -> (M*K,) contiguous fp32, one per flat pair (the kernels' layout)."""
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    return weights


def topk_sum(rows: torch.Tensor, out: torch.Tensor, topk: int, *, row_index: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """out (M, H) = the sum over K of each token's K rows of `rows` (R, H), in fp32 (both contiguous);
    returns out. The rows of token t are t*K .. t*K + K - 1 (R = M*K), or row_index[t*K + k] ((M*K,)
    int, any R; -1: no row, the pair adds nothing); weights (M, K): each row times its router weight first."""
    m, h = out.shape
    assert rows.shape[1] == h and rows.is_contiguous() and out.is_contiguous()
    assert row_index is not None or rows.shape[0] == m * topk
    interpreter_compat()
    if m:
        w = _flat_weights(weights) if weights is not None else rows
        idx = row_index.reshape(-1).contiguous() if row_index is not None else rows
        topk_sum_kernel[(m, triton.cdiv(h, 1024))](rows, out, idx, w, h, TOP_K=topk, GATHER=row_index is not None,
                                                   WEIGHTED=weights is not None, BLOCK=1024,
                                                   EXACT=interpreting() and out.dtype == torch.bfloat16)
    return out


def sorted_rows(x: torch.Tensor, align: AlignResult, topk: int, out: torch.Tensor | None = None,
                zero_pad: bool = True) -> torch.Tensor:
    """x (M, H) -> (max_padded, H): row r = x[sorted_token_ids[r] // topk] for the used rows,
    zeros for sentinels (zero_pad; else left unset, for a consumer whose rows are independent and
    whose padding rows nobody reads); rows past num_tokens_post_padded are left unset (no kernel
    reads them). out: a (max_padded, H) tensor of x's dtype to write, any strides (DeepGEMM's
    MN-major scales); None: a new contiguous one. fp8 rows move as they are."""
    interpreter_compat()
    rows, h = align.sorted_token_ids.numel(), x.shape[1]
    xs = torch.empty((rows, h), dtype=x.dtype, device=x.device) if out is None else out
    assert xs.shape == (rows, h) and xs.dtype == x.dtype
    r = min(32, align.block_size_m)  # r divides every block
    bh = 256 if x.element_size() > 1 else 512  # 16 KB of bf16 / fp8 per program
    sorted_rows_kernel[(triton.cdiv(rows, r), triton.cdiv(h, bh))](
        x, xs, align.sorted_token_ids, align.num_tokens_post_padded, align.num_pairs, h, x.stride(0), x.stride(1),
        xs.stride(0), xs.stride(1), TOPK=topk, ROWS=r, BLOCK_H=bh, ZERO_PAD=zero_pad, num_warps=4)
    return xs


def launch_gemm1(
    x: torch.Tensor,
    w13,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    plan: Gemm1Plan = Gemm1Plan(),
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    zero: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    activation: Activation = SILU,
    b13: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM1 + activation-and-mul on aligned pairs -> inter (max_padded, I), sorted rows, in x's dtype,
    with the code paths of `plan` (`options.plan_layer`; the default: the paired walk by pointers).
    activation (moebench.activation) picks the epilogue's function and w13's gate/up layout
    (interleaved for swigluoai: the paired walk reads gate row 2j and up row 2j + 1 through its
    strides; it needs the paired walk without TMA, unquantised); b13 (E_local, 2I): biases added
    before the activation, or None.
    plan.use_tma: weight tiles through TMA (the plan checked the device, `env.tma_ok`); plan.wide:
    the wide walk; plan.sorted_a: x's rows are first copied into sorted order (`sorted_rows`, one
    launch) and read through TMA from the copy (needs use_tma and wide); plan.k_groups: K steps per
    iteration of the paired walk (H a multiple of k_groups x BLOCK_SIZE_K).
    zero: a contiguous fp32 tensor that the kernel also sets to zero (GEMM2's accumulator).
    out_scale: (1,) fp32 static scale: inter comes back as float8_e4m3fn, bit for bit what
    `quantize_rows(inter, per-tensor scheme, out_scale)` makes of the out_dtype intermediate.

    fp8: w13 a QuantWeight, x (M, H) float8_e4m3fn with a_scale (M, G) fp32 (any row stride, 0 for
    per tensor); inter is then in out_dtype (default bf16)."""
    m, h = x.shape
    n_inter = w13.shape[1] // 2
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    assert align.block_size_m == bm, "alignment block size differs from BLOCK_SIZE_M"
    quantized = quant_meta(w13)["QUANT"] != 0
    interpreter_compat()
    upcast = interpreting() and x.dtype != torch.float32
    num_blocks = align.max_blocks
    bn1 = max(16, bn // 2)  # BLOCK_SIZE_N columns = half gate, half up
    act_dtype = (out_dtype or torch.bfloat16) if quantized else x.dtype
    inter = torch.empty((num_blocks * bm, n_inter), dtype=FP8_DTYPE if out_scale is not None else act_dtype,
                        device=x.device)
    if plan.k_groups > 1 and (plan.wide or h % (plan.k_groups * bk)):
        raise MoebenchError(f"GEMM1 takes {plan.k_groups} K steps per iteration in its paired walk with H a multiple "
                            f"of {plan.k_groups} x BLOCK_SIZE_K (H {h}, BLOCK_SIZE_K {bk})")
    if activation.interleaved and (plan.use_tma or plan.wide or plan.sorted_a or quantized):
        raise MoebenchError("swigluoai's interleaved w13 runs GEMM1's paired walk without TMA, unquantised or "
                            "weight-only (TritonOptions wide_gemm1 / use_tma off)")
    if plan.sorted_a and (not (plan.use_tma and plan.wide) or quantized):
        raise MoebenchError("sorted_a needs 16-bit inputs and the wide GEMM1 with TMA weight tiles (use_tma, wide)")
    if zero is not None:
        assert zero.dtype == torch.float32 and zero.is_contiguous()
    wq = stored(w13)
    stride_wn, gate_up = gate_up_args(wq, n_inter, activation, b13)
    scale_ptrs, scales = gemm_scales(w13, a_scale)
    zero_fill = ZeroFill(inter, 0, tl.constexpr(False)) if zero is None else ZeroFill(zero, zero.numel(),
                                                                                       tl.constexpr(True))
    fp8_out = Fp8Out(inter, tl.constexpr(False), tl.constexpr(_TL_DTYPES[act_dtype])) if out_scale is None else \
        Fp8Out(out_scale.to(device=x.device, dtype=torch.float32).reshape(1), tl.constexpr(True),
               tl.constexpr(_TL_DTYPES[act_dtype]))
    meta = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn1, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"],
                EVEN_K=h % bk == 0, UPCAST=upcast, IEEE_DOT=x.dtype == torch.float32 or upcast, USE_TMA=plan.use_tma,
                SWAP_AB=plan.swap_ab, num_warps=config["num_warps"], num_stages=config["num_stages"],
                **pdl_launch_args(plan.pdl))
    grid1 = (num_blocks * triton.cdiv(n_inter, bn1),)
    tail = (align.num_pairs, n_inter, h, num_blocks, x.stride(0), x.stride(1), wq.stride(0), stride_wn, wq.stride(2),
            inter.stride(0), inter.stride(1), scales, gate_up)
    if plan.wide:
        # one (2, BN, BK) box: gate rows of slice 2e, up rows of slice 2e + 1
        desc = TensorDescriptor.from_tensor(wq.view(-1, n_inter, h), [2, bn1, bk]) if plan.use_tma else wq
        x_desc = x
        if plan.sorted_a:
            x = sorted_rows(x, align, topk)
            x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        gemm1_wide_kernel[grid1](x, x_desc, wq, desc, inter, _rows_arg(align, topk), *scale_ptrs, zero_fill, fp8_out,
                                 *tail, A_TMA=plan.sorted_a, **meta)
    else:
        desc = TensorDescriptor.from_tensor(wq.view(-1, h), [bn1, bk]) if plan.use_tma else wq
        gemm1_paired_kernel[grid1](x, wq, desc, inter, _rows_arg(align, topk), *scale_ptrs, zero_fill, fp8_out, *tail,
                                   K_GROUPS=plan.k_groups, **meta)
    return inter


def launch_gemm2(
    inter: torch.Tensor,
    w2,
    topk_weights: torch.Tensor,
    align: AlignResult,
    topk: int,
    config: Mapping[str, int],
    plan: Gemm2Plan = Gemm2Plan(),
    a_scale: torch.Tensor | None = None,
    ws: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """GEMM2 [+ b2 (E_local, H), before the router weight] + router weight on aligned pairs -> ws
    (M, H) fp32, the sum over top-k done by atomic adds (`ws` given = already zeroed, e.g. by
    GEMM1; else zeroed here), with the code paths of `plan` (`options.plan_layer`).
    plan.split_k: K splits (clamped to whole BLOCK_SIZE_K steps); plan.use_tma: w2's tiles through
    TMA; plan.pdl: launched with programmatic dependent launch (after a launch_gemm1 with pdl).
    plan.pair_store: ws is (M*K, H) (any float dtype; given, or allocated in inter's 16-bit dtype,
    bf16 for fp8): each pair's weighted row is stored there, nothing summed (`topk_sum` does);
    the rows of pairs that are not aligned (remote experts) are not written. One K split only.

    fp8: w2 a QuantWeight, inter (max_padded, I) float8_e4m3fn with a_scale (max_padded, G)."""
    m, k = topk_weights.shape
    e_local, h, n_inter = w2.shape
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    interpreter_compat()
    upcast = interpreting() and inter.dtype != torch.float32
    num_blocks = align.max_blocks
    split_k = plan.split_k
    if plan.pair_store:
        if ws is None:
            ws = torch.empty((m * k, h), dtype=torch.bfloat16 if quant_meta(w2)["QUANT"] else inter.dtype,
                             device=inter.device)
        assert ws.shape == (m * k, h) and split_k == 1, "pair_store: ws is (M*K, H), one K split"
    elif ws is None:
        ws = torch.zeros((m, h), dtype=torch.float32, device=inter.device)
    split_k = max(1, min(int(split_k), triton.cdiv(n_inter, bk)))
    k_per_split = triton.cdiv(triton.cdiv(n_inter, split_k), bk) * bk
    split_k = triton.cdiv(n_inter, k_per_split)
    wq = stored(w2)
    desc = TensorDescriptor.from_tensor(wq.view(-1, n_inter), [bn, bk]) if plan.use_tma else wq
    scale_ptrs, scales = gemm_scales(w2, a_scale)
    grid2 = (num_blocks * triton.cdiv(h, bn), split_k)
    gemm2_weighted_sum_kernel[grid2](
        inter, wq, desc, ws, _flat_weights(topk_weights), _rows_arg(align, topk), *scale_ptrs, align.num_pairs, h,
        n_inter, num_blocks, k_per_split, inter.stride(0), inter.stride(1), wq.stride(0), wq.stride(1), wq.stride(2),
        ws.stride(0), ws.stride(1), scales, bias_arg(b2, ws),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"],
        EVEN_K=(n_inter % k_per_split == 0) and (k_per_split % bk == 0), UPCAST=upcast,
        IEEE_DOT=inter.dtype == torch.float32 or upcast, USE_TMA=plan.use_tma, PAIR_STORE=plan.pair_store,
        SWAP_AB=plan.swap_ab, num_warps=config["num_warps"], num_stages=config["num_stages"],
        **pdl_launch_args(plan.pdl),
    )
    return ws


def fused_moe_gemms(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    align: AlignResult,
    topk: int,
    plan: LayerPlan,
    out: torch.Tensor | None = None,
    *,
    a_scale: torch.Tensor | None = None,
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """The GEMM part on aligned pairs: x (M, H), w13 (E_local, 2I, H), w2 (E_local, H, I),
    topk_weights (M, K) -> out (M, H) in plan.out_dtype, weighted and summed over top-k: GEMM1
    (which zeroes GEMM2's fp32 accumulator), [the fp8 quantisation of the intermediate], GEMM2, a
    cast (none for an fp32 output, which is the accumulator itself); with plan.gemm2.pair_store
    per-pair rows and a `topk_sum` launch instead of the atomics, the cast and GEMM1's zeroing.
    plan: `options.plan_layer` of the same inputs.

    fp8 (w13, w2 QuantWeights of one scheme): x float8_e4m3fn (M, H) with a_scale (M, G). The
    intermediate is quantised with the scheme before GEMM2 (by GEMM1 itself for per-tensor scales,
    with w2.input_scale), as moebench.quant describes. bias: per-expert biases (b13 before the
    activation, b2 before the router weight)."""
    m, h = x.shape
    if out is None:
        out = alloc_output((m, h), plan.out_dtype, x.device)
    if m == 0:
        return out
    if plan.gemm2.pair_store:
        # Each pair's row, summed by `topk_sum` into out; rows of remote pairs are never written.
        acc = (torch.zeros if align.remote else torch.empty)((m * topk, h), dtype=plan.out_dtype, device=x.device)
    else:
        # GEMM2's fp32 accumulator, zeroed by GEMM1: an fp32 output is the accumulator itself (no cast).
        acc = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(
            (m, h), dtype=torch.float32, device=x.device)
    scheme = scheme_of(w13)
    inter = launch_gemm1(x, w13, align, topk, plan.config, plan.gemm1, a_scale, plan.out_dtype,
                         zero=None if plan.gemm2.pair_store else acc,
                         out_scale=w2.input_scale if plan.fp8_out else None, activation=plan.activation,
                         b13=None if bias is None else bias.b13)
    inter_scale = None
    if plan.fp8_out:
        inter_scale = w2.input_scale.to(device=x.device, dtype=torch.float32).reshape(1, 1).expand(inter.shape[0], 1)
    elif scheme is not None and not scheme.weight_only:
        # Only rows < num_tokens_post_padded are in use (read on the device), and of those only the
        # pairs' rows: GEMM2 masks the output rows of sentinels, whatever they hold. (The token-rows
        # layout has no sorted ids: there every row of a used block is quantised.)
        pair_rows = None if align.token_rows else (align.sorted_token_ids, align.num_pairs)
        inter, inter_scale = quantize_rows(inter, scheme, w2.input_scale, row_limit=align.num_tokens_post_padded,
                                           pair_rows=pair_rows)
    ws = launch_gemm2(inter, w2, topk_weights, align, topk, plan.down_config, plan.gemm2, inter_scale, ws=acc,
                      b2=None if bias is None else bias.b2)
    if plan.gemm2.pair_store:
        if out.is_contiguous():
            return topk_sum(ws, out, topk)
        out.copy_(topk_sum(ws, torch.empty_like(out, memory_format=torch.contiguous_format), topk))
    elif ws is not out:
        out.copy_(ws)
    return out
