"""`triton-kernels` experts (optional): OpenAI's `triton_kernels` package (the python/triton_kernels
folder of the Triton repository; on the package index as `tokenspeed-triton-kernels`), whose ragged
matmul with fused gather, scatter and activation is what vLLM runs for gpt-oss's mxfp4 experts.

The API moved between releases: older ones have `triton_kernels.matmul_ogs.matmul_ogs` with
`triton_kernels.routing` (RoutingData, GatherIndx, ScatterIndx, the top-k sum inside the second
call); newer ones `triton_kernels.matmul.matmul` over `RaggedTensorMetadata`, the top-k sum a
separate `triton_kernels.reduce.reduce`. moebench reads the `matmul` API (tokenspeed-triton-kernels
1.0), checking the names and parameters it calls (`read_api`); another API is refused with a
one-line reason, never guessed at.

One layer, Standard format (`TritonKernelsExperts.apply`):

    sort            the (token, k) pairs by local expert (stable argsort; remote pairs last);
                    slice_sizes (E_local,) int32 pairs per expert (no host synchronisation)
    metadata        make_ragged_tensor_metadata(slice_sizes, M*K): the ragged-M block schedule
    GEMM1           matmul(x, w13^T (E, H, 2I), b13, gather_indx = sorted pair // K): x's rows
                    gathered in expert order; swigluoai fused into its epilogue (triton_kernels'
                    swiglu: even columns gate, odd up, as moebench's interleaved w13); silu / gelu
                    computed between the GEMMs on the (pairs, 2I) output (torch, fp32, rounded
                    to the activation dtype)
    GEMM2           matmul(h, w2^T (E, I, H), b2, scatter_indx = sorted pair, gammas = the pair's
                    router weight): each row's output (+ b2) times its weight, written to its
                    pair's row (token * K + k)
    top-k sum       reduce((M, K, H), dim=1); under EP a mask leaves the remote pairs out

Precisions (bf16 activations, bf16 output):
  - bf16: weights as stored (w^T is a view: K-major, which triton_kernels takes as is).
  - fp8_w8a8 with per-tensor scales (`tensor`): fp8 weights (E, N, K) viewed K-major, one scale
    per expert (`InFlexData` of the weights, per batch); the input quantised by prepare with the
    static `w13.input_scale`, the intermediate rounded to bf16 then quantised with
    `w2.input_scale` (the reference's rounding points). triton_kernels has no 128 x 128 block or
    per-token fp8 scales: those schemes are refused.
  - mxfp4 (gpt-oss): the packed e2m1 codes and e8m0 scales, K-major, put once per weight into
    triton_kernels' default layouts for the GPU (Hopper: its swizzled value and scale layouts,
    scales for 8 warps, as vLLM's gpt-oss path does; `mx_layout="strided"` keeps them strided);
    the converted weights are cached per weight tensor, so a timed call converts nothing.
    Hidden and intermediate must be multiples of 32 (whole e8m0 groups: no padded K).

triton_kernels is imported lazily; nothing else in moebench needs it. Its kernels need a CUDA GPU
(its launchers ask the active Triton driver for the target, which a CPU machine has not).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moebench.activation import SILU, Activation
from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels.act_quant import maybe_quantize
from moebench.kernels.modular import (
    ActivationFormat,
    ExpertBias,
    Experts,
    PrepareResult,
    TopKWeightAndReduceNoOp,
    alloc_output,
)
from moebench.kernels.reference import act_and_mul
from moebench.quant import FP8_DTYPE, MXFP4_GROUP, ActQuant, QuantScheme, QuantWeight, scheme_of

MODULE = "triton_kernels"
#: What the adapter calls, per module of the `matmul` API: functions with the parameters passed
#: to them, classes with the fields set on them.
MATMUL_API: dict[str, dict[str, tuple[str, ...]]] = {
    "triton_kernels.matmul": {
        "matmul": ("a", "b", "bias", "a_ragged_metadata", "gather_indx", "scatter_indx", "precision_config",
                   "gammas", "fused_activation"),
        "PrecisionConfig": ("flex_ctx", "b_mx_scale", "b_microblock_size", "out_dtype"),
        "FlexCtx": ("lhs_data", "rhs_data"),
        "FusedActivation": ("specs", "fn_args"),
        "FnSpecs": ("name", "fn", "fn_arg_names", "reduction_n"),
    },
    "triton_kernels.numerics": {"InFlexData": ("dtype", "scale")},
    "triton_kernels.tensor": {"make_ragged_tensor_metadata": ("slice_sizes", "n_total_rows"),
                              "wrap_torch_tensor": ("torch_tensor", "dtype"),
                              "convert_layout": ("tensor", "layout"), "FP4": ()},
    "triton_kernels.tensor_details.layout": {"make_default_matmul_mxfp4_w_layout": ("mx_axis",),
                                             "make_default_matmul_mxfp4_w_scale_layout": ("mx_axis", "num_warps"),
                                             "StridedLayout": ("major_dim",)},
    "triton_kernels.swiglu": {"swiglu_fn": ()},
    "triton_kernels.reduce": {"reduce": ("x", "dim", "mask", "y")},
}
#: The module of the older API (matmul_ogs), recognised to say so.
OGS_MODULE = "triton_kernels.matmul_ogs"
#: The adapter's API, in words (for the reasons it gives).
API_TEXT = "the matmul API of tokenspeed-triton-kernels 1.0 (triton_kernels.matmul.matmul)"
MX_LAYOUTS = ("default", "strided")
#: Warps of the Hopper mxfp4 scale layout (the matmul then runs with as many).
MX_SCALE_WARPS = 8


@dataclass(frozen=True)
class TritonKernelsApi:
    """The names the adapter calls, read from an installed triton_kernels (`read_api`), and the
    version they were read from."""

    version: str
    names: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        if name in ("version", "names") or name.startswith("__"):
            raise AttributeError(name)
        try:
            return self.names[name]
        except KeyError:
            raise AttributeError(name) from None


def _params(obj) -> set[str] | None:
    """The parameter names of a function, or the fields of a (data)class; None if unreadable."""
    fields = getattr(obj, "__dataclass_fields__", None)
    if fields is not None:
        return set(fields)
    try:
        return set(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def installed_version(module: str = MODULE) -> str:
    """'tokenspeed-triton-kernels 1.0.0.post20260510', or where it comes from when no package claims it."""
    from moebench.vendor import installed

    found = installed(module)
    if found is None:
        return "(not installed)"
    dist, version = found
    return f"{dist} {version}" if dist else "(a source tree, no package metadata)"


def read_api(importer: Callable[[str], Any] = importlib.import_module, version: str | None = None
             ) -> tuple[TritonKernelsApi | None, str | None]:
    """(the API, None) when the installed triton_kernels has every name and parameter of
    MATMUL_API, else (None, why not): not installed, does not import, the older matmul_ogs API,
    or an API moebench does not know (naming what is missing). `importer`: importlib.import_module
    (tests hand in others)."""
    version = version if version is not None else installed_version()
    try:
        importer(MODULE)
    except ImportError as e:
        if getattr(e, "name", None) == MODULE:
            return None, "triton_kernels is not installed (moebench vendor install triton-kernels; docs/vendor.md)"
        return None, f"triton_kernels does not import: {e}"
    except Exception as e:  # noqa: BLE001 - a broken install is a reason, not a crash
        return None, f"triton_kernels does not import: {type(e).__name__}: {e}"
    names: dict[str, Any] = {}
    missing: list[str] = []
    for modname, wanted in MATMUL_API.items():
        try:
            mod = importer(modname)
        except ImportError as e:
            if modname == "triton_kernels.matmul" and _has_module(importer, OGS_MODULE):
                return None, (f"triton_kernels {version} has the matmul_ogs API (the releases before matmul); "
                              f"moebench reads {API_TEXT}")
            if getattr(e, "name", None) not in (modname, None):
                return None, f"triton_kernels does not import: {modname}: {e}"
            missing.append(modname)
            continue
        except Exception as e:  # noqa: BLE001
            return None, f"triton_kernels does not import: {modname}: {type(e).__name__}: {e}"
        for name, params in wanted.items():
            obj = getattr(mod, name, None)
            if obj is None:
                missing.append(f"{modname}.{name}")
                continue
            have = _params(obj) if params else set()
            lacking = [p for p in params if have is not None and p not in have]
            if have is None and params:
                lacking = list(params)
            if lacking:
                missing.append(f"{modname}.{name}({', '.join(lacking)})")
            names[name] = obj
    if missing:
        return None, (f"triton_kernels {version} is an API moebench does not know (no {'; no '.join(missing)}); "
                      f"moebench reads {API_TEXT}")
    return TritonKernelsApi(version, names), None


def _has_module(importer, name: str) -> bool:
    try:
        importer(name)
    except Exception:  # noqa: BLE001
        return False
    return True


@functools.lru_cache(maxsize=None)
def installed_api() -> tuple[TritonKernelsApi | None, str | None]:
    """read_api() of this process's triton_kernels, read once."""
    return read_api()


