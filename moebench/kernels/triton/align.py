"""Block alignment of (token, k) pairs by expert, on the device, without a host sync.

The sorted-token fused MoE kernel processes BLOCK_SIZE_M pairs of one expert per program. This
module lays the pairs out that way:

    sorted_token_ids (max_padded,) int32  flat pair index t*K + k, grouped by local expert, each
                                          expert's run padded to a multiple of BLOCK_SIZE_M with
                                          the sentinel M*K; slots past the total also hold it
    expert_ids       (max_blocks,) int32  local expert of each block, -1 past the used blocks
    num_tokens_post_padded (1,) int32     used length of sorted_token_ids (a multiple of BLOCK_SIZE_M)

Buffers are sized for the worst case, max_padded = P + min(E_local, P) * (BLOCK_SIZE_M - 1) with
P = M*K, so the launch grids of the GEMMs are static and everything is CUDA-graph capturable.
Pairs whose expert is remote (local id -1) are left out. Inside an expert the pairs keep their
flat order (token-major), which is deterministic.

Which kernels run is the rule `options.align_kernels` (TritonOptions' one_launch_max_pairs,
align_method, sort_min_work). Up to 1024 pairs, one launch over the local experts (each program
counts all pairs). Above, two launches, by one of two methods: "scan", over a (local expert, chunk of
pairs) grid: (1) count the pairs of expert e in chunk c; (2) from the whole count table, compute
e's padded start (prefix sum) and the pairs of e in earlier chunks, write e's pair indices of
chunk c (a cumsum), and for c = 0 also its padding sentinels, its block ids, and a share of the
tail. "sort", over chunks only (for many experts x pairs): (1) each chunk's histogram over all
experts, and the sentinel fill; (2) from the count table every expert's start, then the chunk's
pairs sorted by (expert, index) and scattered, and a share of the block ids.

`direct_align` makes the same layout without a kernel, one block per pair (decode).
`token_rows_align` needs no kernel either, for M <= BLOCK_SIZE_M tokens: one block per local
expert whose rows are all M tokens, each in use where the token routes to that expert; the GEMMs
read that from topk_ids themselves (`common.token_rows`). `align_pairs` is the layer's choice
among the three (`options.wants_direct_align`, `options.wants_token_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moebench.errors import MoebenchError
from moebench.kernels.triton.common import pdl_launch_args, pdl_release, pdl_wait
from moebench.kernels.triton.env import interpreter_compat
from moebench.kernels.triton.options import TritonOptions, align_kernels, wants_direct_align, wants_token_rows


@dataclass
class AlignResult:
    """Output of `moe_align_block_size` (all on the device)."""

    sorted_token_ids: torch.Tensor  # (max_padded,) int32
    expert_ids: torch.Tensor  # (max_blocks,) int32 (direct_align: topk_ids' own int dtype); -1 = skip
    num_tokens_post_padded: torch.Tensor  # (1,) int32
    block_size_m: int
    num_pairs: int  # M * K = the sentinel
    direct: bool = False  # made by `direct_align` (one block per pair)
    #: direct_align with an expert_map: expert_ids hold the global ids and the GEMMs map them
    #: through this (E,) int32 map (-1 = remote), so no gather launches before them.
    expert_map: torch.Tensor | None = None
    #: an expert map was applied: pairs of remote experts may be left out of every block
    remote: bool = False
    #: made by `token_rows_align`: sorted_token_ids is topk_ids (M, K) flat, block e = local expert
    #: e with rows e * block_size_m + t for the tokens t < M (expert_ids: 0 .. E_local - 1)
    token_rows: bool = False

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()


def pair_rows(align: AlignResult, sink: int) -> torch.Tensor:
    """(M*K,) int32: the row of each flat pair in the aligned layout, `sink` for the pairs the
    alignment left out (remote experts). Plain torch (one scatter), no host synchronisation."""
    rows = align.sorted_token_ids.numel()
    inv = torch.full((align.num_pairs + 1,), sink, dtype=torch.int32, device=align.sorted_token_ids.device)
    # Padding slots hold the sentinel num_pairs: they all land in the spare last entry, dropped.
    inv.scatter_(0, align.sorted_token_ids.long(), torch.arange(rows, dtype=torch.int32, device=inv.device))
    return inv[: align.num_pairs]


def max_padded_size(num_pairs: int, num_local_experts: int, block_size_m: int) -> int:
    """Worst-case length of sorted_token_ids (a multiple of block_size_m)."""
    worst = num_pairs + min(num_local_experts, num_pairs) * (block_size_m - 1)
    return triton.cdiv(worst, block_size_m) * block_size_m


@triton.jit
def _local_ids(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP: tl.constexpr):
    """Local expert id of pairs `offs` (-1: remote or past num_pairs), through the map if any."""
    in_range = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    if HAS_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=in_range & (ids >= 0), other=-1).to(tl.int32)
    return ids


@triton.jit
def _expert_run(counts, e, BLOCK_SIZE_M: tl.constexpr, E_POW2: tl.constexpr):
    """From the pair count of every local expert (E_POW2,): expert e's padded start (exclusive
    prefix sum of the padded run lengths), the used total, and e's count and padded length."""
    eo = tl.arange(0, E_POW2)
    padded = tl.cdiv(counts, BLOCK_SIZE_M) * BLOCK_SIZE_M
    start = tl.sum(tl.where(eo < e, padded, 0), axis=0)
    total = tl.sum(padded, axis=0)
    my_count = tl.sum(tl.where(eo == e, counts, 0), axis=0)
    my_padded = tl.sum(tl.where(eo == e, padded, 0), axis=0)
    return start, total, my_count, my_padded


