"""DESIGN §2: no import circle anywhere. The graph is read from the source (every import
that runs, those inside functions included, those under `if TYPE_CHECKING:` left out); a
submodule that imports its own package (`from pkg import sibling`) closes a circle
through the package's __init__."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import Edge, cycles, import_graph


def describe(graph: dict[str, list[Edge]], cycle: list[str]) -> str:
    inside = [
        f"    {module} -> {edge.target} ({edge.where})"
        for module in cycle
        for edge in graph[module]
        if edge.target in cycle
    ]
    return "\n".join([" <-> ".join(cycle), *inside])


def test_the_project_has_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)


def test_cycles_are_the_strongly_connected_components_of_several_modules():
    graph = {
        "a": ["b"],
        "b": ["c", "d"],
        "c": ["a"],
        "d": ["e"],
        "e": ["d", "f"],
        "f": [],
        "g": ["g", "a"],  # a self-import is no circle between modules
    }
    edges = {m: [Edge(t, f"{m}.py:1") for t in targets] for m, targets in graph.items()}
    assert cycles(edges) == [["a", "b", "c"], ["d", "e"]]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_submodule_importing_its_own_package_is_a_cycle_through_the_init(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.client import Client\n",
            "pkg/client.py": "def make():\n    from pkg import steps\n",
            "pkg/steps.py": "",
        },
    )
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["pkg", "pkg.client"]]
    assert graph["pkg.client"] == [
        Edge("pkg", "pkg/client.py:2"),
        Edge("pkg.steps", "pkg/client.py:2"),
    ]


def test_relative_imports_resolve_and_siblings_imported_directly_are_no_cycle(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from . import a\nfrom .sub import b\n",
            "pkg/a.py": "import os\nfrom pkg.sub.b import B\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "from ..a import A\n",
            "top.py": "import pkg.sub.b\n",
        },
    )
    graph = import_graph(tmp_path)
    assert {m: [e.target for e in edges] for m, edges in graph.items()} == {
        "pkg": ["pkg.a", "pkg.sub", "pkg.sub.b"],
        "pkg.a": ["pkg.sub.b"],
        "pkg.sub": [],
        "pkg.sub.b": ["pkg.a"],
        "top": ["pkg.sub.b"],
    }
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_imports_under_type_checking_are_left_out(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/layer.py": "from pkg.backend import Backend\n",
            "pkg/backend.py": (
                "import typing\nfrom typing import TYPE_CHECKING\n\n"
                "if TYPE_CHECKING:\n    from pkg.layer import Layer\n"
                "if typing.TYPE_CHECKING:\n    import pkg.layer\n"
                "else:\n    import pkg.other\n"
            ),
            "pkg/other.py": "",
        },
    )
    graph = import_graph(tmp_path)
    assert [e.target for e in graph["pkg.backend"]] == ["pkg.other"]
    assert cycles(graph) == []
