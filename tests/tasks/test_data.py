import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.engine.tokenizer import ChatPrompt
from tasks.config import DataConfig
from tasks.inspection import DEFECTS, changed_rules, rulebook
from tasks.records import DataError, read_jsonl, read_text_corpus
from tasks.stages.data import generate_month, import_month, prepare_data

SMALL = DataConfig(train_size=40, val_size=8, calib_size=8, test_size=16, heldout_lines=8)
REPO = Path(__file__).resolve().parents[2]


def month_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_generator_is_deterministic_for_a_seed(tmp_path):
    generate_month(SMALL, "2026-10", tmp_path / "a")
    generate_month(SMALL, "2026-10", tmp_path / "b")
    generate_month(SMALL.model_copy(update={"seed": 7}), "2026-10", tmp_path / "c")
    assert month_bytes(tmp_path / "a") == month_bytes(tmp_path / "b")
    assert month_bytes(tmp_path / "a")["train.jsonl"] != month_bytes(tmp_path / "c")["train.jsonl"]


def test_generator_writes_every_split_with_all_rules(tmp_path):
    out = generate_month(SMALL, "2026-10", tmp_path / "2026-11")
    assert sorted(p.name for p in out.iterdir()) == [
        "calib.jsonl", "heldout.txt", "rulebook.json", "test.jsonl", "train.jsonl", "val.jsonl",
    ]
    test = read_jsonl(out / "test.jsonl")
    assert len(test) == 16
    assert {ex.rule for ex in test} == set(DEFECTS)
    assert len(read_text_corpus(out / "heldout.txt")) == 8


def test_each_month_changes_the_configured_number_of_rules_and_keeps_the_rest():
    changed = changed_rules("2026-11", "2026-10", seed=1234, rules_changed_per_month=2)
    assert len(changed) == 2
    old, new = rulebook("2026-10", 1234, 2), rulebook("2026-11", 1234, 2)
    assert all(old[d] == new[d] for d in DEFECTS if d not in changed)


