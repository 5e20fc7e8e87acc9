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


def _imports(tree: ast.Module, package: str, modules: set[str],
             here: str = "") -> dict[str, str]:
    """Package modules imported by ``tree``: name -> its strongest kind of import.

    ``here`` is the dotted subpackage that holds the module ("" at the package top), against
    which relative imports are resolved; names are dotted below the package ("output.parts").
    """
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
        if isinstance(node, ast.ImportFrom) and (node.level >= 1 or (node.module or "")
                                                  .split(".")[0] == package):
            parts = here.split(".") if here else []
            if node.level >= 1:
                parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module.removeprefix(package).lstrip(".")
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


def _module_name(package_dir: Path, path: Path) -> str:
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package_dir: Path) -> dict[str, dict[str, str]]:
    files = {_module_name(package_dir, p): p for p in sorted(package_dir.rglob("*.py"))}
    files.pop("", None)  # the package's own __init__ (lazy names only)
    modules = set(files)
    graph = {}
    for name in sorted(modules):
        path = files[name]
        here = name if path.stem == "__init__" else name.rpartition(".")[0]
        graph[name] = _imports(ast.parse(path.read_text()), package_dir.name, modules, here)
        graph[name].pop(name, None)
    return graph


def floors(graph: dict[str, dict[str, str]]) -> int:
    """The longest chain of imports that run, counted in modules (1: nothing imports)."""
    depth: dict[str, int] = {}

    def floor(v: str, seen: tuple[str, ...] = ()) -> int:
        if v not in depth:
            below = [floor(w, (*seen, v)) for w, kind in graph[v].items()
                     if kind != "types" and w not in seen]
            depth[v] = 1 + max(below, default=0)
        return depth[v]

    return max((floor(v) for v in graph), default=0)


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


def long_functions(package_dir: Path, limit: int = 100) -> list[tuple[str, int]]:
    """Functions (and methods) longer than ``limit`` lines, with their lengths."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((f"{_module_name(package_dir, path)}.{node.name}", lines))
    return sorted(found)


def private_imports(package_dir: Path, *others: Path) -> list[str]:
    """``from X import _name`` where X is one of the package's modules other than the
    importing file (``_name`` not a dunder), in the package and in ``others`` (tests)."""
    found = []
    for folder in (package_dir, *others):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (
                        node.level or (node.module or "").split(".")[0] == package_dir.name):
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            found.append(f"{path.relative_to(folder.parent)}:{node.lineno} "
                                         f"{'.' * node.level}{node.module or ''}.{alias.name}")
    return found


def main(argv: list[str]) -> int:
    package_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "dsv4enc"
    graph = import_graph(package_dir)
    for name, deps in graph.items():
        shown = [d if kind == "module" else f"{d} ({kind})" for d, kind in sorted(deps.items())]
        print(f"{name} -> {', '.join(shown) or '-'}")
    arrows = sum(len(deps) for deps in graph.values())
    print(f"\nmodules: {len(graph)} ({sum('.' not in m for m in graph)} at the top), "
          f"arrows: {arrows}, floors: {floors(graph)}")
    longest = long_functions(package_dir)
    print(f"functions over 100 lines: {len(longest) or 'none'}"
          + "".join(f"\n  {name} ({lines})" for name, lines in longest))
    tests = package_dir.parent / "tests"
    private = private_imports(package_dir, *([tests] if tests.is_dir() else []))
    print(f"private cross-module imports: {len(private) or 'none'}"
          + "".join(f"\n  {line}" for line in private))
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
