"""The project's imports read from the AST of every module: the scan the layering and import-cycle tests share.

An import counts wherever it is: at module level, inside a function (a lazy import) or under
``if TYPE_CHECKING:`` (a type-only one: it never runs, but its module still names the other, so a type-only
back-reference closes a circle too), relative ones resolved to absolute names first. ``runtime_only`` leaves
the type-only ones out, to tell them apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "kernels", "tasks", "flows", "bench")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.py"))


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, runtime_only: bool):
    """Every Import / ImportFrom node; with ``runtime_only``, none from the body of an ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if runtime_only and _type_checking_block(child):
                stack.extend(child.orelse)  # the else branch does run
            else:
                stack.append(child)


def imports(path: Path, root: Path = ROOT, runtime_only: bool = False) -> list[tuple[int, str, list[tuple[str, str]]]]:
    """(line, absolute module, [(name taken from it, local name)]) for every import statement in ``path``,
    in line order; with ``runtime_only``, those under ``if TYPE_CHECKING:`` left out."""
    package = module_name(path, root) if path.name == "__init__.py" else module_name(path, root).rpartition(".")[0]
    found = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), runtime_only):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names if not alias.asname]
            found += [(node.lineno, alias.name.rpartition(".")[0], [(alias.name.rpartition(".")[2], alias.asname)])
                      for alias in node.names if alias.asname]  # import a.b as c: c is a.b
        else:
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((node.lineno, module, [(alias.name, alias.asname or alias.name) for alias in node.names]))
    return sorted(found, key=lambda record: record[0])


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project by the name it is imported as: the packages' by their dotted names, the
    tests' by their file's stem (pytest puts each test folder on ``sys.path``: ``import engine_testkit``)."""
    modules = {module_name(p, root): p for p in source_modules(root)}
    for path in sorted((root / "tests").rglob("*.py")):
        name = module_name(path, root) if path.name == "conftest.py" else path.stem  # a conftest is never imported
        assert name not in modules, f"{path} and {modules.get(name)} would both be imported as {name}"
        modules[name] = path
    return modules


def import_graph(modules: dict[str, Path], root: Path = ROOT, runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the modules of ``modules`` it imports, type-only imports included unless ``runtime_only``
    (``from a import b`` of a submodule b is an arrow to ``a.b``; ``import a.b`` or ``import a.b as c`` to ``a.b``)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for _, module, names in imports(path, root, runtime_only):
            submodules = {f"{module}.{n}" for n, _ in names if f"{module}.{n}" in modules}
            targets |= submodules
            if not names or len(submodules) < len(names):  # `import module`, or names defined in the module itself
                owner = next((m for m in (module, *_parents(module)) if m in modules), None)
                if owner is not None:
                    targets.add(owner)
        graph[name] = targets - {name}
    return graph


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of two or more modules (Tarjan), each
    as its sorted modules. ``loop_through`` names one loop in it."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(start: str) -> None:  # iterative: a deep chain of imports must not hit the recursion limit
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(components)


def loop_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """The shortest loop of imports from the circle's first module back to itself (breadth-first), the
    first module repeated at the end: ``[a, b, a]`` for a circle of a and b."""
    start, component = min(component), set(component)
    came_from = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if succ not in came_from:
                    came_from[succ] = node
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")
