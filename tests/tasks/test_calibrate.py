"""The calibration stage: scales for base + this month's adapter, and every refusal of a scale file."""

import json
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from engine_testkit import make_adapter
from safetensors.torch import load_file, save_file

from kernels.kv_quant import QuantizedKVCache
from kernels.kv_spec import PRE_ROPE_SCHEME, KVQuantSpec
from runtime.engine.adapter_config import ADAPTER_WEIGHTS, AdapterError
from runtime.engine.hashing import backbone_hash, sha256_file
from runtime.engine.kv_scales import KV_SCALES_FILE, KV_SCALES_JSON, KVScales, KVScalesError, read_kv_scales
from tasks.inspection import rulebook, sample_examples
from tasks.kv_stats import cache_kwargs
from tasks.records import write_jsonl
from tasks.stages.calibrate import calibrate_kv_scales, main, save_kv_scales


@pytest.fixture(scope="module")
def release(tiny_llama_dir, tmp_path_factory):
    """A base (tiny Llama with tokenizer), two adapters for it, a calib split and one calibration."""
    root = tmp_path_factory.mktemp("calib")
    adapter = make_adapter(tiny_llama_dir, root / "adapter", seed=1)
    other = make_adapter(tiny_llama_dir, root / "other_adapter", seed=2)
    calib = root / "calib.jsonl"
    write_jsonl(calib, sample_examples(rulebook("2026-11", 1234, 2), 24, random.Random(0)))
    out = calibrate_kv_scales(tiny_llama_dir, adapter, calib, root / "kv", PRE_ROPE_SCHEME, batch_size=8)
    return dict(base=tiny_llama_dir, adapter=adapter, other=other, calib=calib, out=out, root=root,
                sha=sha256_file(adapter / ADAPTER_WEIGHTS), base_hash=backbone_hash(tiny_llama_dir))


def _load(r, path=None, **kw):
    args = dict(adapter_sha256=r["sha"], base_model_hash=r["base_hash"])
    return read_kv_scales(path or r["out"].parent, **(args | kw))


def _copy(r, tmp_path):
    dst = tmp_path / "kv"
    shutil.copytree(r["out"].parent, dst)
    return dst


def test_calibration_writes_scales_and_how_they_were_computed(release):
    out = release["out"]
    assert out.name == KV_SCALES_FILE and (out.parent / KV_SCALES_JSON).exists()
    record = json.loads((out.parent / KV_SCALES_JSON).read_text())
    assert record["split"] == "calib" and record["rows"] == 24 and record["tokens"] > 24 * 10
    assert record["clip_percentile"] == 99.0  # DEFAULT_CLIP_PERCENTILE
    assert record["spec"] == PRE_ROPE_SCHEME.to_dict()
    assert record["base_model_hash"] == release["base_hash"]
    assert record["adapter_sha256"] == release["sha"]
    assert record["interface"] == ""
    tensors = load_file(str(out))
    # per-channel values too (ORT's GroupQueryAttention takes them); no v_zero: values are symmetric
    assert set(tensors) == {f"layer.{i}.{n}" for i in range(2) for n in ("k_scale", "k_zero", "v_scale")}
    assert tensors["layer.0.k_scale"].shape == (2, 8)  # (kv heads, head dim)
    assert all(torch.isfinite(t).all() and (t > 0).all() for n, t in tensors.items() if n.endswith("scale"))


def test_loaded_scales_drive_the_reference_cache(release):
    scales = _load(release)
    assert scales.k_scale.shape == (2, 2, 8) and scales.k_zero is not None and scales.v_zero is None
    cache = QuantizedKVCache(KVQuantSpec.from_dict(scales.spec), 2, 8, torch.ones(4), **cache_kwargs(scales))
    cache.append(0, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.arange(5)[None])
    assert cache.get(0)[0].shape == (1, 2, 5, 8)


def test_a_new_adapter_gets_new_scales(release, tmp_path):
    out = calibrate_kv_scales(release["base"], release["other"], release["calib"], tmp_path / "kv", PRE_ROPE_SCHEME)
    a, b = load_file(str(release["out"])), load_file(str(out))
    assert not torch.equal(a["layer.1.k_scale"], b["layer.1.k_scale"])
    with pytest.raises(KVScalesError) as err:  # the first adapter's scales do not serve the second
        _load(release, adapter_sha256=sha256_file(release["other"] / ADAPTER_WEIGHTS))
    assert err.value.reason == "adapter_mismatch"


