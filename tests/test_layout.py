"""The package's shape, as STYLE.md rules 1-1c and issue 19 set it, checked on the source.

- no class with more than two bases (parts are held through contracts, not mixins);
- no function over 80 lines, no module over 600;
- the rooms of ``process/`` import only rooms below them, in this order: the trap engine,
  program calls, fetch-args, the fast tier, survival (the ending), following the program,
  then the top-level modules (``Process`` and what builds it). The fast tier depends on the
  engine, never the other way round;
- no import loop between modules at run time. A back-reference written for the type checker
  only (``if TYPE_CHECKING:``: a part naming the object that holds it, a thread its process)
  is allowed (docs/decisions.md, "Parts and contracts in process/").
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kprobes"
ROOMS = ["engine", "inject", "fetch", "fast", "survival", "following", ""]  # "": top level
MAX_FUNCTION = 80
MAX_MODULE = 600


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported module of ours, is it for the type checker only) of every import."""
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            typing_only.update(id(inner) for inner in ast.walk(node))
    package = name if name in modules and _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in modules else base
                if target in modules:
                    out.append((target, id(node) in typing_only))
        elif isinstance(node, ast.Import):
            out += [(a.name, id(node) in typing_only) for a in node.names if a.name in modules]
    return out


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _room(name: str) -> int | None:
    parts = name.split(".")
    if parts[:2] != ["kprobes", "process"] or len(parts) == 2:
        return None
    return ROOMS.index(parts[2]) if len(parts) > 3 or parts[2] in ROOMS[:-1] else len(ROOMS) - 1


def test_no_class_has_more_than_two_bases() -> None:
    wide = [
        f"{name}.{node.name} ({len(node.bases)} bases)"
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and len(node.bases) > 2
    ]
    assert wide == []


def test_no_function_or_module_is_too_long() -> None:
    long = []
    for name, tree in _modules().items():
        lines = max((getattr(n, "end_lineno", 0) or 0) for n in ast.walk(tree))
        if lines > MAX_MODULE:
            long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION:
                    long.append(f"{name}.{node.name}: {size} lines")
    assert long == []


def test_the_rooms_of_process_import_only_rooms_below_them() -> None:
    modules = _modules()
    names = set(modules)
    upward = []
    for name, tree in modules.items():
        room = _room(name)
        if room is None:
            continue
        for target, _typing_only in _imports(name, tree, names):
            other = _room(target)
            if other is not None and other > room:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_import_loop_at_run_time() -> None:
    modules = _modules()
    names = set(modules)
    graph = {
        name: {t for t, typing_only in _imports(name, tree, names) if not typing_only}
        for name, tree in modules.items()
    }
    # A module's package (its __init__) is imported before it: not an edge of a loop.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    loops = _cycles(graph)
    assert loops == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
