"""Hold the DeepEP and DeepGEMM adapters' calls against a build's Python layer, on a machine
without a GPU.

    python scripts/vendor_contracts.py .whl-vendor/tokenspeed_deepep-*.whl .whl-vendor/tokenspeed_deepgemm-*.whl
    python scripts/vendor_contracts.py /path/to/site-packages      # an installed build

Neither library imports without a CUDA driver (their extensions link libcuda), so nothing is
imported: the wheels (or installed folders) are read as files.
  - DeepEP: `deep_ep/buffer.py` is plain Python. Every call the adapters make on a `Buffer` (its
    constructor, `get_low_latency_rdma_size_hint`, `low_latency_dispatch`, `low_latency_combine`,
    `get_dispatch_layout`, `dispatch`, `combine`) is bound, positional arguments and keyword names,
    to the method's signature there; a call that would raise TypeError is a mismatch.
  - DeepGEMM: its functions live in the compiled `_C` module, which does not load without a driver;
    every function the adapters call must be a name `deep_gemm` exports (its `__init__.py` and the
    submodules it star-imports), and where the wheel's type stub `deep_gemm/_C.pyi` declares it, the
    call is bound to that signature too; the others are checked by name only (the GPU tests run them).
Prints one line per call; exit status 1 on a mismatch, 2 when a build is not found.
"""

from __future__ import annotations

import ast
import inspect
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the adapter files and the names their calls go through: (file, {receiver: library class or module})
ADAPTERS = {
    "deep_ep": (("moebench/dispatch/deepep_ll.py", "moebench/dispatch/deepep_ht.py"), ("buf", "Buffer")),
    "deep_gemm": (("moebench/kernels/deepgemm.py",), ("dg",)),
}


def read_member(source: Path, member: str) -> str | None:
    """The text of `member` (e.g. deep_ep/buffer.py) inside a wheel, or under a folder."""
    if source.is_file() and source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            return z.read(member).decode() if member in z.namelist() else None
    path = source / member
    return path.read_text() if path.is_file() else None


def signatures(text: str, cls: str) -> dict[str, inspect.Signature]:
    """{method: Signature} of class `cls` in module source `text` (defaults stand as None)."""
    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef):
                    out[f.name] = _signature(f)
    return out


def _signature(f: ast.FunctionDef) -> inspect.Signature:
    P = inspect.Parameter
    args = f.args
    pos = args.posonlyargs + args.args
    first_default = len(pos) - len(args.defaults)
    params = [P(a.arg, P.POSITIONAL_OR_KEYWORD, default=None if i >= first_default else P.empty)
              for i, a in enumerate(pos)]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    params += [P(a.arg, P.KEYWORD_ONLY, default=None if d is not None else P.empty)
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def module_functions(text: str) -> dict[str, inspect.Signature]:
    """{function: Signature} of the top-level functions of module (or stub) source `text`."""
    return {f.name: _signature(f) for f in ast.parse(text).body if isinstance(f, ast.FunctionDef)}


def exported_names(text: str, read=None, package: str = "") -> set[str]:
    """Names a package module imports, assigns or defines at any level (its public surface),
    following `from .sub import *` through `read(member)` within `package`."""
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if any(a.name == "*" for a in node.names) and node.level and read is not None:
                sub = f"{package}/{node.module.replace('.', '/')}" if node.module else package
                inner = read(f"{sub}/__init__.py") or read(f"{sub}.py")
                if inner is not None:
                    names |= exported_names(inner, read, sub if read(f"{sub}/__init__.py") else package)
                continue
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return names


def adapter_calls(path: Path, receivers: tuple[str, ...]) -> list[tuple[int, str, str, int, list[str]]]:
    """(line, receiver, method, positional count, keyword names) of each `receiver.method(...)` call
    and each `Buffer(...)` construction in an adapter's source."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        kws = [k.arg for k in node.keywords if k.arg is not None]
        if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id in receivers:
            calls.append((node.lineno, fn.value.id, fn.attr, len(node.args), kws))
        elif (isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Call) and isinstance(fn.value.func, ast.Attribute)
              and fn.value.func.attr == "_get_buffer" and "buf" in receivers):  # self._get_buffer(...).method(...)
            calls.append((node.lineno, "buf", fn.attr, len(node.args), kws))
        elif isinstance(fn, ast.Name) and fn.id in receivers:
            calls.append((node.lineno, fn.id, "__init__", len(node.args), kws))
    return calls


def check_deep_ep(buffer_py: str) -> list[tuple[str, str | None]]:
    """(call, problem or None) for every Buffer call of the DeepEP adapters."""
    sigs = signatures(buffer_py, "Buffer")
    files, receivers = ADAPTERS["deep_ep"]
    out = []
    for rel in files:
        for line, recv, method, npos, kws in adapter_calls(ROOT / rel, receivers):
            where = f"{rel}:{line} {recv}.{method}" if method != "__init__" else f"{rel}:{line} Buffer(...)"
            sig = sigs.get(method)
            if sig is None:
                out.append((where, f"Buffer has no method {method}"))
                continue
            static = method == "get_low_latency_rdma_size_hint" or next(iter(sig.parameters), "") != "self"
            try:
                sig.bind(*([None] * (npos + (0 if static else 1))), **{k: None for k in kws})
            except TypeError as e:
                out.append((where, f"does not bind to {method}{sig}: {e}"))
                continue
            out.append((where, None))
    return out


def check_deep_gemm(init_py: str, read=None) -> list[tuple[str, str | None]]:
    """(call, problem or None) for every deep_gemm call of the DeepGEMM adapters; `read(member)`
    gives the build's other files (its star-imported submodules, its `_C.pyi` stub)."""
    names = exported_names(init_py, read, "deep_gemm")
    stub = read("deep_gemm/_C.pyi") if read is not None else None
    sigs = module_functions(stub) if stub else {}
    files, receivers = ADAPTERS["deep_gemm"]
    out = []
    for rel in files:
        for line, recv, method, npos, kws in adapter_calls(ROOT / rel, receivers):
            where = f"{rel}:{line} {recv}.{method}"
            if method not in names:
                out.append((where, f"deep_gemm exports no {method}"))
                continue
            sig = sigs.get(method)
            if sig is None or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
                out.append((f"{where} (name only: its stub declares no argument list)", None))
                continue
            try:
                sig.bind(*([None] * npos), **{k: None for k in kws})
            except TypeError as e:
                out.append((where, f"does not bind to {method}{sig}: {e}"))
                continue
            out.append((where, None))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    checked, bad = 0, 0
    for arg in argv:
        src = Path(arg)
        if not src.exists():
            print(f"error: {arg}: no such wheel or folder", file=sys.stderr)
            return 2
        read = lambda member, src=src: read_member(src, member)  # noqa: E731
        checks = (("deep_ep/buffer.py", check_deep_ep), ("deep_gemm/__init__.py", lambda t: check_deep_gemm(t, read)))
        for member, check in checks:
            text = read(member)
            if text is None:
                continue
            for where, problem in check(text):
                checked += 1
                bad += problem is not None
                print(f"{'MISMATCH' if problem else 'ok':8s} {src.name}: {where}" + (f": {problem}" if problem else ""))
    if not checked:
        print("error: no deep_ep/buffer.py or deep_gemm/__init__.py in what was given", file=sys.stderr)
        return 2
    print(f"{checked} calls checked, {bad} mismatched")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