@triton.jit
def count_pairs_kernel(
    topk_ids_ptr,  # (P,) global or local expert id of each pair
    expert_map_ptr,  # (E,) global -> local, -1 remote (unused without HAS_MAP)
    counts_ptr,  # (E_local, NUM_CHUNKS) int32 out
    num_pairs,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    # Program (e, c): count the pairs of chunk c whose local expert is e.
    e = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = _local_ids(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP)
    tl.store(counts_ptr + e * NUM_CHUNKS + c, tl.sum((ids == e).to(tl.int32), axis=0))


@triton.jit
def place_pairs_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    counts_ptr,  # (E_local, NUM_CHUNKS) int32 from count_pairs_kernel
    sorted_ptr,  # (max_padded,) int32 out
    expert_ids_ptr,  # (max_blocks,) int32 out
    ntpp_ptr,  # (1,) int32 out
    num_pairs,
    num_local,
    max_padded,
    max_blocks,
    HAS_MAP: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    NC_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
):
    e = tl.program_id(0)
    c = tl.program_id(1)
    # Counts of all (expert, chunk) -> per-expert totals, padded run lengths, this expert's start
    # (exclusive prefix sum over experts) and the pairs of e in the chunks before c.
    eo = tl.arange(0, E_POW2)
    co = tl.arange(0, NC_POW2)
    cnt = tl.load(
        counts_ptr + eo[:, None] * NUM_CHUNKS + co[None, :],
        mask=(eo < num_local)[:, None] & (co < NUM_CHUNKS)[None, :], other=0,
    )
    start, total, my_count, my_padded = _expert_run(tl.sum(cnt, axis=1), e, BLOCK_SIZE_M, E_POW2)
    before = tl.sum(tl.sum(tl.where((eo == e)[:, None] & (co < c)[None, :], cnt, 0), axis=1), axis=0)

    # This expert's pairs of chunk c, in flat order: position = start + earlier chunks + cumsum - 1.
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = _local_ids(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP)
    hit = (ids == e).to(tl.int32)
    pos = start + before + tl.cumsum(hit, axis=0) - 1
    tl.store(sorted_ptr + pos, offs, mask=hit > 0)

    if c == 0:
        _finish_expert(e, start, total, my_count, my_padded, sorted_ptr, expert_ids_ptr, ntpp_ptr, num_pairs,
                       num_local, max_padded, max_blocks, BLOCK_SIZE_M, CHUNK)


