"""Helpers shared by the GPU tests (tests/gpu is on sys.path when pytest runs them)."""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, renormalised: (weights (M, k) fp32, ids (M, k) int32)."""
    tw, ti = torch.softmax(logits, -1).topk(k, -1)
    return tw / tw.sum(-1, keepdim=True), ti.to(torch.int32)


def first_experts_map(e: int, e_local: int) -> torch.Tensor | None:
    """The EP shard holding the first e_local of e experts: (e,) int32 map, or None when all are local."""
    if e_local >= e:
        return None
    emap = torch.full((e,), -1, dtype=torch.int32, device="cuda")
    emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device="cuda")
    return emap


def replay_on_new_inputs(graph, x: torch.Tensor, seed: int, logits: torch.Tensor | None = None) -> None:
    """New routing logits (when given) and activations into the captured buffers, then one replay."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if logits is not None:
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=g))
    x.copy_(torch.randn(x.shape, device="cuda", generator=g, dtype=x.dtype))
    graph.replay()
    torch.cuda.synchronize()
