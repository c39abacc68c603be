"""``dvc.yaml`` declares the folders of ``tasks/layout.py``, and git ignores every one of them."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from runtime.engine.interface import INTERFACE_FILE
from tasks.config import load_config, parse_config
from tasks.layout import ArtifactLayout

REPO = Path(__file__).resolve().parents[2]
PARAMS = yaml.safe_load((REPO / "params.yaml").read_text())
LAYOUT = load_config(REPO / "params.yaml").layout


def interpolate(text: str) -> Path:
    """A dvc.yaml path with its ``${section.key}`` read from params.yaml, as DVC does."""
    def value(match: re.Match) -> str:
        section, key = match[1].split(".")
        return str(PARAMS[section][key])

    return Path(re.sub(r"\$\{(\w+\.\w+)\}", value, text))


def paths(entries: list) -> list[Path]:
    """The paths of a dvc.yaml list, whose entries are a path or {path: options}."""
    return [interpolate(next(iter(e)) if isinstance(e, dict) else e) for e in entries]


def is_code(dep: str) -> bool:
    return dep.endswith(".py") or Path(dep).parts[0] in ("tasks", "runtime", "kernels")


DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())
STAGES = DVC["stages"]


def test_each_stage_writes_the_folder_the_layout_names():
    outs = {name: paths(stage.get("outs", [])) for name, stage in STAGES.items()}
    assert outs == {
        "data": [LAYOUT.data_dir],
        "base_model": [LAYOUT.base_model_dir],
        "compile": [LAYOUT.engine_dir],
        "finetune": [LAYOUT.finetune_dir],
        "calibrate": [LAYOUT.kv_dir],
        "evaluate": [LAYOUT.eval_dir],
        "gates": [LAYOUT.gates_dir],
        "package": [LAYOUT.package_dir],
    }
    assert paths(STAGES["compile"]["metrics"]) == [LAYOUT.engine_build_file]


def test_each_stage_depends_on_the_folders_it_reads():
    deps = {name: [p for p, raw in zip(paths(stage["deps"]), stage["deps"]) if not is_code(raw)]
            for name, stage in STAGES.items()}
    engine_interface = LAYOUT.engine_dir / INTERFACE_FILE
    assert deps == {
        "data": [],
        "base_model": [],
        "compile": [LAYOUT.base_model_dir],
        "finetune": [LAYOUT.base_model_dir, LAYOUT.data_dir, engine_interface],
        "calibrate": [LAYOUT.base_model_dir],  # a note of the release's pages: nothing month's is read
        "evaluate": [LAYOUT.base_model_dir, LAYOUT.data_dir, LAYOUT.engine_dir, LAYOUT.finetune_dir],
        "gates": [LAYOUT.eval_dir],
        "package": [LAYOUT.finetune_dir, LAYOUT.eval_dir, LAYOUT.gates_dir, LAYOUT.engine_dir],
    }


def plot_files(entries: list) -> list[Path]:
    """The data files of dvc.yaml's plots: {path: options}, or {name: options} whose ``y`` maps files to fields."""
    files = []
    for entry in entries:
        name, options = next(iter(entry.items()))
        files += list(options["y"]) if isinstance(options.get("y"), dict) else [name]
    return [interpolate(f) for f in files]


def test_metrics_and_plots_are_files_of_the_layouts_folders():
    from tasks.plots import KV_GRID_CSV, LATENCY_CSV, LOSS_CSV, VAL_LOSS_CSV

    assert paths(DVC["metrics"]) == [LAYOUT.metrics_file, LAYOUT.gates_file]
    assert plot_files(DVC["plots"]) == [LAYOUT.finetune_dir / LOSS_CSV, LAYOUT.finetune_dir / VAL_LOSS_CSV,
                                        LAYOUT.eval_dir / LATENCY_CSV, LAYOUT.eval_dir / KV_GRID_CSV]


@pytest.mark.parametrize("engine, serving", [
    ({}, "engine/kvpages-paged16-stacked"),
    ({"weights": "int4"}, "engine/kvpages-paged16-stacked-int4"),
    ({"kv_cache": "float"}, "engine/paged16-stacked"),
    ({"mixed_adapters": False}, "engine/kvpages-paged16"),
    ({"kv_cache": "float", "kv_block_size": 0}, "engine/stacked"),
    ({"kv_block_size": 0, "mixed_adapters": False, "kv_cache": "float"}, "engine"),
    ({"kv_block_size": 0, "mixed_adapters": False, "kv_cache": "float", "weights": "int8"}, "engine/int8"),
    ({"kv_block_size": 0, "mixed_adapters": False, "kv_cache": "float", "weights": "int4", "backend": "tensorrt"},
     "engine/int4-qdq_fp16"),
    ({"kv_cache": "float", "kv_block_size": 32, "mixed_adapters": False}, "engine/paged32"),
])
def test_every_serving_engine_lies_in_the_compile_stages_output(engine, serving):
    # A DVC output must exist after its stage: one folder holds whichever engines the settings build.
    layout = parse_config({"engine": engine}).layout
    assert layout.serving_engine_dir == Path(serving)
    assert layout.serving_engine_dir.is_relative_to(layout.engine_dir)


def test_the_layout_follows_the_configured_roots():
    layout = parse_config({"data": {"month": "2027-01", "dir": "d"}, "train": {"output_dir": "out"},
                           "engine": {"dir": "eng"}}).layout
    assert layout == ArtifactLayout(data_dir=Path("d/2027-01"), output_dir=Path("out"), release_dir=Path("out/2027-01"),
                                    engine_dir=Path("eng"), serving_engine_dir=Path("eng/kvpages-paged16-stacked"))
    assert layout.package_release_dir == Path("out/2027-01/package/release")
    assert layout.engine_build_file == Path("out/engine_build.json")  # the engine is not the month's


def test_git_ignores_every_generated_path():
    # A release on a clone must leave git clean but for dvc.lock: every output, and what the flow writes.
    cfg = load_config(REPO / "params.yaml")
    generated = [*(p for stage in STAGES.values() for p in paths(stage.get("outs", []))), LAYOUT.engine_build_file,
                 Path(cfg.publish.registry_dir), Path(cfg.publish.remote_dir), Path(cfg.publish.signing_key).parent,
                 Path(cfg.publish.artifacts_dir), Path(cfg.publish.tracking_uri.removeprefix("sqlite:///"))]
    probes = [str(p / "probe") for p in generated]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *probes], cwd=REPO, capture_output=True, text=True)
    assert sorted(ignored.stdout.split()) == sorted(probes)