@triton.jit
def chunk_counts_kernel(
    topk_ids_ptr,  # (P,) global or local expert id of each pair
    expert_map_ptr,  # (E,) global -> local, -1 remote (unused without HAS_MAP)
    counts_ptr,  # (NUM_CHUNKS, E_POW2) int32 out
    sorted_ptr,  # (max_padded,) int32 out: filled with the sentinel here, pairs placed next
    num_pairs,
    max_padded,
    fill_per,  # sentinel slots per program
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    E_POW2: tl.constexpr,
    TILE: tl.constexpr,
):
    # Program c: the histogram of chunk c over all local experts (one pass over its pairs), and
    # the sentinel fill of its share of sorted_token_ids (the place kernel overwrites the pairs).
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = _local_ids(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP)
    tl.store(counts_ptr + c * E_POW2 + tl.arange(0, E_POW2), tl.histogram(ids, E_POW2, mask=ids >= 0))
    end = tl.minimum(c * fill_per + fill_per, max_padded)
    for s in range(c * fill_per, end, TILE):
        so = s + tl.arange(0, TILE)
        tl.store(sorted_ptr + so, num_pairs + tl.zeros((TILE,), tl.int32), mask=so < end)


@triton.jit
def chunk_place_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    counts_ptr,  # (NUM_CHUNKS, E_POW2) int32 from chunk_counts_kernel
    sorted_ptr,  # (max_padded,) int32 out
    expert_ids_ptr,  # (max_blocks,) int32 out
    ntpp_ptr,  # (1,) int32 out
    num_pairs,
    max_blocks,
    num_chunks,
    blocks_per,  # block ids per program
    HAS_MAP: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    CHUNK: tl.constexpr,
    NC_POW2: tl.constexpr,
    E_POW2: tl.constexpr,
    TILE: tl.constexpr,  # block ids per step (TILE x E_POW2 comparisons)
):
    c = tl.program_id(0)
    # The count table -> per expert: padded start (exclusive prefix sum of the padded run
    # lengths), the pairs in chunks before c, and where chunk c's own pairs of e begin once the
    # chunk is sorted by expert.
    co = tl.arange(0, NC_POW2)
    eo = tl.arange(0, E_POW2)
    cnt = tl.load(counts_ptr + co[:, None] * E_POW2 + eo[None, :], mask=(co < num_chunks)[:, None], other=0)
    padded = tl.cdiv(tl.sum(cnt, axis=0), BLOCK_SIZE_M) * BLOCK_SIZE_M
    pend = tl.cumsum(padded, axis=0)
    before = tl.sum(tl.where((co < c)[:, None], cnt, 0), axis=0)
    mine = tl.sum(tl.where((co == c)[:, None], cnt, 0), axis=0)
    # Pair at sorted position i of expert e goes to (pend - padded)[e] + before[e] + (i - chunk start of e).
    base = pend - padded + before - (tl.cumsum(mine, axis=0) - mine)

    # Sort chunk c's pairs by (expert, flat index): the key keeps the order inside an expert, and
    # remote / out-of-range pairs (id -1) sort last with expert E_POW2.
    lane = tl.arange(0, CHUNK)
    ids = _local_ids(topk_ids_ptr, expert_map_ptr, c * CHUNK + lane, num_pairs, HAS_MAP)
    ids = tl.where(ids >= 0, ids, E_POW2)
    key = tl.sort(ids * CHUNK + lane)
    e_sorted = key // CHUNK
    local = e_sorted < E_POW2
    dest = tl.gather(base, tl.minimum(e_sorted, E_POW2 - 1), 0) + lane
    tl.store(sorted_ptr + dest, c * CHUNK + key % CHUNK, mask=local)

    # Block ids, blocks_per per program: block b belongs to the number of experts whose padded
    # run ends at or before its first slot; -1 past the used total.
    total = tl.sum(padded, axis=0)
    if c == 0:
        tl.store(ntpp_ptr, total)
    end = tl.minimum(c * blocks_per + blocks_per, max_blocks)
    for b in range(c * blocks_per, end, TILE):
        bo = b + tl.arange(0, TILE)
        first = bo * BLOCK_SIZE_M
        owner = tl.sum((pend[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + bo, tl.where(first < total, owner, -1), mask=bo < end)


@triton.jit
def align_one_launch_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    sorted_ptr,  # (max_padded,) int32 out
    expert_ids_ptr,  # (max_blocks,) int32 out
    ntpp_ptr,  # (1,) int32 out
    num_pairs,
    num_local,
    max_padded,
    max_blocks,
    HAS_MAP: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr,
    CHUNK: tl.constexpr,  # >= num_pairs: all pairs in one tile
    E_POW2: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch: wait for the routing,
    #                             then let GEMM1 launch (it waits for this kernel in turn)
):
    # Few pairs: program e reads all of them and counts every expert itself (a histogram), so
    # the count table of the two-kernel path, and its launch, are not needed.
    pdl_wait(PDL)
    pdl_release(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    ids = _local_ids(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP)
    counts = tl.histogram(ids, E_POW2, mask=ids >= 0)
    start, total, my_count, my_padded = _expert_run(counts, e, BLOCK_SIZE_M, E_POW2)
    hit = (ids == e).to(tl.int32)
    tl.store(sorted_ptr + start + tl.cumsum(hit, axis=0) - 1, offs, mask=hit > 0)
    _finish_expert(e, start, total, my_count, my_padded, sorted_ptr, expert_ids_ptr, ntpp_ptr, num_pairs,
                   num_local, max_padded, max_blocks, BLOCK_SIZE_M, CHUNK)


@triton.jit
def _finish_expert(e, start, total, my_count, my_padded, sorted_ptr, expert_ids_ptr, ntpp_ptr, num_pairs,
                   num_local, max_padded, max_blocks, BLOCK_SIZE_M: tl.constexpr, CHUNK: tl.constexpr):
    """Everything of expert e's run except its pairs: the used length (e = 0), the sentinels that
    pad its last block, its block ids, and its round-robin share of the tail past the total
    (sentinel slots and -1 blocks)."""
    if e == 0:
        tl.store(ntpp_ptr, total)
    pad = start + my_count + tl.arange(0, BLOCK_SIZE_M)
    tl.store(sorted_ptr + pad, num_pairs + tl.zeros((BLOCK_SIZE_M,), tl.int32), mask=pad < start + my_padded)
    first_block = start // BLOCK_SIZE_M
    n_blocks = my_padded // BLOCK_SIZE_M
    for b in range(0, n_blocks, CHUNK):
        bo = b + tl.arange(0, CHUNK)
        tl.store(expert_ids_ptr + first_block + bo, e + tl.zeros((CHUNK,), tl.int32), mask=bo < n_blocks)
    for s in range(total + e * CHUNK, max_padded, num_local * CHUNK):
        so = s + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + so, num_pairs + tl.zeros((CHUNK,), tl.int32), mask=so < max_padded)
    for b in range(total // BLOCK_SIZE_M + e * CHUNK, max_blocks, num_local * CHUNK):
        bo = b + tl.arange(0, CHUNK)
        tl.store(expert_ids_ptr + bo, tl.full((CHUNK,), -1, tl.int32), mask=bo < max_blocks)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    block_size_m: int,
    num_local_experts: int,
    expert_map: torch.Tensor | None = None,
    *,
    options: TritonOptions | None = None,
    chunk: int | None = None,
    pdl: bool = False,
) -> AlignResult:
    """topk_ids (M, K) int32/int64 -> AlignResult for blocks of `block_size_m` pairs.

    Without expert_map, topk_ids are local ids (-1 = remote). With expert_map (E,) int32, they are
    global ids mapped on the fly (map value -1 = remote). M may be 0 (empty buffers, no launch).
    No host synchronisation. Which kernels: `align_kernels(options, ...)` (None: TritonOptions()):
    up to options.one_launch_max_pairs pairs one launch over the local experts, each program
    counting all pairs itself; above, two launches by the "scan" or "sort" method (all give the
    same result). `chunk` (pairs per program of the two-launch paths, a power of two) is for tests;
    by default up to 2048 (scan) or 256 / 512 (sort). pdl: launch the one-launch kernel with
    programmatic dependent launch (CUDA, Hopper+; `options.resolve_pdl`), so that the GEMM1
    launched after it with PDL starts while it runs.
    """
    assert topk_ids.dim() == 2
    dev = topk_ids.device
    num_pairs = topk_ids.numel()
    max_padded = max_padded_size(num_pairs, num_local_experts, block_size_m)
    max_blocks = max_padded // block_size_m
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=dev)
    # Every kernel path writes the used length itself: zeros (a memset launch) only without one.
    nothing = num_pairs == 0 or num_local_experts == 0
    ntpp = (torch.zeros if nothing else torch.empty)((1,), dtype=torch.int32, device=dev)
    if num_pairs == 0:
        return AlignResult(sorted_ids, expert_ids, ntpp, block_size_m, 0)
    interpreter_compat()
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    has_map = expert_map is not None
    emap = expert_map.to(device=dev, dtype=torch.int32).contiguous() if has_map else ids
    e_pow2 = max(16, triton.next_power_of_2(num_local_experts))
    method = align_kernels(options or TritonOptions(), num_local_experts, num_pairs)
    if method == "one_launch":
        align_one_launch_kernel[(num_local_experts,)](
            ids, emap, sorted_ids, expert_ids, ntpp, num_pairs, num_local_experts, max_padded, max_blocks,
            HAS_MAP=has_map, BLOCK_SIZE_M=block_size_m, CHUNK=max(16, triton.next_power_of_2(num_pairs)),
            E_POW2=e_pow2, num_warps=4, **pdl_launch_args(pdl),
        )
        return AlignResult(sorted_ids, expert_ids, ntpp, block_size_m, num_pairs, remote=has_map)
    if method == "sort":
        return _align_sorted_chunks(ids, emap, has_map, sorted_ids, expert_ids, ntpp, block_size_m,
                                    num_local_experts, num_pairs, max_padded, max_blocks, chunk)
    # Chunks of pairs: each program scans one chunk.
    chunk = _chunk_size(chunk or 2048, num_pairs, e_pow2)
    num_chunks = triton.cdiv(num_pairs, chunk)
    warps = 8 if chunk >= 2048 else 4
    counts = torch.empty((num_local_experts, num_chunks), dtype=torch.int32, device=dev)
    grid = (num_local_experts, num_chunks)
    count_pairs_kernel[grid](ids, emap, counts, num_pairs, HAS_MAP=has_map, CHUNK=chunk, NUM_CHUNKS=num_chunks, num_warps=warps)
    place_pairs_kernel[grid](
        ids, emap, counts, sorted_ids, expert_ids, ntpp,
        num_pairs, num_local_experts, max_padded, max_blocks,
        HAS_MAP=has_map, BLOCK_SIZE_M=block_size_m, CHUNK=chunk, NUM_CHUNKS=num_chunks,
        NC_POW2=triton.next_power_of_2(num_chunks), E_POW2=e_pow2, num_warps=warps,
    )
    return AlignResult(sorted_ids, expert_ids, ntpp, block_size_m, num_pairs, remote=has_map)