def _reason(device: str) -> str | None:
    if device != "cuda":
        return "triton_kernels needs a CUDA GPU"
    reason = installed_api()[1]
    if reason is not None:
        return reason
    if not torch.cuda.is_available():
        return "triton_kernels needs a CUDA GPU (none is visible)"
    return None


# ---------------------------------------------------------------------------------------------
# Weights in triton_kernels' layouts (K-major: (E, K, N) with stride 1 along K)


def _k_major(w: torch.Tensor) -> torch.Tensor:
    """(E, N, K) contiguous -> the (E, K, N) view triton_kernels reads as its `b` (no copy)."""
    return w.transpose(1, 2)


class _Prepared:
    """Per weight tensor, what its conversion made; an entry goes when its tensor does (keyed by
    identity: a tensor's == is elementwise, so no WeakKeyDictionary)."""

    def __init__(self):
        self._cache: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, key: torch.Tensor, make: Callable[[], Any]) -> Any:
        hit = self._cache.get(id(key))
        if hit is not None and hit[0]() is key:
            return hit[1]
        value = make()
        self._cache[id(key)] = (weakref.ref(key), value)
        weakref.finalize(key, self._cache.pop, id(key), None)
        return value


def check_shapes(w13, w2, scheme: QuantScheme | None, name: str) -> None:
    """mxfp4: hidden and intermediate (per rank) whole e8m0 groups of 32 (triton_kernels takes no
    padded K)."""
    if scheme is None or scheme.name != "mxfp4":
        return
    h, i = w13.shape[2], w2.shape[2]
    if h % MXFP4_GROUP or i % MXFP4_GROUP:
        raise UnsupportedError(f"experts '{name}': triton_kernels' mxfp4 needs hidden and intermediate (per rank) "
                               f"divisible by {MXFP4_GROUP}, got hidden {h}, intermediate {i}")


