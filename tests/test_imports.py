"""The package's import graph: imports flow one way (CLI -> library -> kernels / dispatch / runtime ->
plain data), so no module of moebench imports itself back through others. Imports inside functions
count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "moebench"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """moebench module -> the moebench modules it imports (anywhere in its text)."""
    mods = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                # the longest moebench module the name refers to
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != mod and n != "moebench":
                    graph[mod].add(n)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_finder_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles between moebench modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _imports_of(prefix: str, graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: deps for m, deps in graph.items() if m == prefix or m.startswith(prefix + ".")}


def _offenders(lower: str, upper: tuple[str, ...]) -> list[str]:
    """Imports from modules under `lower` into modules under any of `upper`."""
    graph = import_graph()
    return sorted(f"{m} -> {d}" for m, deps in _imports_of(lower, graph).items() for d in deps
                  if any(d == u or d.startswith(u + ".") for u in upper))


def test_the_runtime_sits_below_the_sweep():
    """runtime/ (ranks, collectives, the communication model) serves the sweep's runners and never
    reaches up into the sweep, the comparison, the tuner or the CLI."""
    bad = _offenders("moebench.runtime", ("moebench.sweep", "moebench.compare", "moebench.tuning", "moebench.cli"))
    assert not bad, "runtime imports from above it:\n" + "\n".join(bad)


def test_the_sweep_does_not_reach_into_the_cli():
    bad = _offenders("moebench.sweep", ("moebench.cli", "moebench.compare", "moebench.tuning", "moebench.report"))
    assert not bad, "the sweep imports from above it:\n" + "\n".join(bad)


def test_the_kernels_hold_only_the_contract_and_the_backends():
    """kernels/ imports nothing of the CLI, the tuner, the sweep, the comparison, the report or the
    benchmark metrics: parsers, file writers and test fixtures live with their users."""
    bad = _offenders("moebench.kernels", ("moebench.cli", "moebench.tuning", "moebench.sweep", "moebench.compare",
                                          "moebench.report", "moebench.bench.metrics"))
    assert not bad, "kernels import from above them:\n" + "\n".join(bad)


def test_the_communication_model_sits_below_the_registry():
    """moebench.comm (links, traffic, points, fit, model, calibration, robustness) is given the
    operations the backends declare: it never imports the registry, the sweep, the comparison,
    the tuner or the CLI; the kernels' contract imports only its plain CommOp module."""
    bad = _offenders("moebench.comm", ("moebench.backends", "moebench.sweep", "moebench.compare", "moebench.tuning",
                                       "moebench.cli", "moebench.report"))
    assert not bad, "moebench.comm imports from above it:\n" + "\n".join(bad)
    assert import_graph()["moebench.comm"] == set(), "moebench/comm/__init__.py must stay plain data"