def _chunk_size(chunk: int, num_pairs: int, e_pow2: int) -> int:
    """Pairs per program of the two-launch paths: `chunk` (a power of two), at most the pairs'
    next power of two, grown for huge inputs so that the (experts x chunks) count table every
    place program reads stays <= 16K entries."""
    chunk = min(chunk, max(16, triton.next_power_of_2(num_pairs)))
    while e_pow2 * triton.next_power_of_2(triton.cdiv(num_pairs, chunk)) > 16384:
        chunk *= 2
    return chunk


def _align_sorted_chunks(ids, emap, has_map, sorted_ids, expert_ids, ntpp, block_size_m, num_local, num_pairs,
                         max_padded, max_blocks, chunk) -> AlignResult:
    """Two launches over chunks of pairs: per-chunk histograms (and the sentinel fill), then each
    chunk sorts its pairs by expert and scatters them to their slots."""
    e_pow2 = max(16, triton.next_power_of_2(num_local))
    chunk = _chunk_size(chunk or (256 if num_pairs <= 32768 else 512), num_pairs, e_pow2)
    num_chunks = triton.cdiv(num_pairs, chunk)
    warps = 8 if chunk >= 2048 else 4
    counts = torch.empty((num_chunks, e_pow2), dtype=torch.int32, device=ids.device)
    chunk_counts_kernel[(num_chunks,)](
        ids, emap, counts, sorted_ids, num_pairs, max_padded, triton.cdiv(max_padded, num_chunks),
        HAS_MAP=has_map, CHUNK=chunk, E_POW2=e_pow2, TILE=1024, num_warps=warps,
    )
    chunk_place_kernel[(num_chunks,)](
        ids, emap, counts, sorted_ids, expert_ids, ntpp, num_pairs, max_blocks, num_chunks,
        triton.cdiv(max_blocks, num_chunks), HAS_MAP=has_map, BLOCK_SIZE_M=block_size_m, CHUNK=chunk,
        NC_POW2=triton.next_power_of_2(num_chunks), E_POW2=e_pow2, TILE=max(16, min(128, 8192 // e_pow2)),
        num_warps=warps,
    )
    return AlignResult(sorted_ids, expert_ids, ntpp, block_size_m, num_pairs, remote=has_map)


_DIRECT_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _may_cache(dev: torch.device) -> bool:
    """Whether a layout made now on `dev` may be kept for later calls: not while a CUDA graph is
    being captured (its tensors would hold data only after a replay)."""
    return dev.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def direct_align(
    topk_ids: torch.Tensor, block_size_m: int, expert_map: torch.Tensor | None = None
) -> AlignResult:
    """One block per pair, no alignment kernel: block p holds pair p (flat t*K + k) in its first
    row and sentinels in the others; its expert is topk_ids' own entry, mapped through expert_map
    when given (by the GEMMs as they read it: no launch), -1 = remote, a block the GEMMs skip.

    The same AlignResult format as `moe_align_block_size`, so the GEMM kernels are unchanged; pairs
    sharing an expert each read its weights, so use it where `wants_direct_align` says. The
    sorted ids and used length depend only on (M*K, block_size_m) and are cached per device for
    small M*K (not while a CUDA graph is being captured: the tensors would hold data only after a
    replay)."""
    assert topk_ids.dim() == 2
    dev = topk_ids.device
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    mapped = None
    if expert_map is not None:
        mapped = expert_map.to(device=dev, dtype=torch.int32).contiguous()  # as it is when it already was
    key = (num_pairs, block_size_m, dev)
    layout = _DIRECT_LAYOUTS.get(key)
    if layout is None:
        sorted_ids = torch.full((num_pairs, block_size_m), num_pairs, dtype=torch.int32, device=dev)
        sorted_ids[:, 0] = torch.arange(num_pairs, dtype=torch.int32, device=dev)
        ntpp = torch.full((1,), num_pairs * block_size_m, dtype=torch.int32, device=dev)
        layout = (sorted_ids.reshape(-1), ntpp)
        small = num_pairs * block_size_m <= 1 << 16  # what `wants_direct_align` picks; forced big ones are not kept
        if small and _may_cache(dev):
            _DIRECT_LAYOUTS[key] = layout
    return AlignResult(layout[0], ids, layout[1], block_size_m, num_pairs, direct=True, expert_map=mapped,
                       remote=expert_map is not None)


_TOKEN_ROWS_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def token_rows_align(
    topk_ids: torch.Tensor, block_size_m: int, num_local_experts: int, expert_map: torch.Tensor | None = None
) -> AlignResult:
    """The token-rows layout for M <= block_size_m tokens, no kernel: block e is local expert e and
    its rows are the M tokens (row e * block_size_m + t = token t), in use where token t routes to
    e (repeated ids in one token's row are one row, whose router weight is their sum: the same
    sum over top-k). The GEMMs find each block's rows in topk_ids (global ids mapped through
    expert_map when given) as they start, so blocks of experts no token reaches do nothing; the
    intermediate has E_local x block_size_m rows. The block ids and used length are cached per
    (E_local, block_size_m, device) (not while a CUDA graph is being captured)."""
    m, k = topk_ids.shape
    if m > block_size_m:
        raise MoebenchError(f"the token-rows layout takes at most BLOCK_SIZE_M ({block_size_m}) tokens, got {m}")
    dev = topk_ids.device
    key = (num_local_experts, block_size_m, dev)
    layout = _TOKEN_ROWS_LAYOUTS.get(key)
    if layout is None:
        layout = (torch.arange(num_local_experts, dtype=torch.int32, device=dev),
                  torch.full((1,), num_local_experts * block_size_m, dtype=torch.int32, device=dev))
        if _may_cache(dev):
            _TOKEN_ROWS_LAYOUTS[key] = layout
    mapped = None
    if expert_map is not None:
        mapped = expert_map.to(device=dev, dtype=torch.int32).contiguous()
    return AlignResult(topk_ids.reshape(-1).contiguous(), layout[0], layout[1], block_size_m, m * k,
                       expert_map=mapped, remote=expert_map is not None, token_rows=True)


def align_pairs(
    topk_ids: torch.Tensor,
    block_size_m: int,
    num_local_experts: int,
    expert_map: torch.Tensor | None,
    num_experts: int,
    scheme=None,
    options: TritonOptions | None = None,
    pdl: bool = False,
) -> AlignResult:
    """The block alignment `fused_moe` uses for topk_ids (M, K) of a layer with `num_experts`
    global experts and fp8 scheme `scheme` (None: 16-bit): `direct_align` where
    `wants_direct_align(options, ...)` says so, else `token_rows_align` where `wants_token_rows`
    does, else `moe_align_block_size` (pdl: its one-launch kernel with programmatic dependent launch)."""
    options = options or TritonOptions()
    m, k = topk_ids.shape
    if wants_direct_align(options, m, k, num_experts, scheme, expert_map is not None):
        return direct_align(topk_ids, block_size_m, expert_map)
    if wants_token_rows(options, m, k, num_experts, num_local_experts, block_size_m, scheme):
        return token_rows_align(topk_ids, block_size_m, num_local_experts, expert_map)
    return moe_align_block_size(topk_ids, block_size_m, num_local_experts, expert_map, options=options, pdl=pdl)


def moe_align_block_size_torch(
    topk_ids: torch.Tensor, block_size_m: int, num_local_experts: int, expert_map: torch.Tensor | None = None
) -> AlignResult:
    """Same result from plain torch ops (the reference for tests; also no host sync)."""
    dev = topk_ids.device
    num_pairs = topk_ids.numel()
    max_padded = max_padded_size(num_pairs, num_local_experts, block_size_m)
    max_blocks = max_padded // block_size_m
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None and num_pairs:
        ids = expert_map.to(dev).long()[ids.clamp(min=0)].where(ids >= 0, torch.full_like(ids, -1))
    key = torch.where(ids >= 0, ids, torch.full_like(ids, num_local_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_local_experts]
    padded = (counts + block_size_m - 1) // block_size_m * block_size_m
    pstart = torch.cumsum(padded, 0) - padded
    cstart = torch.cumsum(counts, 0) - counts
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=dev)
    local = order[: num_pairs]
    e_sorted = key[local]
    keep = e_sorted < num_local_experts
    e_cl = e_sorted.clamp(max=max(num_local_experts - 1, 0))
    rank = torch.arange(num_pairs, device=dev) - cstart[e_cl] if num_local_experts else e_cl
    dest = torch.where(keep, pstart[e_cl] + rank, torch.full_like(rank, max_padded))
    buf = torch.cat([sorted_ids, sorted_ids.new_zeros(1)])
    buf.index_copy_(0, dest, torch.where(keep, local, torch.zeros_like(local)).to(torch.int32))
    sorted_ids = buf[:max_padded].clone()
    total = padded.sum()
    blk = torch.arange(max_blocks, device=dev) * block_size_m
    ends = torch.cumsum(padded, 0)
    expert_ids = torch.searchsorted(ends, blk, right=True).to(torch.int32)
    expert_ids = torch.where(blk < total, expert_ids, torch.full_like(expert_ids, -1))
    return AlignResult(sorted_ids, expert_ids, total.reshape(1).to(torch.int32), block_size_m, num_pairs,
                       remote=expert_map is not None)
