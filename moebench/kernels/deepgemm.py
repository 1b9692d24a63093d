"""DeepGEMM experts (optional; Hopper): `deepgemm` (Standard, grouped GEMM on the contiguous layout)
and `batched-deepgemm` (BatchedExperts, masked grouped GEMM), in bf16 and in fp8 with 128x128
block scales (`--dtype fp8_w8a8 --block-shape 128,128`).

DeepGEMM 2.6.1's grouped GEMMs ("nt": B is (G, N, K), i.e. our weights as stored), on sm90:

  m_grouped_bf16_gemm_nt_contiguous(a (R, K), b (G, N, K), d (R, N), grouped_layout, use_psum_layout=...,
                                    expected_m_for_psum_layout=...)
  m_grouped_bf16_gemm_nt_masked(a (G, T, K), b (G, N, K), d (G, T, N), masked_m (G,) int32, expected_m)
  m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, grouped_layout, ...)   same, fp8 operands
  m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, expected_m)

Contiguous layout: the rows of one group are consecutive and every group's run starts at a
multiple of get_mk_alignment_for_contiguous_layout() (128 on sm90, which is also the kernel's
BLOCK_M there). `grouped_layout` is either
  - psum (the default here, `layout="psum"`): (G,) int32, the end row of each group's run; the
    kernel visits only the row blocks that hold rows of some group (walking the groups in order
    to find them), so the static worst-case buffer costs no GEMM work where it is empty;
  - m_indices (`layout="indices"`): (R,) int32, the group of every row, -1 for padding rows; the
    kernel visits every row block of the buffer (bf16 computes -1 blocks too, against group 0).

fp8 scale layouts (what DeepGEMM wants on sm90, so that it runs no layout kernel of its own):
  sfa: float32 (R, K/128) (masked: (G, T, K/128)), one scale per row and 128 columns, stored
       MN-major with the row stride padded to 16 bytes: strides (1, R') / (R'*K/128, 1, R'),
       R' = R rounded up to a multiple of 4 (`mn_major_scales`). moebench's activation scales
       are (rows, G) row-major, so the adapter converts them (DeepEP-LL's already are MN-major).
  sfb: float32 (G, N/128, K/128) contiguous: moebench's block weight scale as it is.
Masked layout: DeepGEMM's masked kernels see the (G * T) rows as one 2-D tensor and work in
row blocks of 64 or 128, so each group must be whole 128-row blocks: the adapter hands them T
rounded up to 128 (`masked_rows_per_group`), copying the valid rows over when the prepare's T
is not a multiple (batched-local: T = M tokens; DeepEP-LL's T = 128 x ranks needs no copy).

Outputs are bf16 only. The intermediate after SiLU-and-mul is rounded to bf16 and quantised again
(1 x 128 groups, dynamic) before GEMM2, the rounding points the reference emulates.

`deepgemm`'s glue around the two GEMMs is moebench's Triton kernels (the block alignment, the row
gather, SiLU-and-mul with the requantisation, the weighted top-k sum): five launches besides
DeepGEMM's two and a few small torch ones. `batched-deepgemm`'s SiLU-and-mul with the
requantisation is the same launch over each expert's valid rows in place. The layout helpers
(`grouped_layout`, `pair_rows`, `masked_rows`, `mn_major_scales`, ...) are plain torch, run on any
device and hold no host synchronisation, so the adapters stay CUDA-graph capturable.
deep_gemm is imported lazily; nothing else in moebench needs it.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from moebench.activation import SILU
from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    PrepareResult,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOp,
    alloc_output,
)
from moebench.kernels.token_layout import local_topk_ids
from moebench.kernels.triton.align import AlignResult, moe_align_block_size, pair_rows
from moebench.kernels.triton.launch import sorted_rows, topk_sum
from moebench.kernels.triton.quant import silu_mul_rows
from moebench.quant import FP8_DTYPE, QuantScheme, QuantWeight, scheme_of

#: The only fp8 block DeepGEMM's sm90 grouped GEMMs take: 1 x 128 activation groups, 128 x 128
#: weight blocks (its recipe (1, 128, 128)).
BLOCK_SHAPE = (128, 128)
#: TMA wants 16-byte aligned strides: the MN stride of an fp32 scale tensor is padded to 4 rows.
_TMA_ALIGN_BYTES = 16
LAYOUTS = ("psum", "indices")
#: The largest BLOCK_M DeepGEMM's sm90 heuristic picks for masked GEMMs (it picks 64 or 128).
MASKED_BLOCK_M = 128


# ---------------------------------------------------------------------------------------------
# Layout helpers (pure torch; tested on the CPU)


def tma_aligned(n: int, element_size: int = 4) -> int:
    """n rounded up so that n elements of `element_size` bytes are a multiple of 16 bytes."""
    step = _TMA_ALIGN_BYTES // element_size
    return -(-n // step) * step


def mn_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides DeepGEMM's sm90 fp8 kernels read scales with: (R, G) -> (1, R'),
    (B, R, G) -> (R' * G, 1, R'), R' = tma_aligned(R)."""
    if len(shape) not in (2, 3):
        raise MoebenchError(f"DeepGEMM scales are 2-D or 3-D, got shape {tuple(shape)}")
    r, g = shape[-2], shape[-1]
    ra = tma_aligned(r)
    return (1, ra) if len(shape) == 2 else (ra * g, 1, ra)


