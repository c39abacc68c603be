"""The device side stays lean: no orchestration imports, and ONNX Runtime serving without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def test_runtime_imports_neither_prefect_mlflow_nor_dvc():
    offenders = []
    for path in sorted(RUNTIME.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in {"prefect", "mlflow", "dvc"}]
    assert offenders == []


def test_onnx_runtime_serving_path_does_not_import_torch():
    code = (
        "import sys; import runtime.backends.onnxruntime, runtime.adapter, runtime.generate; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=RUNTIME.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
