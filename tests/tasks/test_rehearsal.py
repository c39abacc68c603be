"""Rehearsal (issue 40, item 2): a share of each fine-tune batch is general text, never the held-out text."""

import json
import shutil

import pytest

import tasks.training as training
from tasks.config import ConfigError, DataConfig, LoraSection, TrainConfig, parse_config
from tasks.models import load_tokenizer
from tasks.records import REHEARSAL_TEXT, DataError, heldout_overlaps, read_text_corpus
from tasks.stages.data import generate_month, prepare_data
from tasks.stages.finetune import finetune

LORA = LoraSection(r=4, alpha=8)
TRAIN = TrainConfig(steps=4, batch_size=4, warmup_steps=1, threads=1, eval_every=0, device="cpu")
GENERAL = [  # documents as a text corpus reads them back: stripped
    ("The quick brown fox jumps over the lazy dog, and the dog does not mind at all. " * 6).strip(),
    ("A list is a mutable sequence; a tuple is an immutable one. Both hold any objects, in order. " * 5).strip(),
]


@pytest.fixture(scope="module")
def month_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "2026-11"
    return generate_month(DataConfig(train_size=32, val_size=8, calib_size=8, test_size=8, heldout_lines=8), "2026-10", out)


def with_rehearsal(month_dir, tmp_path, documents: list[str]):
    """A copy of the month with a rehearsal text of these documents, as the data stage writes it."""
    month = shutil.copytree(month_dir, tmp_path / "month")
    (month / REHEARSAL_TEXT).write_text("\n".join(documents) + "\n")
    return month


def test_the_share_is_rows_of_each_batch_and_needs_general_text():
    assert TrainConfig(batch_size=8, rehearsal_share=0.25).rehearsal_rows == 2
    assert TrainConfig(batch_size=8).rehearsal_rows == 0
    with pytest.raises(ValueError, match=r"rehearsal_share 0.01 of batch_size 8 is 0 text row\(s\)"):
        TrainConfig(batch_size=8, rehearsal_share=0.01)
    with pytest.raises(ValueError, match=r"3 text row\(s\) per batch, not a multiple of processes \(2\)"):
        TrainConfig(batch_size=8, processes=2, rehearsal_share=0.375)
    with pytest.raises(ConfigError, match=r"the embedded default has no general text to rehearse"):
        parse_config({"train": {"rehearsal_share": 0.25}})
    local = {"base_model": {"source": "local", "path": "/srv/model"}, "train": {"rehearsal_share": 0.25}}
    with pytest.raises(ConfigError, match=r"train.rehearsal_share 0.25 needs data.rehearsal_text"):
        parse_config(local)
    assert parse_config(local | {"data": {"rehearsal_text": "/srv/text.txt"}}).train.rehearsal_rows == 8
    with pytest.raises(ConfigError, match=r"data.rehearsal_text: 'data/text.txt' overlaps data.dir"):
        parse_config({"data": {"rehearsal_text": "data/text.txt"}})