def empty_mn_major(shape: tuple[int, ...], device) -> torch.Tensor:
    """An uninitialised float32 tensor of `shape` with `mn_major_strides`."""
    return torch.empty_strided(tuple(shape), mn_major_strides(shape), dtype=torch.float32, device=device)


def mn_major_scales(scale: torch.Tensor) -> torch.Tensor:
    """Per-row, per-128-column scales (R, G) or (B, R, G) float32, any strides -> the same values
    in DeepGEMM's MN-major, TMA-aligned layout (`mn_major_strides`); returned as they are when
    already so (DeepEP-LL's fp8 dispatch hands them over that way)."""
    if scale.dtype != torch.float32:
        raise MoebenchError(f"DeepGEMM takes float32 scales, got {scale.dtype}")
    strides = mn_major_strides(tuple(scale.shape))
    if tuple(scale.stride()) == strides:
        return scale
    out = empty_mn_major(tuple(scale.shape), scale.device)
    out.copy_(scale)
    return out


def grouped_layout(align: AlignResult, local_ids: torch.Tensor, num_groups: int, layout: str = "psum") -> torch.Tensor:
    """DeepGEMM's `grouped_layout` for the rows of a block alignment whose block is DeepGEMM's
    row alignment (every expert's run starts at a multiple of it, in expert order, as DeepGEMM's
    contiguous layout wants). local_ids (M, K): the pairs' local experts, -1 remote.
    psum: (G,) int32, the end row of each group's pairs (its run starts at the previous end rounded
    up to the block; an empty group ends where it starts); indices: (rows,) int32, each row's
    group, -1 for padding rows. Plain torch, static shapes, no host synchronisation."""
    if layout == "indices":
        per_row = align.expert_ids.repeat_interleave(align.block_size_m)
        pad = align.sorted_token_ids >= align.num_pairs
        return torch.where(pad, torch.full_like(per_row, -1), per_row).to(torch.int32).contiguous()
    flat = local_ids.reshape(-1).long()
    slot = torch.where(flat >= 0, flat, torch.full_like(flat, num_groups))  # remote pairs count in a spare slot
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, slot, torch.ones_like(slot))
    counts = counts[:num_groups]
    b = align.block_size_m
    padded = (counts + b - 1) // b * b
    return (torch.cumsum(padded, 0) - padded + counts).to(torch.int32)


