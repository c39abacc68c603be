import math

import pytest
from transformers import AutoModelForCausalLM

from tasks.base_model import load_tokenizer
from tasks.data import Example
from tasks.evaluate import accuracy_report, perplexity


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