def test_clipping_narrows_the_range(release, tmp_path):
    out = calibrate_kv_scales(release["base"], release["adapter"], release["calib"], tmp_path / "kv",
                              PRE_ROPE_SCHEME, clip_percentile=95.0)
    clipped, full = load_file(str(out)), load_file(str(release["out"]))
    assert (clipped["layer.0.k_scale"] <= full["layer.0.k_scale"] + 1e-6).all()
    assert (clipped["layer.0.k_scale"] < full["layer.0.k_scale"]).any()
    assert json.loads((out.parent / KV_SCALES_JSON).read_text())["clip_percentile"] == 95.0


def test_refuses_a_missing_file(release, tmp_path):
    with pytest.raises(KVScalesError, match="never defaulted to 1.0") as err:
        _load(release, tmp_path / "nowhere")
    assert err.value.reason == "missing"
    dst = _copy(release, tmp_path)
    (dst / KV_SCALES_JSON).unlink()
    with pytest.raises(KVScalesError) as err:
        _load(release, dst)
    assert err.value.reason == "missing"


def _tamper(release, tmp_path, name, value):
    from safetensors import safe_open

    dst = _copy(release, tmp_path)
    with safe_open(str(dst / KV_SCALES_FILE), framework="pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(dst / KV_SCALES_FILE))
    tensors[name][0, 3] = value
    save_file(tensors, str(dst / KV_SCALES_FILE), metadata=meta)
    return dst


@pytest.mark.parametrize("value, reason", [(float("nan"), "non_finite"), (float("inf"), "non_finite"), (0.0, "zero"),
                                           (-0.5, "zero")])
def test_refuses_non_finite_and_zero_scales(release, tmp_path, value, reason):
    dst = _tamper(release, tmp_path, "layer.1.k_scale", value)
    with pytest.raises(KVScalesError, match="layer.1.k_scale") as err:
        _load(release, dst)
    assert err.value.reason == reason


def test_refuses_a_non_finite_zero_point(release, tmp_path):
    dst = _tamper(release, tmp_path, "layer.0.k_zero", float("nan"))
    with pytest.raises(KVScalesError) as err:
        _load(release, dst)
    assert err.value.reason == "non_finite"


def test_refuses_another_backbone_interface_or_spec(release):
    with pytest.raises(KVScalesError) as err:
        _load(release, base_model_hash="0" * 64)
    assert err.value.reason == "base_mismatch"
    with pytest.raises(KVScalesError) as err:
        _load(release, interface="abc123")
    assert err.value.reason == "interface_mismatch"
    with pytest.raises(KVScalesError) as err:
        _load(release, spec=replace(PRE_ROPE_SCHEME, k_bits=3).to_dict())
    assert err.value.reason == "spec_mismatch"
    assert _load(release, interface="", spec=PRE_ROPE_SCHEME.to_dict()).spec == PRE_ROPE_SCHEME.to_dict()


def test_refuses_a_record_that_disagrees_with_the_tensors(release, tmp_path):
    dst = _copy(release, tmp_path)
    record = json.loads((dst / KV_SCALES_JSON).read_text())
    record["adapter_sha256"] = "f" * 64  # someone edited the JSON to make old scales look current
    (dst / KV_SCALES_JSON).write_text(json.dumps(record))
    with pytest.raises(KVScalesError) as err:
        _load(release, dst, adapter_sha256="f" * 64)
    assert err.value.reason == "malformed"


def test_refuses_missing_layer_tensors(release, tmp_path):
    from safetensors import safe_open

    dst = _copy(release, tmp_path)
    with safe_open(str(dst / KV_SCALES_FILE), framework="pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(dst / KV_SCALES_FILE))
    del tensors["layer.1.k_zero"]
    save_file(tensors, str(dst / KV_SCALES_FILE), metadata=meta)
    with pytest.raises(KVScalesError, match="layer.1.k_zero") as err:
        _load(release, dst)
    assert err.value.reason == "malformed"


def test_never_writes_bad_scales(tmp_path):
    spec = PRE_ROPE_SCHEME.to_dict()
    bad = KVScales(spec, np.zeros((2, 2, 8), np.float32), None, np.ones((2, 2, 8), np.float32), None, {"spec": spec})
    with pytest.raises(KVScalesError) as err:
        save_kv_scales(tmp_path / "kv", bad)
    assert err.value.reason == "zero"
    assert not (tmp_path / "kv").exists()


def test_refuses_an_adapter_made_for_another_backbone(release, tmp_path):
    wrong = make_adapter(release["base"], tmp_path / "wrong", base_hash="0" * 64)
    with pytest.raises(AdapterError, match="backbone"):
        calibrate_kv_scales(release["base"], wrong, release["calib"], tmp_path / "kv", PRE_ROPE_SCHEME)
    assert not (tmp_path / "kv").exists()


def test_cli_reads_the_kv_section_of_params(release, tmp_path):
    month = tmp_path / "data" / "2026-11"
    month.mkdir(parents=True)
    shutil.copyfile(release["calib"], month / "calib.jsonl")
    shutil.copytree(release["adapter"], tmp_path / "artifacts" / "2026-11" / "finetune" / "adapter")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "data": {"dir": str(tmp_path / "data")},
        "base_model": {"source": "local", "path": str(release["base"])},
        "train": {"output_dir": str(tmp_path / "artifacts"), "threads": 1},
        "engine": {"dir": str(tmp_path / "no-engine"), "kv_cache": "quantized"},  # the static scheme ships scales
        "kv": {"k_bits": 3, "v_bits": 5},
    }))
    assert main(["--params", str(params)]) == 0
    record = json.loads((tmp_path / "artifacts" / "2026-11" / "kv" / KV_SCALES_JSON).read_text())
    assert (record["spec"]["k_bits"], record["spec"]["v_bits"]) == (3, 5)
    assert record["interface"] == ""  # no engine compiled in this test: nothing to bind to


