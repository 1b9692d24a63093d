"""The batched layout (E_local, T, H) built and reduced in two Triton launches, for the
prepare/finalizes that build it themselves (`batched-local`, `all2all-ll`):

    batched_rows   x (M, H) -> (E_local, T, H): each (token, k) pair's row copied into its slot
                   (slot_map, moebench.kernels.token_layout.batched_slots); rows past each
                   expert's count are left unset, a pair on another rank (slot -1) copies nothing
    reduce         (E_local, T, H) -> (M, H): each token's K slot rows times their router weights,
                   summed in fp32 (moebench.kernels.triton.launch.topk_sum, gathered)

Both read and write each row once; the torch forms (token_layout.scatter_to_batched,
modular.TopKWeightAndReduceBatched) stay for a device Triton does not run on."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels.modular import TopKWeightAndReduceBatched
from moebench.kernels.token_layout import scatter_to_batched
from moebench.kernels.triton.env import interpreter_compat, triton_unavailable_reason
from moebench.kernels.triton.launch import topk_sum

BLOCK = 1024


@triton.jit
def batched_rows_kernel(x_ptr, out_ptr, slot_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    # Program (p, c): pair p's token row, columns c * BLOCK .., into row slot[p] of out.
    p = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + p).to(tl.int64)
    if slot < 0:  # the pair's expert is on another rank
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    v = tl.load(x_ptr + (p // TOP_K) * H + offs, mask=ok)
    tl.store(out_ptr + slot * H + offs, v, mask=ok)


def runs_triton(t: torch.Tensor) -> bool:
    """Whether Triton runs on t's device here (env.triton_unavailable_reason)."""
    return triton_unavailable_reason(t.device.type) is None


def batched_rows(x: torch.Tensor, slot_map: torch.Tensor, num_local: int, max_tokens: int) -> torch.Tensor:
    """x (M, H) and slot_map (M, K) -> (E_local, max_tokens, H) in x's dtype (fp8 rows move as bytes);
    rows past each expert's count are garbage."""
    if not runs_triton(x):
        return scatter_to_batched(x, slot_map, num_local, max_tokens)
    src = x.contiguous()
    if src.element_size() == 1:
        src = src.view(torch.uint8)
    m, k = slot_map.shape
    h = src.shape[-1]
    out = torch.empty((num_local * max_tokens, h), dtype=src.dtype, device=src.device)
    if m:
        interpreter_compat()
        batched_rows_kernel[(m * k, triton.cdiv(h, BLOCK))](src, out, slot_map.reshape(-1).contiguous(), h,
                                                           TOP_K=k, BLOCK=BLOCK)
    return out.view(x.dtype).view(num_local, max_tokens, h)


class TopKWeightAndReduceBatchedTriton(TopKWeightAndReduceBatched):
    """The batched reduce in one gathered top-k sum launch where Triton runs (else the torch form)."""

    def apply(self, out, topk_weights, slot_map):
        if not runs_triton(out):
            return super().apply(out, topk_weights, slot_map)
        e, t, h = out.shape
        m, k = slot_map.shape
        y = torch.empty((m, h), dtype=out.dtype, device=out.device)
        return topk_sum(out.reshape(e * t, h), y, k, row_index=slot_map, weights=topk_weights)
