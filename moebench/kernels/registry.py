"""Registry of backends: every experts and prepare/finalize class, their declared capabilities,
and the one place that says whether a pair can run here (and why not).

Adding a backend = one new file that decorates its class with `register_experts` or
`register_prepare_finalize`, plus its module name in the list below.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels.modular import Experts, FusedMoEKernel, PrepareAndFinalize

# Modules that register backends. A module that fails to import (say, Triton missing) makes its
# backends unusable with the import error as the reason; it never hides the others.
_EXPERTS_MODULES = {
    "reference": "moebench.kernels.reference",
    "torch": "moebench.kernels.torch_experts",
    "batched-torch": "moebench.kernels.torch_experts",
    "triton": "moebench.kernels.triton.experts",
    "batched-triton": "moebench.kernels.triton.experts",
    "deepgemm": "moebench.kernels.deepgemm",
    "batched-deepgemm": "moebench.kernels.deepgemm",
    "aiter": "moebench.kernels.aiter",
}
_PF_MODULES = {
    "no-dpep": "moebench.dispatch.no_dpep",
    "batched-local": "moebench.dispatch.batched_local",
    "allgather-rs": "moebench.dispatch.allgather_rs",
    "all2all-ll": "moebench.dispatch.all2all_ll",
    "deepep-ll": "moebench.dispatch.deepep_ll",
}

_EXPERTS: dict[str, type[Experts]] = {}
_PFS: dict[str, type[PrepareAndFinalize]] = {}
_IMPORT_ERRORS: dict[str, str] = {}


def register_experts(cls: type[Experts]) -> type[Experts]:
    _EXPERTS[cls.name] = cls
    return cls


def register_prepare_finalize(cls: type[PrepareAndFinalize]) -> type[PrepareAndFinalize]:
    _PFS[cls.name] = cls
    return cls


def _load(name: str, modules: dict[str, str], table: dict) -> type | None:
    if name not in table and name not in _IMPORT_ERRORS:
        try:
            importlib.import_module(modules[name])
        except ImportError as e:  # a backend module whose own dependency is missing
            _IMPORT_ERRORS[name] = f"cannot import {modules[name]}: {e}"
        if name not in table and name not in _IMPORT_ERRORS:
            _IMPORT_ERRORS[name] = f"{modules[name]} does not register '{name}'"
    return table.get(name)


def experts_names() -> list[str]:
    return list(_EXPERTS_MODULES)


def prepare_finalize_names() -> list[str]:
    return list(_PF_MODULES)


def _unknown(kind: str, name: str, valid: list[str]) -> MoebenchError:
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return MoebenchError(f"unknown {kind} '{name}'{hint}; valid: {', '.join(valid)}")


def get_experts_class(name: str) -> type[Experts]:
    if name not in _EXPERTS_MODULES:
        raise _unknown("experts backend", name, experts_names())
    cls = _load(name, _EXPERTS_MODULES, _EXPERTS)
    if cls is None:
        raise UnsupportedError(f"experts '{name}' is unusable: {_IMPORT_ERRORS[name]}")
    return cls


def get_prepare_finalize_class(name: str) -> type[PrepareAndFinalize]:
    if name not in _PF_MODULES:
        raise _unknown("prepare/finalize backend", name, prepare_finalize_names())
    cls = _load(name, _PF_MODULES, _PFS)
    if cls is None:
        raise UnsupportedError(f"prepare/finalize '{name}' is unusable: {_IMPORT_ERRORS[name]}")
    return cls


def _dtype_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dt, str(dt))


@dataclass
class BackendInfo:
    """One row of `moebench env`: a backend, its declared capabilities and whether it runs here."""

    kind: str
    name: str
    activation_format: str
    dtypes: str
    devices: str
    usable: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def backend_infos(device: str, world_size: int = 1) -> list[BackendInfo]:
    rows = []
    for name in experts_names():
        try:
            cls = get_experts_class(name)
        except UnsupportedError as e:
            rows.append(BackendInfo("experts", name, "?", "?", "?", False, str(e)))
            continue
        reason = _experts_reason(cls, device, None)
        fp8_here, fp8_not = _quant_here(cls, device)
        rows.append(
            BackendInfo(
                "experts", name, str(cls.activation_format),
                _dtypes_text(cls, fp8_here), ",".join(cls.supported_devices),
                # usable, but not with every fp8 scale it declares: why not, in the words a sweep uses
                reason is None, reason or fp8_not,
            )
        )
    for name in prepare_finalize_names():
        try:
            cls = get_prepare_finalize_class(name)
        except UnsupportedError as e:
            rows.append(BackendInfo("prepare_finalize", name, "?", "-", "?", False, str(e)))
            continue
        reason = _pf_reason(cls, device, world_size, None)
        rows.append(
            BackendInfo(
                "prepare_finalize", name, str(cls.activation_format), "-", ",".join(cls.supported_devices),
                reason is None, reason or "",
            )
        )
    return rows


def _dtypes_text(cls: type[Experts], quant: tuple[str, ...] | None = None) -> str:
    """'fp32,fp16,bf16' plus 'fp8_w8a8(tensor/token/block)' for the fp8 scales it takes (`quant`:
    those that run on the device at hand; default: every one it declares)."""
    text = ",".join(_dtype_name(d) for d in cls.supported_dtypes)
    quant = cls.supported_quant if quant is None else quant
    if quant:
        text += ",fp8_w8a8(" + "/".join(quant) + ")"
    return text


def _quant_here(cls: type[Experts], device: str) -> tuple[tuple[str, ...], str]:
    """The fp8 scales of `cls` that run on `device`, and why the others do not: the check a sweep
    makes for each pair (`Experts.quant_unavailable_reason`), so env and sweep agree."""
    from moebench.quant import QuantScheme

    here, why = [], {}
    for sc in cls.supported_quant:
        scheme = QuantScheme("fp8_w8a8", sc, (128, 128) if sc == "block" else None)
        reason = cls.quant_unavailable_reason(device, scheme)
        if reason is None:
            here.append(sc)
        else:
            why.setdefault(reason, []).append(sc)
    return tuple(here), "; ".join(f"fp8_w8a8 {'/'.join(scs)}: {r}" for r, scs in why.items())


def _experts_reason(cls: type[Experts], device: str, dtype: torch.dtype | None) -> str | None:
    if device not in cls.supported_devices:
        return f"experts '{cls.name}' does not run on {device} (runs on {', '.join(cls.supported_devices)})"
    if dtype is not None and dtype not in cls.supported_dtypes:
        return f"experts '{cls.name}' does not support {_dtype_name(dtype)}"
    return cls.unavailable_reason(device)


def _pf_reason(cls: type[PrepareAndFinalize], device: str, world_size: int, enable_ep: bool | None) -> str | None:
    if device not in cls.supported_devices:
        return f"prepare/finalize '{cls.name}' does not run on {device}"
    if world_size < cls.min_world_size:
        return f"prepare/finalize '{cls.name}' needs at least {cls.min_world_size} ranks (have {world_size})"
    if cls.max_world_size is not None and world_size > cls.max_world_size:
        return f"prepare/finalize '{cls.name}' runs on at most {cls.max_world_size} rank(s) (have {world_size})"
    if enable_ep is not None and cls.needs_expert_parallel and not enable_ep:
        return f"prepare/finalize '{cls.name}' needs expert parallelism (--ep)"
    return cls.unavailable_reason(device, world_size)


def _quant_reason(pf_cls: type[PrepareAndFinalize], ex_cls: type[Experts], device: str, quant) -> str | None:
    if quant is None:
        return None
    if quant.scales not in ex_cls.supported_quant:
        return f"experts '{ex_cls.name}' do not support {quant.describe()}"
    if not ex_cls.quantizes_input and quant.scales not in pf_cls.supported_quant:
        return f"prepare/finalize '{pf_cls.name}' cannot quantise activations as {quant.describe()}"
    return ex_cls.quant_unavailable_reason(device, quant)


def check_combination(
    prepare_finalize: str,
    experts: str,
    device: str,
    dtype: torch.dtype | None = None,
    world_size: int = 1,
    enable_ep: bool | None = None,
    quant=None,
    activation=None,
    bias: bool = False,
) -> str | None:
    """None when the pair can run here; else the reason, naming both halves where it matters.
    quant: a moebench.quant.QuantScheme for fp8 runs (dtype is then the activation dtype);
    activation (moebench.activation.Activation; None = silu) and bias: what the experts compute."""
    try:
        pf_cls = get_prepare_finalize_class(prepare_finalize)
        ex_cls = get_experts_class(experts)
    except UnsupportedError as e:
        return str(e)
    if pf_cls.activation_format != ex_cls.activation_format:
        return (
            f"format mismatch: prepare/finalize '{pf_cls.name}' gives {pf_cls.activation_format}, "
            f"experts '{ex_cls.name}' take {ex_cls.activation_format}"
        )
    from moebench.activation import SILU

    return (_pf_reason(pf_cls, device, world_size, enable_ep) or _experts_reason(ex_cls, device, dtype)
            or _quant_reason(pf_cls, ex_cls, device, quant)
            or ex_cls.activation_unavailable_reason(activation or SILU, bias, quant))


def make_experts(name: str, **kwargs: Any) -> Experts:
    return get_experts_class(name)(**kwargs)


def make_prepare_finalize(name: str, **kwargs: Any) -> PrepareAndFinalize:
    return get_prepare_finalize_class(name)(**kwargs)


def make_kernel(
    experts: str = "torch",
    prepare_finalize: str = "no-dpep",
    experts_kwargs: dict[str, Any] | None = None,
    prepare_finalize_kwargs: dict[str, Any] | None = None,
) -> FusedMoEKernel:
    """Build the modular kernel from backend names (the same path the CLI uses).

    Raises FormatMismatchError when the halves disagree on the activation format.
    """
    return FusedMoEKernel(
        make_prepare_finalize(prepare_finalize, **(prepare_finalize_kwargs or {})),
        make_experts(experts, **(experts_kwargs or {})),
    )
