"""Content hashes: of a backbone (the identity every adapter and engine is bound to) and of a file.

Torch-free at import (torch is imported by ``backbone_hash`` only), so the device and the
pipeline hash release files with the same function.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def backbone_hash(model_dir: str | Path) -> str:
    """sha256 over the architecture config and every weight tensor (name, dtype, shape, bytes).

    Hashing tensors rather than files makes the identity independent of how the
    safetensors file was laid out or sharded, and of metadata such as timestamps.
    """
    import torch
    from safetensors import safe_open

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
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(file, framework="pt")) for file in files]
        owner = {name: fh for fh in handles for name in fh.keys()}
        for name in sorted(owner):  # one tensor in memory at a time: a 0.5B checkpoint is 1 GB
            t = owner[name].get_tensor(name).contiguous()
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
