"""PEFT LoRA directory -> the engine's LoRA inputs, checked before any inference.

Every problem is collected and reported at once. The result is a dict keyed by the
interface's input names, one A and one B per layer and fused linear (``runtime.engine.interface.lora_groups``):
``lora_A.{layer}.{targets}`` (n r_max, in) stacks the targets' A matrices, ``lora_B...`` (out of the
fused linear, n r_max) holds each target's ``scale * B`` in its own rows and rank columns, zero
elsewhere; float32 numpy arrays ready to feed any backend.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from runtime.engine.adapter_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PROVENANCE, AdapterError, read_adapter_config
from runtime.engine.interface import EngineInterface, lora_group_name, lora_groups

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may sit before .weight)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def zero_lora_inputs(iface: EngineInterface) -> dict[str, np.ndarray]:
    """All-zero LoRA inputs: the engine then computes exactly the base model."""
    inputs = {}
    for spec in iface.inputs:
        if spec.name.startswith("lora_"):
            inputs[spec.name] = np.zeros(iface.adapter_shape(spec), dtype=np.float32)
    return inputs


def check_provenance(adapter_dir: Path, iface: EngineInterface) -> list[str]:
    path = Path(adapter_dir) / PROVENANCE
    if not path.exists():
        return [f"{path} is missing: cannot prove which backbone the adapter was trained on"]
    prov = json.loads(path.read_text())
    problems = []
    base = prov.get("base_model_hash")
    if base != iface.backbone_hash:
        problems.append(
            f"adapter was made for backbone {str(base)[:12]} but the engine runs backbone {iface.backbone_hash[:12]}"
        )
    claimed = prov.get("engine_interface_hash")
    if claimed is not None and claimed not in iface.accepted_hashes:
        problems.append(
            f"adapter records engine interface {claimed[:12]} but the engine has {iface.interface_hash[:12]}"
        )
    return problems


def load_adapter(adapter_dir: str | Path, iface: EngineInterface, require_provenance: bool = True) -> dict[str, np.ndarray]:
    """Read and validate a PEFT LoRA adapter; return the engine LoRA inputs or raise AdapterError."""
    adapter_dir = Path(adapter_dir)
    problems: list[str] = []
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / name).exists():
            problems.append(f"{adapter_dir / name} is missing")
    if problems:
        raise AdapterError(f"{adapter_dir}: " + "; ".join(problems))
    if require_provenance:
        problems += check_provenance(adapter_dir, iface)

    cfg = read_adapter_config(adapter_dir)
    problems += list(cfg.unsupported)
    if cfg.r > iface.max_rank:
        problems.append(f"rank {cfg.r} exceeds the engine's max rank {iface.max_rank}")
    outside = sorted(set(cfg.target_modules) - set(iface.target_modules))
    if outside:
        problems.append(f"target modules {outside} are not LoRA inputs of the engine {list(iface.target_modules)}")
    scale = cfg.scale

    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    inputs = zero_lora_inputs(iface)
    R = iface.max_rank
    slots = {}  # module -> (group name, rank-column offset, output-row offset)
    for targeted, fused in lora_groups(iface.target_modules):
        for j, module in enumerate(targeted):
            row = sum(iface.module_shapes[m][1] for m in fused[: fused.index(module)])
            slots[module] = (lora_group_name(targeted), j * R, row)
    seen: dict[tuple[int, str], set] = {}
    for key, value in sorted(tensors.items()):
        m = _KEY.search(key)
        if m is None:
            problems.append(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer")
            continue
        layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
        if module not in iface.target_modules:
            if module not in outside:
                problems.append(f"tensor {key!r}: module {module} is not a LoRA input of the engine")
            continue
        if layer >= iface.num_layers:
            problems.append(f"tensor {key!r}: layer {layer} but the backbone has {iface.num_layers} layers")
            continue
        fan_in, fan_out = iface.module_shapes[module]
        rank = value.shape[0] if kind == "A" else value.shape[-1]
        expected = (rank, fan_in) if kind == "A" else (fan_out, rank)
        if value.ndim != 2 or tuple(value.shape) != expected:
            problems.append(f"tensor {key!r} has shape {tuple(value.shape)}, expected {expected}")
            continue
        if rank > iface.max_rank:
            problems.append(f"tensor {key!r} has rank {rank} above the engine's max rank {iface.max_rank}")
            continue
        if not np.isfinite(value).all():
            problems.append(f"tensor {key!r} has non-finite values")
            continue
        value = value.astype(np.float32)
        group, col, row = slots[module]
        # Ranks beyond the adapter's and rows of untargeted members stay zero: the padding is exact.
        if kind == "A":
            inputs[f"lora_A.{layer}.{group}"][col : col + rank, :] = value
        else:
            inputs[f"lora_B.{layer}.{group}"][row : row + fan_out, col : col + rank] = value * np.float32(scale)
        seen.setdefault((layer, module), set()).add(kind)
    for (layer, module), kinds in sorted(seen.items()):
        if kinds != {"A", "B"}:
            problems.append(f"layer {layer} {module}: has lora_{''.join(sorted(kinds))} but not both A and B")
    if not seen and not problems:
        problems.append("adapter holds no LoRA weights")
    if problems:
        raise AdapterError(f"{adapter_dir}: refused before inference:\n  - " + "\n  - ".join(problems))
    return inputs


def check_lora_inputs(iface: EngineInterface, lora: Mapping[str, np.ndarray]) -> None:
    """Every LoRA input present, with the interface's shape and finite values, nothing extra."""
    expected = {t.name: iface.adapter_shape(t) for t in iface.inputs if t.name.startswith("lora_")}
    problems = [f"missing {n}" for n in expected if n not in lora]
    problems += [f"unexpected {n}" for n in lora if n not in expected]
    for name, shape in expected.items():
        if name in lora:
            value = np.asarray(lora[name])
            if tuple(value.shape) != shape:
                problems.append(f"{name} has shape {tuple(value.shape)}, interface says {shape}")
            elif not np.isfinite(value).all():
                problems.append(f"{name} has non-finite values")
    if problems:
        raise ValueError("LoRA inputs do not match the engine interface: " + "; ".join(problems))
