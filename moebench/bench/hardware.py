"""Hardware ceilings (memory bandwidth, matmul throughput) for the roofline, and device facts.

Where the numbers come from, best first:
1. measured on this device by `calibrate` (`moebench env --calibrate`), cached in
   `$MOEBENCH_CACHE_DIR/ceilings.json` (default `~/.cache/moebench/ceilings.json`), keyed by
   device name and torch version; `source = "measured <date>"`;
2. a datasheet profile for a known GPU (`source = "datasheet"`: dense peaks, no sparsity;
   a measured device reaches less, so fractions against it come out lower);
3. on a CPU, a quick rough measurement (`source = "cpu measured <date>"`): good enough to fill
   the columns, never a statement about GPU kernels.

Matmul ceilings are keyed "bf16", "fp16", "fp32" and "fp8" (e4m3 x e4m3 -> bf16 with fp32
per-tensor scales, torch._scaled_mm; measured on CUDA GPUs of compute capability 8.9+ and ROCm,
skipped with a note elsewhere); `Ceilings.tflops("fp8_w8a8")` reads the "fp8" entry.

Reads run faster than a copy on HBM (H200: about 4.8 TB/s read vs 4.3 TB/s copy counting read +
write), and MoE layers mostly read weights, so the memory floor uses the read ceiling, measured
with a tuned read-only Triton reduction (best of a few block sizes), a torch reduction, and the
copy rate, whichever is highest.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

from moebench.errors import MoebenchError
from moebench.fileio import atomic_write_text

try:  # only the read-bandwidth calibration kernel needs Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA/ROCm torch builds
    triton = None

DTYPES = ("bf16", "fp16", "fp32", "fp8")  # keys of Ceilings.matmul_tflops


@dataclass
class Ceilings:
    """Peak rates of one device.

    mem_read_gbps:  read-only bandwidth, GB/s (1e9 bytes/s); the memory floor uses it
    mem_copy_gbps:  device copy bandwidth counting read + write bytes, GB/s (None if unknown)
    matmul_tflops:  {"bf16"|"fp16"|"fp32"|"fp8": TFLOP/s} (fp32 without TF32; fp8 = e4m3 x e4m3
                    with fp32 scales and bf16 output, torch._scaled_mm; absent where unsupported)
    memory_gb:      the device's memory, GB (1e9 bytes; datasheet profiles; None if unknown)
    source:         "measured <date>", "datasheet" or "cpu measured <date>"
    device_type:    "cuda" (also ROCm) or "cpu"
    notes:          how the numbers were obtained
    """

    device_name: str
    mem_read_gbps: float | None
    mem_copy_gbps: float | None
    matmul_tflops: dict[str, float] = field(default_factory=dict)
    source: str = "datasheet"
    device_type: str = "cuda"
    torch_version: str = ""
    triton_version: str = ""
    notes: str = ""
    memory_gb: float | None = None

    @property
    def is_gpu(self) -> bool:
        return self.device_type != "cpu"

    @property
    def label(self) -> str:
        """Short text for tables: 'measured 2026-11-29', 'datasheet', 'cpu (not GPU) ...'."""
        return self.source if self.is_gpu else f"{self.source} (CPU, not GPU)"

    def read_gbps(self) -> float | None:
        """Bandwidth for the memory floor: the read ceiling, else the copy ceiling."""
        return self.mem_read_gbps or self.mem_copy_gbps

    def tflops(self, dtype: str = "bf16") -> float | None:
        """Matmul peak for `dtype` ("bf16", "fp16", "fp32", "fp8", "fp8_w8a8" or a torch dtype;
        fp8_w8a8 and the float8 dtypes read the "fp8" entry). When that dtype was not measured,
        the highest known rate (a higher peak only lowers the floor, so the roofline stays a
        lower bound on time)."""
        key = _dtype_key(dtype)
        if key in self.matmul_tflops:
            return self.matmul_tflops[key]
        return max(self.matmul_tflops.values()) if self.matmul_tflops else None

    def describe_lines(self) -> list[tuple[str, str]]:
        """(label, text) lines for people (`moebench env`): each rate with its unit, one line per
        matmul dtype; unknown rates say so."""

        def gbps(v: float | None, what: str) -> str:
            return f"{v:g} GB/s{what}" if v is not None else "unknown"

        lines = [("ceilings", f"{self.device_name}, {self.label}"),
                 ("ceiling memory read", gbps(self.mem_read_gbps, "")),
                 ("ceiling memory copy", gbps(self.mem_copy_gbps, " (read + write bytes)"))]
        if self.matmul_tflops:
            lines += [(f"ceiling matmul {k}", f"{v:g} TFLOP/s") for k, v in self.matmul_tflops.items()]
        else:
            lines.append(("ceiling matmul", "unknown"))
        versions = ", ".join(f"{n} {v}" for n, v in (("torch", self.torch_version), ("triton", self.triton_version))
                             if v)
        if versions:
            lines.append(("ceilings measured with", versions))
        if self.notes:
            lines.append(("ceiling notes", self.notes))
        return lines

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    as_dict = to_dict

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Ceilings":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


def _dtype_key(dtype: str | torch.dtype) -> str:
    """bf16 / fp16 / fp32 / fp8 key of matmul_tflops for a torch dtype or a dtype name
    (fp8_w8a8, the moebench.quant scheme name, and the float8 e4m3 / e5m2 dtypes map to "fp8"; the
    weight-only schemes int8_w8a16 / int4_w4a16 / mxfp4, whose dots are 16-bit, to "bf16")."""
    if isinstance(dtype, torch.dtype):
        known = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"):
            if getattr(torch, name, None) is not None:
                known[getattr(torch, name)] = "fp8"
        return known.get(dtype, str(dtype))
    d = str(dtype).lower()
    if d.startswith("torch."):
        d = d[len("torch."):]
    if d.startswith("float8") or d.startswith("fp8"):
        return "fp8"
    if d == "nvfp4":
        return "fp4"  # 4-bit weights and activations: the 4-bit tensor-core rate
    if d in ("int8_w8a16", "int4_w4a16", "mxfp4"):
        return "bf16"  # weight-only: dequantised tiles, 16-bit dots
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(d, d)


# ---------------------------------------------------------------------------------------------
# Datasheet profiles (dense peaks; vendor datasheets). Patterns match torch's device name.


@dataclass(frozen=True)
class GpuTarget:
    """A GPU a modeled run can speak of: its datasheet (HBM GB/s, dense TFLOP/s by dtype: "fp8" =
    e4m3, "fp4" = the 4-bit tensor-core rate, NVFP4 / MXFP4), its memory (GiB, as the driver
    reports about the datasheet's GB), its own GPU-to-GPU link (a link profile's name, None where
    moebench has no profile of it), GPUs per NVLink domain, and where the figures come from."""

    pattern: str
    profile: str
    hbm_gbps: float
    tflops: dict
    memory_gib: float | None
    link: str | None
    domain: int
    source: str


_NV = "NVIDIA datasheet"
#: Per-GPU Blackwell figures: NVIDIA's HGX B200 / HGX B300 / GB200 NVL72 / GB300 NVL72 datasheets
#: (a rack's or a board's figures divided by its GPUs; dense = half the sparse figures listed), as
#: tabulated at https://verda.com/blog/gb300-nvl72-architecture and
#: https://glennklockwood.com/garden/processors/B300.
_BLACKWELL = "NVIDIA {} datasheet, per GPU (https://verda.com/blog/gb300-nvl72-architecture)"
GPU_TARGETS: tuple[GpuTarget, ...] = (
    GpuTarget(r"h200", "NVIDIA H200 (SXM)", 4800.0, {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
              141.0, "h200-nvlink", 8, f"{_NV} H200 SXM"),
    GpuTarget(r"h100.*pcie", "NVIDIA H100 PCIe", 2000.0, {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
              80.0, "pcie-gen5", 8, f"{_NV} H100 PCIe"),
    GpuTarget(r"h800", "NVIDIA H800 SXM", 3350.0, {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
              80.0, "h800-nvlink", 8, f"{_NV} H800 SXM (H100 SXM compute, 400 GB/s NVLink)"),
    GpuTarget(r"h100", "NVIDIA H100 SXM", 3350.0, {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
              80.0, "h100-nvlink", 8, f"{_NV} H100 SXM"),
    GpuTarget(r"\bh20\b", "NVIDIA H20", 4000.0, {"bf16": 148.0, "fp16": 148.0, "fp32": 44.0},
              96.0, "h20-nvlink", 8, f"{_NV} H20"),
    GpuTarget(r"a100.*40gb", "NVIDIA A100 40GB", 1555.0, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
              40.0, "a100-nvlink", 8, f"{_NV} A100"),
    GpuTarget(r"a100.*pcie", "NVIDIA A100 80GB PCIe", 1935.0, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
              80.0, "pcie-gen4", 8, f"{_NV} A100"),
    GpuTarget(r"a100", "NVIDIA A100 80GB SXM", 2039.0, {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
              80.0, "a100-nvlink", 8, f"{_NV} A100"),
    GpuTarget(r"gb300", "NVIDIA GB300 (per GPU)", 8000.0,
              {"bf16": 2500.0, "fp16": 2500.0, "fp32": 80.0, "fp8": 5000.0, "fp4": 15000.0},
              288.0, "gb300-nvlink", 72, _BLACKWELL.format("GB300 NVL72")),
    GpuTarget(r"gb200", "NVIDIA GB200 (per GPU)", 8000.0,
              {"bf16": 2500.0, "fp16": 2500.0, "fp32": 80.0, "fp8": 5000.0, "fp4": 10000.0},
              186.0, "gb200-nvlink", 72, _BLACKWELL.format("GB200 NVL72")),
    GpuTarget(r"b300", "NVIDIA B300 (HGX)", 8000.0,
              {"bf16": 2250.0, "fp16": 2250.0, "fp32": 75.0, "fp8": 4500.0, "fp4": 13125.0},
              288.0, "b300-nvlink", 8, _BLACKWELL.format("HGX B300")
              + "; https://glennklockwood.com/garden/processors/B300"),
    GpuTarget(r"b200", "NVIDIA B200", 8000.0,
              {"bf16": 2250.0, "fp16": 2250.0, "fp32": 75.0, "fp8": 4500.0, "fp4": 9000.0},
              180.0, "b200-nvlink", 8, _BLACKWELL.format("HGX B200")),
    GpuTarget(r"l40s", "NVIDIA L40S", 864.0, {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6, "fp8": 733.0},
              48.0, "pcie-gen4", 8, f"{_NV} L40S"),
    GpuTarget(r"mi300x", "AMD Instinct MI300X", 5300.0, {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4, "fp8": 2614.9},
              192.0, "mi300x-xgmi", 8, "AMD Instinct MI300X datasheet"),
    GpuTarget(r"mi325x", "AMD Instinct MI325X", 6000.0, {"bf16": 1307.4, "fp16": 1307.4, "fp32": 163.4, "fp8": 2614.9},
              256.0, "mi325x-xgmi", 8,
              "AMD Instinct MI325X datasheet (as listed at https://awesomeagents.ai/hardware/amd-mi325x)"),
    GpuTarget(r"mi355x", "AMD Instinct MI355X", 8000.0,
              {"bf16": 2516.6, "fp16": 2516.6, "fp32": 157.3, "fp8": 5033.2, "fp4": 10066.3},
              288.0, "mi355x-xgmi", 8,
              "AMD Instinct MI355X datasheet (CDNA 4: 288 GB HBM3E, 8 TB/s; "
              "https://boston-uk-l.azurewebsites.net/blog/2025/08/14/amd-instinct-mi355x.aspx)"),
)


def gpu_target(device_name: str | None) -> GpuTarget | None:
    """The GPU target whose pattern matches `device_name` (torch's name or a short one: "H200",
    "MI355X", "GB300"), or None."""
    low = (device_name or "").lower()
    return next((t for t in GPU_TARGETS if re.search(t.pattern, low)), None) if low else None


def target_names() -> str:
    """The short names --target-gpu takes, for error messages."""
    return "H200, H100, H800, H20, A100, B200, B300, GB200, GB300, L40S, MI300X, MI325X, MI355X"


def datasheet_ceilings(device_name: str) -> Ceilings | None:
    """The datasheet profile whose pattern matches `device_name`, or None."""
    t = gpu_target(device_name)
    if t is None:
        return None
    return Ceilings(
        device_name=device_name, mem_read_gbps=t.hbm_gbps, mem_copy_gbps=None, matmul_tflops=dict(t.tflops),
        source="datasheet", device_type="cuda", torch_version=torch.__version__,
        triton_version=_triton_version(), notes=f"datasheet profile {t.profile}: dense peaks, HBM bandwidth ({t.source})",
        memory_gb=t.memory_gib,
    )


# ---------------------------------------------------------------------------------------------
# Cache.


def cache_path() -> str:
    """`$MOEBENCH_CACHE_DIR/ceilings.json`, default `~/.cache/moebench/ceilings.json`."""
    base = os.environ.get("MOEBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moebench")
    return os.path.join(base, "ceilings.json")


def _cache_key(device_name: str) -> str:
    return f"{device_name} | torch {torch.__version__}"


def _read_cache() -> dict[str, Any]:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        warnings.warn(f"ignoring unreadable ceilings cache {cache_path()}; `moebench env --calibrate` rewrites it")
        return {}
    return data if isinstance(data, dict) else {}


def save_ceilings(c: Ceilings) -> str:
    """Store `c` in the cache (atomic rename). Returns the cache file's path."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read_cache()
        data[_cache_key(c.device_name)] = c.to_dict()
        atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True))
    except OSError as e:
        raise MoebenchError(f"cannot write the ceilings cache {path} ({e.strerror}): set MOEBENCH_CACHE_DIR to a writable folder") from None
    return path


