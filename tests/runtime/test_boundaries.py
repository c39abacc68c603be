"""The layering of docs/architecture.md, enforced on every import of every source module.

The scan (``import_graph_testkit``) reads each module's AST, so imports inside functions (the lazy ones)
count as much as module-level ones, and so do type-only ones here; relative imports are resolved to
absolute names first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from import_graph_testkit import PACKAGES, ROOT, imports, module_name, source_modules

ORCHESTRATION = ("prefect", "mlflow", "dvc")
# What each package may never import, directly or lazily.
FORBIDDEN = {
    "runtime": ("tasks", "flows", "bench", *ORCHESTRATION),  # the device side stands alone
    "kernels": ("runtime", "tasks", "flows", "bench", *ORCHESTRATION),  # numerics only, the bottom layer
    "tasks": ("flows", "bench"),  # stages are plain functions; flows wire them, bench measures them
    "flows": ("bench",),
}
# runtime's three packages, lowest first: each may import only those below it.
RUNTIME_PACKAGES = ("runtime.engine", "runtime.release", "runtime.serve")
# What verifying a release needs of the engine: the formats of the files a release carries (the adapter and
# its LoRA inputs, the interface it was made for), their hashes, and the errors and atomic writes every layer
# shares. The decode loop, sampling, the tokenizer and the backends are the server's business.
RELEASE_USES_OF_ENGINE = {
    "runtime.engine.adapter", "runtime.engine.adapter_config", "runtime.engine.atomic_files", "runtime.engine.errors",
    "runtime.engine.hashing", "runtime.engine.interface",
}


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


def runtime_package(module: str) -> str | None:
    return next((pkg for pkg in RUNTIME_PACKAGES if module == pkg or module.startswith(pkg + ".")), None)


def runtime_package_offences(root: Path = ROOT) -> list[str]:
    """Every import (type-only ones included) from one of runtime's packages into one above it, and every
    import of the engine by the release beyond ``RELEASE_USES_OF_ENGINE``."""
    files = {module_name(p, root) for p in (root / "runtime").rglob("*.py")}
    offences = []
    for path in sorted((root / "runtime").rglob("*.py")):
        here = runtime_package(module_name(path, root))
        if here is None:  # runtime/__init__.py and the command line (__main__) sit above all three
            continue
        for line, module, names in imports(path, root):
            for target in [f"{module}.{n}" for n, _ in names if f"{module}.{n}" in files] or [module]:
                there = runtime_package(target)
                where = f"{path.relative_to(root)}:{line} imports {target}"
                if there is not None and RUNTIME_PACKAGES.index(there) > RUNTIME_PACKAGES.index(here):
                    offences.append(f"{where}, above {here}")
                elif here == "runtime.release" and there == "runtime.engine" and target not in RELEASE_USES_OF_ENGINE:
                    offences.append(f"{where}, not needed to verify a release")
    return offences


def test_runtime_holds_only_its_three_packages_and_its_command():
    entries = {p.name for p in (ROOT / "runtime").iterdir() if p.name != "__pycache__"}
    assert entries == {"engine", "release", "serve", "__init__.py", "__main__.py"}


def test_each_runtime_package_imports_only_the_ones_below_it():
    """engine imports neither release nor serve; release imports of the engine only what verifying needs; serve both."""
    assert runtime_package_offences() == []


def test_the_package_rule_catches_an_import_up_and_a_release_reaching_into_the_decode_loop(tmp_path):
    for folder, text in {"engine": "from runtime.serve.server import X\n", "release": "from runtime.engine import generate\n",
                         "serve": "from runtime.release.contract import MANIFEST\nfrom runtime.engine.generate import g\n"}.items():
        (tmp_path / "runtime" / folder).mkdir(parents=True)
        (tmp_path / "runtime" / folder / "m.py").write_text(text)
    (tmp_path / "runtime" / "engine" / "generate.py").write_text("")
    assert runtime_package_offences(tmp_path) == [
        "runtime/engine/m.py:1 imports runtime.serve.server, above runtime.engine",
        "runtime/release/m.py:1 imports runtime.engine.generate, not needed to verify a release",
    ]


def test_the_scan_resolves_relative_and_lazy_imports(tmp_path):
    """The checker itself: a lazy import inside a function and a relative import are both seen."""
    pkg = tmp_path / "runtime" / "backends"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from ..engine import _check\n    import tasks.compile\n    import tasks.data as d\n")
    assert imports(pkg / "x.py", tmp_path) == [
        (2, "runtime.engine", [("_check", "_check")]), (3, "tasks.compile", []), (4, "tasks", [("data", "d")])
    ]


# Every module the ONNX Runtime serving path loads: `python -m runtime serve` and everything it verifies,
# pulls and serves with. Only the eager and TensorRT backends, the exported forward and its tracing take torch.
SERVING_PATH = (
    "runtime.__main__",
    *(f"runtime.engine.{m}" for m in ("adapter", "adapter_config", "atomic_files", "backbone_config", "engine", "errors",
                                      "generate", "hashing", "interface", "kv_blocks", "kv_pages", "latency", "sampling",
                                      "tokenizer", "backends.onnxruntime")),
    *(f"runtime.release.{m}" for m in ("contract", "device_state", "pull", "signing", "tuf_pull", "verify")),
    *(f"runtime.serve.{m}" for m in ("active_release", "batcher", "channel_watch", "generation", "health", "http_app",
                                     "http_server", "metrics", "openai_api", "residents", "server")),
)


def test_onnx_runtime_serving_path_does_not_import_torch():
    code = f"import sys; import {', '.join(SERVING_PATH)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_serve_without_an_update_channel_does_not_load_python_tuf():
    # the command and the HTTP server a device runs on a package alone (python-tuf and urllib3: ~20 MB imported alone)
    code = ("import sys; import runtime.__main__, runtime.serve.http_server; "
            "print(sorted(m for m in ('tuf', 'urllib3', 'runtime.serve.channel_watch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
