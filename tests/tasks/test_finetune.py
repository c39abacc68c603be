import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from runtime.engine.hashing import backbone_hash
from tasks.config import DataConfig, LoraSection, TrainConfig
from tasks.stages.data import generate_month
from tasks.stages.finetune import finetune
from tasks.training import TrainingDiverged

LORA = LoraSection(r=4, alpha=8)
TRAIN = TrainConfig(steps=4, batch_size=4, warmup_steps=1, threads=1, eval_every=3)


@pytest.fixture(scope="module")
def month_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "2026-11"
    return generate_month(DataConfig(train_size=32, val_size=8, calib_size=8, test_size=8, heldout_lines=8), "2026-10", out)


def test_user_llama_directory_fine_tunes_into_a_loadable_peft_adapter(tmp_path, tiny_llama_dir, month_dir):
    adapter = finetune(tiny_llama_dir, month_dir, tmp_path / "ft", LORA, TRAIN, params_hash="abc")
    assert sorted(p.name for p in adapter.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "provenance.json",
    ]
    provenance = json.loads((adapter / "provenance.json").read_text())
    assert provenance["base_model_hash"] == backbone_hash(tiny_llama_dir)
    assert provenance["params_hash"] == "abc"
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert len(tensors) == 2 * 4 * 2  # A and B, 4 modules, 2 layers
    assert all(name.endswith(("lora_A.weight", "lora_B.weight")) for name in tensors)
    # B starts at zero in PEFT; after training it must not be, or the adapter would do nothing.
    assert any(t.abs().sum() > 0 for n, t in tensors.items() if "lora_B" in n)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    loaded = PeftModel.from_pretrained(base, adapter)
    assert loaded.peft_config["default"].r == 4
    losses = (tmp_path / "ft" / "loss.csv").read_text().splitlines()
    assert losses[0] == "step,train_loss" and [row.split(",")[0] for row in losses[1:]] == ["1", "2", "3", "4"]
    # Validation every eval_every steps and after the last: steps 3 and 4 of 4.
    val = (tmp_path / "ft" / "val_loss.csv").read_text().splitlines()
    assert val[0] == "step,val_loss" and [row.split(",")[0] for row in val[1:]] == ["3", "4"]
    assert all(float(row.split(",")[1]) > 0 for row in val[1:])
    metrics = json.loads((tmp_path / "ft" / "train_metrics.json").read_text())
    assert metrics["final_val_loss"] == pytest.approx(float(val[-1].split(",")[1]), abs=1e-6)
    assert (tmp_path / "ft" / "loss.png").stat().st_size > 0