def test_changed_rules_give_a_different_verdict_on_every_record(tmp_path):
    out = generate_month(SMALL.model_copy(update={"test_size": 200}), "2026-10", tmp_path / "m")
    old = rulebook("2026-10", SMALL.seed, SMALL.rules_changed_per_month)
    test = read_jsonl(out / "test.jsonl")
    changed_rows = [ex for ex in test if ex.changed]
    assert len(changed_rows) == 50  # 2 of 8 rules, equally represented
    for ex in test:
        measurement = int(ex.prompt.split()[-2].split("=")[1])
        old_verdict = old[ex.rule].verdict(measurement)
        assert (ex.completion.strip() != old_verdict) == ex.changed


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "completion": " b"', "not valid JSON"),
        ('{"prompt": "a"}', "missing field 'completion'"),
        ('{"completion": "b"}', "missing field 'prompt'"),
        ('{"prompt": "", "completion": "b"}', "field 'prompt' must be a non-empty string"),
        ('{"prompt": 3, "completion": "b"}', "field 'prompt' must be a non-empty string"),
        ('["prompt", "completion"]', "expected a JSON object, got list"),
        ('{"prompt": "a", "completion": "b", "changed": "yes"}', "field 'changed' must be true or false"),
        ('{"messages": [{"role": "user", "content": "a"}]}', "at least two messages"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
         "the last message must be the assistant's answer, got role 'user'"),
        ('{"messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]}',
         "messages[0].role must be one of system, user, assistant, got 'tool'"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}',
         "messages[1].content must be a non-empty string"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}',
         "messages[1] must be an object with exactly 'role' and 'content'"),
        ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}',
         "no system or user turn"),
    ],
)
def test_bad_row_is_reported_with_file_and_line(tmp_path, line, message):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "ok", "completion": " PASS"}\n\n' + line + "\n")
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def test_empty_split_is_an_error(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(DataError, match=r"val\.jsonl: split is empty"):
        read_jsonl(path)


def test_user_month_is_imported_whole_or_not_at_all(tmp_path):
    src = tmp_path / "mine"
    src.mkdir()
    row = json.dumps({"prompt": "is it ok?", "completion": " yes"})
    for split in ("train", "val", "calib"):
        (src / f"{split}.jsonl").write_text(row + "\n")
    (src / "test.jsonl").write_text(row + "\n" + '{"prompt": "x"}\n')
    out = tmp_path / "data" / "2026-12"
    with pytest.raises(DataError, match=r"test\.jsonl:2: missing field 'completion'"):
        import_month(src, out)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []

    (src / "test.jsonl").write_text(row + "\n")
    import_month(src, out)
    assert read_jsonl(out / "test.jsonl")[0].completion == " yes"


def test_cli_exits_nonzero_and_names_the_bad_key(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("data:\n  month: november\n")
    result = subprocess.run(
        [sys.executable, "-m", "tasks.stages.data", "--params", str(params)],
        cwd=REPO, capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "data.month: Value error, must be a month written YYYY-MM, got 'november'" in result.stderr


def test_rows_that_mix_labelled_and_unlabelled_are_refused_naming_the_file_and_line(tmp_path):
    src = tmp_path / "mine"
    src.mkdir()
    unlabelled = json.dumps({"prompt": "is it ok?", "completion": " yes"})
    labelled = json.dumps({"prompt": "is it ok?", "completion": " yes", "changed": True})
    for split in ("train", "val", "calib", "test"):
        (src / f"{split}.jsonl").write_text(unlabelled + "\n")
    (src / "calib.jsonl").write_text(unlabelled + "\n\n" + labelled + "\n")
    out = tmp_path / "data" / "2026-12"
    with pytest.raises(DataError, match=r"calib\.jsonl:3: row has a 'changed' field but .*train\.jsonl:1 has none"):
        import_month(src, out)
    assert not out.exists()

    (src / "calib.jsonl").write_text(unlabelled + "\n")
    import_month(src, out)  # unlabelled throughout: accepted, the gates read overall accuracy
    assert read_jsonl(out / "calib.jsonl")[0].changed is None


CHAT_ROW = {"messages": [{"role": "system", "content": "Answer yes or no."}, {"role": "user", "content": "is it ok?"},
                         {"role": "assistant", "content": "yes"}], "rule": "ok"}


def test_a_chat_row_is_its_messages_before_the_answer_and_the_answer(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps(CHAT_ROW) + "\n")
    [ex] = read_jsonl(path)
    assert ex.prompt == ChatPrompt(tuple(CHAT_ROW["messages"][:2]))
    assert (ex.completion, ex.rule) == ("yes", "ok")
    assert ex.to_json() == CHAT_ROW  # what predictions.jsonl and a chat month write back


def test_a_file_mixing_chat_and_prompt_completion_rows_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(CHAT_ROW) + "\n" + json.dumps({"prompt": "is it ok?", "completion": " yes"}) + "\n")
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value) == (f"{path}:2: a 'prompt'/'completion' row in a file of 'messages' rows (line 1); "
                              "one format per file")


def write_month(src: Path, row: dict) -> Path:
    src.mkdir()
    for split in ("train", "val", "calib", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    return src


def test_prompt_format_chat_writes_prompt_completion_rows_as_one_user_turn(tmp_path):
    src = write_month(tmp_path / "mine", {"prompt": "is it ok?", "completion": " yes"})
    cfg = DataConfig(jsonl_dir=str(src), prompt_format="chat")
    prepare_data(cfg, "2026-10", tmp_path / "chat", chat_template=True)
    assert json.loads((tmp_path / "chat" / "test.jsonl").read_text()) == {
        "messages": [{"role": "user", "content": "is it ok?"}, {"role": "assistant", "content": "yes"}]}
    # unset: chat where the tokenizer has a template, the bytes as given where it has none
    prepare_data(cfg.model_copy(update={"prompt_format": None}), "2026-10", tmp_path / "default", chat_template=True)
    assert (tmp_path / "default" / "test.jsonl").read_bytes() == (tmp_path / "chat" / "test.jsonl").read_bytes()
    for fmt, template in (("raw", True), (None, False)):
        out = tmp_path / f"raw-{fmt}"
        prepare_data(cfg.model_copy(update={"prompt_format": fmt}), "2026-10", out, chat_template=template)
        assert (out / "test.jsonl").read_bytes() == (src / "test.jsonl").read_bytes()


def test_chats_without_a_chat_template_are_refused(tmp_path):
    src = write_month(tmp_path / "mine", CHAT_ROW)
    with pytest.raises(DataError, match=r"train\.jsonl:1: a 'messages' row, but the base model's tokenizer has no chat"):
        prepare_data(DataConfig(jsonl_dir=str(src)), "2026-10", tmp_path / "out", chat_template=False)
    with pytest.raises(DataError, match="data.prompt_format: chat needs a base model whose tokenizer has a chat template"):
        prepare_data(DataConfig(prompt_format="chat"), "2026-10", tmp_path / "out", chat_template=False)
    assert not (tmp_path / "out").exists()
