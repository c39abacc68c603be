"""The second real-model month (tasks/real_model/docstrings.py): standard-library docstrings -> their package."""

from __future__ import annotations

from tasks.real_model.docstrings import MAX_CHARS, PACKAGES, PER_CLASS, SYSTEM, package_summaries, write_month
from tasks.records import SPLITS, heldout_overlaps, is_chat, read_jsonl, read_text_corpus
from tasks.stages.data import check_month


def test_the_docstrings_month_is_balanced_disjoint_seeded_chat_rows_and_its_heldout_prose_is_not_trained_on(tmp_path):
    month = write_month(tmp_path / "month", seed=0)
    files = sorted(p.name for p in month.iterdir())
    again = write_month(tmp_path / "again", seed=0)
    assert all((month / name).read_bytes() == (again / name).read_bytes() for name in files)  # deterministic
    assert (write_month(tmp_path / "other", seed=1) / "train.jsonl").read_bytes() != (month / "train.jsonl").read_bytes()
    check_month(month)  # what the data stage accepts

    assert tuple(PER_CLASS) == SPLITS
    written = {package: package_summaries(package) for package in PACKAGES}
    seen: set[str] = set()
    rows = {split: read_jsonl(month / f"{split}.jsonl") for split in SPLITS}
    for split, per_class in PER_CLASS.items():
        assert all(is_chat(ex) and ex.prompt.messages[0] == {"role": "system", "content": SYSTEM} for ex in rows[split])
        texts = [ex.prompt.messages[-1]["content"] for ex in rows[split]]
        assert len(set(texts)) == len(texts) and not seen & set(texts)  # distinct within and across splits
        seen |= set(texts)
        assert sorted(ex.completion for ex in rows[split]) == sorted(PACKAGES * per_class)  # balanced
        for text, ex in zip(texts, rows[split]):
            assert ex.rule == ex.completion and len(text.split()) >= 8 and len(text) <= MAX_CHARS
            # the label is the source's: the package whose code holds this docstring, and no other of the six
            assert [p for p in PACKAGES if text in written[p]] == [ex.completion], text
    assert (len(rows["train"]), len(rows["test"])) == (480, 48)

    heldout = read_text_corpus(month / "heldout.txt")
    assert len(heldout) == 16 and all(line.endswith(".") for line in heldout)
    trained = [ex.text for ex in rows["train"]]
    assert heldout_overlaps(trained, heldout) == []  # no held-out paragraph inside a training row
    assert not [t for t in seen if any(t in line for line in heldout)]  # and no row inside a held-out paragraph
    rehearsal = read_text_corpus(month / "rehearsal.txt")
    assert rehearsal and heldout_overlaps(rehearsal, heldout) == []