def masked_rows(counts: torch.Tensor, rows_per_group: int, bound: int) -> torch.Tensor:
    """The valid rows of a masked (G, T, ...) buffer as flat indices g * T + t (t < counts[g]),
    group by group, in a (bound,) int64 tensor; slots past the valid total hold G * T (one past
    the end: callers give their flat buffers a sink row there). No host synchronisation, so
    `bound` must cover the valid total (rows past it are dropped)."""
    g, t = counts.numel(), rows_per_group
    j = torch.arange(t, device=counts.device)
    valid = (j.unsqueeze(0) < counts.to(torch.int64).clamp(max=t).unsqueeze(1)).reshape(-1)
    rank = torch.cumsum(valid.to(torch.int64), 0) - 1
    slot = torch.where(valid & (rank < bound), rank, torch.full_like(rank, bound))
    out = torch.full((bound + 1,), g * t, dtype=torch.int64, device=counts.device)
    out.scatter_(0, slot, torch.arange(g * t, device=counts.device))
    return out[:bound]  # slot `bound` collected every invalid row; it is dropped


def masked_rows_per_group(t: int) -> int:
    """Rows per group DeepGEMM's masked GEMMs are handed: T rounded up to MASKED_BLOCK_M. Their TMA
    descriptors see (G * T) rows as one 2-D tensor, so a row block that starts in group g and
    runs past T reads and writes rows of group g + 1 (measured on the H200: wrong results at
    T = 1 and 16, right at 128): every group must be whole blocks."""
    return -(-t // MASKED_BLOCK_M) * MASKED_BLOCK_M


def _gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] along dim 0; 1-byte dtypes (fp8) move as bytes."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8).index_select(0, idx).view(t.dtype)
    return t.index_select(0, idx)


