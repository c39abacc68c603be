"""The engine interface: the versioned contract between a compiled engine and its adapters.

Written as ``engine/interface.json`` next to the engine. Every adapter and release manifest
records the ``interface_hash`` it was made for, and the runtime refuses a mismatch before
any inference. Bump ``INTERFACE_VERSION`` whenever the meaning of an input changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.errors import RefusedInput

if TYPE_CHECKING:  # the ONNX Runtime side reads interfaces without importing torch
    from runtime.model import BackboneConfig

# 1: ids/positions/mask + per-layer past K/V (B, nkv, P, d) + unmerged LoRA A/B/scale inputs.
INTERFACE_VERSION = 1
INTERFACE_FILE = "interface.json"
KV_LAYOUT = "B,num_kv_heads,past_len,head_dim"  # one key and one value tensor per layer


def lora_input_names(num_layers: int, modules: tuple[str, ...]) -> list[str]:
    """Flat order of the LoRA inputs: per layer, per module, A then B then scale."""
    return [f"lora_{kind}.{i}.{m}" for i in range(num_layers) for m in modules for kind in ("A", "B", "scale")]


class InterfaceError(RefusedInput):
    """An engine, adapter or manifest that does not match the interface it claims."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy spelling: "float32", "int64"
    shape: tuple  # ints for fixed axes, strings for dynamic ones ("batch", "seq", "past", "total")


@dataclass(frozen=True)
class EngineInterface:
    version: int
    backbone_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_rank: int
    target_modules: tuple[str, ...]
    module_shapes: dict  # module -> [in_features, out_features]
    kv_layout: str
    kv_dtype: str  # "float32" today; quantized KV formats will get their own version
    inputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    outputs: tuple[TensorSpec, ...] = field(default_factory=tuple)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def lora_names(self) -> list[str]:
        return lora_input_names(self.num_layers, self.target_modules)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        for key in ("inputs", "outputs"):
            d[key] = [{"name": t["name"], "dtype": t["dtype"], "shape": list(t["shape"])} for t in d[key]]
        return d

    @property
    def interface_hash(self) -> str:
        """sha256 of the canonical JSON of everything above (backbone hash included)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> "EngineInterface":
        d = dict(d)
        claimed = d.pop("interface_hash", None)
        d.pop("exporter", None)
        d["target_modules"] = tuple(d["target_modules"])
        for key in ("inputs", "outputs"):
            d[key] = tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in d[key])
        iface = cls(**d)
        if claimed is not None and claimed != iface.interface_hash:
            raise InterfaceError(
                f"interface hash {claimed[:12]} does not match its content ({iface.interface_hash[:12]}); "
                "the file was edited or corrupted"
            )
        return iface


def build_interface(
    cfg: "BackboneConfig", backbone_hash: str, max_rank: int, target_modules: tuple[str, ...]
) -> EngineInterface:
    L, nkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    inputs = [
        TensorSpec("input_ids", "int64", ("batch", "seq")),
        TensorSpec("position_ids", "int64", ("batch", "seq")),
        TensorSpec("attention_mask", "int64", ("batch", "total")),
    ]
    for i in range(L):
        inputs += [
            TensorSpec(f"past_key.{i}", "float32", ("batch", nkv, "past", d)),
            TensorSpec(f"past_value.{i}", "float32", ("batch", nkv, "past", d)),
        ]
    for name in lora_input_names(L, target_modules):
        kind, _, module = name.split(".")
        fan_in, fan_out = cfg.module_shape(module)
        shape = {"lora_A": (max_rank, fan_in), "lora_B": (fan_out, max_rank), "lora_scale": (1,)}[kind]
        inputs.append(TensorSpec(name, "float32", shape))
    outputs = [TensorSpec("logits", "float32", ("batch", "seq", cfg.vocab_size))]
    for i in range(L):
        outputs += [
            TensorSpec(f"present_key.{i}", "float32", ("batch", nkv, "total", d)),
            TensorSpec(f"present_value.{i}", "float32", ("batch", nkv, "total", d)),
        ]
    return EngineInterface(
        version=INTERFACE_VERSION,
        backbone_hash=backbone_hash,
        num_layers=L,
        num_kv_heads=nkv,
        head_dim=d,
        vocab_size=cfg.vocab_size,
        max_rank=max_rank,
        target_modules=tuple(target_modules),
        module_shapes={m: list(cfg.module_shape(m)) for m in target_modules},
        kv_layout=KV_LAYOUT,
        kv_dtype="float32",
        inputs=tuple(inputs),
        outputs=tuple(outputs),
    )


def write_interface(iface: EngineInterface, path: Path, exporter: dict | None = None) -> None:
    payload = iface.to_dict() | {"interface_hash": iface.interface_hash, "exporter": exporter or {}}
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_interface(path: Path) -> EngineInterface:
    path = Path(path)
    if path.is_dir():
        path = path / INTERFACE_FILE
    if not path.exists():
        raise InterfaceError(f"{path}: no engine interface; compile the engine first")
    d = json.loads(path.read_text())
    if d.get("version") != INTERFACE_VERSION:
        raise InterfaceError(
            f"{path}: interface version {d.get('version')} but this runtime speaks {INTERFACE_VERSION}; recompile"
        )
    return EngineInterface.from_dict(d)
