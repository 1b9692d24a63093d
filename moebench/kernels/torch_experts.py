"""Torch experts: the peer baseline.

`torch` (Standard): tokens sorted by expert, two grouped GEMMs (torch.nn.functional.grouped_mm or
torch._grouped_mm) with the activation-and-mul between; output (M, K, H) unweighted.
`batched-torch` (BatchedExperts): two batched matmuls over (E_local, T, H). No fp8.
Both compute every activation of moebench.activation and add expert biases (b13 to GEMM1's output,
gathered per sorted row; b2 to GEMM2's); fp8 runs silu / gelu without biases.

fp8 (`torch` only, schemes `tensor` and `token`): torch's scaled grouped GEMM
(torch.nn.functional.scaled_grouped_mm with RowWise recipes, else torch._scaled_grouped_mm), which
runs on CUDA compute capability 9.0 / 10.0 only and takes, for a 2-D x 3-D product,

    mat_a (rows, K) float8_e4m3fn row-major        scale_a (rows,) float32, one per row
    mat_b (E, K, N) float8_e4m3fn column-major     scale_b (E, N) float32, one per (expert, column)
    offs (E,) int32 group ends; K and N multiples of 16; output bf16 only.

Per-tensor scales are exactly rowwise scales that happen to be equal: the activation's static
scale is gathered per sorted row, an expert's weight scale (E,) is expanded to (E, N). Per-token
weight scales (E, N) are rowwise already. The intermediate after SiLU-and-mul is rounded once to
the layer's dtype (prep.out_dtype) and quantised with the same scheme (static w2.input_scale /
per row) before GEMM2, as moebench.quant.quantize_activation does and the reference emulates.
The one rounding the reference does not see: GEMM1's output is bf16 (the op's only output dtype)
before SiLU-and-mul, which moves some intermediate values across an fp8 rounding boundary; that
costs about 1% relative error against the reference (below the fp8 tolerance, 3%).
Block scales have no grouped GEMM in torch on Hopper (only MX / NV block formats on sm100): not
supported. Anywhere else (CPU, other GPUs, ROCm, a torch without the op) a quantised call raises
UnsupportedError with the reason (`TorchExperts.quant_unavailable_reason`).
"""

from __future__ import annotations

import torch

from moebench.activation import ACTIVATIONS, SILU, Activation
from moebench.errors import UnsupportedError
from moebench.kernels.modular import (
    ActivationFormat,
    Experts,
    ExpertBias,
    PrepareResult,
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    alloc_output,
)
from moebench.kernels.reference import act_and_mul
from moebench.kernels.token_layout import local_topk_ids, sort_by_expert
from moebench.quant import FP8_DTYPE, QuantScheme, QuantWeight, quantize_activation

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_scaled_grouped_mm_v2 = getattr(torch.nn.functional, "scaled_grouped_mm", None)
_ScalingType = getattr(torch.nn.functional, "ScalingType", None)
_scaled_grouped_mm_v1 = getattr(torch, "_scaled_grouped_mm", None)
#: fp8 scale kinds the scaled grouped GEMM runs (rowwise on both operands).
FP8_SCALES = ("tensor", "token")
#: The scaled grouped GEMM wants K and N in multiples of 16 elements (16 bytes of fp8).
_FP8_ALIGN = 16

#: grouped_mm needs every stride to be a multiple of 16 bytes: H and I are padded to this many
#: elements (zeros, which change no result) when a shape is not aligned; real model shapes are.
_ALIGN = 8


