"""The layering of docs/architecture.md, enforced on every import of every source module.

The scan reads each module's AST, so imports inside functions (the lazy ones) count as much as
module-level ones; relative imports are resolved to absolute names first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "kernels", "tasks", "flows", "bench")
ORCHESTRATION = ("prefect", "mlflow", "dvc")
# What each package may never import, directly or lazily.
FORBIDDEN = {
    "runtime": ("tasks", "flows", "bench", *ORCHESTRATION),  # the device side stands alone
    "kernels": ("runtime", "tasks", "flows", "bench", *ORCHESTRATION),  # numerics only, the bottom layer
    "tasks": ("flows", "bench"),  # stages are plain functions; flows wire them, bench measures them
    "flows": ("bench",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str, list[tuple[str, str]]]]:
    """(line, absolute module, [(name taken from it, local name)]) for every import statement in ``path``."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names if not alias.asname]
            found += [(node.lineno, alias.name.rpartition(".")[0], [(alias.name.rpartition(".")[2], alias.asname)])
                      for alias in node.names if alias.asname]  # import a.b as c: c is a.b
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((node.lineno, module, [(alias.name, alias.asname or alias.name) for alias in node.names]))
    return found


def source_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_every_import_respects_the_layering():
    offenders = []
    for path in source_modules():
        banned = FORBIDDEN.get(path.relative_to(ROOT).parts[0], ())
        for line, module, _ in imports(path):
            if module.split(".")[0] in banned:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert offenders == []


def test_no_private_name_crosses_a_module_boundary():
    """``from a.b import _x`` or ``a.b._x`` from another module: make the name public or keep it home."""
    offenders = []
    for path in source_modules():
        here = module_name(path)
        bound = {}  # local name -> project module it was imported as
        for line, module, names in imports(path):
            if module.split(".")[0] not in PACKAGES or module == here:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line} takes {module}.{n}" for n, _ in names if private(n)]
            if not names:
                bound[module.split(".")[0]] = module
            bound.update({local: f"{module}.{n}" for n, local in names})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and private(node.attr):
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in bound and value.id not in ("self", "cls"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {value.id}.{'.'.join(reversed(chain))}")
    assert offenders == []


def test_the_scan_resolves_relative_and_lazy_imports(tmp_path, monkeypatch):
    """The checker itself: a lazy import inside a function and a relative import are both seen."""
    pkg = tmp_path / "runtime" / "backends"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from ..engine import _check\n    import tasks.compile\n    import tasks.data as d\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imports(pkg / "x.py") == [
        (2, "runtime.engine", [("_check", "_check")]), (3, "tasks.compile", []), (4, "tasks", [("data", "d")])
    ]


def test_onnx_runtime_serving_path_does_not_import_torch():
    code = (
        "import sys; import runtime.backends.onnxruntime, runtime.adapter, runtime.generate, runtime.package, "
        "runtime.server, runtime.residents, runtime.pull, runtime.tokenizer, runtime.sampling, runtime.metrics, runtime.openai_api, "
        "runtime.http_app, runtime.http_server, runtime.generation, runtime.batcher, runtime.tuf_pull, "
        "runtime.channel_watch, runtime.device_state, runtime.health, "
        "runtime.__main__; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
