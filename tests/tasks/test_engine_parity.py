"""The acceptance check runs end to end: tokenizer, test split, engine, PyTorch + PEFT merged."""

from __future__ import annotations

from engine_testkit import make_adapter, make_model

from tasks.checks.engine_parity import engine_parity
from tasks.records import Example, write_jsonl
from tasks.stages.base_model import train_tokenizer
from tasks.stages.compile import compile_engine

TEXTS = [f"board B{i} line L{i % 3} part P{i % 5} defect solder void {i * 7 % 100} -> " for i in range(40)]


def test_engine_matches_peft_merged_on_a_test_split(tmp_path):
    model_dir = make_model(tmp_path / "base", "qwen2", vocab_size=320)
    train_tokenizer(TEXTS, vocab_size=320, out_dir=model_dir)
    adapter = make_adapter(model_dir, tmp_path / "adapter", r=4)
    write_jsonl(tmp_path / "test.jsonl", [Example(prompt=t, completion="ok") for t in TEXTS[:6]])
    compile_engine(model_dir, tmp_path / "engine", max_rank=8)

    metrics = engine_parity(model_dir, adapter, tmp_path / "engine", tmp_path / "test.jsonl",
                            max_new_tokens=6, batch_size=4, out_path=tmp_path / "parity.json")

    assert metrics["prompts"] == 6
    assert metrics["max_abs_logit_diff"] <= 1e-4 and metrics["passed"]
    assert metrics["greedy_identical"] is True and metrics["greedy_mismatches"] == []
