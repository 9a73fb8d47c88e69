"""docs/design.md names the modules that patch megatron; this finds them in the source and holds the list true.

"Patch" here means assigning an attribute onto a megatron module or class (``X.attr = ...`` or
``setattr(X, ...)``), where ``X`` is known, from the text alone, to be megatron's: a name imported from
``megatron``, a module from ``importlib.import_module`` of a megatron name (a literal, or a non-literal in a
file whose strings name megatron modules), an entry of ``sys.modules``, an attribute, ``getattr`` or
iteration of one of those, or a parameter that a call in the same file passes one of those. Instances
built from megatron's classes (``cfg = TransformerConfig(...)``) are not modules or classes, so setting
their fields is not a patch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mimo_sft"
#: calls whose result holds what their argument holds (iterating ``list(sys.modules.items())``, ``vars(mod)``)
_PASS_THROUGH = {"list", "tuple", "sorted", "reversed", "iter", "vars", "getattr", "dict"}
_METHODS = {"items", "values", "keys", "get"}


class _Taint:
    """Which expressions of one file denote megatron modules or classes; names are bound per function scope."""

    def __init__(self, tree: ast.Module, names_megatron: bool):
        self.names_megatron = names_megatron  # a string of the file names a megatron module
        self.parent: dict = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.tree = tree
        self.names: set[tuple[int, str]] = set()  # (id of the scope's node, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.add(node, {(a.asname or a.name.split(".")[0]) for a in node.names if a.name.startswith("megatron")})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                self.add(node, {a.asname or a.name for a in node.names})

    def scopes(self, node):
        """The scopes ``node`` sees, innermost first: its enclosing functions, then the module."""
        while node is not None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
                yield node
            node = self.parent.get(node)

    def add(self, node, names) -> None:
        scope = next(self.scopes(self.parent.get(node, node)))
        self.names |= {(id(scope), n) for n in names}

    def holds(self, e) -> bool:
        if isinstance(e, ast.Name):
            return any((id(s), e.id) in self.names for s in self.scopes(e))
        if isinstance(e, ast.Attribute):
            return (isinstance(e.value, ast.Name) and e.value.id == "sys" and e.attr == "modules") or self.holds(e.value)
        if isinstance(e, ast.Subscript):
            return self.holds(e.value)
        if isinstance(e, (ast.Tuple, ast.List)):
            return any(self.holds(x) for x in e.elts)
        if isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, (ast.Name, ast.Attribute)) and (getattr(f, "attr", None) or getattr(f, "id", None)) == "import_module":
                arg = e.args[0] if e.args else None
                return (arg.value.startswith("megatron") if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                        else self.names_megatron)
            if isinstance(f, ast.Name) and f.id in _PASS_THROUGH:
                return any(self.holds(a) for a in e.args[:1])
            if isinstance(f, ast.Attribute) and f.attr in _METHODS:
                return self.holds(f.value)
        return False

    def bind(self, target, value_holds: bool) -> None:
        if value_holds:
            self.add(target, {n.id for n in ast.walk(target) if isinstance(n, ast.Name)})


def _spread(tree: ast.Module, taint: _Taint) -> None:
    """Assignments, loops and comprehensions bind megatron values to names; calls bind them to parameters."""
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for _ in range(4):  # to a fixed point on these small files
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if not isinstance(t, ast.Attribute):  # an attribute set is a patch, not a binding
                        taint.bind(t, taint.holds(node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                taint.bind(node.target, taint.holds(node.iter))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
                fn = functions[node.func.id]
                for p, a in zip(fn.args.args, node.args):
                    if taint.holds(a):
                        taint.names.add((id(fn), p.arg))


def patches_megatron(path: Path) -> list[int]:
    """Lines of ``path`` that assign an attribute onto a megatron module or class."""
    text = path.read_text()
    tree = ast.parse(text)
    taint = _Taint(tree, names_megatron=bool(re.search(r"[\"']megatron\.", text)))
    _spread(tree, taint)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for t in targets if isinstance(t, ast.Attribute) and taint.holds(t.value)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and taint.holds(node.args[0]):
            lines.append(node.lineno)
    return sorted(lines)


def listed_in_design() -> set[str]:
    """The paths docs/design.md's "Where megatron is patched" paragraph names."""
    text = (ROOT / "docs" / "design.md").read_text()
    para = re.search(r"\*\*Where megatron is patched\*\*(.*?)\n\n", text, re.S)
    assert para, "docs/design.md has no **Where megatron is patched** paragraph"
    return set(re.findall(r"`(mimo_sft/[\w/]+\.py)`", para.group(1)))


def test_design_lists_every_module_that_patches_megatron():
    found = {str(p.relative_to(ROOT)): lines for p in sorted(PACKAGE.rglob("*.py")) if (lines := patches_megatron(p))}
    listed = listed_in_design()
    assert set(found) == listed, (f"patch megatron but not listed: "
                                  f"{ {k: v for k, v in found.items() if k not in listed} }; "
                                  f"listed but patch nothing found: {sorted(listed - set(found))}")


def test_the_finder_sees_each_way_of_patching(tmp_path):
    """Each pattern the modules use, and what is not a patch."""
    cases = {
        "from megatron.core import parallel_state\nparallel_state.x = 1\n": [2],
        "import importlib\nm = importlib.import_module('megatron.core.a')\nm.f = None\n": [3],
        "import importlib\nm = importlib.import_module('torch.nn')\nm.f = None\n": [],
        "import sys\nfor n, m in list(sys.modules.items()):\n    setattr(m, 'a', 1)\n": [3],
        "import importlib\nM = 'megatron.core.a'\ndef g(mod):\n    setattr(mod, 'x', 1)\ng(importlib.import_module(M))\n": [4],
        "import importlib\nfor n in ('megatron.a',):\n    o = getattr(importlib.import_module(n), 'C')\n    o.f = 1\n": [4],
        "from megatron.core.transformer import TransformerConfig\ncfg = TransformerConfig()\ncfg.x = 1\n": [],
        "import torch\ntorch.Tensor.type = None\n": [],
    }
    for k, (src, want) in enumerate(cases.items()):
        path = tmp_path / f"case{k}.py"
        path.write_text(src)
        assert patches_megatron(path) == want, (src, patches_megatron(path))
