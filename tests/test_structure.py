"""The shape of the house, checked from the source text (no imports): no import circle among mimo_sft's
modules or among its packages, lazy imports inside functions included, and no function over 80 lines.

Why lazy imports count: a circle closed by an import inside a function still means neither side can be
understood, moved or tested without the other; it only moves the failure from import time to run time.
A module importing its own parent package is not an edge (Python initialises parents first anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mimo_sft"
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(module: str, node, is_package: bool, known) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    return {n for n in names if n in known}


def import_graph() -> dict[str, set[str]]:
    """module -> the mimo_sft modules it imports anywhere in its text."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= {t for t in _targets(name, node, is_package, mods)
                          if t != name and not name.startswith(t + ".")}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def package_of(module: str) -> str:
    """``mimo_sft.train.checkpoint.save`` -> ``mimo_sft.train``; top-level modules stand for themselves."""
    return ".".join(module.split(".")[:2])


def test_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_modules():
    assert cycles(import_graph()) == []


def test_no_import_circle_among_packages():
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module))
    assert cycles(packages) == []


def test_layers_that_must_not_import_upward():
    """config/ is the bottom (the schema everything reads); data/ and model/ never see each other or train/."""
    graph = import_graph()
    rules = {"mimo_sft.config": ("mimo_sft.memory", "mimo_sft.data", "mimo_sft.model", "mimo_sft.train",
                                 "mimo_sft.plan", "mimo_sft.validate", "mimo_sft.cli"),
             "mimo_sft.data": ("mimo_sft.model", "mimo_sft.train", "mimo_sft.plan", "mimo_sft.cli"),
             "mimo_sft.model": ("mimo_sft.data", "mimo_sft.train", "mimo_sft.plan", "mimo_sft.cli"),
             "mimo_sft.memory": ("mimo_sft.data", "mimo_sft.model", "mimo_sft.train", "mimo_sft.plan",
                                 "mimo_sft.validate", "mimo_sft.cli")}
    bad = [(m, t) for m, targets in graph.items() for t in targets
           if package_of(m) in rules and package_of(t) in rules[package_of(m)]]
    assert bad == []


def test_no_function_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
