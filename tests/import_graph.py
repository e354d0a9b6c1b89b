"""The project's imports read from its source (AST, nothing is imported): every import
statement of a file, and the graph of which project module imports which, for the tests
of DESIGN §2's boundaries and of import cycles."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_SOURCE = {"tests"}  # top-level folders that are not the project's code


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # absolute dotted name; "" for a relative import that leaves the project
    names: tuple[str, ...] = ()  # what `from module import ...` takes; () for `import module`


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST, module: str, is_package: bool, type_checking: bool) -> Iterator[Import]:
    """Every import in `tree`, the source of `module`, those inside functions included;
    those under `if TYPE_CHECKING:` only when `type_checking`."""
    if isinstance(tree, ast.If) and not type_checking and _is_type_checking(tree.test):
        for node in tree.orelse:
            yield from imports(node, module, is_package, type_checking)
        return
    if isinstance(tree, ast.Import):
        for alias in tree.names:
            yield Import(tree.lineno, alias.name)
    elif isinstance(tree, ast.ImportFrom):
        yield Import(
            tree.lineno, _absolute(tree, module, is_package), tuple(a.name for a in tree.names)
        )
    for node in ast.iter_child_nodes(tree):
        yield from imports(node, module, is_package, type_checking)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    if keep <= 0:
        return ""
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted name, whether it is a package's __init__) of a source file under root."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def source_files(root: Path) -> list[Path]:
    """The project's Python files: those at the top and in its top-level folders (tests
    and hidden folders left out)."""
    files = sorted(root.glob("*.py"))
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if folder.name not in NOT_SOURCE and not folder.name.startswith("."):
            files += sorted(folder.rglob("*.py"))
    return files


@dataclass(frozen=True)
class Edge:
    target: str
    where: str  # "path:line" of the import


def import_graph(root: Path = ROOT) -> dict[str, list[Edge]]:
    """module -> the project modules its imports run (outside `if TYPE_CHECKING:`).
    `from pkg import name` runs pkg's __init__, and the submodule pkg.name when there is
    one; `import a.b` counts as an import of a.b alone (its parent packages run first,
    but a package's __init__ importing its own submodules is no cycle)."""
    files = {module_name(path, root): path for path in source_files(root)}
    modules = {name for name, _ in files}
    graph: dict[str, list[Edge]] = {}
    for (name, is_package), path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = graph.setdefault(name, [])
        for found in imports(tree, name, is_package, type_checking=False):
            targets = [found.module, *(f"{found.module}.{n}" for n in found.names)]
            where = f"{path.relative_to(root)}:{found.line}"
            edges += [Edge(t, where) for t in targets if t in modules and t != name]
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm),
    each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph.get(node, ()):
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)
