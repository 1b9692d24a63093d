"""FP8 quantisation schemes (vLLM's names), weight and activation quantisation, and the exact
emulation the float64 reference uses.

Schemes (all `fp8_w8a8`: float8_e4m3fn weights and activations, fp32 scales, bf16/fp16 output):

| scales   | weights (E, N, K)                        | activations (rows, K)                 |
|----------|------------------------------------------|---------------------------------------|
| `tensor` | one scale per expert, (E,)               | one static scale per layer input      |
| `token`  | one per output channel, (E, N)           | one per row (token), dynamic          |
| `block`  | one per [bn, bk] block, (E, N/bn, K/bk)  | one per row and bk columns, dynamic   |

Per-tensor activation scales are static, as in vLLM's per-tensor fp8 checkpoints (`input_scale`
of w13 and w2): calibrated once when the weights are quantised (`calibrate_input_scales`: amax of
256 N(0, 1) tokens and of their intermediate through every expert, / 448) and stored on the
QuantWeight; values beyond them saturate at +-448, in the kernels and in the reference alike. A
static scale also means every rank quantises the layer input the same way, whichever tokens it
holds (under TP each rank's intermediate scale is calibrated on its own shard, as its weights are
quantised per shard). Per-token and block activation scales are dynamic (amax of each row or group).

Every scale is a dequantisation multiplier: value = fp8 * scale. Sizes that are not multiples of
the block are fine: the last block / group is partial (its scale covers the columns it has).

Activation scales always travel as a per-row tensor `(rows, G)`, G = ceil(K / bk) for `block`
and 1 otherwise; a per-tensor scale is that tensor with stride 0 over rows (an expanded view), so
kernels read every scheme the same way and rows from ranks with different per-tensor scales can
share one buffer (after dispatch, each row keeps its sender's scale).

The experts' intermediate (after SiLU-and-mul) is stored in the activation dtype and quantised
again with the same scheme before GEMM2, as vLLM does; `fake_quant` reproduces exactly that for
the reference, so the reference sees the same rounding points and the check measures the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.errors import MoebenchError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Smallest amax used for a scale (an all-zero row or group gets a tiny scale, quantises to 0).
AMAX_EPS = 1e-10
SCALES = ("tensor", "token", "block")
QUANT_DTYPES = ("fp8_w8a8",)


@dataclass(frozen=True)
class QuantScheme:
    """name: vLLM's dtype tag ("fp8_w8a8"); scales: "tensor" | "token" | "block";
    block_shape: (bn, bk) weight block for "block" (activation groups are 1 x bk), else None."""

    name: str = "fp8_w8a8"
    scales: str = "tensor"
    block_shape: tuple[int, int] | None = None

    def __post_init__(self):
        if self.name not in QUANT_DTYPES:
            raise MoebenchError(f"unknown quantised dtype '{self.name}'; use one of {', '.join(QUANT_DTYPES)}")
        if self.scales not in SCALES:
            raise MoebenchError(f"unknown fp8 scales '{self.scales}'; use one of {', '.join(SCALES)}")
        if (self.scales == "block") != (self.block_shape is not None):
            raise MoebenchError("fp8 block scales need --block-shape BN,BK (e.g. 128,128), and only block scales take one")
        if self.block_shape is not None and (len(self.block_shape) != 2 or min(self.block_shape) < 1):
            raise MoebenchError(f"--block-shape must be two positive integers like 128,128, got {self.block_shape}")

    @property
    def group_k(self) -> int | None:
        """Columns per activation scale: bk for block, None = the whole row (or tensor)."""
        return self.block_shape[1] if self.block_shape else None

    def num_groups(self, k: int) -> int:
        """Scale columns of an activation with k columns."""
        return -(-k // self.group_k) if self.group_k else 1

    @property
    def scales_label(self) -> str:
        """'per-tensor', 'per-token' or 'block[128,128]' (the `quant` result column)."""
        if self.scales == "block":
            return f"block[{self.block_shape[0]},{self.block_shape[1]}]"
        return f"per-{self.scales}"

    def describe(self) -> str:
        """'fp8_w8a8 per-tensor', 'fp8_w8a8 per-token', 'fp8_w8a8 block[128,128]'."""
        return f"{self.name} {self.scales_label}"

    @property
    def file_block_shape(self) -> list[int] | None:
        """The `block_shape=[..]` part of a tuned-config file name (vLLM's naming)."""
        return list(self.block_shape) if self.block_shape else None


def precision_text(act_dtype_name: str, quant: QuantScheme | None) -> str:
    """'bf16', or 'fp8_w8a8 block[128,128] (bf16 activations)' (command headers, reports)."""
    return act_dtype_name if quant is None else f"{quant.describe()} ({act_dtype_name} activations)"


def parse_block_shape(text: str | None) -> tuple[int, int] | None:
    """'128,128' -> (128, 128); None/'' -> None."""
    if not text:
        return None
    try:
        parts = tuple(int(p) for p in text.replace("[", "").replace("]", "").split(","))
    except ValueError:
        parts = ()
    if len(parts) != 2 or min(parts) < 1:
        raise MoebenchError(f"--block-shape must be two positive integers like 128,128, got '{text}'")
    return parts  # type: ignore[return-value]


def parse_quant(dtype: str | None, block_shape: str | None = None, scales: str | None = None) -> QuantScheme | None:
    """CLI options -> scheme, or None for an unquantised dtype. `--block-shape` implies block
    scales; `--scales` without fp8 is an error."""
    if dtype not in QUANT_DTYPES:
        if block_shape or scales:
            raise MoebenchError(f"--block-shape/--scales apply to --dtype fp8_w8a8 only (got --dtype {dtype})")
        return None
    bs = parse_block_shape(block_shape)
    sc = scales or ("block" if bs else "tensor")
    return QuantScheme(dtype, sc, bs)


# ---------------------------------------------------------------------------------------------
# Rounding and scales (torch, fp32 math: the same arithmetic the kernels do).


def _to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t / scale (fp32), saturated to +-448, rounded to e4m3 (nearest even)."""
    return (t.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


#: fp32(1 / 448): scales are amax times this product on every device (a division by a Python
#: scalar is a multiply by its fp32 reciprocal on CUDA but a true division on the CPU), so the same
#: amax gives the same scale bits everywhere, in torch and in the Triton kernels.
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The fp8 scale of an amax: max(amax, AMAX_EPS) * fp32(1/448), fp32."""
    return amax.float().clamp(min=AMAX_EPS) * INV_FP8_MAX


def quantize_activation(
    x: torch.Tensor, scheme: QuantScheme, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) in a float dtype -> (q (..., K) float8_e4m3fn, scale (..., G) float32).

    Leading dimensions are rows. tensor: `static_scale` (1,) (dynamic amax of x if None),
    returned expanded over rows (stride 0); token: one per row; block: one per row and group_k
    columns."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    if scheme.scales == "tensor":
        s = static_scale.float().reshape(()) if static_scale is not None else scale_of(x.abs().amax() if x.numel() else x.new_zeros(()))
        return _to_fp8(x, s), s.reshape([1] * (len(lead) + 1)).expand(*lead, 1)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device), torch.ones(
            (*lead, scheme.num_groups(k)), dtype=torch.float32, device=x.device
        )
    if scheme.scales == "token":
        s = scale_of(x.abs().amax(dim=-1, keepdim=True))
        return _to_fp8(x, s), s
    g = scheme.group_k
    n = scheme.num_groups(k)
    pad = n * g - k
    xp = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*lead, n, g)
    s = scale_of(xp.abs().amax(dim=-1))  # (..., n)
    q = (xp / s.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(*lead, n * g)[..., :k]
    return q.contiguous(), s


def expand_groups(scale: torch.Tensor, k: int, scheme: QuantScheme) -> torch.Tensor:
    """Per-group scales (..., G) -> per-column (..., k)."""
    if scheme.group_k is None:
        return scale.expand(*scale.shape[:-1], k)
    return scale.repeat_interleave(scheme.group_k, dim=-1)[..., :k]


def dequantize_activation(
    q: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """q (..., K) fp8, scale (..., G) -> (..., K) in `dtype`."""
    return q.to(dtype) * expand_groups(scale, q.shape[-1], scheme).to(dtype)


def fake_quant(
    t: torch.Tensor, scheme: QuantScheme, act_dtype: torch.dtype, static_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """What a kernel's activation becomes on its way through the scheme: rounded to the activation
    dtype (how it is stored), quantised, dequantised. Returns float64."""
    q, s = quantize_activation(t.to(act_dtype), scheme, static_scale)
    return dequantize_activation(q, s, scheme)


# ---------------------------------------------------------------------------------------------
# Weights: quantised once when the problem is built.


@dataclass
class QuantWeight:
    """A quantised expert weight.

    q:           (E, N, K) float8_e4m3fn (w13: N = 2I, K = H; w2: N = H, K = I)
    scale:       float32 multipliers: tensor (E,); token (E, N); block (E, ceil(N/bn), ceil(K/bk))
    scheme:      the QuantScheme
    input_scale: (1,) float32 static scale of this GEMM's input activation (tensor scheme), else None
    """

    q: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def dim(self) -> int:
        return self.q.dim()

    def nbytes(self) -> int:
        """Bytes of the fp8 payload and the scales."""
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def __getitem__(self, idx) -> "QuantWeight":
        """Select experts (an index, slice or index tensor along dim 0); keeps (E', ...) shapes."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return QuantWeight(self.q[idx], self.scale[idx], self.scheme, self.input_scale)

    def to(self, device) -> "QuantWeight":
        s = None if self.input_scale is None else self.input_scale.to(device)
        return QuantWeight(self.q.to(device), self.scale.to(device), self.scheme, s)

    def contiguous(self) -> "QuantWeight":
        return QuantWeight(self.q.contiguous(), self.scale.contiguous(), self.scheme, self.input_scale)

    def scale_strides(self) -> tuple[int, int, int]:
        """(per expert, per N row, per K block) strides of `scale` as kernels index it:
        scale[e * s0 + (n // bn) * s1 + (k // bk) * s2] for block, scale[e * s0 + n * s1] else."""
        if self.scheme.scales == "tensor":
            return self.scale.stride(0), 0, 0
        if self.scheme.scales == "token":
            return self.scale.stride(0), self.scale.stride(1), 0
        return self.scale.stride(0), self.scale.stride(1), self.scale.stride(2)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """(E, N, K) in `dtype`."""
        e, n, k = self.q.shape
        q = self.q.to(dtype)
        if self.scheme.scales == "tensor":
            return q * self.scale.to(dtype).view(e, 1, 1)
        if self.scheme.scales == "token":
            return q * self.scale.to(dtype).view(e, n, 1)
        bn, bk = self.scheme.block_shape
        s = self.scale.to(dtype).repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bk, dim=2)[:, :, :k]
        return q * s


def quantize_weight(w: torch.Tensor, scheme: QuantScheme) -> QuantWeight:
    """w (E, N, K) float -> QuantWeight with amax scales per expert / channel / block."""
    e, n, k = w.shape
    wf = w.float()
    if scheme.scales == "tensor":
        s = scale_of(wf.abs().amax(dim=(1, 2)))  # (E,)
        return QuantWeight(_to_fp8(wf, s.view(e, 1, 1)), s, scheme)
    if scheme.scales == "token":
        s = scale_of(wf.abs().amax(dim=2))  # (E, N)
        return QuantWeight(_to_fp8(wf, s.view(e, n, 1)), s, scheme)
    bn, bk = scheme.block_shape
    nb, kb = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(wf, (0, kb * bk - k, 0, nb * bn - n)).view(e, nb, bn, kb, bk)
    s = scale_of(wp.abs().amax(dim=(2, 4)))  # (E, nb, kb)
    q = (wp / s.view(e, nb, 1, kb, 1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(e, nb * bn, kb * bk)[:, :n, :k].contiguous()
    return QuantWeight(q, s.contiguous(), scheme)


def calibrate_input_scales(w13: QuantWeight, w2: QuantWeight, act_dtype: torch.dtype, tokens: int = 256) -> None:
    """Static per-tensor input scales (amax / 448) from `tokens` N(0, 1) tokens (seed 0) and their
    SiLU-and-mul intermediate through every expert; sets w13.input_scale and w2.input_scale.
    Every rank derives the same scales for the same experts."""
    e, two_i, h = w13.shape
    g = torch.Generator(device=w13.device).manual_seed(0)
    x = torch.randn((tokens, h), generator=g, device=w13.device).to(act_dtype)
    w13.input_scale = scale_of(x.float().abs().amax()).reshape(1)
    xq = fake_quant(x, w13.scheme, act_dtype, w13.input_scale).float()
    amax = torch.zeros((), device=w13.device)
    for j in range(e):
        gu = xq @ w13[j].dequantize(torch.float32)[0].t()
        inter = torch.nn.functional.silu(gu[:, : two_i // 2]) * gu[:, two_i // 2 :]
        amax = torch.maximum(amax, inter.to(act_dtype).float().abs().amax())
    w2.input_scale = scale_of(amax).reshape(1)


def quantize_weights(w13: torch.Tensor, w2: torch.Tensor, scheme: QuantScheme | None, act_dtype=torch.bfloat16):
    """Both expert weights (w13 (E, 2I, H), w2 (E, H, I)) -> QuantWeights, with static input
    scales for the tensor scheme; the inputs unchanged when scheme is None."""
    if scheme is None:
        return w13, w2
    q13, q2 = quantize_weight(w13, scheme), quantize_weight(w2, scheme)
    if scheme.scales == "tensor":
        calibrate_input_scales(q13, q2, act_dtype)
    return q13, q2


def scheme_of(w) -> QuantScheme | None:
    """The scheme of a (possibly) quantised weight, None for a plain tensor."""
    return w.scheme if isinstance(w, QuantWeight) else None


def as_float(w, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A weight as a float tensor (dequantised when quantised)."""
    return w.dequantize(dtype) if isinstance(w, QuantWeight) else w.to(dtype)


# ---------------------------------------------------------------------------------------------
# Moving quantised rows: one byte row per token, payload then scales (as DeepEP-LL packs them),
# so a dispatch sends one message per (token, rank) and works on any backend (uint8 everywhere).


def pack_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q (R, K) fp8, scale (R, G) fp32 -> (R, K + 4G) uint8."""
    return torch.cat([q.view(torch.uint8), scale.float().contiguous().view(torch.uint8)], dim=1)


def unpack_rows(buf: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, K + 4G) uint8 -> q (R, K) fp8, scale (R, G) fp32."""
    return buf[:, :k].contiguous().view(FP8_DTYPE), buf[:, k:].contiguous().view(torch.float32)


@dataclass
class ActQuant:
    """How prepare() quantises the layer input: the scheme, and the static scale for the tensor
    scheme (w13.input_scale), else None."""

    scheme: QuantScheme
    static_scale: torch.Tensor | None = None
