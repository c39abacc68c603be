"""No import circle anywhere in the project: runtime/, kernels/, tasks/, flows/, bench/ and tests/.

The graph is read from the AST of every module (``import_graph_testkit``): module-level and lazy imports,
relative ones resolved; imports under ``if TYPE_CHECKING:`` never run and are left out. A circle is a
sign that a shared piece wants a home of its own below the modules that share it.
"""

from __future__ import annotations

from import_graph_testkit import import_cycles, import_graph, loop_through, project_modules


def circles(graph: dict[str, set[str]]) -> list[str]:
    return [f"{' -> '.join(loop_through(graph, members))} (a circle of {len(members)}: {', '.join(members)})"
            for members in import_cycles(graph)]


def test_no_module_of_the_project_takes_part_in_an_import_circle():
    assert circles(import_graph(project_modules())) == []


def test_the_check_names_a_planted_circle_of_lazy_and_relative_imports(tmp_path):
    """a imports b inside a function, b imports a relatively: a circle. c imports a, and a imports c only
    for type checking: no circle."""
    pkg = tmp_path / "tasks"
    pkg.mkdir()
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from tasks.c import C\n\n\n"
                              "def f():\n    from tasks import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "c.py").write_text("import tasks.a\n\nC = 1\n")
    graph = import_graph(project_modules(tmp_path), tmp_path)
    assert graph == {"tasks.a": {"tasks.b"}, "tasks.b": {"tasks.a"}, "tasks.c": {"tasks.a"}}
    assert circles(graph) == ["tasks.a -> tasks.b -> tasks.a (a circle of 2: tasks.a, tasks.b)"]


def test_the_check_finds_a_circle_of_three_and_a_chain_too_deep_for_recursion():
    chain = {f"m{i}": {f"m{i + 1}"} for i in range(5000)} | {"m5000": set()}
    ring = {"x": {"y"}, "y": {"z"}, "z": {"x", "m0"}}
    assert circles(chain | ring) == ["x -> y -> z -> x (a circle of 3: x, y, z)"]