def test_non_finite_loss_stops_training_and_writes_no_adapter(tmp_path, tiny_llama_dir, month_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_llama_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(broken / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 1"):
        finetune(broken, month_dir, tmp_path / "ft", LORA, TRAIN, params_hash="abc")
    assert not (tmp_path / "ft").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["broken"]


def test_target_module_missing_from_the_model_is_a_config_error(tmp_path, tiny_llama_dir, month_dir):
    from tasks.config import ConfigError

    with pytest.raises(ConfigError, match=r"lora\.target_modules: \['qkv_proj'\] not found"):
        finetune(tiny_llama_dir, month_dir, tmp_path / "ft", LoraSection(target_modules=("qkv_proj",)), TRAIN, "x")
    assert not (tmp_path / "ft").exists()


def test_adapter_is_bound_to_the_compiled_engine_and_a_foreign_engine_is_refused(tmp_path, tiny_llama_dir, month_dir):
    from runtime.engine.interface import read_interface
    from tasks.stages.compile import compile_engine

    compile_engine(tiny_llama_dir, tmp_path / "engine", max_rank=4, ort_threads=1)
    adapter = finetune(tiny_llama_dir, month_dir, tmp_path / "ft", LORA, TRAIN, "abc", engine_dir=tmp_path / "engine")
    provenance = json.loads((adapter / "provenance.json").read_text())
    assert provenance["engine_interface_hash"] == read_interface(tmp_path / "engine").lora_contract_hash

    other = tmp_path / "other_base"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    model.save_pretrained(other)
    compile_engine(other, tmp_path / "other_engine", max_rank=4, ort_threads=1)
    from tasks.config import ConfigError

    with pytest.raises(ConfigError, match=r"other_engine: engine was compiled for another backbone"):
        finetune(tiny_llama_dir, month_dir, tmp_path / "ft2", LORA, TRAIN, "abc", engine_dir=tmp_path / "other_engine")
    assert not (tmp_path / "ft2").exists()


def test_the_same_seed_gives_the_same_adapter_bytes_on_the_cpu(tmp_path, tiny_llama_dir, month_dir):
    cpu = TRAIN.model_copy(update={"device": "cpu"})
    first = finetune(tiny_llama_dir, month_dir, tmp_path / "a", LORA, cpu, params_hash="abc")
    second = finetune(tiny_llama_dir, month_dir, tmp_path / "b", LORA, cpu, params_hash="abc")
    weights = "adapter_model.safetensors"
    assert (first / weights).read_bytes() == (second / weights).read_bytes()
    provenance = json.loads((first / "provenance.json").read_text())
    assert (provenance["device"], provenance["precision"], provenance["processes"]) == ("cpu", "fp32", 1)
    # A different seed trains another adapter: the equality above is the seed's doing, not a constant.
    other = finetune(tiny_llama_dir, month_dir, tmp_path / "c", LORA, cpu.model_copy(update={"seed": 1}), "abc")
    assert (other / weights).read_bytes() != (first / weights).read_bytes()


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the GPU on this machine")
def test_auto_trains_on_the_cpu_without_a_gpu_and_says_why(tmp_path, tiny_llama_dir, month_dir, capsys):
    adapter = finetune(tiny_llama_dir, month_dir, tmp_path / "ft", LORA, TRAIN, params_hash="abc")
    assert "fine-tune: device cpu, fp32 (train.device: auto and torch.cuda.is_available() is False" \
        in capsys.readouterr().err
    metrics = json.loads((tmp_path / "ft" / "train_metrics.json").read_text())
    assert (metrics["device"], metrics["precision"], metrics["processes"]) == ("cpu", "fp32", 1)
    assert json.loads((adapter / "provenance.json").read_text())["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_asked_for_without_a_gpu_is_a_config_error_before_training(tmp_path, tiny_llama_dir, month_dir):
    from tasks.config import ConfigError

    with pytest.raises(ConfigError, match=r"train\.device: cuda, but torch\.cuda\.is_available\(\) is False"):
        finetune(tiny_llama_dir, month_dir, tmp_path / "ft", LORA, TRAIN.model_copy(update={"device": "cuda"}), "abc")
    assert not (tmp_path / "ft").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
def test_on_a_gpu_the_adapter_trains_under_bf16_autocast_and_stays_fp32(tmp_path, tiny_llama_dir, month_dir):
    adapter = finetune(tiny_llama_dir, month_dir, tmp_path / "ft", LORA, TRAIN.model_copy(update={"device": "cuda"}),
                       "abc")
    provenance = json.loads((adapter / "provenance.json").read_text())
    assert provenance["device"] == "cuda"
    assert provenance["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}  # autocast computes in bf16, the weights stay fp32
    assert any(t.abs().sum() > 0 for n, t in tensors.items() if "lora_B" in n)
    cpu = finetune(tiny_llama_dir, month_dir, tmp_path / "cpu", LORA, TRAIN.model_copy(update={"device": "cpu"}), "abc")
    gpu_val, cpu_val = (json.loads((d.parent / "train_metrics.json").read_text())["final_val_loss"] for d in (adapter, cpu))
    assert gpu_val == pytest.approx(cpu_val, rel=0.05)


@pytest.mark.slow  # two fine-tune stages through their command, one on 2 gloo ranks: about 2 min on 2 busy cores
def test_two_processes_train_the_global_batch_to_the_val_loss_of_one(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    import yaml

    from tasks.config import load_config
    from tasks.stages.base_model import prepare_base_model
    from tasks.stages.data import run_stage as write_data

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # a project: the embedded default is built at its models/base
    settings = {
        "data": {"train_size": 320, "val_size": 64, "calib_size": 16, "test_size": 16, "heldout_lines": 16},
        "base_model": {"pretrain_examples": 600, "pretrain_steps": 40, "pretrain_batch_size": 16},
        "train": {"steps": 24, "batch_size": 16, "warmup_steps": 2, "eval_every": 12, "threads": 1},
    }
    for processes in (1, 2):
        run = {**settings, "train": {**settings["train"], "processes": processes, "output_dir": f"out{processes}"}}
        Path(f"p{processes}.yaml").write_text(yaml.safe_dump(run))
    cfg = load_config("p1.yaml")
    write_data(cfg)
    prepare_base_model(cfg)
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    val, metrics = {}, {}
    for processes in (1, 2):
        done = subprocess.run([sys.executable, "-m", "tasks.stages.finetune", "--params", f"p{processes}.yaml"], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        finetune_dir = load_config(f"p{processes}.yaml").layout.finetune_dir
        metrics[processes] = json.loads((finetune_dir / "train_metrics.json").read_text())
        val[processes] = metrics[processes]["final_val_loss"]
        steps = [row.split(",")[0] for row in (finetune_dir / "loss.csv").read_text().splitlines()[1:]]
        assert steps == [str(s) for s in range(1, 25)]  # written once, by rank 0: no duplicate rows
    assert "fine-tune: device cpu, fp32" in done.stderr and "2 process(es)" in done.stderr
    assert (metrics[1]["processes"], metrics[2]["processes"]) == (1, 2)
    provenance = json.loads((load_config("p2.yaml").layout.adapter_dir / "provenance.json").read_text())
    assert provenance["processes"] == 2
    # The same global batch and steps: the ranks' averaged gradients are the batch's, up to the token
    # weighting of each half and float order, so the adapter reaches the same validation loss.
    assert val[2] == pytest.approx(val[1], rel=0.05)
    assert val[1] < metrics[1]["final_loss"] * 10  # it trained: a finite, sane loss, not a default