def _pad_to(n: int, align: int = _ALIGN) -> int:
    return -(-n // align) * align


def _pad_gate_up(t: torch.Tensor, i: int, ip: int, interleaved: bool) -> torch.Tensor:
    """(..., 2I, *rest) w13 rows (or b13 columns) -> (..., 2I', *rest), zeros added where the
    activation pairs them with zeros: after each half, or (interleaved) at the end, as whole pairs."""
    if ip == i:
        return t
    shape = list(t.shape)
    shape[1] = 2 * ip
    out = t.new_zeros(shape)
    if interleaved:
        out[:, : 2 * i] = t
    else:
        out[:, :i] = t[:, :i]
        out[:, ip : ip + i] = t[:, i:]
    return out


def _aligned_operands(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, interleaved: bool = False):
    """Zero-pad H and I to multiples of _ALIGN: x (R, H'), w13 (E, 2I', H'), w2 (E, H', I')."""
    e, two_i, h = w13.shape
    i = two_i // 2
    hp, ip = _pad_to(h), _pad_to(i)
    if (hp, ip) == (h, i):
        return x, w13, w2
    x_p = torch.nn.functional.pad(x, (0, hp - h))
    w13_p = _pad_gate_up(torch.nn.functional.pad(w13, (0, hp - h)), i, ip, interleaved)
    w2_p = w2.new_zeros((e, hp, ip))
    w2_p[:, :h, :i] = w2
    return x_p, w13_p, w2_p


# ---------------------------------------------------------------------------------------------
# fp8: torch's scaled grouped GEMM


def fp8_grouped_mm_unavailable_reason(device: torch.device | str | None) -> str | None:
    """None when torch's fp8 scaled grouped GEMM can run on `device` ("cuda", "cuda:1", a
    torch.device; None = the current CUDA device), else why not."""
    if _scaled_grouped_mm_v2 is None and _scaled_grouped_mm_v1 is None:
        return (f"torch {torch.__version__} has no fp8 scaled grouped GEMM "
                f"(neither nn.functional.scaled_grouped_mm nor _scaled_grouped_mm)")
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return "torch scaled grouped GEMM needs CUDA (sm90 or sm100 GPU); fp8 'torch' experts do not run on " + str(dev.type)
    if not torch.cuda.is_available():
        return "torch scaled grouped GEMM needs CUDA (sm90 or sm100 GPU); no CUDA device is visible"
    if getattr(torch.version, "hip", None):
        return ("torch scaled grouped GEMM on ROCm takes float8_e4m3fnuz; moebench quantises to float8_e4m3fn, "
                "so fp8 'torch' experts run on CUDA sm90 / sm100 only")
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) not in ((9, 0), (10, 0)):
        return (f"torch scaled grouped GEMM needs CUDA compute capability 9.0 or 10.0 (Hopper / B200); "
                f"{torch.cuda.get_device_name(dev)} is {major}.{minor}")
    return None