def test_the_data_stage_copies_the_rehearsal_text_and_refuses_a_missing_one(tmp_path):
    small = DataConfig(train_size=8, val_size=4, calib_size=4, test_size=4, heldout_lines=4)
    (tmp_path / "general.txt").write_text("\n".join(GENERAL) + "\n")
    out = prepare_data(small.model_copy(update={"rehearsal_text": str(tmp_path / "general.txt")}), "2026-10",
                       tmp_path / "a")
    assert read_text_corpus(out / REHEARSAL_TEXT) == GENERAL
    with pytest.raises(DataError, match=r"missing.txt: text corpus not found"):
        prepare_data(small.model_copy(update={"rehearsal_text": str(tmp_path / "missing.txt")}), "2026-10",
                     tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_every_batch_holds_the_configured_share_of_text_rows(tiny_llama_dir, month_dir, tmp_path, monkeypatch):
    batches = []
    loss = training.completion_loss

    def recording(model, batch, prompt_loss_weight):
        batches.append({k: v.clone() for k, v in batch.items()})
        return loss(model, batch, prompt_loss_weight)

    monkeypatch.setattr(training, "completion_loss", recording)
    train = TRAIN.model_copy(update={"batch_size": 8, "rehearsal_share": 0.25, "eval_every": 4})
    finetune(tiny_llama_dir, with_rehearsal(month_dir, tmp_path, GENERAL), tmp_path / "ft", LORA, train, "abc")
    steps, validations = batches[:4], batches[4:]
    tokenizer = load_tokenizer(tiny_llama_dir)
    pieces = {tuple(ids) for text in GENERAL for ids, _ in training.encode_text(tokenizer, text, train.max_seq_len)}
    assert len(pieces) >= 4  # the documents are cut into pieces of max_seq_len tokens
    for batch in steps:
        text = batch["text_row"]
        assert text.tolist() == [False] * 6 + [True] * 2  # 0.25 of 8 rows
        for row in range(6, 8):
            real = batch["attention_mask"][row].bool()
            assert tuple(batch["input_ids"][row][real].tolist()) in pieces
            assert batch["completion_mask"][row][real].all()  # the loss learns every token of the text
        for row in range(6):  # a task row learns its answer only
            assert batch["completion_mask"][row].sum() < batch["attention_mask"][row].sum()
    assert validations and not any(batch["text_row"].any() for batch in validations)  # val rows are the task's
    metrics = json.loads((tmp_path / "ft" / "train_metrics.json").read_text())
    assert (metrics["rehearsal_rows_per_batch"], metrics["rehearsal_documents"]) == (2, 2)


def test_a_heldout_paragraph_inside_the_rehearsal_text_is_refused_naming_it(tiny_llama_dir, month_dir, tmp_path):
    heldout = read_text_corpus(month_dir / "heldout.txt")
    spaced = "  ".join(heldout[3].split())  # the same text, other whitespace
    month = with_rehearsal(month_dir, tmp_path, [GENERAL[0], f"Some words first. {spaced} And after.", GENERAL[1]])
    train = TRAIN.model_copy(update={"rehearsal_share": 0.25})
    with pytest.raises(DataError) as refused:
        finetune(tiny_llama_dir, month, tmp_path / "ft", LORA, train, "abc")
    message = str(refused.value)
    assert f"{month / REHEARSAL_TEXT} (data.rehearsal_text): 1 held-out text(s) of {month / 'heldout.txt'}" in message
    assert f"line 2 holds {heldout[3][:60]!r}" in message
    assert not (tmp_path / "ft").exists()
    with pytest.raises(DataError, match=r"rehearsal.txt: not found: train.rehearsal_share needs data.rehearsal_text"):
        finetune(tiny_llama_dir, month_dir, tmp_path / "ft", LORA, train, "abc")


def test_without_a_heldout_file_the_val_rows_are_kept_out(month_dir, tmp_path):
    from tasks.records import read_jsonl
    from tasks.stages.finetune import rehearsal_texts

    val = read_jsonl(month_dir / "val.jsonl")[0].text
    month = with_rehearsal(month_dir, tmp_path, [GENERAL[0] + " " + val])
    (month / "heldout.txt").unlink()
    with pytest.raises(DataError, match=r"1 held-out text\(s\) of .*val.jsonl inside rehearsal documents: line 1"):
        rehearsal_texts(month)


def test_rehearsal_off_changes_nothing(tiny_llama_dir, month_dir, tmp_path):
    # Share 0 (the default): the rehearsal text is not even read (this one would be refused), the same adapter.
    leaking = with_rehearsal(month_dir, tmp_path, read_text_corpus(month_dir / "heldout.txt"))
    plain = finetune(tiny_llama_dir, month_dir, tmp_path / "a", LORA, TRAIN, "abc")
    beside = finetune(tiny_llama_dir, leaking, tmp_path / "b", LORA, TRAIN, "abc")
    weights = "adapter_model.safetensors"
    assert (plain / weights).read_bytes() == (beside / weights).read_bytes()
    assert "rehearsal_rows_per_batch" not in json.loads((tmp_path / "a" / "train_metrics.json").read_text())
    # ... and rehearsal on trains another adapter from the same seed.
    on = finetune(tiny_llama_dir, with_rehearsal(month_dir, tmp_path / "c", GENERAL), tmp_path / "c" / "ft", LORA,
                  TRAIN.model_copy(update={"rehearsal_share": 0.25}), "abc")
    assert (on / weights).read_bytes() != (plain / weights).read_bytes()


def test_the_loss_weighs_text_and_task_rows_by_their_share_of_the_batch_not_by_their_tokens():
    import math

    import torch

    class FavoursFour(torch.nn.Module):  # logits (0, 0, 0, 0, 3) everywhere: token 4 costs L - 3, any other L
        def forward(self, input_ids, attention_mask):
            logits = torch.zeros(*input_ids.shape, 5)
            logits[..., 4] = 3.0
            return type("Out", (), {"logits": logits})()

    L = math.log(4 + math.exp(3))
    task = ([1, 2, 3, 1], [False, False, True, True])  # learns two tokens, neither a 4: mean L
    text = ([4] * 8, [True] * 8)  # learns seven 4s: mean L - 3
    batch = training.collate([task, task, task, text], pad_id=0, text_rows=1)
    assert batch["text_row"].tolist() == [False, False, False, True]
    assert training.completion_loss(FavoursFour(), batch, 0.0).item() == pytest.approx(0.75 * L + 0.25 * (L - 3))
    # Without text rows the loss is the task's alone, as before rehearsal existed.
    plain = training.collate([task, task, task], pad_id=0)
    assert training.completion_loss(FavoursFour(), plain, 0.0).item() == pytest.approx(L)


def test_each_rank_draws_its_equal_slice_of_the_same_seeded_order():
    import random

    orders = [[3], [3]]
    slices = [training._draw(orders[rank], 10, 4, random.Random(0), rank, 2) for rank in range(2)]
    assert slices[0][0] == 3 and len(slices[0]) == len(slices[1]) == 2 and not set(slices[0]) & set(slices[1])
    assert orders[0] == orders[1] and len(orders[0]) == 11 - 4  # one shuffled pass of 10 added, 4 taken
    assert training._draw([], 10, 0, random.Random(0), 0, 2) == []  # no rehearsal: nothing drawn, nothing shuffled


def test_the_real_profiles_rehearsal_text_holds_none_of_its_heldout_paragraphs():
    from tasks.real_model.month import heldout_paragraphs, rehearsal_documents
    from tasks.real_model.text import real_documents

    heldout = heldout_paragraphs()
    documents = rehearsal_documents(heldout)
    topics = [" ".join(t.split()) for n, t in real_documents("calib", min_chars=0) if n.startswith("topic:")]
    assert heldout_overlaps(documents, heldout) == []
    assert heldout_overlaps(topics, heldout)  # the calib split's topics do hold some: they were left out
    assert set(documents) < set(topics) and len(documents) >= 20
