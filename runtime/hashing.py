"""Content hash of a backbone, the identity every adapter and engine is bound to."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open


def backbone_hash(model_dir: str | Path) -> str:
    """sha256 over the architecture config and every weight tensor (name, dtype, shape, bytes).

    Hashing tensors rather than files makes the identity independent of how the
    safetensors file was laid out or sharded, and of metadata such as timestamps.
    """
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    # Only fields that change the function the weights compute; bookkeeping such as
    # transformers_version or dtype spelling must not change the identity.
    ignored = {"transformers_version", "torch_dtype", "dtype", "_name_or_path", "architectures"}
    digest.update(json.dumps({k: v for k, v in config.items() if k not in ignored}, sort_keys=True).encode())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