def cached_ceilings(device_name: str) -> Ceilings | None:
    """Measured ceilings cached for this device name and torch version, or None."""
    entry = _read_cache().get(_cache_key(device_name))
    if not isinstance(entry, dict):
        return None
    try:
        return Ceilings.from_dict(entry)
    except TypeError:
        return None


# ---------------------------------------------------------------------------------------------
# Device facts.


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.metadata.version("pytorch-triton-rocm")
        except importlib.metadata.PackageNotFoundError:
            return ""


def _resolve(device: torch.device | str | None) -> torch.device:
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MoebenchError("--device cuda was asked for but no CUDA GPU is visible here: use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise MoebenchError(f"device {dev} does not exist: {torch.cuda.device_count()} GPU(s) are visible")
    elif dev.type != "cpu":
        raise MoebenchError(f"device {str(dev)!r} is not supported: use cpu or cuda")
    return dev


def _driver_version() -> str:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        out = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(out)) == 0:
            return f"CUDA driver API {out.value // 1000}.{(out.value % 1000) // 10}"
    except Exception:
        pass
    return ""


def device_summary(device: torch.device | str | None = None) -> dict[str, Any]:
    """Facts for `moebench env`: device name, SMs, memory, CUDA/HIP and driver versions, torch
    and triton versions, CPU and Python."""
    dev = _resolve(device)
    info: dict[str, Any] = {
        "device": dev.type,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(
            name=p.name,
            index=dev.index,
            gpu_count=torch.cuda.device_count(),
            sm_count=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            compute_capability=f"{p.major}.{p.minor}",
            cuda=torch.version.cuda,
            hip=getattr(torch.version, "hip", None),
            driver=_driver_version(),
        )
    else:
        info["name"] = f"CPU ({info['cpu']})"
        try:
            info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        except (ValueError, OSError, AttributeError):
            pass
    return info


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# ---------------------------------------------------------------------------------------------
# Measurement.


def get_ceilings(device: torch.device | str | None = None, calibrate_if_missing: bool = False) -> Ceilings | None:
    """Ceilings for `device`: cached measurement, else (calibrate_if_missing) a fresh one, else
    the datasheet profile of a known GPU (source "datasheet"), else None.
    On CPU: cached or a quick (< 2 s) rough measurement, cached, marked as CPU."""
    dev = _resolve(device)
    name = _device_name(dev)
    cached = cached_ceilings(name)
    if cached is not None:
        return cached
    if dev.type == "cpu":
        c = calibrate_cpu()
        try:
            save_ceilings(c)
        except MoebenchError:
            pass  # an unwritable cache only costs a re-measurement next time
        return c
    if calibrate_if_missing:
        return calibrate(dev)
    return datasheet_ceilings(name)


def calibrate(device: torch.device | str | None = None, save: bool = True) -> Ceilings:
    """Measure the ceilings of `device` (CUDA: copy, read, matmul; CPU: `calibrate_cpu`) and,
    with `save`, cache them. Takes tens of seconds on a GPU (Triton compiles included)."""
    dev = _resolve(device)
    c = calibrate_cpu() if dev.type == "cpu" else _calibrate_cuda(dev)
    if save:
        save_ceilings(c)
    return c


def _today() -> str:
    return _dt.date.today().isoformat()


def _median_cuda_us(fn: Callable[[], object], reps: int) -> float:
    from moebench.bench.timing import time_cuda

    return time_cuda(fn, warmup=3, reps=reps, use_graph=False).median_us


@contextlib.contextmanager
def _tf32_off() -> Iterator[None]:
    """fp32 matmuls in full fp32 (no TF32) inside the block; the previous setting comes back."""
    mm = torch.backends.cuda.matmul
    if hasattr(mm, "fp32_precision"):  # torch >= 2.9
        old = mm.fp32_precision
        mm.fp32_precision = "ieee"
        try:
            yield
        finally:
            mm.fp32_precision = old
    else:
        old_tf32 = mm.allow_tf32
        mm.allow_tf32 = False
        try:
            yield
        finally:
            mm.allow_tf32 = old_tf32


def _calibrate_cuda(dev: torch.device) -> Ceilings:
    notes: list[str] = []
    with torch.cuda.device(dev):
        free, _ = torch.cuda.mem_get_info()
        # Buffers: 4 GiB for reads, 2 x 2 GiB for the copy, shrunk when memory is short.
        read_bytes = int(min(4 * 2**30, free // 3)) // 2**20 * 2**20
        copy_bytes = int(min(2 * 2**30, free // 4)) // 2**20 * 2**20
        if read_bytes < 256 * 2**20:
            raise MoebenchError(f"calibration needs about 1 GiB of free GPU memory, {free / 2**30:.2f} GiB is free: free some memory")

        # (a) device copy: read + write bytes.
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev).fill_(1)
        dst = torch.empty_like(src)
        copy_us = _median_cuda_us(lambda: dst.copy_(src), reps=20)
        copy_gbps = 2 * copy_bytes / (copy_us * 1e-6) / 1e9
        src = dst = None  # free the buffers
        notes.append(f"copy {copy_bytes / 2**30:.1f} GiB: {copy_gbps:.0f} GB/s (read+write)")

        # (b) read ceiling: best of the read-only kernels and the copy rate.
        read_candidates, read_notes = read_gbps_candidates(dev, read_bytes)
        read_candidates["copy"] = copy_gbps
        notes += read_notes
        read_from, read_gbps = max(read_candidates.items(), key=lambda kv: kv[1])
        notes.append("read " + ", ".join(f"{k} {v:.0f}" for k, v in read_candidates.items()) + f" GB/s; used {read_from}")

        # (c) matmul 8192^3 on random data; fp32 with TF32 off.
        tflops: dict[str, float] = {}
        n = 8192
        for key, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
            a = torch.randn(n, n, device=dev, dtype=dt)
            b = torch.randn(n, n, device=dev, dtype=dt)
            with _tf32_off():
                us = _median_cuda_us(lambda: torch.mm(a, b), reps=10 if key == "fp32" else 20)
            tflops[key] = 2 * n**3 / (us * 1e-6) / 1e12
            a = b = None  # free the operands
        notes.append(f"matmul {n}^3 median of CUDA events")

        # (d) fp8 e4m3 x e4m3 -> bf16 with per-tensor fp32 scales (torch._scaled_mm).
        fp8_tflops, fp8_note = _fp8_matmul_tflops(dev, n)
        if fp8_tflops is not None:
            tflops["fp8"] = fp8_tflops
        notes.append(fp8_note)
        torch.cuda.empty_cache()

    return Ceilings(
        device_name=torch.cuda.get_device_name(dev), mem_read_gbps=round(read_gbps, 1), mem_copy_gbps=round(copy_gbps, 1),
        matmul_tflops={k: round(v, 1) for k, v in tflops.items()}, source=f"measured {_today()}", device_type="cuda",
        torch_version=torch.__version__, triton_version=_triton_version(), notes="; ".join(notes),
    )


def fp8_matmul_unavailable_reason(dev: torch.device) -> str | None:
    """None when torch._scaled_mm (e4m3, per-tensor scales) can run on `dev`, else why not."""
    if getattr(torch, "_scaled_mm", None) is None or getattr(torch, "float8_e4m3fn", None) is None:
        return f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn"
    if dev.type != "cuda":
        return "fp8 matmul is measured on CUDA GPUs only"
    if getattr(torch.version, "hip", None):
        return None  # MI300+ runs it (with its own fp8 flavour: see _fp8_dtype)
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        return f"fp8 matmul needs compute capability 8.9+ (Ada / Hopper / Blackwell), this GPU is {major}.{minor}"
    return None


def _fp8_dtype(dev: torch.device) -> torch.dtype:
    """e4m3 as the device runs it: float8_e4m3fnuz on MI300 (gfx94x), else float8_e4m3fn."""
    if getattr(torch.version, "hip", None) and hasattr(torch, "float8_e4m3fnuz"):
        try:
            if "gfx94" in torch.cuda.get_device_properties(dev).gcnArchName:
                return torch.float8_e4m3fnuz
        except AttributeError:
            pass
    return torch.float8_e4m3fn


def _fp8_matmul_tflops(dev: torch.device, n: int = 8192, reps: int = 20) -> tuple[float | None, str]:
    """(TFLOP/s or None, a note) of an n^3 fp8 e4m3 matmul: torch._scaled_mm(a, b, scale_a,
    scale_b, out_dtype=bf16) with a row-major, b column-major, scales 1-element fp32 tensors."""
    reason = fp8_matmul_unavailable_reason(dev)
    if reason is not None:
        return None, f"fp8 matmul skipped: {reason}"
    f8 = _fp8_dtype(dev)
    try:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16).to(f8)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16).to(f8).t()  # column-major
        one = torch.ones((), device=dev, dtype=torch.float32)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        fn()
        torch.cuda.synchronize(dev)
        us = _median_cuda_us(fn, reps=reps)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:  # an fp8 GEMM torch cannot run here
        first = (str(e).strip().splitlines() or [""])[0][:100]
        return None, f"fp8 matmul skipped: torch._scaled_mm failed ({e.__class__.__name__}: {first})"
    finally:
        a = b = None  # noqa: F841 - free the operands before the caller empties the cache
    return 2 * n**3 / (us * 1e-6) / 1e12, f"fp8 {str(f8).replace('torch.', '')} {n}^3 torch._scaled_mm, bf16 out"


if triton is not None:

    @triton.jit
    def _read_reduce_kernel(x_ptr, partial_ptr, BLOCK_SIZE: tl.constexpr, ITERS: tl.constexpr):
        # Program pid reads ITERS consecutive tiles of BLOCK_SIZE fp32 (no mask: the launcher
        # passes a multiple of BLOCK_SIZE * ITERS elements, so loads stay 128-bit vectorised)
        # and writes their sum, so the loads cannot be optimised away.
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * (BLOCK_SIZE * ITERS)
        offs = tl.arange(0, BLOCK_SIZE)
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for i in tl.static_range(ITERS):
            acc += tl.load(x_ptr + start + i * BLOCK_SIZE + offs)
        tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


    @triton.jit
    def _read_walk_kernel(x_ptr, partial_ptr, COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # x as (rows, COLS): program pid walks its BLOCK_R rows across all columns in BLOCK_C
        # steps, the way a GEMM walks a weight tile along K (the loop is software-pipelined over
        # num_stages), and writes their sum.
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        ptrs = x_ptr + rows[:, None] * COLS + tl.arange(0, BLOCK_C)[None, :]
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for c in range(0, COLS, BLOCK_C):
            acc += tl.load(ptrs + c)
        tl.store(partial_ptr + pid, tl.sum(acc))


def _check_warps(num_warps: int) -> None:
    # The interpreter accepts any count; a GPU compile needs a power of two (caught here, on CPU too).
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")


def read_walk(x: torch.Tensor, partial: torch.Tensor, cols: int, block_r: int, block_c: int, num_warps: int,
              num_stages: int) -> None:
    """partial[p] = sum of rows [p * block_r, (p + 1) * block_r) of x viewed as (n // cols, cols).

    x: (n,) fp32 contiguous, n a multiple of cols * block_r, cols of block_c; partial: (n // (cols * block_r),)."""
    if (x.dim() != 1 or x.dtype != torch.float32 or cols % block_c or x.numel() % (cols * block_r)
            or partial.numel() != x.numel() // (cols * block_r)):
        raise ValueError("read_walk needs a 1-D fp32 x whose length is a multiple of cols * block_r (cols of block_c)")
    _check_warps(num_warps)
    if triton is None:
        raise RuntimeError("triton is not installed")
    _read_walk_kernel[(partial.numel(),)](x, partial, COLS=cols, BLOCK_R=block_r, BLOCK_C=block_c,
                                          num_warps=num_warps, num_stages=num_stages)


def read_reduce(x: torch.Tensor, partial: torch.Tensor, block_size: int, iters: int, num_warps: int) -> None:
    """partial[p] = sum of x[p * block_size * iters : (p + 1) * block_size * iters].

    x: (n,) fp32 contiguous with n a multiple of block_size * iters; partial: (n // (block_size * iters),) fp32.
    """
    chunk = block_size * iters
    if x.dim() != 1 or x.dtype != torch.float32 or x.numel() % chunk or partial.numel() != x.numel() // chunk:
        raise ValueError("read_reduce needs a 1-D fp32 x whose length is a multiple of block_size * iters")
    _check_warps(num_warps)
    if triton is None:
        raise RuntimeError("triton is not installed")
    _read_reduce_kernel[(x.numel() // chunk,)](x, partial, BLOCK_SIZE=block_size, ITERS=iters, num_warps=num_warps)


#: Read-kernel variants tried by `read_gbps_candidates`: the 1-D stream (BLOCK_SIZE, ITERS, warps)
#: and the 2-D tile walk over 8 KiB rows (BLOCK_R, BLOCK_C, warps, stages); on an H200 the walk
#: reached 4.58 TB/s where the stream stayed at 4.37-4.56 (PERF.md).
READ_STREAM_CONFIGS = ((4096, 1, 4), (8192, 1, 8), (16384, 1, 8), (4096, 8, 8), (8192, 4, 16))
READ_WALK_COLS = 2048
READ_WALK_CONFIGS = ((128, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4))


def _triton_read_gbps(
    x: torch.Tensor, time_us: Callable[[Callable[[], object]], float] | None = None, failures: list[str] | None = None
) -> dict[str, float]:
    """Read bandwidth (GB/s) of each Triton read kernel variant over x (1-D fp32, all ones), each
    checked to have summed every element once. time_us(fn) times a call (default: CUDA events).
    A variant that fails to compile or launch is left out and named in `failures`.
    Returns {"triton stream BLOCK_SIZE=.. ITERS=.. warps=..": GB/s, "triton walk ...": GB/s}."""
    failures = [] if failures is None else failures
    time_us = time_us or (lambda fn: _median_cuda_us(fn, reps=20))
    runs: list[tuple[str, int, Callable[[torch.Tensor, torch.Tensor], object]]] = []
    for block_size, iters, warps in READ_STREAM_CONFIGS:
        runs.append((f"triton stream BLOCK_SIZE={block_size} ITERS={iters} warps={warps}", block_size * iters,
                     lambda v, p, b=block_size, i=iters, w=warps: read_reduce(v, p, b, i, w)))
    for block_r, block_c, warps, stages in READ_WALK_CONFIGS:
        runs.append((f"triton walk BLOCK_R={block_r} BLOCK_C={block_c} warps={warps} stages={stages}",
                     READ_WALK_COLS * block_r,
                     lambda v, p, r=block_r, c=block_c, w=warps, st=stages: read_walk(v, p, READ_WALK_COLS, r, c, w, st)))
    out: dict[str, float] = {}
    for name, chunk, launch in runs:
        n = x.numel() // chunk * chunk
        if n == 0:
            continue
        view = x[:n]
        partial = torch.empty(n // chunk, dtype=torch.float32, device=x.device)
        fn = lambda: launch(view, partial)  # noqa: E731
        try:
            fn()
        except Exception as e:  # one variant that does not compile here: the others stand
            failures.append(f"{name} failed ({e.__class__.__name__}: {str(e).strip()[:80]})")
            continue
        got = float(partial.double().sum())
        if abs(got - n) > 1e-6 * n:
            raise RuntimeError(f"{name} summed {got}, expected {n}")
        out[name] = n * x.element_size() / (time_us(fn) * 1e-6) / 1e9
    return out


def read_gbps_candidates(dev: torch.device, nbytes: int) -> tuple[dict[str, float], list[str]]:
    """Read-only bandwidth (GB/s) over an nbytes buffer: the best Triton stream kernel, the best
    Triton tile walk, and torch.sum; the ceiling is the largest (design.md: reads go faster than
    a copy). Returns ({name: GB/s}, notes)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    torch_us = _median_cuda_us(lambda: x.sum(), reps=20)
    cands = {"torch.sum": nbytes / (torch_us * 1e-6) / 1e9}
    notes: list[str] = []
    try:
        triton_runs = _triton_read_gbps(x, failures=notes)
        for kind in ("triton stream", "triton walk"):
            best = max(((k, v) for k, v in triton_runs.items() if k.startswith(kind)), key=lambda kv: kv[1], default=None)
            if best:
                cands[best[0]] = best[1]
    except Exception as e:  # triton missing or a compile failure: the other figures stand
        notes.append(f"triton read kernels unavailable ({e.__class__.__name__}: {str(e)[:80]})")
    x = None  # free the buffer
    return cands, notes


def calibrate_cpu(budget_s: float = 1.5) -> Ceilings:
    """Rough CPU ceilings in well under 2 s: copy and read (sum) bandwidth over a 128 MiB
    buffer, fp32 matmul GFLOP/s. Marked as CPU: these are not GPU numbers."""
    t_start = time.perf_counter()

    def best_s(fn: Callable[[], object], reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if time.perf_counter() - t_start > budget_s:
                break
        return min(times)

    nbytes = 128 * 2**20
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_gbps = 2 * nbytes / best_s(lambda: dst.copy_(src), 5) / 1e9
    read_gbps = nbytes / best_s(lambda: src.sum(), 5) / 1e9
    src = dst = None  # free the buffers
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm_s = best_s(lambda: torch.mm(a, b), 5)
    fp32_tflops = 2 * n**3 / mm_s / 1e12
    return Ceilings(
        device_name=_device_name(torch.device("cpu")), mem_read_gbps=round(max(read_gbps, copy_gbps), 2),
        mem_copy_gbps=round(copy_gbps, 2), matmul_tflops={"fp32": round(fp32_tflops, 4)},
        source=f"cpu measured {_today()}", device_type="cpu", torch_version=torch.__version__,
        triton_version=_triton_version(),
        notes=(f"rough CPU figures ({torch.get_num_threads()} threads): 128 MiB copy/sum, {n}^3 fp32 matmul; "
               f"not GPU numbers; fp8 matmul skipped (GPU only)"),
    )
