"""Softmax top-k routing in one Triton launch (the router step of the benchmark's layer).

    fused_topk_softmax(logits, topk)   logits (M, E) -> weights (M, K) float32, ids (M, K) int32
    topk_softmax_launch(m, e)          the launch shape it uses (tokens per program, warps)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moebench.kernels.triton.common import pdl_release
from moebench.kernels.triton.env import interpreter_compat
from moebench.kernels.triton.options import pdl_supported


@triton.jit
def topk_softmax_kernel(
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
    program than m, twice the tokens from 1024 on (up to 256 experts): the launch shapes that
    measured best (PERF.md section 5)."""
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
    release (None: on where `pdl_supported`, Hopper+): a kernel launched next with programmatic
    dependent launch (GEMM1, the alignment) may start while this one runs; it waits for it before
    reading (PERF.md, the routing and alignment in the PDL chain)."""
    m, e = logits.shape
    weights = torch.empty((m, topk), dtype=torch.float32, device=logits.device)
    ids = torch.empty((m, topk), dtype=torch.int32, device=logits.device)
    if m == 0:
        return weights, ids
    interpreter_compat()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    default_rows, default_warps = topk_softmax_launch(m, e)
    rows, num_warps = rows or default_rows, num_warps or default_warps
    if rows & (rows - 1) or num_warps & (num_warps - 1):
        raise ValueError(f"rows and num_warps must be powers of two, got {rows} and {num_warps}")
    topk_softmax_kernel[(triton.cdiv(m, rows),)](
        logits, weights, ids, m, e, logits.stride(0),
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), RENORMALIZE=renormalize,
        BLOCK_E=max(16, triton.next_power_of_2(e)), ROWS=rows, num_warps=num_warps,
        RELEASE=pdl_supported(logits.device) and (release is None or bool(release)),
    )
    return weights, ids
