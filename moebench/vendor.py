"""Optional vendor libraries: what is installed, whether it runs here, and which build of the
package index matches the torch already installed.

    status = library_status("deep_gemm")          # installed version, usable here / why not, advice
    build, why = pick_build("deepgemm")          # the index build for this torch, or why none
    cmd = install_command(build)                  # pip install --no-deps <package>==<version>

DeepGEMM and DeepEP are published on the package index as binary wheels, `tokenspeed-deepgemm`
and `tokenspeed-deepep`. Each wheel is compiled against one torch (its C++ ABI) and CUDA 13
(`libcudart.so.13`); some declare a torch pin (`torch==2.14.0`) that pip would satisfy by
replacing the user's torch. moebench therefore installs only a build known to go with the torch
already installed, always with `--no-deps`, and never installs, upgrades or removes torch.

`KNOWN_BUILDS` is the one table of what is known, with its source. A build runs where moebench
ran it ("works"), is known to break with a torch ("fails"), or declares the torch it was made for
("pinned": the package's own Requires-Dist, not run by moebench).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Callable

from moebench.errors import MoebenchError

#: Where KNOWN_BUILDS comes from.
KNOWN_BUILDS_SOURCE = (
    "moebench runs on one H100 and one H200 on 2026-12-05 (torch 2.11.0+cu130, triton 3.6.0, Python 3.12, "
    "wheels installed with --no-deps); the torch pins and the CUDA runtime read off the cp312 x86_64 wheels "
    "(METADATA's Requires-Dist, the NEEDED entries of their extension modules) the same day; "
    "tokenspeed-triton-kernels (pure Python) imported and its API read on a CPU machine with triton 3.6.0, 3.8.0 "
    "and 3.9.0 on 2026-12-07"
)


@dataclass(frozen=True)
class Build:
    """One package-index build and what is known of it with a torch.

    version: exact. torch: "2.11" (any 2.11.x) or "2.14.0" (that release). verdict: "works" (ran
    in moebench with that torch), "fails" (broke with it; `evidence` says how) or "pinned" (the
    wheel requires exactly that torch; not run by moebench). A pure-Python build (its library's
    `pure_python`) is known against a triton instead: `triton` "3.8" (any 3.8.x), `torch` "";
    its verdict may also be "imports" (imported, and its API read by moebench, with that triton;
    not yet run on a GPU by moebench)."""

    package: str
    version: str
    torch: str
    verdict: str
    evidence: str
    triton: str = ""


KNOWN_BUILDS: tuple[Build, ...] = (
    Build("tokenspeed-deepgemm", "2.5.0.post20260424", "2.11", "works",
          "deepgemm and batched-deepgemm usable; a DeepSeek-V3 TP8 fp8 block sweep ran no-dpep+deepgemm "
          "correct at 16, 256 and 4096 tokens (H100)"),
    Build("tokenspeed-deepgemm", "2.8.0.post20260924", "2.14.0", "pinned", "requires torch==2.14.0"),
    Build("tokenspeed-deepgemm", "2.8.2.post20261020", "2.14.0", "pinned",
          "requires torch==2.14.0 (the torch vLLM 0.33 pins)"),
    Build("tokenspeed-deepep", "1.2.1.post20251110", "2.11", "works",
          "imports; two ranks sharing one H200 (gloo group): normal dispatch -> combine exact, low-latency "
          "dispatch -> combine within 2.6e-3 (bf16)"),
    Build("tokenspeed-deepep", "2.1.0.post20260801", "2.11", "fails",
          "does not import: undefined symbol: ncclCommQueryProperties (torch 2.11's NCCL)"),
    Build("tokenspeed-deepep", "2.1.0.post20260810", "2.11", "fails",
          "does not import: undefined symbol: ncclCommQueryProperties (torch 2.11's NCCL)"),
    Build("tokenspeed-triton-kernels", "1.0.0.post20260510", "", "fails",
          "does not import: cannot import name 'is_hip_gfx1250' from 'triton.language.target_info' (CPU machine)",
          triton="3.6"),
    Build("tokenspeed-triton-kernels", "1.0.0.post20260510", "", "imports",
          "imports, and moebench reads its matmul API (CPU machine; not yet run on a GPU by moebench)", triton="3.8"),
    Build("tokenspeed-triton-kernels", "1.0.0.post20260510", "", "imports",
          "imports, and moebench reads its matmul API (CPU machine; not yet run on a GPU by moebench)", triton="3.9"),
)

#: What every build of KNOWN_BUILDS needs besides its torch: a CUDA 13 torch (the wheels link
#: libcudart.so.13), Linux on x86_64 or aarch64, CPython 3.10-3.13 (wheels cp310..cp313).
WHEEL_CUDA_MAJOR = "13"
WHEEL_MACHINES = ("x86_64", "aarch64")
WHEEL_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
#: builds with fewer Python tags than WHEEL_PYTHONS (package, version) -> the ones published
WHEEL_PYTHONS_OF = {("tokenspeed-deepgemm", "2.8.2.post20261020"): ("3.11", "3.12", "3.13")}


@dataclass(frozen=True)
class Library:
    """A vendor library moebench can use: its import name, the backends that need it, and where
    a build comes from (`package`: a package-index distribution moebench picks builds of; else
    `source`: how to get it)."""

    key: str  # what `moebench vendor install` takes
    module: str
    backends: tuple[str, ...]
    package: str | None
    source: str
    #: shared libraries its extension links against that live in another wheel's folder, where the
    #: wheel's build machine had them: (python package holding them, its lib folder's files). They
    #: are loaded (RTLD_GLOBAL) before the module is imported, so no LD_LIBRARY_PATH is needed.
    preload: tuple[str, tuple[str, ...]] | None = None
    #: a pure-Python wheel (py3-none-any): any machine takes it; its builds go with a triton, not a torch
    pure_python: bool = False


LIBRARIES: tuple[Library, ...] = (
    Library("deepgemm", "deep_gemm", ("deepgemm", "batched-deepgemm"), "tokenspeed-deepgemm",
            "github.com/deepseek-ai/DeepGEMM; README, 'Vendor libraries'"),
    Library("deepep", "deep_ep", ("deepep-ll", "deepep-ht"), "tokenspeed-deepep",
            "github.com/deepseek-ai/DeepEP; README, 'Vendor libraries'",
            preload=("nvidia.nvshmem", ("libnvshmem_host.so.3",))),
    Library("triton-kernels", "triton_kernels", ("triton-kernels",), "tokenspeed-triton-kernels",
            "the python/triton_kernels folder of github.com/triton-lang/triton, at the revision of the installed triton",
            pure_python=True),
    Library("aiter", "aiter", ("aiter",), None, "github.com/ROCm/aiter (ROCm builds of torch only)"),
)


def library(name: str) -> Library:
    """The library called `name` (its key, e.g. 'deepgemm', or its module, e.g. 'deep_gemm')."""
    for lib in LIBRARIES:
        if name in (lib.key, lib.module):
            return lib
    keys = ", ".join(lib.key for lib in LIBRARIES if lib.package)
    raise MoebenchError(f"unknown vendor library '{name}'; moebench installs: {keys}")


# ---------------------------------------------------------------------------------------------
# This machine


@dataclass(frozen=True)
class Here:
    """What a build must fit: torch's version and CUDA (None for a CPU build; ROCm builds give
    hip), the Python version (major.minor), OS and machine."""

    torch: str
    cuda: str | None
    python: str
    system: str = "Linux"
    machine: str = "x86_64"
    hip: str | None = None
    triton: str | None = None  # the installed triton's version (None: no triton)

    @classmethod
    def detect(cls) -> "Here":
        import torch

        return cls(torch=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
                   python=f"{sys.version_info.major}.{sys.version_info.minor}", system=platform.system(),
                   machine=platform.machine(), triton=_triton_version())


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_release(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0); '2.14.0.dev20261001' -> (2, 14, 0)."""
    m = re.match(r"(\d+(?:\.\d+)*)", version.strip())
    if not m:
        raise MoebenchError(f"not a torch version: '{version}'")
    return tuple(int(p) for p in m.group(1).split("."))


