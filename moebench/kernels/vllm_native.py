"""vLLM's own fused-MoE Triton experts (`vllm`, Standard), when the `vllm` package imports on a
CUDA machine: the engine itself, beside moebench's implementation of its structure (`vllm-triton`).

What is called (vLLM's Python API, read from its fused_moe package):

  vllm.model_executor.layers.fused_moe.override_config(config)       context manager: every
      fused-MoE launch inside it uses `config` (the six tile keys) instead of vLLM's file lookup
  vllm.model_executor.layers.fused_moe.fused_moe.fused_experts(x, w1, w2, topk_weights, topk_ids,
      ..., expert_map=..., global_num_experts=..., <quantisation>)
      x (M, H) bf16/fp16, w1 = w13 (E_local, 2I, H), w2 (E_local, H, I): moebench's layouts as they
      are; topk_ids global, with expert_map (E,) -> local id or -1 under expert parallelism.
  fp8 block weights: newer vLLM takes `quant_config=fp8_w8a8_moe_quant_config(w1_scale, w2_scale,
      block_shape=[bn, bk])` (vllm.model_executor.layers.fused_moe.config); older vLLM takes
      `use_fp8_w8a8=True, w1_scale=, w2_scale=, block_shape=`. Which one is read from
      fused_experts' signature. The scales are moebench's block scales (E, ceil(N/bn), ceil(K/bk))
      float32, vLLM's layout.

vLLM quantises the activations itself (1 x bk groups), applies the router weights in GEMM2 and
sums over top-k, so this backend, like `vllm-triton`, returns the finished (M, H).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from typing import Any, Mapping

import torch

from moebench.errors import MoebenchError
from moebench.kernels.modular import ActivationFormat, Experts, PrepareResult, TopKWeightAndReduceNoOp
from moebench.kernels.tuned_files import TILE_KEYS, validate_tile_config
from moebench.quant import FP8_DTYPE, scheme_of

#: vLLM's fused-MoE package (its public entry points live here)
FUSED_MOE = "vllm.model_executor.layers.fused_moe"


def vllm_unavailable_reason(device: str) -> str | None:
    """Why vLLM's own kernel cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (the `vllm-triton` experts follow its kernel's structure without it)"
    if not str(device).startswith("cuda"):
        return "vLLM's fused-MoE Triton kernel needs a CUDA GPU"
    return None


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def quant_kwargs(fused_experts, w13, w2) -> dict[str, Any]:
    """fused_experts' quantisation arguments for moebench's fp8 block weights, in whichever of
    vLLM's two APIs this vLLM has (none for 16-bit weights)."""
    quant = scheme_of(w13)
    if quant is None:
        return {}
    block = [int(b) for b in quant.block_shape]
    if "quant_config" in inspect.signature(fused_experts).parameters:
        make = importlib.import_module(f"{FUSED_MOE}.config").fp8_w8a8_moe_quant_config
        return {"quant_config": make(w1_scale=w13.scale, w2_scale=w2.scale, block_shape=block)}
    return {"use_fp8_w8a8": True, "w1_scale": w13.scale, "w2_scale": w2.scale, "block_shape": block}


def vllm_own_fused_experts(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Mapping[str, int] | None = None,
    expert_map: torch.Tensor | None = None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """vLLM's fused_experts on moebench's tensors -> (M, H) in x's dtype; `config` overrides vLLM's
    file lookup for every launch (None: vLLM looks up its own files)."""
    package = importlib.import_module(FUSED_MOE)
    fused_experts = importlib.import_module(f"{FUSED_MOE}.fused_moe").fused_experts
    if scheme_of(w13) != scheme_of(w2):
        raise MoebenchError("w13 and w2 must be quantised with the same scheme (or both not at all)")
    w1q, w2q = (w13.q, w2.q) if scheme_of(w13) is not None else (w13, w2)
    kw = quant_kwargs(fused_experts, w13, w2)
    if expert_map is not None:
        kw.update(expert_map=expert_map, global_num_experts=int(num_experts if num_experts is not None
                                                               else expert_map.shape[0]))
    ctx = (package.override_config({k: int(config[k]) for k in TILE_KEYS}) if config is not None
           else contextlib.nullcontext())
    with ctx:
        return fused_experts(x, w1q, w2q, topk_weights, topk_ids, **kw)


class VllmExperts(Experts):
    """vLLM's own fused_experts (Standard): (M, H), weighted and summed over top-k. config: one
    TileConfig for every call (a tune's candidate; vLLM's override_config), None for vLLM's lookup."""

    name = "vllm"
    activation_format = ActivationFormat.STANDARD
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_devices = ("cuda",)
    supported_quant = ("block",)
    quantizes_input = True

    def __init__(self, config: Mapping[str, int] | None = None):
        self.config = validate_tile_config(dict(config), "VllmExperts config") if config is not None else None

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return vllm_unavailable_reason(device)

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    def apply(self, prep: PrepareResult, w13, w2) -> torch.Tensor:
        if prep.a.dtype == FP8_DTYPE:
            raise MoebenchError("vllm quantises its own input: hand it bf16/fp16 activations")
        return vllm_own_fused_experts(prep.a, w13, w2, prep.topk_weights, prep.topk_ids, self.config,
                                      prep.expert_map, prep.num_experts)
