"""``make gpu-check`` (bench/engine/gpu_check.py): a dry run without a GPU, and its parts that run on a CPU."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.engine.gpu_check import Unavailable, finetune_part, finetune_summary, need_real_profile
from tasks.config import parse_config

REPO = Path(__file__).resolve().parents[2]
PARTS = ["finetune/default", "finetune/real", "tensorrt/default", "tensorrt/real", "torch_tensorrt/default"]


def has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def make_recipe() -> list[str]:
    """The command of the Makefile's gpu-check target, with $(PY) as this interpreter."""
    recipe = re.search(r"^gpu-check:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M)[1]
    return [sys.executable if word == "$(PY)" else word for word in recipe.split()]


@pytest.mark.skipif(torch.cuda.is_available() or has_tensorrt(), reason="this machine can run the GPU parts")
def test_without_a_gpu_make_gpu_check_is_a_dry_run_that_says_what_each_part_needs(tmp_path):
    cmd = make_recipe()
    assert cmd[1:4] == ["-m", "bench.engine.gpu_check", "--skip-unavailable"]
    done = subprocess.run([*cmd, "--out", str(tmp_path / "gpu_check.json")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["parts"]) == PARTS
    assert {name: part["status"] for name, part in report["parts"].items()} == dict.fromkeys(PARTS, "skipped")
    no_cuda = f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__})"
    assert report["parts"]["finetune/default"]["reason"] == no_cuda
    assert report["parts"]["finetune/real"]["reason"] == no_cuda
    assert all("tensorrt is not installed" in report["parts"][name]["reason"] for name in PARTS[2:])
    assert report["passed"] is False and report["latency_ms"] == {}
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:]] == PARTS  # one table: a header, then a row per part
    assert "DRY RUN (every part skipped)" in done.stdout


@pytest.mark.skipif(has_tensorrt(), reason="TensorRT is installed here")
def test_without_skip_unavailable_a_machine_without_tensorrt_cannot_run_here(tmp_path):
    # bench.run_all records exit 2 with "cannot run here" as a skipped benchmark, not a failure.
    done = subprocess.run([sys.executable, "-m", "bench.engine.gpu_check", "--out", str(tmp_path / "g.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "gpu_check: cannot run here: tensorrt is not installed" in done.stderr
    assert not (tmp_path / "g.json").exists()


def test_the_real_model_part_is_unavailable_without_its_profile_or_checkpoint(tmp_path):
    with pytest.raises(Unavailable, match=r"absent\.yaml: no real-model profile"):
        need_real_profile(tmp_path / "absent.yaml")
    profile = tmp_path / "profile.yaml"
    profile.write_text(f"base_model: {{source: local, path: {tmp_path / 'no-model'}}}\n")
    with pytest.raises(Unavailable, match=r"the real-model directory base_model\.path .*no-model is absent"):
        need_real_profile(profile)


def test_the_finetune_part_compares_speed_and_val_loss_of_two_devices(tmp_path, monkeypatch):
    # Both on the CPU here (the part's code, not a GPU's numbers): the same seed gives the same adapter.
    monkeypatch.chdir(tmp_path)
    cfg = parse_config({
        "data": {"train_size": 32, "val_size": 8, "calib_size": 8, "test_size": 8, "heldout_lines": 8},
        "base_model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                       "intermediate_size": 64, "pretrain_examples": 32, "pretrain_steps": 3, "pretrain_batch_size": 4},
        "train": {"batch_size": 4, "warmup_steps": 1, "eval_every": 2, "threads": 1},
    })
    part = finetune_part(cfg, tmp_path / "work", steps=4, tolerance=0.05, accelerated="cpu")
    assert part["passed"] is True and part["val_loss_rel_diff"] == 0.0
    for role in ("cpu", "accelerated"):
        assert (part[role]["device"], part[role]["precision"], part[role]["steps"]) == ("cpu", "fp32", 4)
        assert part[role]["steps_per_s"] > 0 and part[role]["final_val_loss"] > 0
    assert finetune_summary(part).startswith("cpu fp32 ")
    assert f"val loss {part['cpu']['final_val_loss']:.4f} vs {part['cpu']['final_val_loss']:.4f} (0.00%)" \
        in finetune_summary(part)