def test_with_kv_disabled_the_stage_calibrates_nothing_and_says_so(tmp_path, capsys):
    """A float-cache profile: no base model or adapter is read (none exists here), no scales are written."""
    from runtime.engine.kv_scales import KV_SCALES_FILE
    from tasks.stages.calibrate import KV_DISABLED_FILE

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "base_model": {"source": "local", "path": str(tmp_path / "no-model")},
        "train": {"output_dir": str(tmp_path / "artifacts")},
        "engine": {"kv_cache": "float"},
        "kv": {"enabled": False},
    }))
    assert main(["--params", str(params)]) == 0
    kv_dir = tmp_path / "artifacts" / "2026-11" / "kv"
    assert sorted(p.name for p in kv_dir.iterdir()) == [KV_DISABLED_FILE]
    assert json.loads((kv_dir / KV_DISABLED_FILE).read_text())["kv_enabled"] is False
    assert not (kv_dir / KV_SCALES_FILE).exists()
    assert "no KV scales to calibrate: kv.enabled is false" in capsys.readouterr().out


def test_cli_refuses_bad_kv_settings_naming_the_key(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("kv:\n  k_bits: 9\n")
    assert main(["--params", str(params)]) == 2
    assert "kv.k_bits: Input should be less than or equal to 8" in capsys.readouterr().err


def test_calibration_binds_scales_to_the_compiled_engine_interface(release, tmp_path):
    """An adapter bound to a compiled engine is checked against that engine, and so are its scales."""
    from runtime.engine.interface import read_interface
    from tasks.stages.compile import compile_engine

    engine_dir = tmp_path / "engine"
    compile_engine(release["base"], engine_dir, max_rank=8, ort_threads=1)
    iface_hash = read_interface(engine_dir).lora_contract_hash
    bound = tmp_path / "bound"
    shutil.copytree(release["adapter"], bound)
    provenance = json.loads((bound / "provenance.json").read_text())
    (bound / "provenance.json").write_text(json.dumps(provenance | {"engine_interface_hash": iface_hash}))

    out = calibrate_kv_scales(release["base"], bound, release["calib"], tmp_path / "kv", PRE_ROPE_SCHEME, engine_dir=engine_dir)
    assert json.loads((out.parent / KV_SCALES_JSON).read_text())["interface"] == iface_hash

    (bound / "provenance.json").write_text(json.dumps(provenance | {"engine_interface_hash": "f" * 64}))
    with pytest.raises(AdapterError, match="adapter records engine interface ffffffffffff"):
        calibrate_kv_scales(release["base"], bound, release["calib"], tmp_path / "kv2", PRE_ROPE_SCHEME, engine_dir=engine_dir)
    assert not (tmp_path / "kv2").exists()


def test_the_same_scales_are_the_same_bytes_in_every_process(release, tmp_path):
    """safetensors writes its metadata map in hash order, which changes per process; DVC hashes the
    file, so equal scales written by two runs must be equal bytes (else every later stage re-runs)."""
    code = (
        "import sys; from pathlib import Path; from runtime.engine.kv_scales import read_kv_scales, write_kv_scales; "
        "s = read_kv_scales(Path(sys.argv[1]), sys.argv[2], sys.argv[3]); out = Path(sys.argv[4]); out.mkdir(); "
        "write_kv_scales(out, s)"
    )
    written = []
    for i in range(4):
        out = tmp_path / f"run{i}"
        subprocess.run([sys.executable, "-c", code, str(release["out"].parent), release["sha"], release["base_hash"],
                        str(out)], check=True, cwd=Path(__file__).resolve().parents[2])
        written.append((out / KV_SCALES_FILE).read_bytes())
    assert len(set(written)) == 1
    assert _load(release, tmp_path / "run0").k_scale.tobytes() == _load(release).k_scale.tobytes()


def _random_batches(vocab: int = 96, rows: int = 4, length: int = 24) -> list:
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, vocab, (rows, length)))
    return [(ids, torch.ones_like(ids))]


