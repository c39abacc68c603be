"""Eager PyTorch backend: the same hand-written forward, run directly. The reference."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from runtime.engine.adapter import check_lora_inputs, zero_lora_inputs
from runtime.engine.interface import EngineInterface, read_interface
from runtime.engine.model import load_backbone


class TorchEngine:
    def __init__(self, model_dir: str | Path, interface: EngineInterface, threads: int | None = 2):
        if threads:
            torch.set_num_threads(threads)
        if interface.paged:  # its PyTorch reference is the padded Backbone; pages live in the ORT runtime
            raise ValueError("paged KV cache: the eager backend runs padded float-KV interfaces only")
        self.interface = interface
        self.model = load_backbone(model_dir, interface.target_modules)
        self._lora: tuple[torch.Tensor, ...] = ()
        self.set_adapter(None)

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, model_dir: str | Path, threads: int | None = 2) -> "TorchEngine":
        return cls(model_dir, read_interface(engine_dir), threads)

    def set_adapter(self, lora: Mapping[str, np.ndarray] | None) -> None:
        if lora is None:
            lora = zero_lora_inputs(self.interface)
        check_lora_inputs(self.interface, lora)
        self._lora = tuple(torch.tensor(np.asarray(lora[n], dtype=np.float32)) for n in self.interface.lora_names)  # copies

    def forward(self, input_ids, position_ids, attention_mask, past=None, logit_positions=None):
        if past is None:
            past = self.model.empty_past(input_ids.shape[0])
        with torch.inference_mode():
            logits, present = self.model(
                torch.tensor(input_ids), torch.tensor(position_ids), torch.tensor(attention_mask),
                tuple(past), self._lora, None if logit_positions is None else torch.tensor(logit_positions),
            )
        return logits.numpy(), list(present)

    def cache_to_numpy(self, cache) -> list[np.ndarray]:
        return [t.numpy() for t in cache]