def _scatter_rows(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """dst[idx] = src along dim 0; 1-byte dtypes (fp8) move as bytes."""
    if dst.element_size() == 1 and dst.dtype != torch.uint8:
        dst.view(torch.uint8).index_copy_(0, idx, src.view(torch.uint8))
    else:
        dst.index_copy_(0, idx, src)


def stage(name: str):
    """A profiler range named `deepgemm:<name>` around one step of an adapter while torch.profiler
    records (`benchmarks deepgemm_breakdown` sums the kernels of each); nothing otherwise, so a
    timed or graph-captured call is unchanged."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"deepgemm:{name}")
    return contextlib.nullcontext()


#: the steps `stage` names, in the order the adapters run them: DeepGEMM's two GEMMs and the glue
STAGES = {"deepgemm": ("align", "gather", "gemm1", "act", "gemm2", "sum"),
          "batched-deepgemm": ("pack", "gemm1", "act", "gemm2", "unpack")}
GEMM_STAGES = ("gemm1", "gemm2")


# ---------------------------------------------------------------------------------------------
# Availability


@functools.lru_cache(maxsize=None)
def _import_error() -> str | None:
    """None when deep_gemm imports, else why not (cached: an import is tried once)."""
    try:
        import deep_gemm  # noqa: F401
    except ImportError as e:
        if getattr(e, "name", None) == "deep_gemm":
            return "deep_gemm is not installed (moebench vendor install deepgemm; README, 'Vendor libraries')"
        return f"deep_gemm does not import: {e}"
    except Exception as e:  # noqa: BLE001 - a broken build (CUDA home, libraries) is a reason, not a crash
        return f"deep_gemm does not import: {type(e).__name__}: {e}"
    for name in ("m_grouped_bf16_gemm_nt_contiguous", "m_grouped_bf16_gemm_nt_masked",
                 "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"):
        if not hasattr(deep_gemm, name):
            version = getattr(deep_gemm, "__version__", "?")
            return f"deep_gemm {version} has no {name} (moebench's adapters follow DeepGEMM 2.6's API)"
    return None


def _deep_gemm_reason(device: str) -> str | None:
    if device != "cuda":
        return "DeepGEMM needs a CUDA GPU"
    reason = _import_error()
    if reason is not None:
        return reason
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return "DeepGEMM needs Hopper (sm_90) or newer"
    return None


def check_shapes(w13, w2, quant: QuantScheme | None, name: str) -> None:
    """K of both GEMMs (H, I) must be whole DeepGEMM K blocks: 64 in bf16, 128 in fp8."""
    _, two_i, h = w13.shape
    i = two_i // 2
    step = 128 if quant is not None else 64
    if h % step or i % step:
        raise UnsupportedError(
            f"experts '{name}': DeepGEMM needs hidden and intermediate (per rank) divisible by {step} "
            f"({'fp8' if quant else 'bf16'}), got hidden {h}, intermediate {i}"
        )


def _fp8_weights(w13, w2, name: str) -> tuple[QuantWeight, QuantWeight, QuantScheme]:
    if not (isinstance(w13, QuantWeight) and isinstance(w2, QuantWeight)) or w13.scheme != w2.scheme:
        raise UnsupportedError(f"experts '{name}': w13 and w2 must be quantised with the same scheme")
    scheme = w13.scheme
    if scheme.scales != "block" or tuple(scheme.block_shape) != BLOCK_SHAPE:
        raise UnsupportedError(f"experts '{name}': DeepGEMM's fp8 grouped GEMMs take block[128,128] scales, "
                               f"got {scheme.describe()}")
    return w13, w2, scheme


class _DeepGemmBackend(Experts):
    """What both DeepGEMM backends declare: bf16 activations and output, CUDA (Hopper), deep_gemm
    importable; fp8 with 128 x 128 block scales (prepare quantises the input, 1 x 128 groups)."""

    supported_dtypes = (torch.bfloat16,)
    supported_devices = ("cuda",)
    gpu_vendors = ("nvidia",)
    supported_quant = ("block",)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return _deep_gemm_reason(device)

    @classmethod
    def quant_unavailable_reason(cls, device: str, scheme: QuantScheme) -> str | None:
        if scheme.scales != "block" or tuple(scheme.block_shape) != BLOCK_SHAPE:
            return (f"experts '{cls.name}': DeepGEMM's fp8 grouped GEMMs take block[128,128] scales only, "
                    f"not {scheme.describe()}")
        return _deep_gemm_reason(device)

    def _out_dtype(self, prep: PrepareResult) -> torch.dtype:
        dt = prep.out_dtype or (prep.a.dtype if prep.a.dtype != FP8_DTYPE else torch.bfloat16)
        if dt != torch.bfloat16:
            raise UnsupportedError(f"experts '{self.name}': DeepGEMM's grouped GEMMs write bf16 only, got {dt}")
        return dt


# ---------------------------------------------------------------------------------------------
# Standard: the contiguous layout


class DeepGemmExperts(_DeepGemmBackend):
    """Standard: (token, k) pairs placed by expert into DeepGEMM's contiguous layout (psum or
    m-indices grouped layout), two grouped GEMMs, and moebench's Triton kernels around them:
    the block alignment (`moe_align_block_size`, DeepGEMM's row alignment as the block), x's rows
    gathered into that order with their scales (`sorted_rows`), SiLU-and-mul with the
    requantisation in one launch (`silu_mul_rows`), and the router-weighted sum over top-k read
    straight from GEMM2's rows (`topk_sum` with a row index). Returns (M, H), weighted and summed;
    remote pairs (EP) add nothing."""

    name = "deepgemm"
    activation_format = ActivationFormat.STANDARD

    def __init__(self, layout: str = "psum"):
        if layout not in LAYOUTS:
            raise MoebenchError(f"deepgemm layout must be one of {', '.join(LAYOUTS)}, got '{layout}'")
        self.layout = layout

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    def _gemm(self, dg, a, a_scale, w, d, grouped: torch.Tensor, expected_m: int) -> None:
        kw = {"use_psum_layout": True, "expected_m_for_psum_layout": expected_m} if self.layout == "psum" else {}
        if a_scale is None:
            dg.m_grouped_bf16_gemm_nt_contiguous(a, w, d, grouped, **kw)
        else:
            dg.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w.q, w.scale.contiguous()), d, grouped, **kw)

    def apply(self, prep: PrepareResult, w13, w2, *, activation=SILU, bias=None) -> torch.Tensor:
        self.check_activation(activation, bias, scheme_of(w13))
        import deep_gemm as dg

        fp8 = isinstance(w13, QuantWeight) or isinstance(w2, QuantWeight)
        scheme = _fp8_weights(w13, w2, self.name)[2] if fp8 else None
        check_shapes(w13, w2, scheme, self.name)
        out_dtype = self._out_dtype(prep)
        if fp8 and (prep.a.dtype != FP8_DTYPE or prep.a_scale is None):
            raise UnsupportedError(f"experts '{self.name}' take fp8 activations quantised by prepare (prep.a_scale is missing)")
        x, ids = prep.a, prep.topk_ids
        m, k = ids.shape
        e, two_i, h = w13.shape
        i = two_i // 2
        dev = x.device
        with stage("align"):
            align = moe_align_block_size(ids, dg.get_mk_alignment_for_contiguous_layout(), e, prep.expert_map)
            rows = align.sorted_token_ids.numel()
            grouped = grouped_layout(align, local_topk_ids(ids, prep.expert_map), e, self.layout)
        expected_m = max(1, -(-m * k // e))  # mean rows per group: DeepGEMM's config hint

        # DeepGEMM's rows are independent and nothing reads a padding row's output: padding stays unset
        with stage("gather"):
            a = sorted_rows(x, align, k, zero_pad=False)
            a_scale = None
            if fp8:
                a_scale = sorted_rows(prep.a_scale.float(), align, k, out=empty_mn_major((rows, h // 128), dev),
                                      zero_pad=False)
        gate_up = torch.empty((rows, two_i), dtype=out_dtype, device=dev)
        with stage("gemm1"):
            self._gemm(dg, a, a_scale, w13, gate_up, grouped, expected_m)

        act = torch.empty((rows, i), dtype=FP8_DTYPE if fp8 else out_dtype, device=dev)
        act_scale = empty_mn_major((rows, i // 128), dev) if fp8 else None
        with stage("act"):
            silu_mul_rows(gate_up, align.num_tokens_post_padded, act, act_scale)
        y = torch.empty((rows + 1, h), dtype=out_dtype, device=dev)  # the last row: zeros, for remote pairs
        with stage("gemm2"):
            self._gemm(dg, act, act_scale, w2, y[:rows], grouped, expected_m)
        with stage("sum"):
            y[rows].zero_()
            out = alloc_output((m, h), out_dtype, dev)
            return topk_sum(y, out, k, row_index=pair_rows(align, rows), weights=prep.topk_weights)


# ---------------------------------------------------------------------------------------------
# BatchedExperts: the masked layout


class BatchedDeepGemmExperts(_DeepGemmBackend):
    """BatchedExperts: masked grouped GEMMs over (E_local, T, H), SiLU-and-mul on the valid rows
    only. Returns (E_local, T, H) unweighted; rows past expert_num_tokens are not meaningful."""

    name = "batched-deepgemm"
    activation_format = ActivationFormat.BATCHED

    def weight_and_reduce(self):
        return TopKWeightAndReduceDelegate()

    @staticmethod
    def valid_bound(prep: PrepareResult) -> int:
        """Static bound on the valid rows of the buffer: every routed (token, k) pair at most."""
        e, t = prep.a.shape[0], prep.a.shape[1]
        if prep.num_tokens is not None and prep.topk is not None:
            return max(1, min(e * t, prep.num_tokens * prep.topk))
        return max(1, e * t)

    @staticmethod
    def expected_m(prep: PrepareResult) -> int:
        """Mean valid rows per expert (DeepGEMM's config hint), 1 <= hint <= T."""
        e, t = prep.a.shape[0], prep.a.shape[1]
        if prep.num_tokens is not None and prep.topk is not None:
            return max(1, min(t, -(-prep.num_tokens * prep.topk // e)))
        return max(1, t)

    def apply(self, prep: PrepareResult, w13, w2, *, activation=SILU, bias=None) -> torch.Tensor:
        self.check_activation(activation, bias, scheme_of(w13))
        import deep_gemm as dg

        fp8 = isinstance(w13, QuantWeight) or isinstance(w2, QuantWeight)
        scheme = _fp8_weights(w13, w2, self.name)[2] if fp8 else None
        check_shapes(w13, w2, scheme, self.name)
        out_dtype = self._out_dtype(prep)
        a, counts = prep.a, prep.expert_num_tokens.to(torch.int32).contiguous()
        if fp8 and (a.dtype != FP8_DTYPE or prep.a_scale is None):
            raise UnsupportedError(f"experts '{self.name}' take fp8 activations quantised by prepare (prep.a_scale is missing)")
        e, t, h = a.shape
        two_i = w13.shape[1]
        i = two_i // 2
        dev = a.device
        hint = self.expected_m(prep)
        tp = masked_rows_per_group(t)
        # Valid rows as flat indices of the (E, T) buffer (sink E * T) and of the padded (E + 1, T')
        # buffers (sink E * T': row 0 of the spare group after the real ones).
        with stage("pack"):
            idx = masked_rows(counts, t, self.valid_bound(prep))
            idx_p = idx if tp == t else (idx // t) * tp + idx % t
            src = idx.clamp(max=e * t - 1)  # the sink reads some valid row; what it gets goes to a sink
            if tp == t:
                a_g = a.contiguous()
                a_scale = mn_major_scales(prep.a_scale.float()) if fp8 else None
            else:  # copy the valid rows into whole 128-row blocks per expert
                a_full = torch.empty(((e + 1) * tp, h), dtype=a.dtype, device=dev)
                _scatter_rows(a_full, idx_p, _gather_rows(a.reshape(e * t, h), src))
                a_g = a_full[: e * tp].view(e, tp, h)
                a_scale = None
                if fp8:
                    g = prep.a_scale.shape[-1]
                    sf = empty_mn_major((e + 1, tp, g), dev)
                    sf[idx_p // tp, idx_p % tp] = prep.a_scale.float().reshape(e * t, g).index_select(0, src)
                    a_scale = sf[:e]
        gate_up = torch.empty((e + 1, tp, two_i), dtype=out_dtype, device=dev)
        with stage("gemm1"):
            if fp8:
                dg.m_grouped_fp8_gemm_nt_masked((a_g, a_scale), (w13.q, w13.scale.contiguous()), gate_up[:e], counts,
                                                hint)
            else:
                dg.m_grouped_bf16_gemm_nt_masked(a_g, w13, gate_up[:e], counts, hint)

        # SiLU-and-mul (and the requantisation) on the valid rows only.
        with stage("act"):
            act_buf = torch.empty((e + 1, tp, i), dtype=FP8_DTYPE if fp8 else out_dtype, device=dev)
            # The output keeps a sink row after the (E, T) rows the finalize reads.
            out_full = alloc_output((e * t + 1, h), out_dtype, dev)
            out = out_full[: e * t].view(e, t, h)
            y = out if tp == t else torch.empty((e + 1, tp, h), dtype=out_dtype, device=dev)[:e]
            act_scale = empty_mn_major((e + 1, tp, i // 128), dev) if fp8 else None
            # one launch over each expert's first counts[e] rows: SiLU-and-mul, then the requantisation
            silu_mul_rows(gate_up[:e], counts, act_buf[:e], act_scale[:e] if fp8 else None)
        with stage("gemm2"):
            if fp8:
                dg.m_grouped_fp8_gemm_nt_masked((act_buf[:e], act_scale[:e]), (w2.q, w2.scale.contiguous()), y, counts,
                                                hint)
            else:
                dg.m_grouped_bf16_gemm_nt_masked(act_buf[:e], w2, y, counts, hint)
        if tp != t:
            with stage("unpack"):
                out_full.index_copy_(0, idx, y.reshape(e * tp, h).index_select(0, idx_p.clamp(max=e * tp - 1)))
        return out
