"""Print the package's import graph and its cycles, from the source alone (``ast``).

    python benchmarks/import_graph.py [PACKAGE_DIR]      # default: dsv4enc next to this folder

Each line is ``module -> imported modules``; an import inside a function is marked ``(local)``,
one under ``if TYPE_CHECKING:`` ``(types)``. Cycles are found over all imports that run, module
level and function-local alike (a function-local import does not remove a cycle, it only hides
it from the interpreter), then once more with the type-only imports (a module that names
another's types still depends on it). The exit status is 1 when there is a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


#: How a module is imported, strongest first: at module level, inside a function, for types.
KINDS = ("module", "local", "types")


def _imports(tree: ast.Module, package: str, modules: set[str]) -> dict[str, str]:
    """Package modules imported by ``tree``: name -> its strongest kind of import."""
    found: dict[str, str] = {}

    def note(name: str, kind: str) -> None:
        if name in modules and KINDS.index(kind) < KINDS.index(found.get(name, "types")) + 1:
            found[name] = kind

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                visit(child, "types")
            for child in node.orelse:
                visit(child, kind)
            return
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = node.module or ""
            names = [base] if base else [alias.name for alias in node.names]
            if base:  # "from .x import y": y may itself be a module (from . import x)
                names += [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                note(name, kind)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                note(alias.name.removeprefix(f"{package}."), kind)
        inner = kind
        if kind == "module" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda)):
            inner = "local"
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, "module")
    return found


def import_graph(package_dir: Path) -> dict[str, dict[str, str]]:
    modules = {p.stem for p in package_dir.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name in sorted(modules):
        tree = ast.parse((package_dir / f"{name}.py").read_text())
        graph[name] = _imports(tree, package_dir.name, modules)
    return graph


def cycles(graph: dict[str, dict[str, str]], kinds: tuple[str, ...]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, kind in graph[v].items():
            if kind not in kinds:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def main(argv: list[str]) -> int:
    package_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "dsv4enc"
    graph = import_graph(package_dir)
    for name, deps in graph.items():
        shown = [d if kind == "module" else f"{d} ({kind})" for d, kind in sorted(deps.items())]
        print(f"{name} -> {', '.join(shown) or '-'}")
    status = 0
    for title, kinds in (("imports that run", ("module", "local")),
                         ("with type-only imports", KINDS)):
        found = cycles(graph, kinds)
        print(f"\ncycles over {title}: {len(found) or 'none'}")
        for component in found:
            print("  " + " <-> ".join(component))
        status = status or int(bool(found))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
