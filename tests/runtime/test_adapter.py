"""Every adapter the engine must not run is refused before inference, with a message that says why."""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_testkit import make_adapter, make_model
from safetensors.numpy import load_file, save_file

from runtime.engine.adapter import load_adapter
from runtime.engine.adapter_config import AdapterError
from runtime.engine.hashing import backbone_hash
from runtime.engine.interface import build_interface
from runtime.engine.model import read_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def iface(tiny_qwen):
    return build_interface(read_config(tiny_qwen), backbone_hash(tiny_qwen), 8, TARGETS)


def rewrite_tensor(adapter_dir, key_part, fn):
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if key_part in k)
    tensors[key] = fn(tensors[key])
    save_file(tensors, path)
    return key


def test_valid_adapter_becomes_padded_engine_inputs(iface, qwen_adapter):
    lora = load_adapter(qwen_adapter, iface)
    assert set(lora) == set(iface.lora_names)
    assert lora["lora_A.1.o_proj"].shape == (8, 64) and lora["lora_B.1.o_proj"].shape == (64, 8)
    assert np.abs(lora["lora_A.1.o_proj"][:4]).sum() > 0 and not lora["lora_A.1.o_proj"][4:].any()
    raw = load_file(qwen_adapter / "adapter_model.safetensors")
    raw_bo = next(v for k, v in raw.items() if "layers.1.self_attn.o_proj.lora_B" in k)
    np.testing.assert_allclose(lora["lora_B.1.o_proj"][:, :4], 2.0 * raw_bo)  # alpha 8 / r 4, folded into B
    assert lora["lora_A.0.q_proj+k_proj+v_proj"].shape == (24, 64) and lora["lora_B.0.q_proj+k_proj+v_proj"].shape == (128, 24)


def test_rank_above_max_rank_is_refused(tiny_qwen, iface, tmp_path):
    adapter = make_adapter(tiny_qwen, tmp_path / "a", r=16, alpha=16.0)
    with pytest.raises(AdapterError, match="rank 16 exceeds the engine's max rank 8"):
        load_adapter(adapter, iface)


def test_target_module_outside_the_interface_is_refused(tiny_qwen, iface, tmp_path):
    adapter = make_adapter(tiny_qwen, tmp_path / "a", targets=("q_proj", "gate_proj"))
    with pytest.raises(AdapterError, match=r"target modules \['gate_proj'\] are not LoRA inputs"):
        load_adapter(adapter, iface)


def test_wrong_tensor_shape_is_refused(tiny_qwen, iface, tmp_path):
    adapter = make_adapter(tiny_qwen, tmp_path / "a")
    key = rewrite_tensor(adapter, "layers.0.self_attn.k_proj.lora_B", lambda t: np.zeros((40, 4), np.float32))
    with pytest.raises(AdapterError, match=rf"{key}' has shape \(40, 4\), expected \(32, 4\)"):
        load_adapter(adapter, iface)


def test_non_finite_values_are_refused(tiny_qwen, iface, tmp_path):
    adapter = make_adapter(tiny_qwen, tmp_path / "a")
    rewrite_tensor(adapter, "layers.1.self_attn.v_proj.lora_A", lambda t: np.where(t > 0, np.nan, t).astype(t.dtype))
    with pytest.raises(AdapterError, match="layers.1.self_attn.v_proj.lora_A.weight' has non-finite values"):
        load_adapter(adapter, iface)


def test_adapter_for_another_backbone_is_refused(tiny_qwen, iface, tmp_path):
    other = make_model(tmp_path / "other", "qwen2", seed=7)
    adapter = make_adapter(tiny_qwen, tmp_path / "a", base_hash=backbone_hash(other))
    with pytest.raises(AdapterError, match="adapter was made for backbone .* but the engine runs backbone"):
        load_adapter(adapter, iface)


def test_adapter_recording_another_interface_is_refused(tiny_qwen, iface, tmp_path):
    adapter = make_adapter(tiny_qwen, tmp_path / "a")
    prov = json.loads((adapter / "provenance.json").read_text()) | {"engine_interface_hash": "0" * 64}
    (adapter / "provenance.json").write_text(json.dumps(prov))
    with pytest.raises(AdapterError, match="adapter records engine interface 000000000000 but the engine has"):
        load_adapter(adapter, iface)


def test_adapter_without_provenance_is_refused(tiny_qwen, iface, tmp_path):
    adapter = make_adapter(tiny_qwen, tmp_path / "a")
    (adapter / "provenance.json").unlink()
    with pytest.raises(AdapterError, match="provenance.json is missing"):
        load_adapter(adapter, iface)


def test_every_problem_is_reported_at_once(tiny_qwen, iface, tmp_path):
    other = make_model(tmp_path / "other", "qwen2", seed=7)
    adapter = make_adapter(tiny_qwen, tmp_path / "a", r=16, alpha=16.0, base_hash=backbone_hash(other))
    with pytest.raises(AdapterError) as err:
        load_adapter(adapter, iface)
    assert "made for backbone" in str(err.value) and "exceeds the engine's max rank" in str(err.value)
