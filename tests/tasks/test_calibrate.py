"""The calibrate stage: a release ships no KV scales (quantized pages seal their own on the device), so the stage
writes a note of what the release's cache is, without loading a model, and refuses bad ``kv`` settings."""

import json

import yaml

from tasks.layout import KV_DISABLED_FILE, KV_PAGES_FILE
from tasks.stages.calibrate import main


def params(tmp_path, model_dir, **sections) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"base_model": {"source": "local", "path": str(model_dir)},
                                    "train": {"output_dir": str(tmp_path / "artifacts")}} | sections))
    return str(path)


def test_the_stage_notes_the_pages_of_the_release_and_their_group_on_this_backbone(tiny_llama_dir, tmp_path, capsys):
    """The tiny Llama's heads are 8 channels wide: narrower than kv.v_group_size 64, so a value group is a head."""
    assert main(["--params", params(tmp_path, tiny_llama_dir, kv={"k_bits": 3, "v_bits": 8})]) == 0
    kv_dir = tmp_path / "artifacts" / "2026-11" / "kv"
    assert sorted(p.name for p in kv_dir.iterdir()) == [KV_PAGES_FILE]
    note = json.loads((kv_dir / KV_PAGES_FILE).read_text())
    assert note["kv_cache"] == "quantized_pages" and note["pages"] == {"k_bits": 3, "v_bits": 8, "v_group_size": 8}
    assert note["layer_kl_budget"] is None  # one width everywhere unless the compile stage calibrates per layer
    assert "no KV scales to calibrate: quantized pages take each page's scales" in capsys.readouterr().out


def test_with_kv_disabled_the_stage_reads_no_model_and_says_so(tmp_path, capsys):
    """A float-cache profile: no base model is read (none exists here)."""
    assert main(["--params", params(tmp_path, tmp_path / "no-model", engine={"kv_cache": "float"},
                                    kv={"enabled": False})]) == 0
    kv_dir = tmp_path / "artifacts" / "2026-11" / "kv"
    assert sorted(p.name for p in kv_dir.iterdir()) == [KV_DISABLED_FILE]
    assert json.loads((kv_dir / KV_DISABLED_FILE).read_text())["kv_enabled"] is False
    assert "no KV scales to calibrate: kv.enabled is false" in capsys.readouterr().out


def test_cli_refuses_bad_kv_settings_and_the_removed_static_scheme_naming_the_key(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text("kv:\n  k_bits: 9\n")
    assert main(["--params", str(path)]) == 2
    assert "kv.k_bits: Input should be less than or equal to 8" in capsys.readouterr().err
    path.write_text("engine:\n  kv_cache: quantized\nkv:\n  clip_percentile: 99.0\n")
    assert main(["--params", str(path)]) == 2
    err = capsys.readouterr().err
    assert "engine.kv_cache: Value error, the static quantized cache was removed" in err
    assert "kv.clip_percentile" in err
