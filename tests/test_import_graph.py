"""No import circle anywhere in the project: runtime/, kernels/, tasks/, flows/, bench/ and tests/.

The graph is read from the AST of every module (``import_graph_testkit``): module-level and lazy imports,
relative ones resolved, and type-only ones (under ``if TYPE_CHECKING:``) too: they never run, but a module
that names another's types for its signatures depends on it all the same. A circle is a sign that a shared
piece wants a home of its own below the modules that share it. One link is allowed, listed below.
"""

from __future__ import annotations

from collections.abc import Collection

from import_graph_testkit import import_cycles, import_graph, loop_through, project_modules

# The project's one deliberate two-way link, type-only: a ReleaseGate (runtime.serve.health) drives the server
# and registers itself in ``AdapterServer.gates``, and ``AdapterServer.load`` calls back into it in the middle
# of a load (floor, admit, begin); server.py imports ReleaseGate under TYPE_CHECKING only, to name its type.
ALLOWED_LINKS = {("runtime.serve.server", "runtime.serve.health")}


def circles(graph: dict[str, set[str]], allowed: Collection[tuple[str, str]] = ()) -> list[str]:
    """Every circle of ``graph`` without the ``allowed`` links (importer, imported), named by one loop and its modules."""
    graph = {module: targets - {b for a, b in allowed if a == module} for module, targets in graph.items()}
    return [f"{' -> '.join(loop_through(graph, members))} (a circle of {len(members)}: {', '.join(members)})"
            for members in import_cycles(graph)]


def test_no_module_of_the_project_takes_part_in_an_import_circle():
    assert circles(import_graph(project_modules()), ALLOWED_LINKS) == []


def test_each_allowed_link_is_still_there_and_type_only():
    """A link gone leaves the list; a link imported when its module runs would be a circle Python itself trips on."""
    modules = project_modules()
    every, running = import_graph(modules), import_graph(modules, runtime_only=True)
    assert [(a, b) for a, b in sorted(ALLOWED_LINKS) if b not in every[a] or b in running[a]] == []


def test_the_check_names_planted_circles_of_lazy_relative_and_type_only_imports(tmp_path):
    """a imports b inside a function, b imports a relatively: a circle. c imports d, and d imports c only for
    type checking: a circle too, unless that link is allowed."""
    pkg = tmp_path / "tasks"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from tasks import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "c.py").write_text("import tasks.d\n\nC = 1\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from tasks.c import C\n")
    modules = project_modules(tmp_path)
    graph = import_graph(modules, tmp_path)
    assert graph == {"tasks.a": {"tasks.b"}, "tasks.b": {"tasks.a"}, "tasks.c": {"tasks.d"}, "tasks.d": {"tasks.c"}}
    lazy_and_relative = "tasks.a -> tasks.b -> tasks.a (a circle of 2: tasks.a, tasks.b)"
    assert circles(graph) == [lazy_and_relative, "tasks.c -> tasks.d -> tasks.c (a circle of 2: tasks.c, tasks.d)"]
    assert circles(graph, {("tasks.d", "tasks.c")}) == [lazy_and_relative]
    assert import_graph(modules, tmp_path, runtime_only=True)["tasks.d"] == set()


def test_the_check_finds_a_circle_of_three_and_a_chain_too_deep_for_recursion():
    chain = {f"m{i}": {f"m{i + 1}"} for i in range(5000)} | {"m5000": set()}
    ring = {"x": {"y"}, "y": {"z"}, "z": {"x", "m0"}}
    assert circles(chain | ring) == ["x -> y -> z -> x (a circle of 3: x, y, z)"]
