"""Every name a docstring of the package writes in double backticks resolves.

The rule, for each ````span```` in a module's, class's or function's docstring (whitespace
inside a span, from a wrapped line, is dropped):

- A *dotted name* (``a.b``, ``a.b.c``, ``a.b()``, ``a.``) and a *path name*
  (``output/parts``, ``output/parts.write_part``) must resolve. The head is looked up, in
  order: a path from the package's root (``images/headers.Planned``); ``dsv4enc.…``; a
  parameter of the documented function (its annotated type, when it has one); ``self``/``cls``
  (the enclosing class); the module's own names (``Class.method``, an imported ``pq.…``); a
  module of the same wing (``parts.write_part`` from ``output/``); a module of the package by
  its last name (``headers.Planned``); an importable top-level module (``torch.dtype``). The
  rest is read attribute by attribute; a class also has its annotated fields and the
  ``self.X`` it assigns, a module its submodules.
- A *bare name* is checked when it reads as a class (``CamelCase``) or a call (``name()``):
  it must be a name of the module, of the enclosing class, a parameter, a builtin, or a module
  of the package. Other bare spans (a parameter, a column, a field, an option's value,
  ``None``) are words of the text and are not checked.
- Not names, and not checked: spans with other characters (``(x - 0.5) / 0.5``, ``s3://``),
  file names (a last part that is a file suffix: ``_manifest.json``, ``model.py``), and
  placeholders (an upper-case head: ``OUT.partial/``, ``FOLDER/go``).
"""
from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import pathlib
import re
import typing

import pytest

import dsv4enc

PACKAGE = pathlib.Path(dsv4enc.__file__).parent
FILE_SUFFIXES = {"json", "journal", "parquet", "py", "md", "safetensors", "jpg", "jpeg", "png",
                 "tar", "gz", "tgz", "partial", "go", "lock", "arrow", "txt", "npy", "webp"}
NAME = re.compile(r"[A-Za-z_]\w*")
DOTTED = re.compile(r"(?:[a-z_]\w*/)*[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\.?(?:\(\))?")
MISSING = object()
WINGS = {"dsv4enc"} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("dsv4enc",) + path.relative_to(PACKAGE).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = module_names()


