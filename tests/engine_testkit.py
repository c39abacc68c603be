"""Engine test kit: tiny random Qwen2/Llama backbones and PEFT adapters made on the fly.

Sizes are chosen so every engine test runs in seconds on 2 CPU cores while still
exercising GQA (4 query heads on 2 kv heads), q/k/v bias (Qwen2) and tied embeddings (Llama).
The fixtures are imported by ``tests/runtime/conftest.py`` and by the task tests that need them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.engine.hashing import backbone_hash

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_model(out_dir: Path, kind: str = "qwen2", seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**(TINY | {"rope_theta": 5000.0} | overrides)))
    else:
        model = LlamaForCausalLM(LlamaConfig(**(TINY | {"tie_word_embeddings": True} | overrides)))
    with torch.no_grad():  # larger than init_range so logits spread and greedy choices are not ties
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:  # RMSNorm gains: not all ones, so a norm loaded under the wrong name shows
                p.normal_(1.0, 0.1)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def make_adapter(model_dir: Path, out_dir: Path, r: int = 4, alpha: float = 8.0,
                 targets: tuple[str, ...] = TARGETS, seed: int = 1, base_hash: str | None = None) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  init_lora_weights=False, lora_dropout=0.0))
    with torch.no_grad():  # non-zero B and a visible effect on the logits
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    peft_model.save_pretrained(out_dir)
    prov = {"base_model_hash": base_hash or backbone_hash(model_dir)}
    (Path(out_dir) / "provenance.json").write_text(json.dumps(prov, sort_keys=True))
    return Path(out_dir)


def engine_run(engine, ids, split: int, **slots):
    """Prefill ``split`` tokens of ``ids`` (B, T), then one token per step: (logits of every position, the cache).
    ``slots=`` (B,): a stacked engine's slot per row."""
    import numpy as np

    B, T = ids.shape
    pos = np.broadcast_to(np.arange(T), (B, T))
    mask = np.ones((B, T), dtype=np.int64)
    logits, cache = engine.forward(ids[:, :split], pos[:, :split], mask[:, :split], None, **slots)
    out = [logits]
    for t in range(split, T):
        logits, cache = engine.forward(ids[:, t : t + 1], pos[:, t : t + 1], mask[:, : t + 1], cache, **slots)
        out.append(logits)
    return np.concatenate(out, axis=1), cache


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen"), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen_adapter(tiny_qwen, tmp_path_factory) -> Path:
    return make_adapter(tiny_qwen, tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_qwen, tmp_path_factory) -> Path:
    """One compiled engine (max rank 8, q/k/v/o) shared by the engine tests: exports cost seconds."""
    from tasks.stages.compile import compile_engine

    engine_dir = tmp_path_factory.mktemp("engines") / "engine"
    compile_engine(tiny_qwen, engine_dir, max_rank=8, target_modules=TARGETS)
    return engine_dir
