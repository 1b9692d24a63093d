"""The Triton experts backends: `triton` (Standard format) and `batched-triton` (BatchedExperts).

`triton` is moebench's sorted-token fused MoE layer:

    align   (token, k) pairs grouped by local expert in blocks of BLOCK_SIZE_M
            (moebench.kernels.triton.align; one small kernel, two above 1024 pairs, or none:
            `direct_align`, one block per pair, at one token; no host sync)
    GEMM1   act(x w_gate [+ b_gate]) * (x w_up [+ b_up]) per block and intermediate tile
            (moebench.kernels.triton.gemm1; SiLU by default, any moebench.activation)
    GEMM2   inter @ w2^T [+ b2], times the router weight, summed over top-k by fp32 atomics
    cast    the fp32 sum -> the output dtype
            (at prefill with a short GEMM2 K loop, `pair_store`: GEMM2 stores each pair's row and
            one launch sums them over top-k in place of the atomics and the cast)

So the experts return (M, H), weighted and summed (TopKWeightAndReduceNoOp): one write of the
output instead of (M, K, H) plus a reduction pass. Pairs whose expert is remote are left out by
the alignment and add nothing. Tile configs: the tuned-file lookup (moebench.kernels.triton.configs,
GEMM2's own from a `_down.json` file where there is one), else the default heuristic, or an
explicit `config=`. GEMM2 may split its K loop (I) over programs when there are too few output
tiles to fill the GPU, or where its grid runs in a few waves of long K loops (`split_k`, chosen by
`options.layer_split_k` unless given). Every code path is chosen by a TritonOptions
(moebench.kernels.triton.options), resolved once per call into the plan the launchers run
(`options.plan_layer`, moebench.kernels.triton.launch).

`batched-triton` runs moebench.kernels.triton.batched on (E_local, T, H) and leaves weighting and
the sum over top-k to the prepare/finalize.

fp8_w8a8 weights (every scale kind of moebench.quant) take the activations prepare quantised
(prep.a fp8 + prep.a_scale); the output is in prep.out_dtype. `fused_moe` also quantises a 16-bit
x itself. Weight-only weights (int8_w8a16, int4_w4a16, mxfp4) take the 16-bit activations as they
are; the GEMMs dequantise the packed weight tiles (moebench.kernels.triton.wquant).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from moebench.activation import ACTIVATIONS, SILU, Activation
from moebench.errors import MoebenchError
from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    ExpertBias,
    PrepareResult,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    alloc_output,
)
from moebench.kernels.triton.align import align_pairs
from moebench.kernels.triton.batched import batched_default_config, batched_moe, mean_rows
from moebench.kernels.triton.configs import layer_config, lookup_config, lookup_down_config, quant_default
from moebench.kernels.tuned_files import TileConfig, config_search_dirs, device_name, validate_tile_config
from moebench.kernels.triton.env import triton_unavailable_reason
from moebench.kernels.triton.launch import fused_moe_gemms
from moebench.kernels.triton.options import TritonOptions, plan_layer, resolve_pdl
from moebench.kernels.triton.quant import quantize_rows
from moebench.quant import FP8_DTYPE, QUANT_KINDS, QuantScheme, scheme_of


def _interleaved_quant_reason(name: str, activation: Activation, quant: QuantScheme | None) -> str | None:
    """swigluoai's interleaved w13 is read through the paired walk's strides; the weight-only
    schemes follow its rows, the fp8 paths (with their activation quantisation) do not."""
    if activation.interleaved and quant is not None and not quant.weight_only:
        return f"experts '{name}': swigluoai's interleaved w13 runs unquantised or weight-only (not {quant.describe()})"
    return None


def select_config(
    m: int, topk: int, w13, w2, num_experts: int, dtype: torch.dtype, folders: tuple[Path, ...] | None = None
) -> tuple[TileConfig, str]:
    """GEMM1's config for m tokens: the tuned file (E = local experts, N = I) along `folders`
    (None: `config_search_dirs()` now) else the default heuristic over global experts
    (`configs.layer_config`). Quantised weights look up the scheme's file
    (dtype=fp8_w8a8[,block_shape=[..]]) and fit the default to the scale block."""
    e_local, h, n_inter = w2.shape
    return layer_config(m, local_experts=e_local, inter=n_inter, hidden=h, topk=topk, num_experts=num_experts,
                        dtype=dtype, folders=config_search_dirs() if folders is None else folders,
                        device_name=device_name(w2.device), quant=scheme_of(w2))


def select_down_config(
    m: int, w2, gemm1: Mapping[str, int], dtype: torch.dtype, topk: int | None = None, num_experts: int | None = None,
    folders: tuple[Path, ...] | None = None,
) -> tuple[TileConfig | None, str]:
    """GEMM2's own config from a `_down.json` file along `folders` (None: `config_search_dirs()`
    now; `configs.lookup_down_config`), or (None, "GEMM1's config") without one."""
    e_local, _, n_inter = w2.shape
    return lookup_down_config(e_local, n_inter, max(m, 1), gemm1, dtype, device_name=device_name(w2.device),
                              folders=config_search_dirs() if folders is None else folders,
                              quant=scheme_of(w2), topk=topk, num_experts_global=num_experts)


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
    *,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    down_config: Mapping[str, Any] | None = None,
    options: TritonOptions | None = None,
    activation: Activation = SILU,
    bias: ExpertBias | None = None,
) -> torch.Tensor:
    """Whole experts step (activation / bias: the epilogues' function and per-expert biases,
    see `fused_moe_gemms`): x (M, H), w13 (E_local, 2I, H), w2 (E_local, H, I), topk_weights (M, K)
    float32, topk_ids (M, K) global ids, expert_map (E,) or None -> (M, H) in x's dtype.

    The alignment (`align_pairs`), then the GEMMs (`fused_moe_gemms`) with the plan the options
    (None: TritonOptions()) resolve to (`plan_layer`: GEMM2's K split, None: `layer_split_k`, and
    every code path); PDL is resolved once, for the alignment and both GEMMs. Without `config`, both configs come from the
    lookup (`select_config`, `select_down_config`); an explicit `config` is used for both GEMMs
    unless `down_config` is given too.

    fp8: w13 and w2 moebench.quant.QuantWeight of one scheme, and either
      - x float8_e4m3fn with a_scale (M, G) fp32 (as prepare makes them); the output is in
        out_dtype (default bf16), or
      - x bf16/fp16/fp32: quantised here (`quantize_rows`, w13.input_scale for per tensor); the
        output is in x's dtype (or out_dtype).
    Weight-only (int8_w8a16, int4_w4a16, mxfp4 QuantWeights): x stays in its 16-bit dtype (the one
    the weights were quantised for); the GEMMs dequantise the weight tiles; the output is in x's dtype."""
    options = options or TritonOptions()
    m, k = topk_ids.shape
    e_local = w13.shape[0]
    scheme = scheme_of(w13)
    if scheme_of(w2) != scheme:
        raise MoebenchError("w13 and w2 must be quantised with the same scheme (or both not at all)")
    if scheme is None or scheme.weight_only:
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
        folders = config_search_dirs()
        config, _ = select_config(m, k, w13, w2, num_experts, out_dtype, folders)
        if down_config is None:
            down_config, _ = select_down_config(m, w2, config, out_dtype, k, num_experts, folders)
    if m == 0:
        return alloc_output((0, x.shape[1]), out_dtype, x.device)
    pdl = resolve_pdl(options, x.device, w2.shape[2])
    align = align_pairs(topk_ids, config["BLOCK_SIZE_M"], e_local, expert_map, num_experts, scheme, options, pdl)
    plan = plan_layer(options, x, w13, w2, align, k, config, down_config, split_k, a_scale=a_scale, out_dtype=out_dtype,
                      num_experts=num_experts, activation=activation, pdl=pdl)
    return fused_moe_gemms(x, w13, w2, topk_weights, align, k, plan, a_scale=a_scale, bias=bias)


