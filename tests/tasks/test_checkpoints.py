"""Checkpoints people have: what is refused up front, and one special-token policy end to end.

The refusals go through ``check_base_model_dir``, the first thing the base_model stage does with a
local checkpoint, so each must name the file and the key. The policy tests use ``tiny_llama_bos_dir``,
whose tokenizer adds BOS: training, PyTorch evaluation, the engine and the device must all see it.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from runtime.engine.generate import generate_text
from runtime.engine.tokenizer import ChatPrompt, DeviceTokenizer, encode_prompt
from tasks.checks.page_quality import greedy_through_pages
from tasks.models import BaseModelError, check_base_model_dir, load_tokenizer
from tasks.records import DataError, Example
from tasks.scoring import greedy_completions
from tasks.training import encode_example

PROMPT = "inspect board=PCB-0007 void_pct=12 verdict:"


@pytest.fixture
def llama_copy(tiny_llama_bos_dir, tmp_path):
    """A writable copy of the BOS-adding Llama, to break one file at a time."""
    return shutil.copytree(tiny_llama_bos_dir, tmp_path / "model")


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del data[key]
    path.write_text(json.dumps(data))


def refusal(model_dir) -> str:
    with pytest.raises(BaseModelError) as err:
        check_base_model_dir(model_dir)
    assert "\n" not in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------- refused before any work


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
     "use_sliding_window true with sliding_window 64 < max_position_embeddings 256 on layers 0-1: "
     "sliding-window attention is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     "rope_parameters.rope_type 'yarn' is not supported (default, linear, llama3)"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.type 'dynamic' is not supported (default, linear, llama3)"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "rope_parameters.low_freq_factor is missing (rope_type 'llama3' needs factor, low_freq_factor, high_freq_factor)"),
    ({"num_local_experts": 8}, "num_local_experts 8: mixture-of-experts is not supported"),
    ({"mlp_bias": True}, "mlp_bias true is not supported (the MLP has no bias)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (silu)"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quantization_config (quant_method 'gptq') is not supported: give the unquantized weights"),
], ids=["sliding-window", "yarn", "dynamic-4x-spelling", "llama3-incomplete", "moe", "mlp-bias", "gelu", "gptq"])
def test_config_the_engine_cannot_compute_is_refused_naming_file_and_key(llama_copy, changes, message):
    edit_json(llama_copy / "config.json", **changes)
    assert refusal(llama_copy) == f"{llama_copy / 'config.json'}: {message}"


def test_every_config_problem_is_reported_at_once(llama_copy):
    edit_json(llama_copy / "config.json", mlp_bias=True, hidden_act="gelu")
    assert refusal(llama_copy) == (f"{llama_copy / 'config.json'}: hidden_act 'gelu' is not supported (silu); "
                                   "mlp_bias true is not supported (the MLP has no bias)")


def test_pickled_only_checkpoint_is_refused_naming_the_bin_file(llama_copy):
    from safetensors.torch import load_file

    torch.save(load_file(llama_copy / "model.safetensors"), llama_copy / "pytorch_model.bin")
    (llama_copy / "model.safetensors").unlink()
    assert refusal(llama_copy).startswith(f"{llama_copy / 'pytorch_model.bin'}: pickled weights are not loaded")


def test_tokenizer_without_eos_is_refused_naming_tokenizer_config_and_key(llama_copy):
    edit_json(llama_copy / "tokenizer_config.json", eos_token=None)
    assert refusal(llama_copy) == f"{llama_copy / 'tokenizer_config.json'}: no eos_token; generation could never stop"


def test_eos_token_unknown_to_the_tokenizer_is_refused(llama_copy):
    edit_json(llama_copy / "tokenizer_config.json", eos_token="<|end|>")
    assert refusal(llama_copy) == (f"{llama_copy / 'tokenizer_config.json'}: eos_token '<|end|>' is not a token "
                                   "of tokenizer.json; generation could never stop")


def test_generation_config_eos_outside_the_vocabulary_is_refused(llama_copy):
    edit_json(llama_copy / "generation_config.json", eos_token_id=[1, 100000])
    assert refusal(llama_copy).startswith(f"{llama_copy / 'generation_config.json'}: eos_token_id [1, 100000] "
                                          "is not a token id")


def test_checkpoint_without_tokenizer_json_is_refused(llama_copy):
    (llama_copy / "tokenizer.json").unlink()
    assert refusal(llama_copy).startswith(f"{llama_copy / 'tokenizer.json'}: missing; the device tokenizes with it")


def test_supported_checkpoint_passes_the_check(tiny_llama_bos_dir):
    assert check_base_model_dir(tiny_llama_bos_dir)["rope_parameters"]["rope_type"] == "llama3"


def break_sliding_window(model_dir):
    edit_json(model_dir / "config.json", model_type="qwen2", use_sliding_window=True, sliding_window=64,
              max_window_layers=0)
    return "config.json", "use_sliding_window true with sliding_window 64"


def break_rope_type(model_dir):
    edit_json(model_dir / "config.json", rope_parameters={"rope_type": "longrope", "factor": 4.0})
    return "config.json", "rope_parameters.rope_type 'longrope' is not supported"


def break_to_bin_only(model_dir):
    from safetensors.torch import load_file

    torch.save(load_file(model_dir / "model.safetensors"), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    return "pytorch_model.bin", "pickled weights are not loaded"


def break_eos(model_dir):
    edit_json(model_dir / "tokenizer_config.json", eos_token=None)
    return "tokenizer_config.json", "no eos_token"


@pytest.mark.parametrize("breaks", [break_sliding_window, break_rope_type, break_to_bin_only, break_eos],
                         ids=["sliding-window", "rope-type", "bin-only", "no-eos"])
def test_base_model_stage_refuses_with_one_line_exit_2_and_writes_nothing(breaks, llama_copy, tmp_path, monkeypatch,
                                                                          capsys):
    from tasks.stages.base_model import main

    file, message = breaks(llama_copy)
    (tmp_path / "params.yaml").write_text(f"base_model:\n  source: local\n  path: {llama_copy}\n")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))

    assert main(["--params", str(tmp_path / "params.yaml")]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"error: {llama_copy / file}: {message}") and err.count("\n") == 1
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# ---------------------------------------------------------------- several eos ids


def test_stop_ids_are_the_tokenizers_eos_then_generation_configs(tiny_llama_bos_dir):
    device = DeviceTokenizer(tiny_llama_bos_dir)
    eos, eot = device._tok.token_to_id("</s>"), device._tok.token_to_id("<|eot_id|>")

    assert device.stop_ids == (eos, eot) and device.eos_id == eos
    assert load_tokenizer(tiny_llama_bos_dir).stop_ids == (eos, eot)


def test_embedded_style_tokenizer_stops_at_its_one_eos(tiny_llama_dir):
    device = DeviceTokenizer(tiny_llama_dir)
    assert device.stop_ids == (device.eos_id,) == (device._tok.token_to_id("<|endoftext|>"),)


class SpyEngine:
    """An Engine whose logits pick ``script`` token by token; records the prefill ids."""

    def __init__(self, script, vocab):
        self.script, self.vocab, self.prefill = list(script), vocab, None

    def forward(self, ids, pos, mask, past, logit_positions=None):
        if past is None:
            self.prefill = ids[0].tolist()
        step = 0 if past is None else past + 1
        logits = np.zeros((ids.shape[0], ids.shape[1], self.vocab), np.float32)
        logits[:, -1, self.script[min(step, len(self.script) - 1)]] = 1.0
        return logits, step


class SpyModel:
    """A transformers model whose generate appends ``script``; records its arguments."""

    device = torch.device("cpu")  # where greedy_completions puts the batch, as on a transformers model

    def __init__(self, script):
        self.script, self.kwargs = script, None

    def generate(self, input_ids, attention_mask, **kwargs):
        self.kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        return torch.cat([input_ids, torch.tensor([self.script] * input_ids.shape[0])], 1)


def test_engine_and_pytorch_decoding_stop_at_the_second_eos_id(tiny_llama_bos_dir):
    tokenizer = load_tokenizer(tiny_llama_bos_dir)
    eot = tokenizer.stop_ids[1]
    a, b = tokenizer.convert_tokens_to_ids(["1", "2"])

    engine = SpyEngine([a, b, eot, a], len(tokenizer))
    model = SpyModel([a, b, eot, a])

    assert generate_text(engine, tokenizer, [PROMPT], 8) == ["12"]
    assert greedy_completions(model, tokenizer, [PROMPT], 8, 1) == ["12"]
    assert model.kwargs["eos_token_id"] == list(tokenizer.stop_ids)


# ---------------------------------------------------------------- one special-token policy


class RecordingBackbone:
    """runtime.engine.model.Backbone of the checkpoint, recording the ids of the first forward greedy_through_pages
    runs (the prompt's prefill)."""

    def __init__(self, model_dir):
        from runtime.engine.model import load_backbone

        self.backbone, self.prefill = load_backbone(model_dir), None

    def prepare(self, ids, *args):
        if self.prefill is None:
            self.prefill = ids[0].tolist()
        return self.backbone.prepare(ids, *args)

    def __getattr__(self, name):
        return getattr(self.backbone, name)


def ids_on_every_path(model_dir, prompt, completion: str) -> tuple[list[int], list[int], list[list[int]]]:
    """(the prompt ids training learns after, the answer ids it learns, and the prompt ids the engine,
    PyTorch greedy decoding and the pages' reference each prefill) for one row."""
    tokenizer = load_tokenizer(model_dir)
    eos = tokenizer.eos_token_id
    ids, learned = encode_example(tokenizer, Example(prompt, completion), 512)
    start = learned.index(True)
    assert all(learned[start:]) and not any(learned[:start])
    engine, model = SpyEngine([eos], len(tokenizer)), SpyModel([eos])
    generate_text(engine, tokenizer, [prompt], 4)
    greedy_completions(model, tokenizer, [prompt], 4, 1)
    backbone = RecordingBackbone(model_dir)
    greedy_through_pages(backbone, tokenizer, [prompt], None, 16, 2)
    return ids[:start], ids[start:], [model.kwargs["input_ids"][0].tolist(), engine.prefill, backbone.prefill]


def test_training_evaluation_engine_and_device_see_the_same_prompt_ids_bos_first(tiny_llama_bos_dir):
    device = DeviceTokenizer(tiny_llama_bos_dir)
    bos = device._tok.token_to_id("<s>")
    training, answer, evaluated = ids_on_every_path(tiny_llama_bos_dir, PROMPT, " PASS")

    assert training[0] == bos and training.count(bos) == 1
    assert evaluated == [training] * 3
    assert training == device.encode(PROMPT)
    assert answer == load_tokenizer(tiny_llama_bos_dir)(" PASS", add_special_tokens=False)["input_ids"] + [device.eos_id]


# A Llama-style chat template that writes the BOS itself, as Llama 3's does: a tokenizer whose
# post-processor adds BOS too must not be asked for it again.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}assistant:\n{% endif %}")
CHAT = ({"role": "system", "content": "Give the verdict."}, {"role": "user", "content": PROMPT})


@pytest.fixture
def chat_llama(llama_copy):
    (llama_copy / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return llama_copy


def test_training_evaluation_engine_and_device_render_a_chat_to_the_same_ids(chat_llama):
    tokenizer = load_tokenizer(chat_llama)
    device = DeviceTokenizer(chat_llama)
    bos = device._tok.token_to_id("<s>")
    training, answer, evaluated = ids_on_every_path(chat_llama, ChatPrompt(CHAT), "PASS")

    assert training == device.encode_chat(list(CHAT))  # what /v1/chat/completions prefills
    assert evaluated == [training] * 3
    assert training[0] == bos and training.count(bos) == 1  # the template's BOS, not the post-processor's as well
    # transformers' own rendering of the same template agrees (the rendering is the template's, not ours)
    assert training == tokenizer.apply_chat_template(list(CHAT), add_generation_prompt=True, return_dict=True)["input_ids"]
    assert answer == tokenizer("PASS", add_special_tokens=False)["input_ids"] + [device.eos_id]


def test_the_loss_learns_every_assistant_turn_and_no_system_or_user_token(chat_llama):
    tokenizer = load_tokenizer(chat_llama)
    chat = ChatPrompt((*CHAT, {"role": "assistant", "content": "HOLD"}, {"role": "user", "content": "and now?"}))
    ids, learned = encode_example(tokenizer, Example(chat, "PASS"), 512)
    assert tokenizer.decode([t for t, keep in zip(ids, learned) if keep]) == "HOLD</s>PASS</s>"


def test_a_template_that_drops_past_assistant_turns_is_refused_for_training(chat_llama):
    (chat_llama / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace(
        "{% for m in messages %}", "{% for m in messages if m['role'] != 'assistant' %}"))
    tokenizer = load_tokenizer(chat_llama)
    chat = ChatPrompt((*CHAT, {"role": "assistant", "content": "HOLD"}, {"role": "user", "content": "and now?"}))
    with pytest.raises(DataError, match="does not render assistant turn 2 .'HOLD'. as the generation prompt"):
        encode_example(tokenizer, Example(chat, "PASS"), 512)


def test_embedded_style_tokenizer_adds_no_special_tokens_to_a_prompt(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    ids, learned = encode_example(tokenizer, Example(PROMPT, " PASS"), 512)
    start = learned.index(True)
    assert ids[:start] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids[:start] == DeviceTokenizer(tiny_llama_dir).encode(PROMPT)


def test_transformers_tokenizer_that_disagrees_with_tokenizer_json_is_refused(tiny_llama_bos_dir, monkeypatch):
    from tokenizers import processors
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def without_bos(path, **kwargs):  # as a transformers that rebuilt the post-processor from add_bos_token false
        tokenizer = real(path, **kwargs)
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", without_bos)
    with pytest.raises(BaseModelError, match=r"transformers encodes .* tokenizer\.json as \[0, .*align add_bos_token"):
        load_tokenizer(tiny_llama_bos_dir)


def test_compiled_engine_of_the_bos_llama3_checkpoint_matches_pytorch(tiny_llama_bos_dir, tmp_path):
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.models import load_base_model
    from tasks.stages.compile import compile_engine
    from tasks.stages.evaluate import engine_perplexity, perplexity

    compile_engine(tiny_llama_bos_dir, tmp_path / "engine", max_rank=4, ort_threads=1)
    engine = OrtEngine(tmp_path / "engine", threads=1)
    model, tokenizer = load_base_model(tiny_llama_bos_dir)
    ids = np.asarray([encode_prompt(tokenizer, PROMPT * 5)], np.int64)  # (1, T), T > the 64-token original context
    T = ids.shape[1]

    logits, _ = engine.forward(ids, np.arange(T)[None], np.ones((1, T), np.int64), None)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).logits.numpy()

    assert T > 64 and np.abs(logits - ref).max() <= 1e-4
    prompts = [PROMPT, "inspect board=PCB-0002 verdict:", "x"]
    assert generate_text(engine, tokenizer, prompts, 6, 2) == greedy_completions(model, tokenizer, prompts, 6, 2)
    texts = [PROMPT + " PASS", "a longer line of held-out text, 12345"]
    on_engine = engine_perplexity(engine, tokenizer, texts)
    assert on_engine == pytest.approx(perplexity(model, tokenizer, texts, 2), rel=1e-5)
