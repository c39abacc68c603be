import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from runtime.engine.hashing import backbone_hash
from tasks.config import parse_config
from tasks.models import BaseModelError, check_base_model_dir, load_base_model
from tasks.stages.base_model import prepare_base_model


@pytest.fixture(autouse=True)
def in_tmp_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the embedded default is built at models/base of the project


def tiny_release_config(tmp_path: Path, **base_overrides):
    return parse_config(
        {
            "data": {"dir": str(tmp_path / "data")},
            "base_model": {
                "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                "intermediate_size": 64, "pretrain_examples": 32, "pretrain_steps": 3, "pretrain_batch_size": 4,
                **base_overrides,
            },
            "train": {"output_dir": str(tmp_path / "artifacts"), "threads": 1},
        }
    )


def test_embedded_base_is_a_standard_hf_qwen2_directory(tmp_path):
    cfg = tiny_release_config(tmp_path)
    path = prepare_base_model(cfg)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "base_model_card.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2"
    assert model.config.num_key_value_heads == 1
    card = json.loads((path / "base_model_card.json").read_text())
    assert card["backbone_hash"] == backbone_hash(path)
    assert card["pretrain_steps"] == 3


def test_embedded_base_is_reused_while_its_settings_are_unchanged(tmp_path):
    cfg = tiny_release_config(tmp_path)
    path = prepare_base_model(cfg)
    first = (path / "model.safetensors").stat().st_mtime_ns
    prepare_base_model(cfg)
    assert (path / "model.safetensors").stat().st_mtime_ns == first
    prepare_base_model(tiny_release_config(tmp_path, pretrain_steps=4))
    assert (path / "model.safetensors").stat().st_mtime_ns != first


def test_tokenizer_splits_numbers_into_single_digits(tmp_path):
    _, tokenizer = load_base_model(prepare_base_model(tiny_release_config(tmp_path)))
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("void_pct=64", add_special_tokens=False)["input_ids"])
    assert pieces[-2:] == ["6", "4"]
    assert tokenizer.decode(tokenizer("offset_um=37 verdict: FAIL:void")["input_ids"]) == "offset_um=37 verdict: FAIL:void"


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(BaseModelError, match=r"not a Hugging Face model directory \(no config\.json\)"):
        check_base_model_dir(tmp_path)


def test_non_qwen2_non_llama_model_is_refused_naming_its_type(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(BaseModelError, match=r"config\.json: model_type 'gpt2' is not supported; expected one of qwen2, llama"):
        check_base_model_dir(tmp_path)


def test_hash_depends_on_weights_not_on_file_metadata(tmp_path, tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(tmp_path / "copy")
    assert backbone_hash(tmp_path / "copy") == backbone_hash(tiny_llama_dir)
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    model.save_pretrained(tmp_path / "changed")
    assert backbone_hash(tmp_path / "changed") != backbone_hash(tiny_llama_dir)


def test_loading_the_base_and_wrapping_it_in_peft_prints_no_bar_or_library_deprecation_but_keeps_warnings(
        tiny_llama_dir, capfd, recwarn):
    """Each stage loads the base once: the weight-loading bar's first frame and PEFT's probe of a
    deprecated transformers property printed the same lines in finetune's and evaluate's output."""
    import warnings

    from peft import LoraConfig, get_peft_model

    model, _ = load_base_model(tiny_llama_dir)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    warnings.warn("a warning of our own", UserWarning, stacklevel=1)
    assert "Loading weights" not in capfd.readouterr().err
    messages = [str(w.message) for w in recwarn]
    assert not any("is_gradient_checkpointing" in m for m in messages)
    assert "a warning of our own" in messages
