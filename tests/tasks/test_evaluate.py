import math

import pytest
from transformers import AutoModelForCausalLM

from tasks.models import load_tokenizer
from tasks.records import Example
from tasks.scoring import accuracy_report
from tasks.stages.evaluate import perplexity


def test_accuracy_splits_new_and_regression_rules_and_reports_each_rule():
    examples = [
        Example("p1", " PASS", "void", True),
        Example("p2", " HOLD", "void", True),
        Example("p3", " REWORK", "crack", False),
        Example("p4", " FAIL:crack", "crack", False),
    ]
    report = accuracy_report(examples, ["PASS", " REWORK", "REWORK ", "FAIL:crack"])
    assert report["accuracy"] == 0.75
    assert report["accuracy_new"] == 0.5
    assert report["accuracy_regression"] == 1.0
    assert report["per_rule"] == {"crack": 1.0, "void": 0.5}
    assert (report["count_new"], report["count_regression"]) == (2, 2)


def test_accuracy_without_rule_metadata_reports_overall_only():
    report = accuracy_report([Example("a", " x"), Example("b", " y")], ["x", "z"])
    assert report["accuracy"] == 0.5
    assert report["accuracy_new"] is None and report["accuracy_regression"] is None
    assert report["per_rule"] == {}


def test_perplexity_of_an_untrained_model_is_near_the_vocabulary_size(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = load_tokenizer(tiny_llama_dir)
    ppl = perplexity(model, tokenizer, ["inspect board=PCB-0001 verdict: PASS", "short line"], batch_size=2)
    # Random init predicts close to uniformly: perplexity within a factor of 2 of the vocabulary.
    assert len(tokenizer) / 2 < ppl < 2 * len(tokenizer)
    assert math.isfinite(ppl)


def test_perplexity_on_the_engine_equals_perplexity_in_pytorch(tiny_llama_dir, tmp_path):
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.stages.compile import compile_engine
    from tasks.stages.evaluate import engine_perplexity

    compile_engine(tiny_llama_dir, tmp_path / "engine", max_rank=4, ort_threads=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = load_tokenizer(tiny_llama_dir)
    texts = ["inspect board=PCB-0001 verdict: PASS", "a longer line of held-out text, 12345"]
    on_engine = engine_perplexity(OrtEngine(tmp_path / "engine", threads=1), tokenizer, texts)
    assert on_engine == pytest.approx(perplexity(model, tokenizer, texts, batch_size=2), rel=1e-4)
    assert len(tokenizer) / 2 < on_engine < 2 * len(tokenizer)


def test_decode_latency_rows_carry_the_past_length_each_step_attends_to(tiny_llama_dir, tmp_path):
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.plots import latency_by_past_length, latency_figure, read_rows, save_figure
    from tasks.stages.compile import compile_engine
    from tasks.stages.evaluate import decode_latency

    compile_engine(tiny_llama_dir, tmp_path / "engine", max_rank=4, ort_threads=1)
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompts = ["inspect board=PCB-0001", "a longer prompt of the held-out kind, 12345"]
    engine = OrtEngine(tmp_path / "engine", threads=1)
    summary, samples = decode_latency(engine, engine, tokenizer, prompts, steps=3)
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert [(i, past) for i, past, _ in samples] == [(i, lengths[i] + s) for i in range(2) for s in range(3)]
    assert summary["steps"] == 6 and all(ms > 0 for _, _, ms in samples)

    path = tmp_path / "latency.csv"
    path.write_text("prompt,past_length,decode_ms\n" + "".join(f"{i},{p},{ms}\n" for i, p, ms in samples))
    by_length = latency_by_past_length(read_rows(path))
    assert [length for length, _, _ in by_length] == sorted({p for _, p, _ in samples})
    assert all(median <= worst for _, median, worst in by_length)
    assert save_figure(latency_figure(read_rows(path), "test"), tmp_path / "latency.png").stat().st_size > 0
