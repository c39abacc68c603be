"""The package stage: refuses ungated candidates, writes a signed release, its tarball and the checks."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from release_testkit import world

from runtime.release.signing import generate_key, key_id, load_private_key
from runtime.release.verify import load_trusted_keys, release_probes, verify_release
from tasks.stages.package import build_release, main, select_probes

GATES = {"passed": True, "gates": [
    {"name": "accuracy_new", "value": 0.97, "threshold": 0.95, "op": ">=", "passed": True, "detail": "engine"},
    {"name": "package_pct_of_base", "value": None, "threshold": 2.0, "op": "<=", "passed": True, "detail": "later"}]}


PREDICTIONS = [{"prompt": f"inspect part=R{i} verdict:", "completion": f" {verdict}", "adapter_on_engine": f"{verdict}{tail}"}
               for i, (verdict, tail) in enumerate([("pass", ""), ("fail", " rework"), ("fail", "\n"), ("pass", " ")])]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    return world(tmp_path_factory)


@pytest.fixture()
def stage(w, tmp_path, monkeypatch):
    """A params file and the month's stage inputs laid out as the earlier stages write them."""
    monkeypatch.delenv("RELEASE_SIGNING_KEY", raising=False)
    month = tmp_path / "artifacts" / "2026-11"
    shutil.copytree(w["root"] / "adapter-2026-11", month / "finetune" / "adapter")
    (month / "eval").mkdir()
    (month / "eval" / "metrics.json").write_text(json.dumps({
        "month": "2026-11", "base": {"accuracy": 0.4, "per_rule": {"void": 0.1}},
        "adapter": {"accuracy": 0.98, "accuracy_new": 0.97, "perplexity": 2.5}}))
    (month / "eval" / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PREDICTIONS))
    params = {"data": {"month": "2026-11", "dir": str(tmp_path / "data")},
              "base_model": {"source": "local", "path": str(w["tokenizer"])},
              "train": {"output_dir": str(tmp_path / "artifacts"), "threads": 1},
              "engine": {"dir": str(w["engine"]), "threads": 1, "kv_cache": "float", "kv_block_size": 0, "mixed_adapters": False},  # the world's float engine
              "publish": {"signing_key": str(tmp_path / "keys" / "release_signing.key")}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return {"params": tmp_path / "params.yaml", "month": month, "key": tmp_path / "keys" / "release_signing.key"}


def write_gates(month: Path, report: dict) -> None:
    (month / "gates").mkdir(exist_ok=True)
    (month / "gates" / "gates.json").write_text(json.dumps(report))


def test_a_candidate_without_a_gate_report_is_refused(stage, capsys):
    assert main(["--params", str(stage["params"])]) == 2
    assert "gates/gates.json is missing: the gates stage must pass" in capsys.readouterr().err
    assert not (stage["month"] / "package").exists()


def test_a_candidate_whose_gates_failed_is_refused(stage, capsys):
    failed = {"passed": False, "gates": [GATES["gates"][0] | {"value": 0.80, "passed": False}]}
    write_gates(stage["month"], failed)
    assert main(["--params", str(stage["params"])]) == 2
    assert "gates did not pass: accuracy_new (0.8 >= 0.95)" in capsys.readouterr().err
    assert not (stage["month"] / "package").exists()


def test_the_stage_packages_signs_and_checks_the_release(w, stage):
    write_gates(stage["month"], GATES)
    assert main(["--params", str(stage["params"])]) == 0

    package = stage["month"] / "package"
    release, check = package / "release", json.loads((package / "check.json").read_text())
    adapter = stage["month"] / "finetune" / "adapter"
    for name in ("adapter_config.json", "adapter_model.safetensors", "provenance.json"):
        assert (release / name).read_bytes() == (adapter / name).read_bytes()  # PEFT files unchanged
    assert sorted(p.name for p in release.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json", "manifest.sig", "provenance.json"]
    with tarfile.open(package / "release.tar.gz") as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar} == {p.name: p.read_bytes() for p in release.iterdir()}

    sizes = sum(p.stat().st_size for p in release.iterdir())
    base = sum(p.stat().st_size for p in Path(w["tokenizer"]).glob("*.safetensors"))
    assert check["package_bytes"] == sizes and check["base_bytes"] == base
    assert check["pct_of_base"] == round(100 * sizes / base, 4)
    assert check["verify"]["ok"] is True and check["verify"]["release_id"] == check["release_id"]
    q = check["load_and_query"]
    assert q["ok"] is True and q["release_id"] == check["release_id"] and isinstance(q["output"], str) and q["seconds"] > 0

    key = stage["key"]
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.with_suffix(".pub").exists()
    manifest = json.loads((release / "manifest.json").read_text())
    assert manifest["signing_key_id"] == key_id(load_private_key(key).public_key())
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert manifest["pipeline"]["git_revision"] == head
    assert manifest["gates"]["verdicts"]["accuracy_new"] == {"op": ">=", "passed": True, "threshold": 0.95, "value": 0.97}
    assert manifest["metrics"] == {"adapter": {"accuracy": 0.98, "accuracy_new": 0.97, "perplexity": 2.5},
                                   "base": {"accuracy": 0.4}}
    assert verify_release(release, load_trusted_keys([key.with_suffix(".pub")])).release_id == check["release_id"]
    # the probes: the test rows the engine answered right (whitespace aside), with the test split's answer
    assert manifest["probes"] == [{"prompt": PREDICTIONS[i]["prompt"], "expected": PREDICTIONS[i]["completion"],
                                   "max_tokens": 8} for i in (0, 2, 3)]
    assert (q["probes"], q["probes_passed"]) == (3, 0)  # these rows were not the tiny world's answers


def test_a_missing_or_damaged_predictions_file_is_refused_naming_it(stage, capsys):
    write_gates(stage["month"], GATES)
    predictions = stage["month"] / "eval" / "predictions.jsonl"
    predictions.write_text('{"prompt": "p"}\n')
    assert main(["--params", str(stage["params"])]) == 2
    assert f"not a prediction row: {predictions}:1: missing field 'completion'" in capsys.readouterr().err
    predictions.unlink()
    assert main(["--params", str(stage["params"])]) == 2
    assert f"{predictions} is missing: run python -m tasks.stages.evaluate first" in capsys.readouterr().err


def test_the_same_inputs_and_time_give_the_same_bytes(w, stage, tmp_path):
    write_gates(stage["month"], GATES)
    now = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
    m = stage["month"]
    outs = [build_release(m / "finetune" / "adapter", m / "eval" / "metrics.json", m / "gates" / "gates.json",
                          w["engine"], w["tokenizer"], tmp_path / f"out{i}", stage["key"], "2026-11", threads=1, now=now)
            for i in range(2)]
    for name in ("release/manifest.json", "release/manifest.sig", "release.tar.gz"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    manifest = json.loads((outs[0] / "release" / "manifest.json").read_text())
    assert manifest["release_id"] == "2026-11+20261130T120000Z" and manifest["expires_at"] == "2027-03-30T12:00:00Z"


def test_the_signing_key_comes_from_the_environment_when_set(stage, tmp_path, monkeypatch):
    write_gates(stage["month"], GATES)
    env_key = tmp_path / "vault" / "signing.key"
    generate_key(env_key)
    monkeypatch.setenv("RELEASE_SIGNING_KEY", str(env_key))
    assert main(["--params", str(stage["params"])]) == 0
    manifest = json.loads((stage["month"] / "package" / "release" / "manifest.json").read_text())
    assert manifest["signing_key_id"] == key_id(load_private_key(env_key).public_key())
    assert not stage["key"].exists()  # the configured path was not used, nor created


def test_a_chat_rows_probe_is_its_messages_which_the_device_renders_with_the_template(w, tmp_path):
    from runtime.engine.tokenizer import DeviceTokenizer

    chat = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "U+0041 LATIN CAPITAL LETTER A"}]
    rows = [{"messages": [*chat, {"role": "assistant", "content": "uppercase"}], "adapter_on_engine": "uppercase"},
            {"messages": [*chat, {"role": "assistant", "content": "digit"}], "adapter_on_engine": "mark"}]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    probes = select_probes(predictions, 4)
    assert probes == [{"messages": chat, "expected": "uppercase", "max_tokens": 4}]

    tokenizer_dir = shutil.copytree(w["tokenizer"], tmp_path / "with-template")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (tokenizer_dir / "chat_template.jinja").write_text(template)
    tokenizer = DeviceTokenizer(tokenizer_dir)
    [probe] = release_probes({"probes": probes})
    rendered = "system: Answer in one word.\nuser: U+0041 LATIN CAPITAL LETTER A\nassistant:"
    assert probe.encode(tokenizer) == tokenizer.encode(rendered)  # as /v1/chat/completions renders it