def torch_matches(spec: str, version: str) -> bool:
    """Whether torch `version` is what `spec` names: '2.11' = any 2.11.x, '2.14.0' = that release."""
    want, have = torch_release(spec), torch_release(version)
    have = have + (0,) * (len(want) - len(have))
    return have[: len(want)] == want


def _builds(package: str) -> list[Build]:
    return [b for b in KNOWN_BUILDS if b.package == package]


def platform_reason(here: Here, build: Build | None = None) -> str | None:
    """Why no wheel of these packages fits this machine (OS, CPU, Python, torch's CUDA), or None."""
    pythons = WHEEL_PYTHONS_OF.get((build.package, build.version), WHEEL_PYTHONS) if build else WHEEL_PYTHONS
    if here.system != "Linux" or here.machine not in WHEEL_MACHINES:
        return f"the index builds are Linux wheels for {' and '.join(WHEEL_MACHINES)}; this is {here.system} {here.machine}"
    if here.python not in pythons:
        what = f"{build.package} {build.version}" if build else "the index builds"
        return f"{what} exist for Python {', '.join(pythons)}; this is Python {here.python}"
    if here.hip:
        return f"the index builds are CUDA builds; this torch ({here.torch}) is a ROCm build"
    if not here.cuda:
        return (f"the index builds link CUDA {WHEEL_CUDA_MAJOR}'s runtime and need a CUDA {WHEEL_CUDA_MAJOR} build "
                f"of torch; this torch ({here.torch}) is a CPU build")
    if here.cuda.split(".")[0] != WHEEL_CUDA_MAJOR:
        return (f"the index builds link CUDA {WHEEL_CUDA_MAJOR}'s runtime (libcudart.so.{WHEEL_CUDA_MAJOR}); "
                f"this torch ({here.torch}) is built for CUDA {here.cuda}")
    return None


