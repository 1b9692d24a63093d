"""What a whole model needs per GPU: its weights under a layout, the KV cache one token costs on a
rank, and the largest batch a layout holds at a context length.

The MoE shape (moebench.models.MoEShape) is one layer; a fit needs the rest of the model too:
every layer's attention, the dense MLP layers, the embeddings and the LM head (`ModelSize`). It
comes from the model's config.json (the file a shape was read from) or, for a preset, from the
same values of its published config.json (`PRESET_SIZES`).

How a layout holds the model (`Placement`, as vLLM and SGLang run them):
- attention, the dense MLP layers, the shared experts and the embeddings are split over the
  `attn_tp` ranks of a TP group (DP attention: `attn_tp` = 1, every rank holds them whole);
- the routed experts are split by expert over `ep` ranks and within each expert over `etp`;
- KV cache: MLA's latent (DeepSeek) is one vector per token shared by the heads, so every rank of a
  TP group holds all of it; GQA's KV heads are split over the TP ranks, replicated once the group
  is larger than the KV-head count; under DP attention each rank holds only its own sequences.

Memory: the GPU's datasheet capacity (moebench.bench.hardware) less `RESERVE` (what vLLM's default
`--gpu-memory-utilization 0.9` leaves for activations, CUDA graphs and the allocator). The weights
come first; what is left is KV cache. The checkpoint's precision applies where it ships: fp8 and
integer checkpoints quantise every linear layer, MX/NV fp4 checkpoints the routed experts; the
embeddings, the LM head and the router stay 16-bit. KV cache is 16-bit (engines' default).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from moebench.errors import MoebenchError

#: Fraction of a GPU's memory a layout may not use for weights and KV cache (vLLM's default
#: --gpu-memory-utilization 0.9 leaves 10% to activations, CUDA graphs and the allocator).
RESERVE = 0.10
#: Bytes of one KV-cache element (bf16, the engines' default kv-cache dtype "auto" for bf16 models).
KV_BYTES = 2
GiB = 2**30


@dataclass(frozen=True)
class ModelSize:
    """The model around its MoE layers. layers: decoder layers (without a multi-token-prediction
    head, which engines load only for speculative decoding); moe_layers: those with routed experts
    (the rest have a dense MLP of `dense_intermediate`); vocab, tied: embeddings and LM head;
    attention: heads, kv_heads, head_dim (GQA), or MLA's ranks (kv_lora_rank > 0: q_lora_rank,
    qk_rope_dim, qk_nope_dim, v_head_dim); sliding_layers of `window` tokens hold at most that
    many tokens of KV; source: where the numbers come from."""

    layers: int
    moe_layers: int
    dense_intermediate: int
    vocab: int
    tied: bool
    heads: int
    kv_heads: int
    head_dim: int
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    sliding_layers: int = 0
    window: int = 0
    source: str = ""

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self, hidden: int) -> int:
        """Parameters of one layer's attention projections (norms and biases left out)."""
        if self.mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = (hidden * self.q_lora_rank + self.q_lora_rank * self.heads * qk) if self.q_lora_rank else \
                hidden * self.heads * qk
            kv = hidden * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank * self.heads * (
                self.qk_nope_dim + self.v_head_dim)
            return q + kv + self.heads * self.v_head_dim * hidden
        q_out = self.heads * self.head_dim
        return 2 * hidden * q_out + 2 * hidden * self.kv_heads * self.head_dim

    def kv_elements(self, tp: int) -> int:
        """KV-cache elements one token costs one rank of a TP group of `tp`, per full-attention
        layer: MLA's latent + rope key whole on every rank; GQA's K and V of ceil(kv_heads / tp)
        heads (one head, replicated, where tp > kv_heads)."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * math.ceil(self.kv_heads / tp) * self.head_dim


def total_params(shape, size: ModelSize) -> int:
    """Parameters of the whole model (for the published totals; norms and biases left out)."""
    h = shape.hidden
    expert = 3 * h * shape.intermediate
    shared = 3 * h * shape.shared_intermediate
    moe = shape.num_experts * expert + shared + shape.num_experts * h
    dense = 3 * h * size.dense_intermediate
    embed = size.vocab * h * (1 if size.tied else 2)
    return (size.layers * size.attention_params(h) + size.moe_layers * moe
            + (size.layers - size.moe_layers) * dense + embed)


def _p(layers, moe, dense, vocab, heads, kv, hd, source, tied=False, **kw) -> ModelSize:
    return ModelSize(layers, moe, dense, vocab, tied, heads, kv, hd, source=source, **kw)


_MLA_V3 = dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128)
_HF = "https://huggingface.co/{}/blob/main/config.json"

#: Whole-model sizes of the presets, from the same config.json as the preset's MoE shape
#: (num_hidden_layers, first_k_dense_replace / decoder_sparse_step, intermediate_size,
#: vocab_size, tie_word_embeddings, the attention fields). Presets with an attention these formulas
#: do not cover (Qwen3-Next's linear attention) are absent: their fit needs a config.json.
PRESET_SIZES: dict[str, ModelSize] = {
    "deepseek-v3": _p(61, 58, 18432, 129280, 128, 128, 128, _HF.format("deepseek-ai/DeepSeek-V3"), **_MLA_V3),
    "deepseek-r1": _p(61, 58, 18432, 129280, 128, 128, 128, _HF.format("deepseek-ai/DeepSeek-R1"), **_MLA_V3),
    "deepseek-v2": _p(60, 59, 12288, 102400, 128, 128, 128, _HF.format("deepseek-ai/DeepSeek-V2"), **_MLA_V3),
    "deepseek-v2-lite": _p(27, 26, 10944, 102400, 16, 16, 128, _HF.format("deepseek-ai/DeepSeek-V2-Lite"),
                           **{**_MLA_V3, "q_lora_rank": 0}),
    "qwen3-235b-a22b": _p(94, 94, 0, 151936, 64, 4, 128, _HF.format("Qwen/Qwen3-235B-A22B")),
    "qwen3-30b-a3b": _p(48, 48, 0, 151936, 32, 4, 128, _HF.format("Qwen/Qwen3-30B-A3B")),
    "qwen2-moe-a2.7b": _p(24, 24, 0, 151936, 16, 16, 128, _HF.format("Qwen/Qwen1.5-MoE-A2.7B")),
    "gpt-oss-120b": _p(36, 36, 0, 201088, 64, 8, 64, _HF.format("openai/gpt-oss-120b"), sliding_layers=18,
                       window=128),
    "gpt-oss-20b": _p(24, 24, 0, 201088, 64, 8, 64, _HF.format("openai/gpt-oss-20b"), sliding_layers=12, window=128),
    "mixtral-8x7b": _p(32, 32, 0, 32000, 32, 8, 128, _HF.format("mistralai/Mixtral-8x7B-v0.1")),
    "mixtral-8x22b": _p(56, 56, 0, 32000, 48, 8, 128, _HF.format("mistralai/Mixtral-8x22B-v0.1")),
    "olmoe-1b-7b": _p(16, 16, 0, 50304, 16, 16, 128, _HF.format("allenai/OLMoE-1B-7B-0924")),
    "dbrx": _p(40, 40, 0, 100352, 48, 8, 128, _HF.format("databricks/dbrx-base")),
    "llama4-scout": _p(48, 48, 0, 202048, 40, 8, 128, _HF.format("meta-llama/Llama-4-Scout-17B-16E")),
}


def _int(cfg: dict, *keys, default=None):
    for k in keys:
        cur = cfg
        for part in k.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is not None:
            if not isinstance(cur, int) or isinstance(cur, bool) or cur < 0:
                raise MoebenchError(f"config.json: {k} must be a non-negative integer, got {cur!r}")
            return cur
    return default


def size_from_config(cfg: dict, hidden: int, where: str) -> ModelSize | None:
    """The ModelSize of a config.json's text model (its `text_config` where it has one), None when
    it does not say how many layers it has (the fit is then of the MoE layer alone)."""
    for sub in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(sub), dict) and cfg[sub].get("num_hidden_layers"):
            cfg = cfg[sub]
    layers = _int(cfg, "num_hidden_layers", "n_layers", "num_layers")
    if not layers:
        return None
    dense_first = _int(cfg, "first_k_dense_replace", default=0)
    step = _int(cfg, "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq", default=1) or 1
    only = cfg.get("mlp_only_layers") or []
    moe = sum(1 for i in range(layers) if i >= dense_first and (i + 1) % step == 0 and i not in only)
    heads = _int(cfg, "num_attention_heads", "n_heads", "n_head", default=1) or 1
    kv = _int(cfg, "num_key_value_heads", "attn_config.kv_n_heads", default=heads) or heads
    hd = _int(cfg, "head_dim", default=hidden // heads) or hidden // heads
    types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    sliding = sum(1 for t in types if "sliding" in str(t))
    return ModelSize(
        layers=layers, moe_layers=moe, dense_intermediate=_int(cfg, "intermediate_size", default=0) or 0,
        vocab=_int(cfg, "vocab_size", default=0) or 0, tied=bool(cfg.get("tie_word_embeddings", False)),
        heads=heads, kv_heads=kv, head_dim=hd, q_lora_rank=_int(cfg, "q_lora_rank", default=0) or 0,
        kv_lora_rank=_int(cfg, "kv_lora_rank", default=0) or 0, qk_rope_dim=_int(cfg, "qk_rope_head_dim", default=0) or 0,
        qk_nope_dim=_int(cfg, "qk_nope_head_dim", default=0) or 0, v_head_dim=_int(cfg, "v_head_dim", default=0) or 0,
        sliding_layers=sliding, window=_int(cfg, "sliding_window", default=0) or 0 if sliding else 0, source=where)


def model_size(shape) -> ModelSize | None:
    """The whole model of `shape`: read again from the config.json it came from, else its preset's
    PRESET_SIZES entry; None for a shape given by its size flags (only its MoE layer is known)."""
    src = shape.source or ""
    if src and os.path.isfile(src):
        with open(src, encoding="utf-8") as f:
            return size_from_config(json.load(f), shape.hidden, src)
    return PRESET_SIZES.get(shape.name)


@dataclass(frozen=True)
class Placement:
    """How one rank of a layout holds the model: attention / dense / shared / embeddings split over
    `attn_tp` ranks; routed experts split by expert over `ep` ranks and within each over `etp`;
    `dp_attention`: each rank serves its own sequences (the KV of a replica = ranks x one rank's)."""

    attn_tp: int
    ep: int
    etp: int
    dp_attention: bool
    ranks: int  # ranks of one replica


def _linear_bytes(n: int, k: int, quant, act_bytes: int) -> float:
    return quant.weight_bytes(n, k, act_bytes) if quant is not None else n * k * act_bytes


def rank_weight_bytes(shape, size: ModelSize | None, place: Placement, quant, act_bytes: int = 2,
                      experts_only_quant: bool = False) -> float:
    """Bytes of weights on the busiest rank of `place`. quant: the routed experts' scheme (None:
    `act_bytes` per value); experts_only_quant: the other linear layers stay 16-bit (MX/NV fp4
    checkpoints); without a ModelSize, one MoE layer."""
    h = shape.hidden
    other_quant = None if experts_only_quant else quant
    i_r = shape.intermediate // place.etp
    e_r = math.ceil(shape.num_experts / place.ep)
    experts = e_r * (_linear_bytes(2 * i_r, h, quant, act_bytes) + _linear_bytes(h, i_r, quant, act_bytes))
    if shape.expert_bias:
        experts += e_r * (2 * i_r + h) * act_bytes
    si = shape.shared_intermediate // place.attn_tp
    shared = (_linear_bytes(2 * si, h, other_quant, act_bytes) + _linear_bytes(h, si, other_quant, act_bytes)) if si else 0
    router = shape.num_experts * h * act_bytes
    if size is None:
        return experts + shared + router
    moe_layer = experts + shared + router
    di = size.dense_intermediate // place.attn_tp
    dense = _linear_bytes(2 * di, h, other_quant, act_bytes) + _linear_bytes(h, di, other_quant, act_bytes)
    per_value = _linear_bytes(h, h, other_quant, act_bytes) / (h * h)  # the scheme's bytes per value, scales included
    attn = size.attention_params(h) / place.attn_tp * per_value
    embed = size.vocab * h * act_bytes * (1 if size.tied else 2) / place.attn_tp
    return (size.moe_layers * moe_layer + (size.layers - size.moe_layers) * dense + size.layers * attn + embed)


def kv_bytes_per_token(size: ModelSize, place: Placement, context: int) -> float:
    """KV-cache bytes one rank keeps for one token of a sequence of `context` tokens (sliding-window
    layers hold at most their window, spread over the context)."""
    per_layer = size.kv_elements(place.attn_tp) * KV_BYTES
    full = size.layers - size.sliding_layers
    sliding = size.sliding_layers * min(1.0, size.window / context) if size.window else size.sliding_layers
    return per_layer * (full + sliding)


@dataclass(frozen=True)
class Fit:
    """One layout's fit on a GPU: weights and usable memory per rank (bytes), the KV left, and the
    sequences of `context` tokens one replica holds (None: the model around the MoE layer is unknown)."""

    weights: float
    usable: float
    kv_free: float
    sequences: int | None
    context: int
    whole_model: bool

    @property
    def fits(self) -> bool:
        return self.weights <= self.usable and (self.sequences is None or self.sequences >= 1)

    def describe(self) -> str:
        what = "weights" if self.whole_model else "one MoE layer's weights"
        text = f"{what} {self.weights / GiB:.0f} of {self.usable / GiB:.0f} GiB per rank"
        if not self.fits:
            return text + " (does not fit)"
        return text + (f", holds {self.sequences} x {self.context} tokens" if self.sequences is not None else "")


def fit(shape, size: ModelSize | None, place: Placement, quant, memory_gib: float, context: int,
        act_bytes: int = 2, experts_only_quant: bool = False) -> Fit:
    """The fit of one layout (`place`) of the model on a GPU of `memory_gib` GiB at `context`
    tokens per sequence."""
    usable = memory_gib * GiB * (1 - RESERVE)
    w = rank_weight_bytes(shape, size, place, quant, act_bytes, experts_only_quant)
    free = max(0.0, usable - w)
    seqs = None
    if size is not None:
        per_seq = kv_bytes_per_token(size, place, context) * context
        one_rank = int(free // per_seq) if per_seq else 0
        seqs = one_rank * place.ranks if place.dp_attention else one_rank
    return Fit(w, usable, free, seqs, context, size is not None)


def experts_only(quant, shape) -> bool:
    """True where the checkpoint's precision covers the routed experts only (MX/NV fp4: gpt-oss's
    mxfp4, NVFP4 expert checkpoints); fp8 and integer checkpoints quantise every linear layer."""
    return quant is not None and quant.name in ("mxfp4", "nvfp4")
