"""Quantisation schemes (vLLM's names), weight and activation quantisation, and the exact
emulation the float64 reference uses: fp8_w8a8 (weights and activations), and the weight-only
schemes int8_w8a16, int4_w4a16 and mxfp4 (see "Weight-only schemes" below).

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

Weight-only schemes: activations stay in their 16-bit dtype (bf16, or fp16 for the integer
schemes); weights are stored packed and dequantised inside the GEMMs' K loops, then dotted in the
activation dtype with fp32 accumulation.

| name         | q (E, N, Kq)                                     | scale                          | zeros |
|--------------|--------------------------------------------------|--------------------------------|-------|
| `int8_w8a16` | int8, Kq = K                                     | (E, N) act dtype, per channel  | -     |
| `int4_w4a16` | uint8, two 4-bit codes per byte along K, Kq = Kp/2 | (E, N, G) act dtype          | optional (E, ceil(N/2), G) uint8, two 4-bit zeros per byte along N |
| `mxfp4`      | uint8, two e2m1 codes per byte along K, Kq = Kp/2  | (E, N, G) uint8 e8m0 (2^(s-127)) | - |

Packing (vLLM's int4_w4a16 layout): element k of a row is in byte k // 2, low nibble for even k,
high nibble for odd k; zero points pack the same way along N (output row n in byte n // 2).
G = ceil(K / group) groups along K (int4: `group_size` 32 | 64 | 128; mxfp4: 32, OCP MX); a K that
is not a multiple of the group is padded with zeros to Kp = G * group (the last group is
partial; its padded codes dequantise to exactly 0), so any K works, odd ones too.

Values: int8 w = q * s (symmetric, s = amax / 127); int4 w = (q - z) * s with z = 8 without zero
points (symmetric, s = amax / 7, codes 0..15 for -8..7) or the group's own uint4 zero (asymmetric,
GPTQ/AWQ style: s = (max - min) / 15, z = round(-min / s)); mxfp4 w = e2m1(q) * 2^(s - 127), s the
OCP shared exponent floor(log2(amax)) - 2 + 127 (e2m1's largest exponent is 2), values rounded to
the nearest e2m1 (ties to even) and saturated at +-6. Scales of the integer schemes are stored in
the activation dtype, as GPTQ/AWQ and vLLM's int8_w8a16 checkpoints hold them.

Exactness: the kernels form (q - z) * s in fp32 (exact: a 4/8-bit integer times a 16-bit scale)
and round it once to the activation dtype before the dot; `QuantWeight.dequantize` does exactly
that, so the float64 reference sees the weights the tensor cores see (mxfp4's values are exact in
bf16). The check then measures the kernel, under the unquantised dtype's tolerance.
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
#: Weight-only schemes (activations unquantised); each is also its own capability kind.
WEIGHT_ONLY = ("int8_w8a16", "int4_w4a16", "mxfp4")
#: Schemes moebench prices but runs no kernel of: NVFP4 (4-bit e2m1 weights and activations, one
#: e4m3 scale per 16 values and an fp32 scale per tensor), the format Blackwell deployments use.
MODELED_ONLY = ("nvfp4",)
NVFP4_GROUP = 16
QUANT_DTYPES = ("fp8_w8a8",) + WEIGHT_ONLY + MODELED_ONLY
#: Every capability kind an experts backend may declare in `supported_quant`: the fp8 scale kinds
#: and the weight-only scheme names (`QuantScheme.kind`).
QUANT_KINDS = SCALES + WEIGHT_ONLY
INT4_GROUP_SIZES = (32, 64, 128)
MXFP4_GROUP = 32


@dataclass(frozen=True)
class QuantScheme:
    """name: vLLM's dtype tag ("fp8_w8a8", "int8_w8a16", "int4_w4a16", "mxfp4").
    fp8: scales "tensor" | "token" | "block" (default "tensor"); block_shape: (bn, bk) weight block
    for "block" (activation groups are 1 x bk), else None.
    Weight-only: scales and block_shape stay None; group_size: int4's K group (32 | 64 | 128,
    default 128; mxfp4: 32, fixed); zero_points: int4 with a uint4 zero per group (asymmetric)."""

    name: str = "fp8_w8a8"
    scales: str | None = None
    block_shape: tuple[int, int] | None = None
    group_size: int | None = None
    zero_points: bool = False

    def __post_init__(self):
        if self.name not in QUANT_DTYPES:
            raise MoebenchError(f"unknown quantised dtype '{self.name}'; use one of {', '.join(QUANT_DTYPES)}")
        if self.name in WEIGHT_ONLY:
            self._check_weight_only()
            return
        if self.name in MODELED_ONLY:
            if self.scales is not None or self.block_shape is not None or self.zero_points \
                    or self.group_size not in (None, NVFP4_GROUP):
                raise MoebenchError(f"nvfp4 has one e4m3 scale per {NVFP4_GROUP} values: --block-shape, --scales, "
                                    f"--group-size and --zero-points do not apply")
            object.__setattr__(self, "group_size", NVFP4_GROUP)
            return
        if self.scales is None:
            object.__setattr__(self, "scales", "tensor")
        if self.scales not in SCALES:
            raise MoebenchError(f"unknown fp8 scales '{self.scales}'; use one of {', '.join(SCALES)}")
        if (self.scales == "block") != (self.block_shape is not None):
            raise MoebenchError("fp8 block scales need --block-shape BN,BK (e.g. 128,128), and only block scales take one")
        if self.block_shape is not None and (len(self.block_shape) != 2 or min(self.block_shape) < 1):
            raise MoebenchError(f"--block-shape must be two positive integers like 128,128, got {self.block_shape}")
        if self.group_size is not None or self.zero_points:
            raise MoebenchError("--group-size/--zero-points apply to --dtype int4_w4a16 only (got fp8_w8a8)")

    def _check_weight_only(self) -> None:
        if self.scales is not None or self.block_shape is not None:
            raise MoebenchError(f"--block-shape/--scales apply to --dtype fp8_w8a8 only (got --dtype {self.name})")
        if self.name == "int4_w4a16":
            if self.group_size is None:
                object.__setattr__(self, "group_size", 128)
            if self.group_size not in INT4_GROUP_SIZES:
                raise MoebenchError(f"--group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} for "
                                    f"int4_w4a16, got {self.group_size}")
            return
        if self.zero_points:
            raise MoebenchError(f"--zero-points applies to --dtype int4_w4a16 only (got --dtype {self.name})")
        if self.name == "mxfp4":
            if self.group_size not in (None, MXFP4_GROUP):
                raise MoebenchError(f"mxfp4 has one scale per {MXFP4_GROUP} values along K (OCP MX); "
                                    f"--group-size {self.group_size} does not apply")
            object.__setattr__(self, "group_size", MXFP4_GROUP)
        elif self.group_size is not None:
            raise MoebenchError(f"--group-size applies to --dtype int4_w4a16 only (int8_w8a16 has one scale per "
                                f"output channel)")

    @property
    def weight_only(self) -> bool:
        """True for int8_w8a16 / int4_w4a16 / mxfp4: activations are not quantised."""
        return self.name in WEIGHT_ONLY

    @property
    def kind(self) -> str:
        """The capability kind backends declare in `supported_quant`: the fp8 scale kind
        ("tensor" | "token" | "block"), or the weight-only scheme's name."""
        return self.name if self.weight_only else self.scales

    @property
    def modeled_only(self) -> bool:
        """A scheme moebench prices (weights, activations, the floor) but has no kernel of."""
        return self.name in MODELED_ONLY

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per byte along K (int4_w4a16, mxfp4, nvfp4)."""
        return self.name in ("int4_w4a16", "mxfp4", "nvfp4")

    def row_bytes(self, hidden: int, act_bytes: float = 2) -> float:
        """Bytes of one activation row as dispatched: the activation dtype (weight-only schemes),
        fp8 values and fp32 scales per group (fp8), 4-bit values and an e4m3 scale per 16 (nvfp4)."""
        if self.weight_only:
            return hidden * act_bytes
        if self.modeled_only:
            return hidden / 2 + -(-hidden // NVFP4_GROUP)
        return hidden + 4 * self.num_groups(hidden)

    def padded_k(self, k: int) -> int:
        """K of the packed layout: K itself (int8), else rounded up to a whole group."""
        if not self.packed:
            return k
        return -(-k // self.group_size) * self.group_size

    def weight_bytes(self, n: int, k: int, act_bytes: int | float = 2) -> float:
        """Bytes of one expert's (N, K) weight as stored: the payload (fp8/int8 1 byte per value,
        int4/mxfp4 half a byte over the padded K) plus its scales (fp8: fp32; int8/int4: the
        activation dtype, `act_bytes`; mxfp4: 1 byte e8m0) and int4's packed zero points."""
        if self.modeled_only:  # nvfp4: 4-bit values, an e4m3 scale per 16 along K, an fp32 per tensor
            return n * self.padded_k(k) / 2 + n * -(-k // NVFP4_GROUP) + 4
        if not self.weight_only:
            if self.scales == "tensor":
                n_scales = 1
            elif self.scales == "token":
                n_scales = n
            else:
                bn, bk = self.block_shape
                n_scales = -(-n // bn) * -(-k // bk)
            return n * k + 4 * n_scales
        if self.name == "int8_w8a16":
            return n * k + n * act_bytes
        g = -(-k // self.group_size)
        payload = n * self.padded_k(k) / 2
        if self.name == "mxfp4":
            return payload + n * g
        return payload + n * g * act_bytes + (-(-n // 2) * g if self.zero_points else 0)

    @property
    def group_k(self) -> int | None:
        """Columns per activation scale: bk for block, 16 for nvfp4, None = the whole row (or
        tensor; weight-only schemes quantise no activation)."""
        if self.modeled_only:
            return NVFP4_GROUP
        return self.block_shape[1] if self.block_shape else None

    def num_groups(self, k: int) -> int:
        """Scale columns of an activation with k columns."""
        return -(-k // self.group_k) if self.group_k else 1

    @property
    def scales_label(self) -> str:
        """The `quant` result column: 'per-tensor', 'per-token', 'block[128,128]' (fp8);
        'per-channel' (int8_w8a16), 'group[128]' / 'group[128]+zp' (int4_w4a16), 'e8m0 group[32]' (mxfp4)."""
        if self.name == "int8_w8a16":
            return "per-channel"
        if self.name == "int4_w4a16":
            return f"group[{self.group_size}]" + ("+zp" if self.zero_points else "")
        if self.name == "mxfp4":
            return f"e8m0 group[{self.group_size}]"
        if self.modeled_only:
            return f"e4m3 group[{self.group_size}]"
        if self.scales == "block":
            return f"block[{self.block_shape[0]},{self.block_shape[1]}]"
        return f"per-{self.scales}"

    def describe(self) -> str:
        """'fp8_w8a8 per-tensor', 'fp8_w8a8 block[128,128]', 'int4_w4a16 group[128]+zp', ..."""
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


def parse_quant(dtype: str | None, block_shape: str | None = None, scales: str | None = None,
                group_size: int | None = None, zero_points: bool = False) -> QuantScheme | None:
    """CLI options -> scheme, or None for an unquantised dtype. `--block-shape` implies block
    scales; `--scales` / `--block-shape` without fp8, `--group-size` / `--zero-points` without
    int4_w4a16 are errors."""
    if dtype not in QUANT_DTYPES:
        if block_shape or scales:
            raise MoebenchError(f"--block-shape/--scales apply to --dtype fp8_w8a8 only (got --dtype {dtype})")
        if group_size is not None or zero_points:
            raise MoebenchError(f"--group-size/--zero-points apply to --dtype int4_w4a16 only (got --dtype {dtype})")
        return None
    if dtype in MODELED_ONLY:
        return QuantScheme(dtype, scales=scales, block_shape=parse_block_shape(block_shape), group_size=group_size,
                           zero_points=bool(zero_points))
    if dtype in WEIGHT_ONLY:
        if block_shape or scales:
            raise MoebenchError(f"--block-shape/--scales apply to --dtype fp8_w8a8 only (got --dtype {dtype})")
        return QuantScheme(dtype, group_size=group_size, zero_points=bool(zero_points))
    bs = parse_block_shape(block_shape)
    sc = scales or ("block" if bs else "tensor")
    return QuantScheme(dtype, sc, bs, group_size=group_size, zero_points=bool(zero_points))


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
    """A quantised expert weight of logical shape (E, N, K) (w13: N = 2I, K = H; w2: N = H, K = I).

    q:           fp8_w8a8: (E, N, K) float8_e4m3fn; int8_w8a16: (E, N, K) int8; int4_w4a16 / mxfp4:
                 (E, N, Kp / 2) uint8, two codes per byte along K (the module docstring's layout)
    scale:       fp8: float32 multipliers, tensor (E,), token (E, N), block (E, ceil(N/bn), ceil(K/bk));
                 int8: (E, N) act dtype; int4: (E, N, G) act dtype; mxfp4: (E, N, G) uint8 e8m0
    scheme:      the QuantScheme
    input_scale: (1,) float32 static scale of this GEMM's input activation (fp8 tensor scheme), else None
    zeros:       int4 with zero points: (E, ceil(N/2), G) uint8, two uint4 zeros per byte along N
    k:           the logical K of the packed schemes (q holds the padded K), else None
    """

    q: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    input_scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    k: int | None = None

    @property
    def shape(self) -> torch.Size:
        """The logical (E, N, K), whatever the packing."""
        if self.k is not None:
            return torch.Size((*self.q.shape[:2], self.k))
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
        """Bytes of the payload, the scales and the zero points as stored."""
        out = self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()
        if self.zeros is not None:
            out += self.zeros.numel() * self.zeros.element_size()
        return out

    def _with(self, f) -> "QuantWeight":
        return QuantWeight(f(self.q), f(self.scale), self.scheme, self.input_scale,
                           None if self.zeros is None else f(self.zeros), self.k)

    def __getitem__(self, idx) -> "QuantWeight":
        """Select experts (an index, slice or index tensor along dim 0); keeps (E', ...) shapes."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return self._with(lambda t: t[idx])

    def to(self, device) -> "QuantWeight":
        out = self._with(lambda t: t.to(device))
        out.input_scale = None if self.input_scale is None else self.input_scale.to(device)
        return out

    def contiguous(self) -> "QuantWeight":
        return self._with(lambda t: t.contiguous())

    def scale_strides(self) -> tuple[int, int, int]:
        """(per expert, per N row, per K block) strides of `scale` as kernels index it:
        scale[e * s0 + (n // bn) * s1 + (k // bk) * s2] for block, scale[e * s0 + n * s1] else
        (weight-only groups: scale[e * s0 + n * s1 + (k // group) * s2])."""
        if self.scheme.weight_only:
            return self.scale.stride(0), self.scale.stride(1), (self.scale.stride(2) if self.scale.dim() == 3 else 0)
        if self.scheme.scales == "tensor":
            return self.scale.stride(0), 0, 0
        if self.scheme.scales == "token":
            return self.scale.stride(0), self.scale.stride(1), 0
        return self.scale.stride(0), self.scale.stride(1), self.scale.stride(2)

    @property
    def act_dtype(self) -> torch.dtype:
        """Weight-only: the dtype the kernels dequantise to (the activations'): the integer
        schemes' scale dtype; bf16 for mxfp4."""
        return torch.bfloat16 if self.scheme.name == "mxfp4" else self.scale.dtype

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """(E, N, K) in `dtype`. Weight-only schemes: the values the GEMMs dot, i.e. fp32
        (q - z) * s rounded once to the activation dtype (`act_dtype`), then `dtype`."""
        if self.scheme.weight_only:
            return dequantize_weight_only(self).to(dtype)
        e, n, k = self.q.shape
        q = self.q.to(dtype)
        if self.scheme.scales == "tensor":
            return q * self.scale.to(dtype).view(e, 1, 1)
        if self.scheme.scales == "token":
            return q * self.scale.to(dtype).view(e, n, 1)
        bn, bk = self.scheme.block_shape
        s = self.scale.to(dtype).repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bk, dim=2)[:, :, :k]
        return q * s


def quantize_weight(w: torch.Tensor, scheme: QuantScheme, act_dtype: torch.dtype = torch.bfloat16) -> QuantWeight:
    """w (E, N, K) float -> QuantWeight with amax scales per expert / channel / block (fp8), or
    packed in a weight-only scheme (`quantize_weight_only`; act_dtype: its scales' dtype)."""
    if scheme.weight_only:
        return quantize_weight_only(w, scheme, act_dtype)
    # A few experts at a time: the fp32 temporaries stay near _QUANT_CHUNK_BYTES instead of several
    # copies of the whole weight (a tuner's compile workers each build one).
    e, n, k = w.shape
    step = max(1, _QUANT_CHUNK_BYTES // max(1, n * k * 4))
    codes, scales = zip(*(_quantize_fp8(w[i:i + step].float(), scheme) for i in range(0, e, step)))
    return QuantWeight(torch.cat(codes), torch.cat(scales), scheme)


#: fp32 bytes of weights `quantize_weight` converts at a time.
_QUANT_CHUNK_BYTES = 1 << 28


def _quantize_fp8(wf: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 wf (E, N, K) -> (fp8 codes (E, N, K), fp32 scales: (E,) tensor, (E, N) token, (E, nb, kb) block)."""
    e, n, k = wf.shape
    if scheme.scales == "tensor":
        s = scale_of(wf.abs().amax(dim=(1, 2)))  # (E,)
        return _to_fp8(wf, s.view(e, 1, 1)), s
    if scheme.scales == "token":
        s = scale_of(wf.abs().amax(dim=2))  # (E, N)
        return _to_fp8(wf, s.view(e, n, 1)), s
    bn, bk = scheme.block_shape
    nb, kb = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(wf, (0, kb * bk - k, 0, nb * bn - n)).view(e, nb, bn, kb, bk)
    s = scale_of(wp.abs().amax(dim=(2, 4)))  # (E, nb, kb)
    q = (wp / s.view(e, nb, 1, kb, 1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(e, nb * bn, kb * bk)[:, :n, :k].contiguous(), s.contiguous()


# ---------------------------------------------------------------------------------------------
# Weight-only schemes: quantise, pack, unpack, dequantise (the module docstring's layouts).

#: e2m1 magnitudes of codes 0..7 (sign in bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Midpoints between neighbouring e2m1 magnitudes, and whether a tie there rounds up (to the even
#: code above: ties to even) or down.
_E2M1_MIDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
#: Smallest amax an mxfp4 group's exponent is taken from (keeps scales and values fp32-normal).
_MX_AMAX_MIN = 2.0 ** -100


def pack_nibbles(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Integer codes 0..15, (..., 2P, ...) along `dim` -> (..., P, ...) uint8: code 2j in the low
    nibble of byte j, code 2j + 1 in the high nibble (an odd length is padded with a 0 code)."""
    c = codes.to(torch.uint8).movedim(dim, -1)
    if c.shape[-1] % 2:
        c = torch.nn.functional.pad(c, (0, 1))
    out = c[..., 0::2] | (c[..., 1::2] << 4)
    return out.movedim(-1, dim).contiguous()


def unpack_nibbles(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """(..., P, ...) uint8 -> (..., 2P, ...) int64 codes 0..15 (`pack_nibbles` undone)."""
    p = packed.to(torch.int64).movedim(dim, -1)
    out = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return out.movedim(-1, dim)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> e2m1 codes 0..15: nearest magnitude, ties to
    even, saturated at 6; the sign in bit 3 (-0 encodes as +0)."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    for mid, up in _E2M1_MIDS:
        code += (a >= mid) if up else (a > mid)
    return torch.where((v < 0) & (code > 0), code | 8, code)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 -> fp32 values."""
    lut = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return lut[codes.to(torch.int64)]


def _groups(wf: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """(E, N, K) fp32 -> (E, N, G, group), zero-padded along K."""
    e, n, k = wf.shape
    kp = scheme.padded_k(k)
    return torch.nn.functional.pad(wf, (0, kp - k)).view(e, n, kp // scheme.group_size, scheme.group_size)


def quantize_weight_only(w: torch.Tensor, scheme: QuantScheme, act_dtype: torch.dtype = torch.bfloat16) -> QuantWeight:
    """w (E, N, K) float -> a packed weight-only QuantWeight (int8_w8a16, int4_w4a16 with or
    without zero points, mxfp4). Scales of the integer schemes are stored in act_dtype (bf16 or
    fp16) and the codes are computed from the stored scale, so the kernels' dequantisation is the
    one the codes were made for."""
    if act_dtype not in (torch.bfloat16, torch.float16) or (scheme.name == "mxfp4" and act_dtype != torch.bfloat16):
        ok = "bf16" if scheme.name == "mxfp4" else "bf16 or fp16"
        raise MoebenchError(f"{scheme.name} keeps {ok} activations, not {act_dtype}; drop the fp32 dtype")
    if w.shape[0] > 1:  # one expert at a time: the temporaries stay one expert's size
        parts = [quantize_weight_only(w[j : j + 1], scheme, act_dtype) for j in range(w.shape[0])]
        zeros = torch.cat([p.zeros for p in parts]) if scheme.zero_points else None
        return QuantWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), scheme,
                           zeros=zeros, k=parts[0].k)
    e, n, k = w.shape
    wf = w.float()
    if scheme.name == "int8_w8a16":
        s = (wf.abs().amax(dim=2) / 127.0).clamp(min=AMAX_EPS).to(act_dtype)  # (E, N)
        q = torch.round(wf / s.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return QuantWeight(q.contiguous(), s.contiguous(), scheme)
    wg = _groups(wf, scheme)  # (E, N, G, group)
    if scheme.name == "mxfp4":
        amax = wg.abs().amax(dim=-1).clamp(min=_MX_AMAX_MIN)
        sexp = (torch.floor(torch.log2(amax)) - 2 + 127).clamp_(1, 254)  # e8m0, biased
        scale = torch.exp2(sexp - 127)
        codes = e2m1_encode(wg / scale.unsqueeze(-1))
        q = pack_nibbles(codes.view(e, n, -1))
        return QuantWeight(q, sexp.to(torch.uint8).contiguous(), scheme, k=k)
    zeros = None
    if scheme.zero_points:
        lo = wg.amin(dim=-1).clamp(max=0.0)
        hi = wg.amax(dim=-1).clamp(min=0.0)
        s = ((hi - lo) / 15.0).clamp(min=AMAX_EPS).to(act_dtype)
        z = torch.round(-lo / s.float()).clamp_(0, 15)
        codes = (torch.round(wg / s.float().unsqueeze(-1)) + z.unsqueeze(-1)).clamp_(0, 15)
        zeros = pack_nibbles(z.to(torch.int64), dim=1)  # (E, ceil(N/2), G)
    else:
        s = (wg.abs().amax(dim=-1) / 7.0).clamp(min=AMAX_EPS).to(act_dtype)
        codes = torch.round(wg / s.float().unsqueeze(-1)).clamp_(-8, 7) + 8
        # the zero padding of a partial last group codes 8 (= 0) as it is
    q = pack_nibbles(codes.to(torch.int64).view(e, n, -1))
    return QuantWeight(q, s.contiguous(), scheme, zeros=zeros, k=k)


def dequantize_weight_only(w: QuantWeight) -> torch.Tensor:
    """A weight-only QuantWeight -> (E, N, K) in its act_dtype: fp32 (q - z) * s (int8: q * s;
    mxfp4: e2m1(q) * 2^(s - 127)) rounded once to act_dtype, as the kernels compute it."""
    scheme = w.scheme
    e, n, k = w.shape
    if scheme.name == "int8_w8a16":
        return (w.q.float() * w.scale.float().unsqueeze(-1)).to(w.act_dtype)
    codes = unpack_nibbles(w.q)  # (E, N, Kp)
    g = scheme.group_size
    if scheme.name == "mxfp4":
        scale = torch.exp2(w.scale.float() - 127)
        v = e2m1_decode(codes) * scale.repeat_interleave(g, dim=-1)
    else:
        z = unpack_nibbles(w.zeros, dim=1)[:, :n].float() if w.zeros is not None else 8.0
        zz = z.repeat_interleave(g, dim=-1) if w.zeros is not None else z
        v = (codes.float() - zz) * w.scale.float().repeat_interleave(g, dim=-1)
    return v[:, :, :k].to(w.act_dtype)


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
    q13, q2 = quantize_weight(w13, scheme, act_dtype), quantize_weight(w2, scheme, act_dtype)
    if not scheme.weight_only and scheme.scales == "tensor":
        calibrate_input_scales(q13, q2, act_dtype)
    return q13, q2


def scheme_of(w) -> QuantScheme | None:
    """The scheme of a (possibly) quantised weight, None for a plain tensor."""
    return w.scheme if isinstance(w, QuantWeight) else None


def stored(w) -> torch.Tensor:
    """The tensor a weight's values are stored in: a QuantWeight's codes, or the weight itself."""
    return w.q if isinstance(w, QuantWeight) else w


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