def _scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       offs: torch.Tensor) -> torch.Tensor:
    """a (R, K) fp8 row-major, b (E, K, N) fp8 column-major, scale_a (R,) fp32, scale_b (E, N)
    fp32, offs (E,) int32 -> (R, N) bf16; rows past offs[-1] are undefined."""
    global _scaled_grouped_mm_v2
    if _scaled_grouped_mm_v2 is not None and _ScalingType is not None:
        try:
            return _scaled_grouped_mm_v2(
                a, b, scale_a=scale_a, scale_recipe_a=_ScalingType.RowWise, scale_b=scale_b,
                scale_recipe_b=_ScalingType.RowWise, offs=offs, output_dtype=torch.bfloat16,
            )
        except TypeError:  # a torch whose public signature differs: use the private op from now on
            if _scaled_grouped_mm_v1 is None:
                raise
            _scaled_grouped_mm_v2 = None
    return _scaled_grouped_mm_v1(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def _pad_fp8_rows(q: torch.Tensor, cols: int) -> torch.Tensor:
    """(R, C) fp8 -> (R, cols) with zero columns appended (as bytes: fp8 +0.0 is 0x00)."""
    if q.shape[-1] == cols:
        return q
    return torch.nn.functional.pad(q.view(torch.uint8), (0, cols - q.shape[-1])).view(q.dtype)


def _fp8_weight_operand(w: QuantWeight, n_pad: int, k_pad: int, split_halves: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A QuantWeight (E, N, K) -> mat_b (E, K', N') fp8 column-major and scale_b (E, N') fp32.

    N and K are zero-padded to n_pad / k_pad; with split_halves (w13) each half of N (gate, up)
    is padded to n_pad / 2 separately, so gate and up columns stay where silu_and_mul looks.
    Padded columns get scale 1 (their weights are zero)."""
    e, n, k = w.q.shape
    q = w.q.view(torch.uint8)
    scale = w.scale.float()
    scale = scale.reshape(e, 1).expand(e, n) if w.scheme.scales == "tensor" else scale.reshape(e, n)
    if (n, k) != (n_pad, k_pad):
        if split_halves:
            h, hp = n // 2, n_pad // 2
            q = torch.cat([torch.nn.functional.pad(q[:, :h], (0, k_pad - k, 0, hp - h)),
                           torch.nn.functional.pad(q[:, h:], (0, k_pad - k, 0, hp - h))], dim=1)
            scale = torch.cat([torch.nn.functional.pad(scale[:, :h], (0, hp - h), value=1.0),
                               torch.nn.functional.pad(scale[:, h:], (0, hp - h), value=1.0)], dim=1)
        else:
            q = torch.nn.functional.pad(q, (0, k_pad - k, 0, n_pad - n))
            scale = torch.nn.functional.pad(scale, (0, n_pad - n), value=1.0)
    mat_b = q.contiguous().view(w.q.dtype).transpose(1, 2)  # (E, K', N') column-major
    return mat_b, scale.contiguous()


def torch_fp8_moe(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    w13: QuantWeight,
    w2: QuantWeight,
    out_dtype: torch.dtype,
    activation: Activation = SILU,
) -> torch.Tensor:
    """The fp8 `torch` experts: a (M, H) fp8 with a_scale (M, 1) fp32 (stride 0 for a static
    per-tensor scale), topk_ids (M, K) global ids -> (M, K, H) in out_dtype, unweighted, remote
    pairs zero. See the module docstring for the operand rules."""
    scheme: QuantScheme = w13.scheme
    m, k = topk_ids.shape
    e, two_i, h = w13.q.shape
    i = two_i // 2
    hp, ip = _pad_to(h, _FP8_ALIGN), _pad_to(i, _FP8_ALIGN)
    out = alloc_output((m * k, h), out_dtype, a.device)
    if m * k == 0:
        return out.view(m, k, h)
    local = local_topk_ids(topk_ids, expert_map)
    s = sort_by_expert(local, e)
    rows = s.order // k
    # Rows move as bytes: index_select has no fp8 kernel on every device.
    xs = _pad_fp8_rows(a.view(torch.uint8).index_select(0, rows).view(a.dtype), hp)  # (M*K, H')
    xs_scale = a_scale.float().index_select(0, rows).reshape(-1).contiguous()  # (M*K,)
    offs = s.offsets.to(torch.int32)
    b13, s13 = _fp8_weight_operand(w13, 2 * ip, hp, split_halves=True)
    b2, s2 = _fp8_weight_operand(w2, hp, ip, split_halves=False)
    gate_up = _scaled_grouped_mm(xs, b13, xs_scale, s13, offs)  # (M*K, 2I') bf16
    # One rounding to the layer's dtype (the reference's rounding point), then the scheme.
    act = act_and_mul(gate_up.float(), activation).to(out_dtype)  # (M*K, I'), padded columns are 0
    act_q, act_scale = quantize_activation(act, scheme, w2.input_scale if scheme.scales == "tensor" else None)
    act_scale = act_scale.reshape(-1).contiguous()
    ys = _scaled_grouped_mm(act_q, b2, act_scale, s2, offs)[:, :h].to(out_dtype)  # (M*K, H)
    valid = (torch.arange(m * k, device=a.device) < offs[-1:].long()).unsqueeze(-1)
    out.index_copy_(0, s.order, torch.where(valid, ys, torch.zeros((), dtype=ys.dtype, device=ys.device)))
    return out.view(m, k, h)


class TorchExperts(Experts):
    """Standard: grouped GEMM on expert-sorted tokens. Returns (M, K, H), remote pairs zero.

    fp8 (tensor / token scales): torch's scaled grouped GEMM on CUDA sm90 / sm100 (module
    docstring); elsewhere a quantised call raises UnsupportedError."""

    name = "torch"
    activation_format = ActivationFormat.STANDARD
    supported_quant = FP8_SCALES

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if _grouped_mm is None:
            return f"torch {torch.__version__} has neither nn.functional.grouped_mm nor _grouped_mm"
        return None

    @classmethod
    def quant_unavailable_reason(cls, device: str, scheme: QuantScheme) -> str | None:
        """None when `scheme` runs on `device` ("cpu", "cuda", "cuda:N"), else why not."""
        if scheme.kind not in cls.supported_quant:
            return (f"experts '{cls.name}' do not support {scheme.describe()} (torch's scaled grouped GEMM "
                    f"takes per-tensor / per-row scales only)")
        return fp8_grouped_mm_unavailable_reason(device)

    supported_activations = ACTIVATIONS
    supports_bias = True

    @classmethod
    def activation_unavailable_reason(cls, activation, bias, quant=None):
        if quant is not None and (bias or activation.interleaved):
            return (f"experts '{cls.name}': fp8 runs silu / gelu without biases (the scaled grouped GEMM pads "
                    f"w13 by halves)")
        return super().activation_unavailable_reason(activation, bias, quant)

    def weight_and_reduce(self):
        return TopKWeightAndReduceContiguous()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor, *, activation: Activation = SILU,
              bias: ExpertBias | None = None) -> torch.Tensor:
        if isinstance(w13, QuantWeight) or isinstance(w2, QuantWeight):
            self.check_activation(activation, bias, getattr(w13, "scheme", None))
            return self._apply_fp8(prep, w13, w2, activation)
        x, ids = prep.a, prep.topk_ids
        m, k = ids.shape
        h = x.shape[-1]
        i = w2.shape[-1]
        local = local_topk_ids(ids, prep.expert_map)
        s = sort_by_expert(local, w13.shape[0])
        xs = x.index_select(0, s.order // k)  # (M*K, H): pairs in expert order, remote ones last
        xs, w13, w2 = _aligned_operands(xs, w13, w2, activation.interleaved)
        offs = s.offsets.to(torch.int32)
        # grouped_mm: rows [offs[g-1], offs[g]) of xs times group g; rows past offs[-1] undefined.
        gate_up = _grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # (M*K, 2I)
        if bias is not None:
            # Each sorted row's expert (remote rows, past offs[-1], borrow the last one: masked below).
            row_expert = torch.searchsorted(s.offsets, torch.arange(m * k, device=x.device), right=True)
            row_expert = row_expert.clamp(max=w13.shape[0] - 1)
            gate_up = gate_up + _pad_gate_up(bias.b13.to(gate_up.dtype), i, w2.shape[-1],
                                             activation.interleaved).index_select(0, row_expert)
        act = act_and_mul(gate_up, activation)
        ys = _grouped_mm(act, w2.transpose(1, 2), offs=offs)[:, :h]  # (M*K, H)
        if bias is not None:
            ys = ys + bias.b2.to(ys.dtype).index_select(0, row_expert)
        valid = (torch.arange(m * k, device=x.device) < offs[-1:].long()).unsqueeze(-1) if m * k else None
        out = alloc_output((m * k, h), x.dtype, x.device)
        if m * k:
            out.index_copy_(0, s.order, torch.where(valid, ys, torch.zeros((), dtype=ys.dtype, device=ys.device)))
        return out.view(m, k, h)

    def _apply_fp8(self, prep: PrepareResult, w13: QuantWeight, w2: QuantWeight,
                   activation: Activation = SILU) -> torch.Tensor:
        if not (isinstance(w13, QuantWeight) and isinstance(w2, QuantWeight)) or w13.scheme != w2.scheme:
            raise UnsupportedError("experts 'torch': w13 and w2 must be quantised with the same scheme")
        reason = self.quant_unavailable_reason(str(w13.device), w13.scheme)
        if reason is not None:
            raise UnsupportedError(reason)
        if prep.a_scale is None or prep.a.dtype != FP8_DTYPE:
            raise UnsupportedError("experts 'torch' take fp8 activations quantised by prepare (prep.a_scale is missing)")
        out_dtype = prep.out_dtype or torch.bfloat16
        return torch_fp8_moe(prep.a, prep.a_scale, prep.topk_ids, prep.expert_map, w13, w2, out_dtype, activation)


class BatchedTorchExperts(Experts):
    """BatchedExperts: bmm over (E_local, T, H). Returns (E_local, T, H) unweighted; rows past
    expert_num_tokens are not meaningful (the finalize only reads valid slots). Those rows of the
    input are zeroed first: they hold whatever the buffer held (NaN, inf), and torch's bf16 bmm on
    CPU carried a NaN of such a row into the valid rows of its batch."""

    name = "batched-torch"
    activation_format = ActivationFormat.BATCHED
    supported_activations = ACTIVATIONS
    supports_bias = True

    def weight_and_reduce(self):
        return TopKWeightAndReduceDelegate()

    def apply(self, prep: PrepareResult, w13: torch.Tensor, w2: torch.Tensor, *, activation: Activation = SILU,
              bias: ExpertBias | None = None) -> torch.Tensor:
        a = prep.a  # (E_local, T, H)
        live = torch.arange(a.shape[1], device=a.device) < prep.expert_num_tokens.to(a.device).unsqueeze(1)
        a = torch.where(live.unsqueeze(-1), a, torch.zeros((), dtype=a.dtype, device=a.device))
        gate_up = torch.bmm(a, w13.transpose(1, 2))  # (E_local, T, 2I)
        if bias is not None:
            gate_up = gate_up + bias.b13.to(gate_up.dtype).unsqueeze(1)
        out = alloc_output(a.shape, a.dtype, a.device)
        if bias is None:
            torch.bmm(act_and_mul(gate_up, activation), w2.transpose(1, 2), out=out)
        else:
            torch.baddbmm(bias.b2.to(a.dtype).unsqueeze(1), act_and_mul(gate_up, activation), w2.transpose(1, 2),
                          out=out)
        return out