class TritonExperts(Experts):
    """Sorted-token fused MoE (Standard). Returns (M, H), weighted and summed over top-k.

    config: a TileConfig (vLLM keys) used for every call instead of the lookup; down_config:
    GEMM2's own (with config, same BLOCK_SIZE_M; without config the lookup also reads a `_down.json`
    file); split_k: GEMM2 K splits (None = `layer_split_k`); options: the code paths
    (TritonOptions; None = the defaults); config_dirs: the lookup's folders (None:
    `config_search_dirs()`, resolved here, once). fp8_w8a8 weights (all scales of moebench.quant)
    take the activations prepare quantised (prep.a fp8 + prep.a_scale); the output is in
    prep.out_dtype.
    """

    name = "triton"
    activation_format = ActivationFormat.STANDARD
    supported_quant = QUANT_KINDS
    quantizes_input = False
    supported_activations = ACTIVATIONS
    supports_bias = True

    def __init__(
        self,
        config: Mapping[str, int] | None = None,
        split_k: int | None = None,
        down_config: Mapping[str, Any] | None = None,
        options: TritonOptions | None = None,
        config_dirs: tuple[Path, ...] | None = None,
    ):
        self.config = validate_tile_config(dict(config), "TritonExperts config") if config is not None else None
        self.config_dirs = tuple(config_dirs) if config_dirs is not None else \
            config_search_dirs() if self.config is None else ()
        self.down_config = (validate_tile_config(dict(down_config), "TritonExperts down_config", down=True)
                            if down_config is not None else None)
        if self.config is not None and self.down_config is not None and \
                self.config["BLOCK_SIZE_M"] != self.down_config["BLOCK_SIZE_M"]:
            raise MoebenchError("TritonExperts: down_config's BLOCK_SIZE_M must equal config's (one alignment)")
        self.split_k = split_k
        self.options = options or TritonOptions()

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
        cfg, src = select_config(m, topk, w13, w2, num_experts, dtype, self.config_dirs)
        down, down_src = (dict(self.down_config), "explicit") if self.down_config is not None else \
            select_down_config(m, w2, cfg, dtype, topk, num_experts, self.config_dirs)
        self.last_config_source = src + (f"; GEMM2: {down_src}" if down_src != "GEMM1's config" else "")
        return dict(cfg), (dict(down) if down is not None else None)

    @classmethod
    def activation_unavailable_reason(cls, activation, bias, quant=None):
        return _interleaved_quant_reason(cls.name, activation, quant) or \
            super().activation_unavailable_reason(activation, bias, quant)

    def apply(self, prep: PrepareResult, w13, w2, *, activation: Activation = SILU,
              bias: ExpertBias | None = None) -> torch.Tensor:
        self.check_activation(activation, bias, scheme_of(w13))
        x = prep.a
        m, k = prep.topk_ids.shape
        out_dtype = None
        dtype = x.dtype
        scheme = scheme_of(w13)
        if scheme is not None and not scheme.weight_only:
            out_dtype = prep.out_dtype or (torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype)
            dtype = out_dtype
        cfg, down = self.config_for(m, k, w13, w2, prep.num_experts, dtype)
        return fused_moe(
            x, w13, w2, prep.topk_weights, prep.topk_ids, prep.expert_map, prep.num_experts, cfg, self.split_k,
            a_scale=prep.a_scale, out_dtype=out_dtype, down_config=down, options=self.options,
            activation=activation, bias=bias,
        )


