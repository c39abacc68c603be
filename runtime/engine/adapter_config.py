"""A PEFT adapter's files, and ``adapter_config.json`` read once into one typed object every reader takes.

The pipeline writes these files (``tasks/stages/finetune.py``), the engine reads them (``runtime.engine.adapter``)
and a release carries them unchanged (``runtime.release.verify``). Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.errors import RefusedInput

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PROVENANCE = "provenance.json"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PROVENANCE)


class AdapterError(RefusedInput):
    """An adapter the engine must not run; the message names the file and lists every problem found."""


@dataclass(frozen=True)
class AdapterConfig:
    """``adapter_config.json`` (PEFT ``LoraConfig``) as read once, the fields every reader uses."""

    r: int
    lora_alpha: int | float  # as written (PEFT's default is r when absent), so the manifest records it unchanged
    target_modules: tuple[str, ...]  # sorted; PEFT may write a single module as a string
    use_rslora: bool
    base_model_name_or_path: str | None
    # PEFT features the engine's LoRA inputs (one A and one B per module, no bias) cannot express,
    # one sentence each; ``runtime.adapter.load_adapter`` refuses an adapter that has any.
    unsupported: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        """The multiplier of B A: alpha / r, or alpha / sqrt(r) for rsLoRA (Kalajdzievski 2023)."""
        return self.lora_alpha / math.sqrt(self.r) if self.use_rslora else self.lora_alpha / self.r


def read_adapter_config(adapter_dir: str | Path) -> AdapterConfig:
    """Parse ``adapter_dir/adapter_config.json``; raise AdapterError naming the file and every bad field."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise AdapterError(f"{path}: cannot read ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: top level must be an object")
    problems = []
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        problems.append(f"r: must be a positive integer (got {r!r})")
    alpha = raw.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        problems.append(f"lora_alpha: must be a finite number (got {alpha!r})")
    targets = raw.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        problems.append("target_modules: must be a module name or a non-empty list of them "
                        f"(got {raw.get('target_modules')!r})")
    base = raw.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        problems.append(f"base_model_name_or_path: must be a string (got {base!r})")
    if problems:
        raise AdapterError(f"{path}: invalid adapter config:\n  - " + "\n  - ".join(problems))

    unsupported = []
    if raw.get("peft_type", "LORA") != "LORA":
        unsupported.append(f"peft_type {raw.get('peft_type')!r} is not LORA")
    if raw.get("use_dora"):
        unsupported.append("DoRA adapters are not supported by the engine")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        unsupported.append("per-module rank_pattern/alpha_pattern is not supported")
    if raw.get("bias", "none") != "none":
        unsupported.append(f"bias={raw.get('bias')!r}: the engine has no inputs for trained biases")
    if raw.get("modules_to_save"):
        unsupported.append(f"modules_to_save {raw['modules_to_save']} would change base weights")
    return AdapterConfig(r, alpha, tuple(sorted(set(targets))), bool(raw.get("use_rslora")), base, tuple(unsupported))
