"""The backends: every experts and prepare/finalize class, their declared capabilities, and the
one place that says whether a pair can run here (and why not).

Backends are discovered, not listed: every module below `moebench.kernels` and
`moebench.dispatch` is imported once, and each class defined there that subclasses `Experts` or
`PrepareAndFinalize` and sets its own `name` is a backend. Adding a backend = one new file. A
module that fails to import (say, its own dependency missing) is reported with its import error;
it never hides the others.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import re
from dataclasses import dataclass
from typing import Any

import torch

from moebench.errors import MoebenchError, UnsupportedError
from moebench.kernels.modular import Experts, FusedMoEKernel, PrepareAndFinalize

#: The packages whose modules hold the backends: GEMMs, and the communication around them.
BACKEND_PACKAGES = ("moebench.kernels", "moebench.dispatch")


@dataclass
class _Found:
    experts: dict[str, type[Experts]]
    prepare_finalize: dict[str, type[PrepareAndFinalize]]
    import_errors: dict[str, str]  # module -> why it could not be imported


_found: _Found | None = None


def _module_names(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=package + "."))


def _discover() -> _Found:
    global _found
    if _found is not None:
        return _found
    experts: dict[str, type[Experts]] = {}
    pfs: dict[str, type[PrepareAndFinalize]] = {}
    errors: dict[str, str] = {}
    for package in BACKEND_PACKAGES:
        for modname in _module_names(package):
            try:
                module = importlib.import_module(modname)
            except ImportError as e:  # a backend module whose own dependency is missing
                errors[modname] = f"cannot import {modname}: {e}"
                continue
            # The module's own classes, in the order it defines them (a module's names keep that order).
            for cls in (c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == modname):
                if "name" not in vars(cls) or inspect.isabstract(cls):
                    continue
                if issubclass(cls, Experts):
                    experts[cls.name] = cls
                elif issubclass(cls, PrepareAndFinalize):
                    pfs[cls.name] = cls
    # Listing order: the float64 reference first, then the backends that run anywhere, then the
    # GPU-only ones; the prepare/finalize backends that keep tokens in place before those that move them.
    experts = dict(sorted(experts.items(), key=lambda kv: (kv[1].timed, "cpu" not in kv[1].supported_devices)))
    pfs = dict(sorted(pfs.items(), key=lambda kv: kv[1].communicates))
    _found = _Found(experts, pfs, errors)
    return _found


def experts_names() -> list[str]:
    return list(_discover().experts)


def prepare_finalize_names() -> list[str]:
    return list(_discover().prepare_finalize)


def declared_communication() -> tuple:
    """Every operation the prepare/finalize backends declare (moebench.comm.CommOp), in registry
    order: what the communication model is given (moebench.comm.model.CommModel.from_link)."""
    return tuple(op for name in prepare_finalize_names() for op in get_prepare_finalize_class(name).communication)


def import_errors() -> dict[str, str]:
    """Backend modules that could not be imported, with why (what `moebench env` reports)."""
    return dict(_discover().import_errors)


def _unknown(kind: str, name: str, valid: list[str]) -> MoebenchError:
    near = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    errors = import_errors()
    missing = f"; not importable: {'; '.join(errors.values())}" if errors else ""
    return MoebenchError(f"unknown {kind} '{name}'{hint}; valid: {', '.join(valid)}{missing}")


def get_experts_class(name: str) -> type[Experts]:
    table = _discover().experts
    if name not in table:
        raise _unknown("experts backend", name, experts_names())
    return table[name]


def get_prepare_finalize_class(name: str) -> type[PrepareAndFinalize]:
    table = _discover().prepare_finalize
    if name not in table:
        raise _unknown("prepare/finalize backend", name, prepare_finalize_names())
    return table[name]


def experts_class(experts: "str | type[Experts]") -> type[Experts]:
    """The experts class of a name (or the class itself: what a spec resolved when it was built)."""
    return experts if isinstance(experts, type) else get_experts_class(experts)


def prepare_finalize_class(pf: "str | type[PrepareAndFinalize]") -> type[PrepareAndFinalize]:
    """The prepare/finalize class of a name (or the class itself)."""
    return pf if isinstance(pf, type) else get_prepare_finalize_class(pf)


def local_prepare_finalize(fmt) -> type[PrepareAndFinalize]:
    """The first communication-free prepare/finalize (tokens kept in place) of activation format `fmt`."""
    for cls in _discover().prepare_finalize.values():
        if cls.activation_format == fmt and not cls.communicates:
            return cls
    raise MoebenchError(f"no prepare/finalize without communication lays tokens out as {fmt}")


def stand_in(pf: "str | type[PrepareAndFinalize]") -> type[PrepareAndFinalize]:
    """The communication-free prepare/finalize that lays tokens out as `pf` would on a rank."""
    return local_prepare_finalize(prepare_finalize_class(pf).activation_format)


def experts_classes() -> list[type[Experts]]:
    """Every experts class, in listing order."""
    return list(_discover().experts.values())


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
        cls = get_experts_class(name)
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
        cls = get_prepare_finalize_class(name)
        reason = _pf_reason(cls, device, world_size, None)
        rows.append(
            BackendInfo(
                "prepare_finalize", name, str(cls.activation_format), "-", ",".join(cls.supported_devices),
                reason is None, reason or "",
            )
        )
    for module, why in import_errors().items():  # a module that could not be imported: its backends unknown
        rows.append(BackendInfo("module", module.rsplit(".", 1)[-1], "?", "?", "?", False, why))
    return rows


def _dtypes_text(cls: type[Experts], quant: tuple[str, ...] | None = None) -> str:
    """'fp32,fp16,bf16' plus 'fp8_w8a8(tensor/token/block)' for the fp8 scales it takes and the
    weight-only schemes by name ('int8_w8a16,int4_w4a16,mxfp4') (`quant`: the kinds that run on the
    device at hand; default: every one it declares)."""
    from moebench.quant import WEIGHT_ONLY

    text = ",".join(_dtype_name(d) for d in cls.supported_dtypes)
    quant = cls.supported_quant if quant is None else quant
    fp8 = [q for q in quant if q not in WEIGHT_ONLY]
    if fp8:
        text += ",fp8_w8a8(" + "/".join(fp8) + ")"
    return ",".join([text] + [q for q in quant if q in WEIGHT_ONLY])


def _quant_here(cls: type[Experts], device: str) -> tuple[tuple[str, ...], str]:
    """The quantisation kinds of `cls` (fp8 scales, weight-only schemes) that run on `device`, and
    why the others do not: the check a sweep makes for each pair (`Experts.quant_unavailable_reason`),
    so env and sweep agree."""
    from moebench.quant import WEIGHT_ONLY, QuantScheme

    here, why = [], {}
    for kind in cls.supported_quant:
        if kind in WEIGHT_ONLY:
            scheme = QuantScheme(kind)
        else:
            scheme = QuantScheme("fp8_w8a8", kind, (128, 128) if kind == "block" else None)
        reason = cls.quant_unavailable_reason(device, scheme)
        if reason is None:
            here.append(kind)
        else:
            why.setdefault(reason, []).append(kind)
    return tuple(here), "; ".join(
        f"{'/'.join(k for k in kinds)}: {r}" if kinds[0] in WEIGHT_ONLY else f"fp8_w8a8 {'/'.join(kinds)}: {r}"
        for r, kinds in why.items())


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


def _quant_reason(pf_cls: type[PrepareAndFinalize], ex_cls: type[Experts], device: str, quant,
                  declared_only: bool = False) -> str | None:
    """Why the pair cannot run `quant`; declared_only: from what both declare, whatever runs here."""
    if quant is None:
        return None
    if quant.modeled_only:  # priced at a target GPU's floor, never run
        return None if declared_only else (f"{quant.describe()} is a modeled precision (no kernel here runs it): "
                                           f"compare tp-vs-ep with a --target-gpu")
    if quant.kind not in ex_cls.supported_quant:
        return f"experts '{ex_cls.name}' do not support {quant.describe()}"
    if not quant.weight_only and not ex_cls.quantizes_input and quant.scales not in pf_cls.supported_quant:
        return f"prepare/finalize '{pf_cls.name}' cannot quantise activations as {quant.describe()}"
    return None if declared_only else ex_cls.quant_unavailable_reason(device, quant)


def check_combination(
    prepare_finalize: str | type[PrepareAndFinalize],
    experts: str | type[Experts],
    device: str,
    dtype: torch.dtype | None = None,
    world_size: int = 1,
    enable_ep: bool | None = None,
    quant=None,
    activation=None,
    bias: bool = False,
    comm_modeled: bool = False,
    experts_modeled: str | None = None,
) -> str | None:
    """None when the pair can run here; else the reason, naming both halves where it matters.
    quant: a moebench.quant.QuantScheme for fp8 runs (dtype is then the activation dtype);
    activation (moebench.activation.Activation; None = silu) and bias: what the experts compute.

    A simulated run prices the prepare/finalize's communication from its declaration
    (comm_modeled: it need not run here, only pair with the experts and carry the precision), and
    may take the experts time from the target GPU's floor (experts_modeled: that GPU's name; the
    experts need not run here, only run on a GPU of its maker in this precision). Either half may be
    given as its class (what a spec resolved when it was built) or by name."""
    try:
        pf_cls = prepare_finalize_class(prepare_finalize)
        ex_cls = experts_class(experts)
    except UnsupportedError as e:
        return str(e)
    if pf_cls.activation_format != ex_cls.activation_format:
        return (
            f"format mismatch: prepare/finalize '{pf_cls.name}' gives {pf_cls.activation_format}, "
            f"experts '{ex_cls.name}' take {ex_cls.activation_format}"
        )
    from moebench.activation import SILU

    if comm_modeled:
        pf_reason = (f"prepare/finalize '{pf_cls.name}' needs expert parallelism (--ep)"
                     if pf_cls.needs_expert_parallel and enable_ep is False else None)
    else:
        pf_reason = _pf_reason(pf_cls, device, world_size, enable_ep)
    if experts_modeled:
        vendor = gpu_vendor(experts_modeled)
        ex_reason = (None if "cuda" in ex_cls.supported_devices and vendor in ex_cls.gpu_vendors
                     else f"experts '{ex_cls.name}' do not run on {experts_modeled} ({vendor}) GPUs")
        if ex_reason is None and dtype is not None and dtype not in ex_cls.supported_dtypes:
            ex_reason = f"experts '{ex_cls.name}' does not support {_dtype_name(dtype)}"
        q_reason = _quant_reason(pf_cls, ex_cls, "cuda", quant, declared_only=True)
    else:
        ex_reason = _experts_reason(ex_cls, device, dtype)
        q_reason = _quant_reason(pf_cls, ex_cls, device, quant)
    return pf_reason or ex_reason or q_reason or ex_cls.activation_unavailable_reason(activation or SILU, bias, quant)


def gpu_vendor(gpu: str) -> str:
    """'amd' for an AMD Instinct name (MI300X...), else 'nvidia'."""
    return "amd" if re.search(r"\bMI\d", gpu.upper()) else "nvidia"


def check_named_experts_quant(names: list[str], quant) -> None:
    """Experts backends named explicitly (`--experts a,b`) must declare a weight-only scheme they
    are asked to run (`supported_quant`): else a one-line MoebenchError naming those that do. (In
    `--experts all` such pairs are skipped rows with the reason instead.)"""
    if quant is None or not quant.weight_only:
        return
    bad = [n for n in names if quant.kind not in get_experts_class(n).supported_quant]
    if bad:
        ok = [n for n in experts_names() if quant.kind in get_experts_class(n).supported_quant
              and get_experts_class(n).timed]
        raise MoebenchError(f"experts {', '.join(bad)} cannot run {quant.describe()} (weight-only); "
                            f"use --experts {','.join(ok)} or another --dtype")


def make_experts(name: str | type[Experts], **kwargs: Any) -> Experts:
    return experts_class(name)(**kwargs)


def make_prepare_finalize(name: str | type[PrepareAndFinalize], **kwargs: Any) -> PrepareAndFinalize:
    return prepare_finalize_class(name)(**kwargs)


def make_kernel(
    experts: str | type[Experts] = "torch",
    prepare_finalize: str | type[PrepareAndFinalize] = "no-dpep",
    experts_kwargs: dict[str, Any] | None = None,
    prepare_finalize_kwargs: dict[str, Any] | None = None,
) -> FusedMoEKernel:
    """Build the modular kernel from backend names or classes (the same path the CLI uses).

    Raises FormatMismatchError when the halves disagree on the activation format.
    """
    return FusedMoEKernel(
        make_prepare_finalize(prepare_finalize, **(prepare_finalize_kwargs or {})),
        make_experts(experts, **(experts_kwargs or {})),
    )
