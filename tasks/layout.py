"""Where every stage of the monthly release reads and writes: one frozen layout built from the config.

Stages, the flow's decisions (``tasks/release/steps.py``) and the benchmarks take their paths from here;
``dvc.yaml`` declares the same folders as outputs and dependencies (``tests/tasks/test_layout.py``
holds the two together). Paths are relative to the project root, as DVC runs the stages there::

    models/base/                     the base_model stage (the embedded default; a card for a local model)
    <data.dir>/<month>/              the data stage: train/val/calib/test.jsonl, held-out text
    <engine.dir>/                    the compile stage: the float engine of the backbone, and inside it
        kvpages-paged16-stacked/     the serving engine: quantized pages (engine.kv_cache: quantized_pages) of a paged
                                     cache (engine.kv_block_size: 16), stacked adapters (engine.mixed_adapters);
                                     paged16-stacked/, paged16/, stacked/ with a float cache
        kvpages-paged16-stacked-int4/...  weight-quantized copies of the serving engine (engine.weights; int8-qdq_fp16/ for TensorRT)
    <train.output_dir>/engine_build.json   what the compile stage built (not per month: the engine is not)
    <train.output_dir>/<month>/
        finetune/adapter/            the LoRA adapter, PEFT's files
        kv/                          the calibrate stage's note: the pages' scheme (their scales are the device's)
        eval/metrics.json            evaluation on PyTorch and on the serving engine
        gates/gates.json             the gate verdicts
        package/release/, check.json the signed release and its check

Every variant engine sits inside ``<engine.dir>`` so that one DVC output holds whichever of them the
settings build: a DVC output must exist after its stage, and which variants exist depends on the config.
Names of the files inside an adapter, a release or an engine belong to their formats, not to this layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The base_model stage's output: the embedded default is built here; with ``source: local`` it holds
# only the card that records the user's checkpoint, which is never an output.
BASE_MODEL_STAGE_DIR = "models/base"
ENGINE_BUILD_FILE = "engine_build.json"
KV_PAGES_ENGINE = "kvpages"  # the serving engine with quantized pages (``kvpages-paged16-stacked``)
PAGED_ENGINE = "paged"  # + engine.kv_block_size: a paged-cache engine's folder (``paged16``, ``kvpages-paged16``)
STACKED_ENGINE = "stacked"  # engine.mixed_adapters: the serving form with stacked adapters (``kvpages-paged16-stacked``)
FINETUNE, KV, EVAL, GATES, PACKAGE = "finetune", "kv", "eval", "gates", "package"  # a month's stage folders
ADAPTER_DIR = "adapter"  # in finetune/
METRICS_FILE = "metrics.json"  # in eval/
PREDICTIONS_FILE = "predictions.jsonl"  # in eval/: each test row with the base's, the adapter's and the engine's answer
GATES_FILE = "gates.json"  # in gates/
KV_PAGES_FILE = "kv_pages.json"  # in kv/, with kv.enabled: the pages the KV gates measure (and the engine may serve)
KV_DISABLED_FILE = "kv_disabled.json"  # in kv/, with kv.enabled false: the KV gates measure nothing
RELEASE_DIR, CHECK_FILE = "release", "check.json"  # in package/


@dataclass(frozen=True)
class ArtifactLayout:
    data_dir: Path  # <data.dir>/<month>
    output_dir: Path  # <train.output_dir>
    release_dir: Path  # <train.output_dir>/<month>
    engine_dir: Path  # <engine.dir>: the float engine
    serving_engine_dir: Path  # the engine the device runs (engine.kv_cache, engine.kv_block_size, engine.weights)
    base_model_dir: Path = Path(BASE_MODEL_STAGE_DIR)

    @property
    def engine_build_file(self) -> Path:
        # Not under the month's folder: the engine belongs to the backbone, and a new month must not
        # make the compile stage (or its DVC record) look changed.
        return self.output_dir / ENGINE_BUILD_FILE

    @property
    def finetune_dir(self) -> Path:
        return self.release_dir / FINETUNE

    @property
    def adapter_dir(self) -> Path:
        return self.finetune_dir / ADAPTER_DIR

    @property
    def kv_dir(self) -> Path:
        return self.release_dir / KV

    @property
    def eval_dir(self) -> Path:
        return self.release_dir / EVAL

    @property
    def metrics_file(self) -> Path:
        return self.eval_dir / METRICS_FILE

    @property
    def gates_dir(self) -> Path:
        return self.release_dir / GATES

    @property
    def gates_file(self) -> Path:
        return self.gates_dir / GATES_FILE

    @property
    def package_dir(self) -> Path:
        return self.release_dir / PACKAGE

    @property
    def package_release_dir(self) -> Path:
        return self.package_dir / RELEASE_DIR

    @property
    def package_check_file(self) -> Path:
        return self.package_dir / CHECK_FILE
