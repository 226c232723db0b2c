"""The structure figures of issue 37, counted the same way before and after a change:

    python tools/structure_report.py [REPO_ROOT]

- cross-package import cycles (elementary cycles of the package graph, every import counted, function-level
  ones included, TYPE_CHECKING ones not);
- upward imports: module imports that climb the layers of pyproject.toml's import-linter contract;
- imports inside functions;
- private reach-ins: ``x._name`` on another object than ``self`` / ``cls`` (or the module's own names), and
  ``from m import _name`` from another module;
- lines and files of Python under tallyserve/, environment variables, files in docs/ and benchmarks/, README lines.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

# stdlib / library attributes whose names start with "_" by their own API
_PUBLIC_PRIVATE = {"_exit", "_getframe", "_replace", "_asdict", "_fields", "_make", "_field_defaults", "_queue",
                   "_C", "_dynamo", "_inductor", "_prims", "_subclasses", "_refs", "_utils", "_ops", "_library",
                   "_api", "_fields_set", "_get_current_dispatch_mode"}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _imports(root: Path):
    """(importer, imported, line, inside a function) for every tallyserve import outside TYPE_CHECKING."""
    out = []
    for path in sorted((root / "tallyserve").rglob("*.py")):
        mod = _module_name(root, path)
        tree = ast.parse(path.read_text())

        def walk(node, infunc, tc):
            for ch in ast.iter_child_nodes(node):
                f2 = infunc or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef))
                tc2 = tc or (isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test))
                if not tc:
                    if isinstance(ch, ast.ImportFrom) and ch.module and ch.module.startswith("tallyserve"):
                        for a in ch.names:
                            out.append((mod, f"{ch.module}.{a.name}", ch.lineno, infunc))
                    elif isinstance(ch, ast.Import):
                        for a in ch.names:
                            if a.name.startswith("tallyserve"):
                                out.append((mod, a.name, ch.lineno, infunc))
                walk(ch, f2, tc2)

        walk(tree, False, False)
    return out


def _layers() -> dict[str, int]:
    """Package -> its layer (0 at the top), from this checkout's import-linter contract (also when counting another tree)."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    m = re.search(r"layers = \[(.*?)\]", text, re.S)
    rank = {}
    if m:
        for i, line in enumerate(re.findall(r'"([^"]+)"', m.group(1))):
            for name in line.split("|"):
                rank[name.strip().split(".", 1)[1]] = i
    return rank


def _cycles(edges: dict[str, set[str]]) -> tuple[list[list[str]], list[set[str]]]:
    """(the elementary cycles of the package graph, its strongly connected components of two or more packages)."""
    import networkx as nx

    g = nx.DiGraph([(a, b) for a in edges for b in edges[a]])
    return list(nx.simple_cycles(g)), [c for c in nx.strongly_connected_components(g) if len(c) > 1]


def _own_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: its classes, functions and methods, and the attributes it assigns."""
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                if isinstance(t, ast.Attribute):
                    names.add(t.attr)
                elif isinstance(t, ast.Name):
                    names.add(t.id)
    return names


def _reach_ins(root: Path) -> list[str]:
    """Private names used across modules (one module's ``_x`` read or written by another)."""
    found = []
    for path in sorted((root / "tallyserve").rglob("*.py")):
        tree = ast.parse(path.read_text())
        local = _own_names(tree)
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and (base.id in ("self", "cls", "super") or base.id in defined):
                    continue
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                    continue
                if node.attr in _PUBLIC_PRIVATE or node.attr in local or ast.unparse(base).startswith("torch.ops"):
                    continue
                found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tallyserve"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{path.relative_to(root)}:{node.lineno} from {node.module} import {a.name}")
    return found


def report(root: Path) -> dict:
    imports = _imports(root)
    edges: dict[str, set[str]] = defaultdict(set)
    rank = _layers()
    upward = []
    for src, dst, line, _ in imports:
        a, b = _package(src), _package(dst)
        if a != b:
            edges[a].add(b)
            if a in rank and b in rank and rank[b] < rank[a]:
                upward.append(f"{src}:{line} -> {dst}")
    py = list((root / "tallyserve").rglob("*.py"))
    envs = set(re.findall(r"TALLYSERVE_[A-Z0-9_]+", " ".join(
        p.read_text() for p in (root / "tallyserve").rglob("*") if p.suffix in (".py", ".cpp", ".h"))))
    envs -= {"TALLYSERVE_PAUSE", "TALLYSERVE_HAVE_AMX", "TALLYSERVE_HEADERS", "TALLYSERVE_X"}  # C++ macros, a doc
    cycles, tangles = _cycles(edges)
    return {
        "cross_package_cycles": cycles,
        "packages_tangled_in_cycles": tangles,
        "upward_imports": upward,
        "function_level_import_statements": len({(src, line) for src, _, line, f in imports if f}),
        "private_reach_ins": _reach_ins(root),
        "tallyserve_python_files": len(py),
        "tallyserve_python_lines": sum(len(p.read_text().splitlines()) for p in py),
        "environment_variables": sorted(envs),
        "docs_files": sum(1 for p in (root / "docs").rglob("*") if p.is_file()),
        "benchmarks_python_files": sum(1 for p in (root / "benchmarks").glob("*.py")),
        "benchmarks_results_files": sum(1 for p in (root / "benchmarks" / "results").glob("*") if p.is_file()),
        "readme_lines": len((root / "README.md").read_text().splitlines()),
    }


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    r = report(root)
    for key, value in r.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"    {item}")
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
