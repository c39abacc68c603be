"""``python -m tasks.checks.peft_vs_device`` finds the device answering what PEFT answers, and finds it when not."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from release_testkit import world

from tasks.checks.peft_vs_device import Answer, compare, release_id, render, serving, verdict
from tasks.inspection import rulebook, sample_examples
from tasks.records import read_jsonl, write_jsonl

# A template the tiny world's tokenizer does not have: its tokenizer.json (and so the release's hash) is kept.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    base = shutil.copytree(w["base"], w["root"] / "base-with-template")
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    rows = [ex.as_chat() for ex in sample_examples(rulebook("2026-11", 1234, 2), 4, random.Random(3))]
    write_jsonl(w["root"] / "test.jsonl", rows)
    return w | {"base": base, "test": w["root"] / "test.jsonl"}


def test_the_release_peft_loads_answers_on_the_device_as_in_pytorch_both_endpoints(w):
    with serving(w["engine"], w["base"], w["b"], w["trusted_key"], threads=1) as url:
        model, answers = compare(w["base"], w["b"], url, w["test"], max_new_tokens=5)
    rows = read_jsonl(w["test"])
    assert [(a.row, a.endpoint) for a in answers] == [(r, e) for r in range(1, len(rows) + 1)
                                                       for e in ("chat", "completions")]
    assert [a.prompt for a in answers if a.endpoint == "chat"] == [[*ex.prompt.messages] for ex in rows]
    assert model == release_id(w["b"]) and model.startswith("2026-11")
    assert all(a.equal for a in answers), render(model, model, answers)
    assert sum(bool(a.peft.strip()) for a in answers) >= len(answers) // 2  # words, not only eos
    assert "chat: 4 of 4 answers equal" in render(model, model, answers)


def test_a_device_serving_another_release_is_found_different(w):
    with serving(w["engine"], w["base"], w["a"], w["trusted_key"], threads=1) as url:
        model, answers = compare(w["base"], w["b"], url, w["test"], max_new_tokens=5)
    assert model == release_id(w["a"])  # what the device says it serves: release A, while PEFT loaded B
    assert not all(a.equal for a in answers)
    table = render(model, release_id(w["b"]), answers)
    assert "| NO |" in table and "(ANOTHER RELEASE)" in table


def test_peft_answers_a_model_that_ends_on_several_eos_ids_and_has_no_pad_token(tmp_path, tiny_llama_bos_dir):
    """Llama-3-style checkpoints list several eos ids and no pad token; a fresh LoRA (B = 0) answers as the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.checks.peft_vs_device import peft_greedy

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_bos_dir)
    assert tokenizer.pad_token_id is None
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_bos_dir, dtype=torch.float32).eval()
    eos = base.generation_config.eos_token_id
    assert isinstance(eos, list) and len(eos) == 2
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_bos_dir, dtype=torch.float32),
                   LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path / "adapter")
    prompts = ["cam 3 scratch", "cam 7 dent 2"]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0])
            expected.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert peft_greedy(tiny_llama_bos_dir, tmp_path / "adapter", prompts, 6) == expected
    assert any(expected)


def test_a_quantized_pages_device_must_answer_as_its_module_through_the_same_pages_and_may_differ_from_peft_within_a_limit():
    same = Answer(1, "chat", "p", peft="digit", device="digit", module="digit")
    cache = Answer(2, "chat", "q", peft="symbol", device="mark", module="mark")  # the 4-bit pages' answer: the module's
    defect = Answer(3, "chat", "r", peft="digit", device="mark", module="digit")  # the module reads the same pages

    assert verdict("m", "m", [same, cache], max_cache_differences=1)
    assert not verdict("m", "m", [same, cache], max_cache_differences=0)
    assert not verdict("m", "m", [same, defect], max_cache_differences=5)
    assert not verdict("m", "other", [same], max_cache_differences=5)
    table = render("m", "m", [same, cache, defect])
    assert "| 3 | chat | r | 'digit' | 'mark' | NO | 'digit' | NO |" in table
    assert "chat: 1 of 3 answers equal to PEFT's, 2 of 3 to the module's through the same pages" in table
    float_cache = Answer(1, "chat", "p", peft="digit", device="digit")
    assert verdict("m", "m", [float_cache], 0) and "module" not in render("m", "m", [float_cache])
