"""No two modules of the project share a file name: a name says what a module holds, and two modules that
hold different things need different names (a reader, a traceback or `grep` shows the file name alone)."""

from __future__ import annotations

from collections import defaultdict

from import_graph_testkit import ROOT, source_modules

# Names that mean the same thing wherever they are: a package, a package's command, pytest's hooks.
ROLE_NAMES = {"__init__.py", "__main__.py", "conftest.py"}


def shared_file_names(root=ROOT) -> dict[str, list[str]]:
    where = defaultdict(list)
    for path in [*source_modules(root), *sorted((root / "tests").rglob("*.py"))]:
        if path.name not in ROLE_NAMES:
            where[path.name].append(path.relative_to(root).as_posix())
    return {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}


def test_no_two_modules_share_a_file_name():
    assert shared_file_names() == {}


def test_the_check_names_both_files_of_a_shared_name(tmp_path):
    for path in ("tasks/package.py", "runtime/release/package.py", "runtime/__init__.py", "tasks/__init__.py",
                 "tests/conftest.py", "tests/runtime/conftest.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert shared_file_names(tmp_path) == {"package.py": ["runtime/release/package.py", "tasks/package.py"]}