# ---------------------------------------------------------------------------------------------
# The backend


class TritonKernelsExperts(Experts):
    """Standard: OpenAI triton_kernels' ragged matmul for both GEMMs (gather fused into GEMM1,
    scatter and the router weight into GEMM2, swigluoai into GEMM1's epilogue) and its reduce
    for the top-k sum (module docstring). Returns (M, H), weighted and summed; remote pairs (EP)
    add nothing.

    mx_layout: mxfp4 weights in triton_kernels' default layouts for the GPU ("default") or
    strided ("strided"). api: the TritonKernelsApi to call (None: the installed package's)."""

    name = "triton-kernels"
    activation_format = ActivationFormat.STANDARD
    supported_dtypes = (torch.bfloat16,)
    supported_devices = ("cuda",)
    gpu_vendors = ("nvidia",)
    supported_quant = ("tensor", "mxfp4")
    quantizes_input = False
    supported_activations = ("silu", "gelu", "swigluoai")
    supports_bias = True

    def __init__(self, mx_layout: str = "default", api: TritonKernelsApi | None = None):
        if mx_layout not in MX_LAYOUTS:
            raise MoebenchError(f"triton-kernels mx_layout must be one of {', '.join(MX_LAYOUTS)}, got '{mx_layout}'")
        self.mx_layout = mx_layout
        self._api = api
        self._prepared = _Prepared()

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        return _reason(device)

    @classmethod
    def quant_unavailable_reason(cls, device: str, scheme: QuantScheme) -> str | None:
        if scheme.name == "fp8_w8a8" and scheme.scales != "tensor":
            return (f"experts '{cls.name}': triton_kernels' fp8 matmul takes per-tensor scales only, "
                    f"not {scheme.describe()}")
        return _reason(device)

    def weight_and_reduce(self):
        return TopKWeightAndReduceNoOp()

    @property
    def api(self) -> TritonKernelsApi:
        if self._api is None:
            api, reason = installed_api()
            if api is None:
                raise UnsupportedError(f"experts '{self.name}': {reason}")
            self._api = api
        return self._api

    # -- weights ---------------------------------------------------------------------------

    def _weight(self, w) -> tuple[Any, Any]:
        """(b, its InFlexData or mx scale) for one expert weight, as matmul takes it."""
        api = self.api
        if not isinstance(w, QuantWeight):
            return _k_major(w), None
        if w.scheme.name == "fp8_w8a8":
            return _k_major(w.q), api.InFlexData(dtype=FP8_DTYPE, scale=w.scale.float().contiguous())
        return self._prepared.get(w.q, lambda: self._mx_weight(w))

    def _mx_weight(self, w: QuantWeight) -> tuple[Any, Any]:
        api = self.api
        value = api.wrap_torch_tensor(_k_major(w.q), dtype=api.FP4)  # logical (E, K, N), K-major
        scale = api.wrap_torch_tensor(_k_major(w.scale))  # (E, K / 32, N)
        if self.mx_layout == "default":
            value = api.convert_layout(value, api.make_default_matmul_mxfp4_w_layout(mx_axis=-2))
            scale = api.convert_layout(scale, api.make_default_matmul_mxfp4_w_scale_layout(
                mx_axis=-2, num_warps=MX_SCALE_WARPS))
        return value, scale

    def _bias(self, b: torch.Tensor | None) -> torch.Tensor | None:
        if b is None:
            return None
        return self._prepared.get(b, lambda: b.float().contiguous())

    def _precision(self, flex_a, w_extra) -> Any:
        api = self.api
        kw: dict[str, Any] = {"out_dtype": torch.bfloat16}
        if isinstance(w_extra, api.InFlexData) or flex_a is not None:
            kw["flex_ctx"] = api.FlexCtx(lhs_data=flex_a or api.InFlexData(), rhs_data=w_extra or api.InFlexData())
        elif w_extra is not None:  # an mxfp4 weight's scales
            kw["b_mx_scale"] = w_extra
            kw["b_microblock_size"] = MXFP4_GROUP
        return api.PrecisionConfig(**kw)

    # -- the layer -------------------------------------------------------------------------

    def apply(self, prep: PrepareResult, w13, w2, *, activation: Activation = SILU,
              bias: ExpertBias | None = None) -> torch.Tensor:
        scheme = scheme_of(w13)
        self.check_activation(activation, bias, scheme)
        if scheme is not None:
            if scheme_of(w2) != scheme:
                raise UnsupportedError(f"experts '{self.name}': w13 and w2 must be quantised with the same scheme")
            if scheme.kind not in self.supported_quant:
                raise UnsupportedError(self.quant_unavailable_reason("cuda", scheme) or
                                       f"experts '{self.name}' do not support {scheme.describe()}")
        check_shapes(w13, w2, scheme, self.name)
        fp8 = scheme is not None and scheme.name == "fp8_w8a8"
        out_dtype = prep.out_dtype or torch.bfloat16
        if out_dtype != torch.bfloat16:
            raise UnsupportedError(f"experts '{self.name}': triton_kernels runs bf16 activations here, got {out_dtype}")
        if fp8 and (prep.a.dtype != FP8_DTYPE or w13.input_scale is None or w2.input_scale is None):
            raise UnsupportedError(f"experts '{self.name}' take fp8 activations quantised by prepare with the "
                                   f"static per-tensor scales of w13 and w2")
        api = self.api
        x, ids = prep.a, prep.topk_ids
        m, k = ids.shape
        e_local, two_i, h = w13.shape
        dev = x.device
        out = alloc_output((m, h), out_dtype, dev)
        if m == 0:
            return out

        # Sort the pairs by local expert (remote ones last, outside every slice).
        flat = ids.reshape(-1).long()
        if prep.expert_map is not None:
            flat = prep.expert_map.to(dev).long()[flat]
        key = torch.where(flat >= 0, flat, torch.full_like(flat, e_local))
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(e_local + 1, dtype=torch.int32, device=dev)
        counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        meta = api.make_ragged_tensor_metadata(counts[:e_local], m * k)
        gather = (order // k).to(torch.int32)
        scatter = order.to(torch.int32)
        gammas = prep.topk_weights.reshape(-1).float()[order]

        # GEMM1 (+ b13), swigluoai fused; silu / gelu after it.
        b1, extra1 = self._weight(w13)
        flex1 = api.InFlexData(dtype=FP8_DTYPE, scale=w13.input_scale.float().reshape(1)) if fp8 else None
        fused = None
        if activation.interleaved:
            fused = api.FusedActivation(api.FnSpecs("swiglu", api.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                                        (float(activation.alpha), float(activation.limit)))
        hmid = api.matmul(x, b1, self._bias(bias.b13 if bias is not None else None), a_ragged_metadata=meta,
                          gather_indx=gather, precision_config=self._precision(flex1, extra1),
                          fused_activation=fused)
        if fused is None:
            hmid = act_and_mul(hmid.float(), activation).to(out_dtype)
        flex2 = None
        if fp8:
            hmid, _ = maybe_quantize(hmid, ActQuant(scheme, w2.input_scale))
            flex2 = api.InFlexData(dtype=FP8_DTYPE, scale=w2.input_scale.float().reshape(1))

        # GEMM2 (+ b2) times the router weight, each row to its pair's place; then the top-k sum.
        b2, extra2 = self._weight(w2)
        y = api.matmul(hmid, b2, self._bias(bias.b2 if bias is not None else None), a_ragged_metadata=meta,
                       scatter_indx=scatter, precision_config=self._precision(flex2, extra2), gammas=gammas)
        mask = None
        if prep.expert_map is not None:  # remote pairs' rows were never written
            mask = (key < e_local).to(torch.int32).view(m, k, 1).expand(m, k, h)
        api.reduce(y.view(m, k, h), dim=1, mask=mask, y=out)
        return out