def test_calibration_turns_a_layer_when_the_turned_cache_quantizes_its_calibration_kv_closer(tiny_llama_dir):
    from bench.quality.kv_schemes import inject_key_outliers
    from kernels.kv_quant import hadamard_matrix
    from runtime.engine.model import load_backbone
    from tasks.kv_stats import ROTATION_MIN_GAIN, choose_rotation, collect_kv_stats

    backbone = inject_key_outliers(load_backbone(tiny_llama_dir), factor=50.0)  # the float model is unchanged
    stats, rotation, record = choose_rotation(backbone, _random_batches(), KVQuantSpec(), 99.0)
    assert min(record["key_outlier_ratio"]) > 10  # what it saw, before turning
    chosen = ["hadamard" if h < n * (1 - ROTATION_MIN_GAIN) else "none"
              for h, n in zip(record["kv_error_hadamard"], record["kv_error_none"])]
    assert record["rotation"] == chosen and len(chosen) == 2
    turned = collect_kv_stats(backbone, _random_batches(), False, 99.0, progress=False,
                              rotation=hadamard_matrix(8).expand(2, 8, 8))
    plain = collect_kv_stats(backbone, _random_batches(), False, 99.0, progress=False)
    for i, name in enumerate(chosen):
        assert torch.equal(stats["k_hi"][i], (turned if name == "hadamard" else plain)["k_hi"][i])
        if rotation is not None:
            assert torch.equal(rotation[i], hadamard_matrix(8) if name == "hadamard" else torch.eye(8))
    assert (rotation is None) == (chosen == ["none", "none"])


def test_keys_cached_before_rope_are_never_turned(tiny_llama_dir):
    from runtime.engine.model import load_backbone
    from tasks.kv_stats import choose_rotation

    _, rotation, record = choose_rotation(load_backbone(tiny_llama_dir), _random_batches(), PRE_ROPE_SCHEME, 99.0)
    assert rotation is None and record["rotation"] == ["none", "none"] and "kv_error_hadamard" not in record


def test_a_rotation_is_stored_with_the_scales_and_a_file_without_one_reads_as_none(release, tmp_path):
    from kernels.kv_quant import hadamard_matrix

    old = _load(release)
    assert old.rotation is None and np.array_equal(old.rotation_or_identity(), np.stack([np.eye(8, dtype=np.float32)] * 2))
    turned = replace(old, rotation=hadamard_matrix(8).expand(2, 8, 8).numpy())
    save_kv_scales(tmp_path / "kv", turned)
    assert np.array_equal(_load(release, tmp_path / "kv").rotation, turned.rotation)


def test_never_writes_a_rotation_that_is_not_orthogonal(release, tmp_path):
    skewed = replace(_load(release), rotation=np.stack([np.eye(8, dtype=np.float32) * 1.01] * 2))
    with pytest.raises(KVScalesError, match="layer.0.rotation is not an orthogonal square matrix") as err:
        save_kv_scales(tmp_path / "kv", skewed)
    assert err.value.reason == "malformed" and not (tmp_path / "kv").exists()