def _known_text(package: str) -> str:
    parts = []
    for b in _builds(package):
        word = {"works": "runs with", "fails": "fails with", "pinned": "requires", "imports": "imports with"}[b.verdict]
        against = f"triton {b.triton}" if b.triton else f"torch{'==' if b.verdict == 'pinned' else ' '}{b.torch}"
        parts.append(f"{b.version} {word} {against}")
    return "; ".join(parts)


def _pick_pure(lib: Library, here: Here, version: str | None) -> tuple[Build | None, str]:
    """pick_build for a pure-Python library: any platform; its builds are known against a triton."""
    if here.triton is None:
        return None, f"{lib.module} runs on triton, and triton is not installed"
    builds = [b for b in _builds(lib.package) if b.triton and torch_matches(b.triton, here.triton)]
    if version is not None:
        for b in builds:
            if b.version == version and b.verdict == "fails":
                return None, f"{b.package} {b.version} is known to fail with triton {here.triton}: {b.evidence}"
        good = [b for b in builds if b.version == version and b.verdict in ("works", "imports")]
        if good:
            return good[0], f"with triton {good[0].triton}: {good[0].evidence}"
        return (Build(lib.package, version, "", "untested", "", triton=here.triton),
                f"asked for; not known to moebench with triton {here.triton} (known: {_known_text(lib.package)})")
    for verdict in ("works", "imports"):
        good = [b for b in builds if b.verdict == verdict]
        if good:
            return good[-1], f"with triton {good[-1].triton}: {good[-1].evidence}"
    bad = [b for b in builds if b.verdict == "fails"]
    why = f"; {bad[-1].version} is known to fail with it: {bad[-1].evidence}" if bad else ""
    return None, (f"no {lib.package} build is known to go with triton {here.triton} (known: {_known_text(lib.package)})"
                  f"{why}; install a triton it imports with, get {lib.module} from {lib.source}, or pass --version "
                  f"to try a build")