class BatchedTritonExperts(Experts):
    """BatchedExperts: (E_local, T, H) -> (E_local, T, H) unweighted; weights applied by the P/F.

    config: a TileConfig used for every call (else the tuned-config lookup, else
    `batched_default_config`, fitted to the fp8 scale block for block-quantised weights); options:
    TritonOptions (its batched_wide_rows sizes the heuristic); config_dirs: the lookup's folders
    (None: `config_search_dirs()`, resolved here, once). fp8_w8a8 weights (all scales of
    moebench.quant) take the activations prepare quantised (prep.a fp8 + prep.a_scale); the
    output is in prep.out_dtype.
    """

    name = "batched-triton"
    activation_format = ActivationFormat.BATCHED
    supported_quant = QUANT_KINDS
    quantizes_input = False
    supported_activations = ACTIVATIONS
    supports_bias = True

    @classmethod
    def activation_unavailable_reason(cls, activation, bias, quant=None):
        return _interleaved_quant_reason(cls.name, activation, quant) or \
            super().activation_unavailable_reason(activation, bias, quant)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return triton_unavailable_reason(device)

    def __init__(self, config: Mapping[str, int] | None = None, options: TritonOptions | None = None,
                 config_dirs: tuple[Path, ...] | None = None):
        self.config = validate_tile_config(dict(config), "BatchedTritonExperts config") if config is not None else None
        self.config_dirs = tuple(config_dirs) if config_dirs is not None else \
            config_search_dirs() if self.config is None else ()
        self.options = options or TritonOptions()

    def weight_and_reduce(self):
        return TopKWeightAndReduceDelegate()

    def config_for(
        self, t: int, e_local: int, n_inter: int, hidden: int, dtype: torch.dtype, quant: QuantScheme | None = None,
        device_type: str = "cuda", tokens: int | None = None, topk: int | None = None,
        num_experts: int | None = None,
    ) -> dict[str, Any]:
        """The config for a (e_local, t, hidden) batch of `tokens` routed tokens with `topk`
        experts each over `num_experts` (PrepareResult.num_tokens / topk / num_experts): the
        explicit one, else the tuned-config lookup (E = local experts, N = I, the entry nearest to
        `tokens`: the config the sorted-token kernel runs with for the same load), else
        `batched_default_config` at the mean routed pairs per expert (t when the load is unknown).
        last_config_source says which.

        vLLM's batched experts key the lookup on the buffer's rows per expert instead; an H200
        run (PERF.md) measured that 1.4-3.4x slower than the heuristic at 64-256 rows
        per expert (it picks the entries tuned for 64-256 tokens in all)."""
        if self.config is not None:
            self.last_config_source = "explicit"
            return dict(self.config)
        default = batched_default_config(mean_rows(t, tokens, topk, num_experts), n_inter, hidden, dtype, self.options)
        if quant is not None:
            default = quant_default(default, quant)
        if tokens is None:
            self.last_config_source = "default heuristic (token count unknown)"
            return dict(default)
        cfg, self.last_config_source = lookup_config(
            e_local, n_inter, max(tokens, 1), dtype, device_name=device_name(device_type), folders=self.config_dirs,
            quant=quant, default=default, topk=topk, num_experts_global=num_experts)
        return dict(cfg)

    def apply(self, prep: PrepareResult, w13, w2, *, activation: Activation = SILU,
              bias: ExpertBias | None = None) -> torch.Tensor:
        self.check_activation(activation, bias, scheme_of(w13))
        a = prep.a
        scheme = scheme_of(w13)
        out_dtype = None
        dtype = a.dtype
        if scheme is not None and not scheme.weight_only:
            out_dtype = prep.out_dtype or (torch.bfloat16 if a.dtype == FP8_DTYPE else a.dtype)
            dtype = out_dtype
        cfg = self.config_for(a.shape[1], a.shape[0], w2.shape[2], a.shape[2], dtype, scheme, a.device.type,
                              prep.num_tokens, prep.topk, prep.num_experts)
        return batched_moe(a, prep.expert_num_tokens, w13, w2, cfg, prep.a_scale, out_dtype, activation, bias)
