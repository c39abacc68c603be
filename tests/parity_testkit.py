"""Planted defects for the engine parity check (tasks/checks/engine_parity.py): four ways an engine can compute another
function than its PyTorch reference while it still loads, answers and looks plausible. Each is built from real parts
(an adapter directory, a compiled engine), changed in one place:

- ``adapter_without_module``: one LoRA module of one layer left out (its A and B tensors dropped from the file);
- ``adapter_with_scale``: the adapter's scale off by a factor (``lora_alpha`` in adapter_config.json);
- ``DecodePositionsOneOn``: an engine whose decode steps read a RoPE position one further on (a test double);
- ``checkpoint_with_layer_from``: a checkpoint to compile whose one layer's weights are another checkpoint's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

from runtime.engine.adapter_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def adapter_without_module(adapter_dir: Path, out_dir: Path, layer: int, module: str) -> Path:
    """A copy of ``adapter_dir`` without ``module``'s LoRA tensors in ``layer``: what an export that skipped one
    module would ship."""
    shutil.copytree(adapter_dir, out_dir)
    tensors = load_file(out_dir / ADAPTER_WEIGHTS)
    kept = {k: v for k, v in tensors.items() if f"layers.{layer}.self_attn.{module}." not in k
            and f"layers.{layer}.mlp.{module}." not in k}
    assert len(kept) == len(tensors) - 2, f"layer {layer} {module}: not 2 tensors in {sorted(tensors)[:4]}..."
    save_file(kept, out_dir / ADAPTER_WEIGHTS)
    return out_dir


def adapter_with_scale(adapter_dir: Path, out_dir: Path, factor: float) -> Path:
    """A copy of ``adapter_dir`` whose LoRA scale (alpha / r) is ``factor`` times the trained one."""
    shutil.copytree(adapter_dir, out_dir)
    config = json.loads((out_dir / ADAPTER_CONFIG).read_text())
    config["lora_alpha"] *= factor
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config))
    return out_dir


class DecodePositionsOneOn:
    """A test double of an engine: the wrapped engine, but a step that continues a cache reads its tokens' RoPE positions
    one further on (the new token one position away from where the cache holds its predecessor: the off-by-one of a
    decode loop that counts the cache's length after appending). A prefill is untouched: RoPE attention sees only
    differences of positions, so shifting a whole prompt would change nothing."""

    def __init__(self, engine):
        self.engine = engine

    def forward(self, input_ids, position_ids, attention_mask, past=None, *args, **kwargs):
        shift = 0 if past is None else 1
        return self.engine.forward(input_ids, np.asarray(position_ids) + shift, attention_mask, past, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def checkpoint_with_layer_from(base_dir: Path, other: dict, layer: int, out_dir: Path) -> Path:
    """A copy of the Hugging Face checkpoint ``base_dir`` whose decoder layer ``layer`` holds ``other``'s tensors
    ({name: torch tensor}, a checkpoint of the same architecture), each in the base's dtype: what a conversion that
    mixed up one shard would leave. The engine compiled from it is the defect."""
    shutil.copytree(base_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    prefix = f".layers.{layer}."
    for shard in sorted(Path(base_dir).glob("*.safetensors")):
        tensors = load_file(shard)
        swapped = {name: other[name].to(value.dtype).contiguous() for name, value in tensors.items() if prefix in name}
        assert all(swapped[n].shape == tensors[n].shape for n in swapped), f"layer {layer}: shapes differ"
        save_file(tensors | swapped, out_dir / shard.name, metadata={"format": "pt"})
    return out_dir