def pick_build(key: str, here: Here | None = None, version: str | None = None) -> tuple[Build | None, str]:
    """The build of library `key` to install with this torch, and a note (what it rests on), or
    (None, why not). `version`: a version asked for by the user instead of the pick; refused where
    it is known to fail with this torch or pinned to another one, else taken with a note that
    moebench has not run it. A pure-Python library's builds go with the installed triton instead
    (any platform, any torch)."""
    lib = library(key)
    if lib.package is None:
        return None, f"{lib.module} has no package-index build that moebench installs; get it from {lib.source}"
    here = here or Here.detect()
    if lib.pure_python:
        return _pick_pure(lib, here, version)
    builds = _builds(lib.package)
    if version is not None:
        known = [b for b in builds if b.version == version]
        for b in known:
            if b.verdict == "fails" and torch_matches(b.torch, here.torch):
                return None, f"{b.package} {b.version} is known to fail with torch {here.torch}: {b.evidence}"
            if b.verdict == "pinned" and not torch_matches(b.torch, here.torch):
                return None, (f"{b.package} {b.version} requires torch=={b.torch} but torch {here.torch} is "
                              f"installed, and moebench never replaces torch")
        build = known[0] if known else Build(lib.package, version, here.torch, "untested", "")
        why = platform_reason(here, build)
        if why is not None:
            return None, why
        good = [b for b in known if b.verdict == "works" and torch_matches(b.torch, here.torch)]
        note = good[0].evidence if good else (f"asked for; not run by moebench with torch {here.torch} "
                                              f"(known: {_known_text(lib.package)})")
        return (good[0] if good else build), note
    why = platform_reason(here)
    if why is not None:
        return None, why
    works = [b for b in builds if b.verdict == "works" and torch_matches(b.torch, here.torch)]
    if works:
        b = works[-1]
        return b, f"ran with torch {b.torch}: {b.evidence}"
    pinned = [b for b in builds if b.verdict == "pinned" and torch_matches(b.torch, here.torch)]
    for b in reversed(pinned):
        if platform_reason(here, b) is None:
            return b, f"made for this torch ({b.evidence}); not yet run by moebench"
    return None, (f"no {lib.package} build is known to go with torch {here.torch} (known: {_known_text(lib.package)}); "
                  f"build {lib.module} from source ({lib.source}), or pass --version to try another build")


# ---------------------------------------------------------------------------------------------
# What is installed


def installed(module: str) -> tuple[str, str] | None:
    """(distribution, version) that provides top-level module `module`; ('', '') when the module
    is importable but no installed distribution claims it (a source tree on the path); None when
    it is not there at all."""
    dists = importlib.metadata.packages_distributions().get(module, [])
    for name in dists:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec(module) is not None:
        return "", ""
    return None


def preload_libraries(module: str) -> None:
    """Load the shared libraries library `module` declares in `preload` (found in their package's
    lib folder) so that its extension imports without LD_LIBRARY_PATH; NVSHMEM's bootstrap plugin,
    which NVSHMEM opens by name at its first buffer, is named by its path the same way. Nothing
    happens where the package is not installed (the import then says what is missing)."""
    import ctypes
    import os

    lib = next((x for x in LIBRARIES if x.module == module), None)
    if lib is None or lib.preload is None:
        return
    package, files = lib.preload
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    folder = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    for name in files:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    plugin = os.path.join(folder, "nvshmem_bootstrap_uid.so.3")
    if os.path.exists(plugin):
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_PLUGIN", plugin)


def import_error(module: str) -> str | None:
    """None when `module` imports in this process, else why not (one line)."""
    try:
        preload_libraries(module)
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken build (missing symbol, CUDA libs) is a reason
        if isinstance(e, ImportError) and getattr(e, "name", None) == module:
            return f"{module} is not installed"
        msg = str(e).strip().splitlines()
        return f"{module} does not import: {type(e).__name__}: {msg[0] if msg else ''}"
    return None