def class_members(cls: type) -> set[str]:
    """A class's attributes that ``getattr`` misses: its annotated fields and ``self.X = ...``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        names.update(getattr(klass, "__slots__", ()))
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())
        except (OSError, TypeError, SyntaxError, IndentationError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


def attribute(obj: object, name: str) -> object:
    value = getattr(obj, name, MISSING)
    if value is not MISSING:
        return value
    if inspect.ismodule(obj):
        try:
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ImportError:
            return MISSING
    if inspect.isclass(obj) and name in class_members(obj):
        return None  # a field or an instance attribute: it exists, its value is unknown
    return MISSING


def resolve_rest(obj: object, rest: list[str]) -> bool:
    for name in rest:
        if obj is None:
            return True  # past a field whose value is unknown: the field itself resolved
        obj = attribute(obj, name)
        if obj is MISSING:
            return False
    return True


def package_module(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError:
        return MISSING


def imported(module: object) -> dict[str, object]:
    """The names ``module`` imports only for a type checker (``if TYPE_CHECKING:``)."""
    names: dict[str, object] = {}
    for node in ast.walk(ast.parse(pathlib.Path(module.__file__).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            package = module.__name__ if hasattr(module, "__path__") else \
                module.__name__.rpartition(".")[0]
            base = package_module(importlib.util.resolve_name(
                "." * node.level + (node.module or ""), package))
            for alias in node.names:
                names[alias.asname or alias.name] = attribute(base, alias.name) \
                    if base is not MISSING else MISSING
    return {name: obj for name, obj in names.items() if obj is not MISSING}


def heads(head: str, scope: Scope) -> list[object]:
    """What the first part of a dotted name may be, in the order the rule gives."""
    found = []
    if head in scope.params:
        found.append(scope.params[head])
    if head in ("self", "cls") and scope.cls is not None:
        found.append(scope.cls)
    value = getattr(scope.module, head, imported(scope.module).get(head, MISSING))
    if value is not MISSING:
        found.append(value)
    wing = scope.module.__name__ if hasattr(scope.module, "__path__") else \
        scope.module.__name__.rpartition(".")[0]
    for name in [f"{wing}.{head}"] + [m for m in MODULES if m.rpartition(".")[2] == head]:
        if name in MODULES:
            found.append(package_module(name))
    if scope.cls is not None and attribute(scope.cls, head) is not MISSING:
        found.append(attribute(scope.cls, head))
    if not found and hasattr(builtins, head):
        found.append(getattr(builtins, head))
    found.append(package_module(head))
    return [obj for obj in found if obj is not MISSING]


class Scope(typing.NamedTuple):
    module: object
    cls: type | None
    params: dict[str, object]  # a parameter's annotated type, or None when it has none


def resolves(span: str, scope: Scope) -> bool:
    span = span.removesuffix("()").removesuffix(".")
    path, _, dotted = span.removeprefix("dsv4enc/").rpartition("/")
    parts = dotted.split(".")
    if path or "/" in span:
        folders = ["dsv4enc"] + (path.split("/") if path else [])
        module_name = ".".join(folders + ([] if parts[0] == "__init__" else parts[:1]))
        module = package_module(module_name)
        return module is not MISSING and resolve_rest(module, parts[1:])
    if parts[0] == "dsv4enc":
        return resolve_rest(dsv4enc, parts[1:])
    for obj in heads(parts[0], scope):
        if obj is None or resolve_rest(obj, parts[1:]):
            return True
    return False


def checked(span: str) -> bool:
    """Whether ``span`` is a name the rule checks (see the module's docstring)."""
    if not DOTTED.fullmatch(span):
        return False
    bare = "." not in span.removesuffix(".") and "/" not in span
    if bare:
        word = span.removesuffix("()")
        camel = word[0].isupper() and any(ch.islower() for ch in word) and "_" not in word
        return span.endswith("()") or camel
    head = re.split(r"[./]", span)[0]
    if "/" in span and head not in WINGS:
        return False  # a path of the user's: owner/name, dir/sample
    if head.isupper() and len(head) > 1:
        return False  # a placeholder: OUT.partial, FOLDER/go
    last = span.removesuffix("()").rstrip(".").rsplit(".", 1)[-1]
    return not ("." in span.removesuffix(".") and last in FILE_SUFFIXES)


def parameters(module: object, cls: type | None, node: ast.AST) -> dict[str, object]:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    owner = cls if cls is not None else module
    func = inspect.unwrap(getattr(owner, node.name, None) or (lambda: None))
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # a hint that names what only a type checker imports
        hints = {}
    return {name: hints.get(name) if inspect.isclass(hints.get(name)) else None
            for name in names if name not in ("self", "cls")}


def docstring_spans(modname: str):
    module = importlib.import_module(modname)
    path = pathlib.Path(module.__file__)
    tree = ast.parse(path.read_text())

    def visit(node: ast.AST, cls: type | None):
        doc = ast.get_docstring(node, clean=False) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if doc:
            scope = Scope(module, cls, parameters(module, cls, node))
            for span in re.findall(r"``(.+?)``", doc, flags=re.S):
                yield node, re.sub(r"(?<=[./])\s*\n\s*", "", span), scope
        for child in ast.iter_child_nodes(node):
            inner = cls
            if isinstance(child, ast.ClassDef):
                owner = cls if cls is not None else module
                inner = getattr(owner, child.name, None)
                inner = inner if inspect.isclass(inner) else None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = None if isinstance(child, ast.ClassDef) else cls
            yield from visit(child, inner)

    yield from visit(tree, None)


@pytest.mark.parametrize("modname", MODULES)
def test_docstring_names_resolve(modname):
    bad = [f"line {getattr(node, 'lineno', 1)}: ``{span}``"
           for node, span, scope in docstring_spans(modname)
           if checked(span) and not resolves(span, scope)]
    assert not bad, f"{modname}: names that do not resolve:\n" + "\n".join(bad)


def test_no_spec_references():
    cited = [f"{path.relative_to(PACKAGE)}:{number}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bSPEC\b", line)]
    assert not cited, "the package cites a document it does not ship: " + ", ".join(cited)


@pytest.mark.parametrize("span, expected", [
    ("output/parts.write_part", True), ("parts.write_part", True), ("dsv4enc/__init__", True),
    ("run/pipeline", True), ("dsv4enc.storage.stamp", True), ("torch.dtype", True),
    ("images/headers.Planned", True), ("run/ranks.Topology.agree_on_todo", True),
    ("writer.Row", False), ("parts.NoSuchThing", False), ("output/nothing", False),
])
def test_the_rule_itself(span, expected):
    scope = Scope(importlib.import_module("dsv4enc.output.layout"), None, {})
    assert checked(span) and resolves(span, scope) is expected


@pytest.mark.parametrize("span", ["_manifest.json", "OUT.partial/", "FOLDER/go", "owner/name",
                                  "s3://", "(x - 0.5) / 0.5", "binary", "key_column"])
def test_words_and_files_are_not_checked(span):
    assert not checked(span)


def test_a_bare_class_name_must_be_the_modules():
    scope = Scope(importlib.import_module("dsv4enc.output.commit"), None, {})
    assert checked("PartWriter") and resolves("PartWriter", scope)
    assert checked("NoSuchWriter") and not resolves("NoSuchWriter", scope)
