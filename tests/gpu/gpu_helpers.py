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


_WEIGHTS: dict = {}


def quantized_case(dims: tuple[int, int, int, int, int], m: int, scheme, seed: int = 0):
    """A layer of `dims` (E global, topk, H, I, E local) with bf16 weights quantised by `scheme`
    (the last shape's weights kept between calls) and `m` routed bf16 tokens: (x, w13, w2,
    topk_weights, topk_ids, expert_map, E). Routing leans towards the local experts, so an EP
    shard's M = 1 hits one."""
    from moebench.quant import quantize_weights

    e, k, h, i, e_local = dims
    key = (dims, scheme)
    if key not in _WEIGHTS:
        g = torch.Generator(device="cuda").manual_seed(seed)
        w13 = torch.randn(e_local, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5
        w2 = torch.randn(e_local, h, i, device="cuda", generator=g, dtype=torch.bfloat16) / i**0.5
        _WEIGHTS.clear()
        _WEIGHTS[key] = quantize_weights(w13, w2, scheme, act_dtype=torch.bfloat16)
    q13, q2 = _WEIGHTS[key]
    g = torch.Generator(device="cuda").manual_seed(seed + m)
    x = torch.randn(m, h, device="cuda", generator=g, dtype=torch.bfloat16)
    logits = torch.randn(m, e, device="cuda", generator=g)
    logits[:, :e_local] += 1.0
    tw, ti = softmax_topk(logits, k)
    return x, q13, q2, tw, ti, first_experts_map(e, e_local), e


def assert_graph_replays_follow_reference(experts: str, prepare_finalize: str, case: tuple, tol: float) -> None:
    """The layer of `case` (quantized_case's tuple) captured into one CUDA graph: two replays on
    new activations each match the reference within `tol`."""
    import moebench
    from moebench.bench.timing import capture_graph
    from moebench.correctness import relative_error

    x, q13, q2, tw, ti, emap, e = case
    kernel = moebench.make_kernel(experts, prepare_finalize)
    graph, out = capture_graph(lambda: kernel.apply(x, q13, q2, tw, ti, expert_map=emap, num_experts=e))
    for seed in (5, 6):
        replay_on_new_inputs(graph, x, seed)
        err = relative_error(out, moebench.reference_moe(x, q13, q2, tw, ti, emap))
        assert err < tol, err