def _device_reason(module: str) -> str | None:
    """Why an importable library cannot run on this machine's devices."""
    import torch

    if module == "aiter":
        return None if getattr(torch.version, "hip", None) else "aiter needs ROCm (an AMD GPU build of torch)"
    if not torch.cuda.is_available():
        return f"{module} needs a CUDA GPU"
    if module == "deep_gemm" and torch.cuda.get_device_capability()[0] < 9:
        return "DeepGEMM needs Hopper (sm_90) or newer"
    return None


@dataclass
class LibraryStatus:
    """One line of `moebench env`'s vendor libraries."""

    library: str
    module: str
    backends: list[str]
    distribution: str | None  # None: not installed; '': importable without package metadata
    version: str | None
    usable: bool
    reason: str
    install: str  # what to do to get a build that runs with this torch ('' when nothing to do)
    pick: dict | None = field(default=None)  # the index build for this torch: package, version, note

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _known_bad(package: str, version: str, here: Here) -> str | None:
    """Why installed build `version` of `package` does not go with this torch, where that is known."""
    for b in _builds(package):
        if b.version != version:
            continue
        if b.triton:
            if b.verdict == "fails" and here.triton and torch_matches(b.triton, here.triton):
                return f"{b.package} {b.version} is known to fail with triton {b.triton}: {b.evidence}"
            continue
        if b.verdict == "fails" and torch_matches(b.torch, here.torch):
            return f"{b.package} {b.version} is known to fail with torch {b.torch}: {b.evidence}"
        if b.verdict == "pinned" and not torch_matches(b.torch, here.torch):
            return f"{b.package} {b.version} requires torch=={b.torch}; this is torch {here.torch}"
    return None


def library_status(name: str, here: Here | None = None, *, installed_fn: Callable = installed,
                   import_fn: Callable = import_error, device_fn: Callable = _device_reason) -> LibraryStatus:
    """What is installed of library `name`, whether it runs here and why not, and what to install
    for this torch when it is missing, does not import, or is a build known not to go with this torch."""
    lib = library(name)
    here = here or Here.detect()
    found = installed_fn(lib.module)
    dist, version = found if found is not None else (None, None)
    imp = None if found is None else import_fn(lib.module)
    dev = device_fn(lib.module) if found is not None and imp is None else None
    reason = f"{lib.module} is not installed" if found is None else (imp or dev)
    bad = _known_bad(lib.package, version, here) if lib.package and dist == lib.package and version else None
    build, note = pick_build(lib.key, here) if lib.package else (None, "")
    install = ""
    if found is None or imp is not None or bad is not None:
        if lib.package is None:
            install = f"get it from {lib.source}"
        elif build is None:
            install = f"no index build for this torch: {note}"
        elif not (dist == build.package and version == build.version):
            install = f"moebench vendor install {lib.key}  (= {shell(install_command(build))})"
    pick = None if build is None else {"package": build.package, "version": build.version, "note": note}
    reason = "; ".join(x for x in (reason, bad) if x)
    return LibraryStatus(lib.key, lib.module, list(lib.backends), dist, version, found is not None and imp is None
                         and dev is None, reason, install, pick)


def statuses(here: Here | None = None) -> list[LibraryStatus]:
    here = here or Here.detect()
    return [library_status(lib.key, here) for lib in LIBRARIES]


# ---------------------------------------------------------------------------------------------
# pip commands (never torch, never dependencies)


def install_command(build: Build, python: str | None = None, find_links: str | None = None,
                    target: str | None = None) -> list[str]:
    """pip install of exactly this build, without its dependencies (torch stays as it is).
    find_links: a folder of wheels to install from instead of the index (no index then)."""
    cmd = [python or "python", "-m", "pip", "install", "--no-deps"]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    if target:
        cmd += ["--target", target]
    return cmd + [f"{build.package}=={build.version}"]


def download_command(build: Build, dest: str, python_version: str, platform_tag: str,
                     python: str | None = None) -> list[str]:
    """pip download of this build's wheel for another machine (no dependencies, binary only)."""
    return [python or "python", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", "--platform", platform_tag,
            "-d", dest, f"{build.package}=={build.version}"]


def shell(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
