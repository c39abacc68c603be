"""One typed, frozen configuration that mirrors ``params.yaml``.

Every stage, the CLI entry points and (later) the Prefect flow read their slice of
``ReleaseConfig``. Unknown keys, wrong types and out-of-range values are errors that
name the offending key, never silent defaults. Torch is not imported here so that
loading the config (and the Prefect form) stays fast.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernels.kv_spec import PAGE_BITS, PageQuantSpec
from kernels.weight_quant import DEFAULT_BLOCK_SIZES
from runtime.release.contract import DEFAULT_PRODUCT, check_product
from tasks.layout import BASE_MODEL_STAGE_DIR, KV_PAGES_ENGINE, PAGED_ENGINE, STACKED_ENGINE, ArtifactLayout

# engine.kv_block_size, when paged: vLLM's CUDA kernels take 8, 16 or 32 tokens (16 is what docs/paged-kv.md
# measured). A row wastes less than one block, so past 256 a short row's block is mostly empty; below 8 the
# block table grows and a step writes into more blocks.
MIN_KV_BLOCK_SIZE, MAX_KV_BLOCK_SIZE, DEFAULT_KV_BLOCK_SIZE = 8, 256, 16
MONTH_PATTERN = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")
DEFAULT_PARAMS = Path("params.yaml")
# Engine parity's limits (tasks/checks/engine_parity.py: LogitAgreement), where params.yaml leaves them out.
PARITY_MAX_LOGIT_ERROR = 64.0
PARITY_MAX_KL = 1e-6


class StageError(Exception):
    """Input a stage refuses (bad config, data, model or a diverged run); the message says where."""


class ConfigError(StageError, ValueError):
    """A params file that cannot be used; the message names every bad key."""


def _check_month(value: str) -> str:
    if not MONTH_PATTERN.match(value):
        raise ValueError(f"must be a month written YYYY-MM, got {value!r}")
    return value


Month = Annotated[str, AfterValidator(_check_month)]
Product = Annotated[str, AfterValidator(check_product)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DataConfig(_Section):
    month: Month = "2026-11"
    # The line of releases this project publishes (runtime/release/contract.py): the registry, the update
    # channel and a device keep champion and candidate per product. The default is what releases published
    # before products existed are read as.
    product: Product = DEFAULT_PRODUCT
    dir: str = "data"
    jsonl_dir: str | None = None
    heldout_text: str | None = None
    # General text rehearsed with train.rehearsal_share (one document per line); never the held-out text.
    rehearsal_text: str | None = None
    # chat | raw for prompt/completion rows; None: chat when the tokenizer has a chat template (tasks.stages.data).
    prompt_format: Literal["chat", "raw"] | None = None
    seed: int = Field(1234, ge=0)
    train_size: int = Field(3000, ge=1)
    val_size: int = Field(200, ge=1)
    calib_size: int = Field(128, ge=1)
    test_size: int = Field(600, ge=1)
    heldout_lines: int = Field(200, ge=1)
    rules_changed_per_month: int = Field(2, ge=1, le=8)


class BaseModelConfig(_Section):
    source: Literal["embedded", "local"] = "embedded"
    path: str = BASE_MODEL_STAGE_DIR
    trained_through: Month = "2026-10"
    vocab_size: int = Field(512, ge=300, le=65536)
    hidden_size: int = Field(256, ge=16)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    head_dim: int = Field(64, ge=8)
    intermediate_size: int = Field(768, ge=16)
    rope_theta: float = Field(10000.0, gt=0)
    pretrain_examples: int = Field(6000, ge=1)
    pretrain_steps: int = Field(400, ge=1)
    pretrain_batch_size: int = Field(32, ge=1)
    pretrain_lr: float = Field(1e-3, gt=0, le=1.0)
    prompt_loss_weight: float = Field(0.2, ge=0.0)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _path_fits_source(self) -> "BaseModelConfig":
        # DVC removes a stage's outputs before it runs it: a user's model must never be one.
        stage_dir = Path(BASE_MODEL_STAGE_DIR).resolve()
        if self.source == "embedded" and Path(self.path).resolve() != stage_dir:
            raise ValueError(f"path: the embedded default is built at {BASE_MODEL_STAGE_DIR} (the base_model stage's "
                             f"output), not {self.path!r}; to use your own model set source: local")
        return self

    @model_validator(mode="after")
    def _heads_divide(self) -> "BaseModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        return self


class LoraSection(_Section):
    r: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("must name at least one module")
        if len(set(v)) != len(v):
            raise ValueError(f"contains duplicates: {list(v)}")
        return v


class TrainConfig(_Section):
    seed: int = Field(0, ge=0)
    steps: int = Field(600, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    prompt_loss_weight: float = Field(0.2, ge=0.0)
    max_seq_len: int = Field(96, ge=8)
    # Rows of each batch that are general text (data.rehearsal_text), the loss on every token: rehearsal. 0: off.
    rehearsal_share: float = Field(0.0, ge=0.0, lt=1.0)
    eval_every: int = Field(50, ge=0)  # validation loss every this many steps (and after the last); 0: never
    threads: int = Field(2, ge=1)  # torch CPU threads of each process
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when torch sees one (tasks/device.py)
    processes: int = Field(1, ge=1, le=64)  # data-parallel ranks of the fine-tune (accelerate launch)
    output_dir: str = "artifacts"

    @model_validator(mode="after")
    def _batch_splits_over_processes(self) -> "TrainConfig":
        # batch_size is the global batch: every rank takes an equal slice of it.
        if self.batch_size % self.processes:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of processes ({self.processes}): "
                             "each rank takes an equal slice of the global batch")
        return self

    @property
    def rehearsal_rows(self) -> int:
        """Rows of each batch that are general text: ``rehearsal_share`` of ``batch_size``, rounded."""
        return round(self.rehearsal_share * self.batch_size)

    @model_validator(mode="after")
    def _rehearsal_rows_fit_the_batch(self) -> "TrainConfig":
        rows = self.rehearsal_rows
        if self.rehearsal_share and not 1 <= rows < self.batch_size:
            raise ValueError(f"rehearsal_share {self.rehearsal_share} of batch_size {self.batch_size} is {rows} text "
                             "row(s): a batch needs at least one text row and one task row")
        if rows % self.processes:
            raise ValueError(f"rehearsal_share {self.rehearsal_share} gives {rows} text row(s) per batch, not a multiple "
                             f"of processes ({self.processes}): each rank takes an equal slice of them")
        return self


class EngineConfig(_Section):
    dir: str = "engine"
    max_rank: int = Field(8, ge=1, le=256)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    opset: int = Field(18, ge=17)
    threads: int = Field(2, ge=1)
    backend: Literal["onnxruntime", "torch", "tensorrt"] = "onnxruntime"
    # Engine vs PyTorch + merged PEFT at every prefill position of the test prompts (tasks/checks/engine_parity.py).
    parity_max_logit_error: float = Field(PARITY_MAX_LOGIT_ERROR, gt=0)
    parity_max_kl: float = Field(PARITY_MAX_KL, gt=0)
    weights: Literal["fp32", "int8", "int4"] = "fp32"
    # Input channels per int8/int4 scale; null: each width's own (``kernels.weight_quant.DEFAULT_BLOCK_SIZES``: int8 32,
    # int4 128), read through ``weight_block``.
    weight_block_size: int | None = Field(None, ge=16, le=4096)
    # How int8/int4 codes are chosen (``tasks.weights.engines``): gptq = GPTQ on weight_calibration_tokens tokens of
    # real prose and code (each column's rounding error spread over the columns after it, by the inverse of the
    # calibration's second moments), once per backbone and cached with the engine; rtn = round to nearest.
    weight_method: Literal["rtn", "gptq"] = "gptq"
    weight_calibration_tokens: int = Field(16384, ge=512)
    # int4 by GPTQ only (``tasks.weights.mixed``): the average stored bits per weight of the body's projections; each
    # part (q, k, v, o, gate, up, down of each layer) takes int4 at weight_block_size, a half or a quarter of it, or
    # int8, where its loss (GPTQ's output error weighted by the loss gradient) falls most per bit. null: int4 at
    # weight_block_size everywhere (4.28 bits at 128 where the block divides the width; 4.76 on 576 channels).
    weight_mixed_bits: float | None = Field(4.6, ge=4.0, le=8.5)
    # quantized_pages (the served cache) = each full page of the paged cache quantized with its own scales when it
    # fills, the first and the open page float (``kernels.kv_spec.PageQuantSpec``: kv.k_bits, kv.v_bits,
    # kv.v_group_size); or float. (The static per-channel scheme, "quantized", was removed: it cost +39.6%
    # perplexity at 4 bits on SmolLM2, docs/kv-cache-real-weights.md.)
    kv_cache: Literal["float", "quantized_pages"] = "quantized_pages"
    # Tokens per block of the serving engine's paged KV cache (engine interface version 6, docs/paged-kv.md):
    # rows hold only the blocks they fill instead of a cache as long as the batch's longest row.
    # 0 = the padded cache, which the TensorRT and eager backends need.
    kv_block_size: int = Field(DEFAULT_KV_BLOCK_SIZE, ge=0)
    # The serving engine takes the LoRA of every resident release stacked, with a slot per row (interface
    # version 7, docs/mixed-adapters.md): requests of several products, or of champion and candidate, decode in
    # one batch. False = one release per batch (the engine the TensorRT and eager backends need).
    mixed_adapters: bool = True

    @property
    def cache_engine_dir(self) -> Path:
        """The engine with the configured KV cache and adapter slots and float weights: the float engine, its paged
        form (``paged16``: blocks of 16 tokens), either with stacked adapters (``paged16-stacked``); quantized pages:
        ``kvpages-paged16-stacked`` (the default)."""
        return self._engine_variant(with_weights=False)

    @property
    def serving_engine_dir(self) -> Path:
        """The engine the device runs: ``cache_engine_dir``, or a weight-quantized copy of it (``int8``,
        ``kvpages-paged16-stacked-int4``; TensorRT's format appended: ``int8-qdq_fp16``)."""
        return self._engine_variant(with_weights=True)

    def _engine_variant(self, with_weights: bool) -> Path:
        variant = [KV_PAGES_ENGINE] if self.kv_cache == "quantized_pages" else []
        if self.kv_block_size:  # each block size its own folder: switching back and forth rebuilds nothing
            variant.append(f"{PAGED_ENGINE}{self.kv_block_size}")
        if self.mixed_adapters:
            variant.append(STACKED_ENGINE)
        if with_weights and self.weights != "fp32":
            variant.append(self.weights)
            if self.weights_format() != "matmulnbits":
                variant.append(self.weights_format())
        return Path(self.dir, "-".join(variant)) if variant else Path(self.dir)

    def weights_format(self) -> str:
        """How quantized weights are written for the backend (``tasks.weights.graph.WEIGHT_FORMATS``):
        ONNX Runtime's MatMulNBits, or the Q/DQ form with fp16 GEMMs that TensorRT builds weight-only."""
        return "qdq_fp16" if self.backend == "tensorrt" else "matmulnbits"

    @field_validator("kv_cache", mode="before")
    @classmethod
    def _static_scheme_is_gone(cls, v):
        if v == "quantized":
            raise ValueError("the static quantized cache was removed (it cost +39.6% perplexity at 4 bits on real "
                             "weights, docs/kv-cache-real-weights.md): set quantized_pages (the kv section's k_bits, "
                             "v_bits and v_group_size) or float")
        return v

    def weight_block(self, weights: str | None = None) -> int:
        """Input channels per scale of ``weights`` (int8 or int4; default ``weights``): ``weight_block_size``, or the
        width's own block when it is null."""
        return self.weight_block_size or DEFAULT_BLOCK_SIZES[weights or self.weights]

    @field_validator("weight_block_size")
    @classmethod
    def _block_is_power_of_two(cls, v: int | None) -> int | None:
        if v is not None and v & (v - 1):
            raise ValueError(f"must be a power of two (MatMulNBits), got {v}")
        return v

    @field_validator("kv_block_size")
    @classmethod
    def _kv_block_is_a_power_of_two(cls, v: int) -> int:
        if v and (v & (v - 1) or not MIN_KV_BLOCK_SIZE <= v <= MAX_KV_BLOCK_SIZE):
            raise ValueError(f"must be 0 (the padded cache) or a power of two from {MIN_KV_BLOCK_SIZE} to "
                             f"{MAX_KV_BLOCK_SIZE} (tokens per block of the paged cache), got {v}")
        return v

    @model_validator(mode="after")
    def _weights_need_a_compiled_backend(self) -> "EngineConfig":
        # The eager reference loads the float checkpoint: it would silently run float weights.
        if self.weights != "fp32" and self.backend == "torch":
            raise ValueError(f"weights {self.weights} needs backend onnxruntime or tensorrt, not torch")
        # Every onnxruntime-only default named in one error: a user switching backends fixes them in one edit.
        if self.backend != "onnxruntime":
            needs = [("engine.kv_cache: float", self.kv_cache != "float"),  # their runtimes read no quantized cache yet
                     ("engine.kv_block_size: 0", bool(self.kv_block_size)),
                     ("engine.mixed_adapters: false", self.mixed_adapters)]
            fixes = [fix for fix, needed in needs if needed]
            if fixes:
                raise ValueError(f"backend {self.backend} runs neither the quantized KV cache, the paged cache nor "
                                 f"stacked adapters (onnxruntime only): set {' and '.join(fixes)}")
        return self


_PAGES = PageQuantSpec()  # the pages' defaults are defined once, there


class KVConfig(_Section):
    """The ``kv:`` section: the quantized pages (``kernels.kv_spec.PageQuantSpec``, whose defaults these are) that
    ``engine.kv_cache: quantized_pages`` serves, and whether the KV gates measure what they cost (``enabled``)."""

    enabled: bool = True
    k_bits: int = Field(_PAGES.k_bits, ge=2, le=8)
    v_bits: int = Field(_PAGES.v_bits, ge=2, le=8)
    v_group_size: int = Field(_PAGES.v_group_size, ge=1)  # channels per value scale of a sealed page
    # Per-layer widths (``tasks.checks.page_widths``): the KL to the float cache, per scored token of real text, that the
    # pages may cost summed over layers; each layer's keys and values get an equal share, and one that exceeds it
    # alone gets more bits than k_bits/v_bits. Chosen once per backbone (the widths are compiled into the serving
    # engine) on layer_calibration_tokens tokens of real prose and code. null: every layer at k_bits/v_bits.
    layer_kl_budget: float | None = Field(None, gt=0)
    layer_calibration_tokens: int = Field(4096, ge=256)

    def page_spec(self, head_dim: int) -> PageQuantSpec:
        """The quantized pages of a backbone whose heads have ``head_dim`` channels, as a ``PageQuantSpec``: the
        widths of this section and its value group, a whole head where the head is narrower than the group (the
        embedded default and the test backbones: 64, 16 and 8 channels)."""
        return PageQuantSpec(k_bits=self.k_bits, v_bits=self.v_bits, v_group_size=min(self.v_group_size, head_dim))


class EvalConfig(_Section):
    max_new_tokens: int = Field(8, ge=1)
    batch_size: int = Field(64, ge=1)
    latency_prompts: int = Field(16, ge=1)
    latency_steps: int = Field(16, ge=1)
    latency_threads: int = Field(1, ge=1)  # ONNX Runtime intra-op threads of both engines while the step is timed


class WeightAccuracyDrop(_Section):
    """Accuracy a weight-quantized engine may lose against float PyTorch, per precision (absolute, each of
    overall, new and regression rules; issue 8 acceptance)."""

    int8: float = Field(0.005, ge=0.0, le=1.0)
    int4: float = Field(0.02, ge=0.0, le=1.0)

    def limit(self, weights: str) -> float:
        return {"int8": self.int8, "int4": self.int4}[weights]


class GatesConfig(_Section):
    """Thresholds a candidate must pass before it is packaged and published."""

    min_accuracy_new: float = Field(0.95, ge=0.0, le=1.01)
    min_accuracy: float = Field(0.95, ge=0.0, le=1.01)  # overall accuracy: the gate when rows carry no `changed`
    champion_tolerance: float = Field(0.02, ge=0.0, le=1.0)
    min_accuracy_regression: float = Field(0.95, ge=0.0, le=1.01)
    max_kv_accuracy_drop: float = Field(0.01, ge=0.0, le=1.0)
    max_kv_ppl_increase_pct: float = Field(1.0, ge=0.0)
    max_weight_accuracy_drop: WeightAccuracyDrop = WeightAccuracyDrop()
    max_forgetting_pct: float = Field(10.0, ge=0.0)  # held-out perplexity, base + adapter over the base, % increase
    max_decode_step_ratio: float = Field(2.5, gt=0.0)  # release decode step / the float engine's, timed beside it
    max_package_pct_of_base: float = Field(2.0, gt=0.0)


class PublishConfig(_Section):
    """Where a release is published and recorded, and how it is signed."""

    dry_run: bool = False
    force: bool = False
    registry_dir: str = "registry"
    remote_dir: str = "dvc-remote"
    signing_key: str = "keys/release_signing.key"
    expiry_days: int = Field(120, ge=1)
    tuf_dir: str = "tuf"  # the update channel's TUF repository (tasks/release/update_channel.py), served as static files
    tuf_keys_dir: str = "keys/tuf"
    timestamp_expiry_days: int = Field(1, ge=1, le=7)  # a device refuses metadata older than this
    tracking_uri: str = "sqlite:///mlflow.db"
    artifacts_dir: str = "mlruns"
    experiment: str = "monthly-adapter-release"
    model_name: str = "inspection-adapter"


class ReleaseConfig(_Section):
    data: DataConfig = DataConfig()
    base_model: BaseModelConfig = BaseModelConfig()
    lora: LoraSection = LoraSection()
    train: TrainConfig = TrainConfig()
    engine: EngineConfig = EngineConfig()
    kv: KVConfig = KVConfig()
    eval: EvalConfig = EvalConfig()
    gates: GatesConfig = GatesConfig()
    publish: PublishConfig = PublishConfig()

    @model_validator(mode="after")
    def _adapter_fits_engine(self) -> "ReleaseConfig":
        # The engine is compiled once; an adapter it cannot take must be refused before training.
        if self.lora.r > self.engine.max_rank:
            raise ValueError(f"lora.r ({self.lora.r}) exceeds engine.max_rank ({self.engine.max_rank})")
        outside = [m for m in self.lora.target_modules if m not in self.engine.target_modules]
        if outside:
            raise ValueError(f"lora.target_modules {outside} are not LoRA inputs of the engine (engine.target_modules)")
        return self

    @model_validator(mode="after")
    def _served_pages_are_gated(self) -> "ReleaseConfig":
        if self.engine.kv_cache == "quantized_pages" and not self.kv.enabled:
            raise ValueError("engine.kv_cache quantized_pages needs kv.enabled: the KV gates measure what the pages cost")
        return self

    @model_validator(mode="after")
    def _quantized_pages_fit(self) -> "ReleaseConfig":
        # What the compile stage would refuse after the month's training, refused before it (a local backbone's
        # head_dim is read at compile). kv.enabled with a float cache measures the same pages in PyTorch.
        if not self.kv.enabled:
            return self
        problems = [f"kv.{n} {getattr(self.kv, n)} (pages store {', '.join(map(str, PAGE_BITS))} bits)"
                    for n in ("k_bits", "v_bits") if getattr(self.kv, n) not in PAGE_BITS]
        if self.engine.kv_cache == "quantized_pages" and not self.engine.kv_block_size:
            problems += ["engine.kv_block_size 0 (a page is a block of the paged cache)"]
        if not problems and self.base_model.source == "embedded":
            problems += ["kv." + p for p in self.kv.page_spec(self.base_model.head_dim).problems(self.base_model.head_dim)]
        if problems:
            raise ValueError("kv (the quantized pages): " + "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _user_inputs_are_not_outputs(self) -> "ReleaseConfig":
        # DVC deletes a stage's outputs before running it and the stages replace their folders whole:
        # a user's model or data inside (or around) one of them would be lost.
        outputs = {"the base_model stage's output": BASE_MODEL_STAGE_DIR, "data.dir": self.data.dir,
                   "train.output_dir": self.train.output_dir, "engine.dir": self.engine.dir,
                   "publish.registry_dir": self.publish.registry_dir}
        inputs = {"data.jsonl_dir": self.data.jsonl_dir, "data.heldout_text": self.data.heldout_text,
                  "data.rehearsal_text": self.data.rehearsal_text,
                  "base_model.path": self.base_model.path if self.base_model.source == "local" else None}
        for key, value in inputs.items():
            if value is None:
                continue
            path = Path(value).resolve()
            for name, out in outputs.items():
                out_path = Path(out).resolve()
                if path == out_path or out_path in path.parents or path in out_path.parents:
                    raise ValueError(f"{key}: {value!r} overlaps {name} ({out}), which the pipeline rewrites; "
                                     "keep your files in a folder of their own")
        return self

    @model_validator(mode="after")
    def _rehearsal_has_general_text(self) -> "ReleaseConfig":
        if not self.train.rehearsal_share:
            return self
        if self.base_model.source == "embedded":
            raise ValueError("train.rehearsal_share: the embedded default has no general text to rehearse: its base is "
                             "pre-trained only on inspection rows of the previous rule book (whose verdicts the month's "
                             "changed rules contradict) and its held-out text is rows of the month's rule book; "
                             "rehearsal is for a pretrained model (base_model.source: local) and its data.rehearsal_text")
        if self.data.rehearsal_text is None:
            raise ValueError(f"train.rehearsal_share {self.train.rehearsal_share} needs data.rehearsal_text: a plain-text "
                             "file of general text, one document per line, holding none of the held-out text")
        return self

    @model_validator(mode="after")
    def _base_precedes_release(self) -> "ReleaseConfig":
        if self.base_model.source == "embedded" and self.base_model.trained_through >= self.data.month:
            raise ValueError(
                f"base_model.trained_through ({self.base_model.trained_through}) must be before "
                f"data.month ({self.data.month}): the base learns an earlier rule book"
            )
        return self

    @property
    def layout(self) -> ArtifactLayout:
        """Every path the stages read and write (``tasks/layout.py``)."""
        return ArtifactLayout(
            data_dir=Path(self.data.dir) / self.data.month,
            output_dir=Path(self.train.output_dir),
            release_dir=Path(self.train.output_dir) / self.data.month,
            engine_dir=Path(self.engine.dir),
            serving_engine_dir=self.engine.serving_engine_dir,
        )

    def base_build_hash(self) -> str:
        """Hash of everything the embedded base model is built from; unchanged = reuse it."""
        inputs = {
            "base_model": self.base_model.model_dump(mode="json"),
            "seed": self.data.seed,
            "rules_changed_per_month": self.data.rules_changed_per_month,
            "max_seq_len": self.train.max_seq_len,
        }
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()

    def params_hash(self) -> str:
        """Stable hash of every setting, recorded in artifacts for provenance."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"{source}: {err.error_count()} invalid setting(s)"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {key}: {e['msg']}")
    return "\n".join(lines)


def parse_config(raw: dict, source: str = "<params>") -> ReleaseConfig:
    try:
        return ReleaseConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(source, err)) from None


def load_config(path: str | Path = DEFAULT_PARAMS) -> ReleaseConfig:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    return parse_config(raw, source=str(path))


def dotted(raw: Mapping, prefix: str = "") -> dict[str, Any]:
    """Every setting of a config mapping by its dotted key (``gates.max_weight_accuracy_drop.int8``).

    A list is one setting: it is set whole."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= dotted(value, name + ".")
        else:
            out[name] = value
    return out


def changed_settings(config: ReleaseConfig, base: ReleaseConfig) -> dict[str, Any]:
    """The dotted keys whose value in ``config`` differs from ``base``, with ``config``'s values (JSON types)."""
    old = dotted(base.model_dump(mode="json"))
    return {key: value for key, value in dotted(config.model_dump(mode="json")).items() if old[key] != value}


def with_settings(config: ReleaseConfig, settings: Mapping[str, Any], source: str) -> ReleaseConfig:
    """``config`` with the dotted keys of ``settings`` set, validated like params.yaml.

    A key that is not a setting of ``ReleaseConfig`` is an error naming it (and the nearest setting)."""
    raw = config.model_dump(mode="json")
    known = dotted(raw)
    unknown = [key for key in settings if key not in known]
    if unknown:
        lines = [f"{source}: {len(unknown)} unknown setting(s)"]
        for key in unknown:
            near = difflib.get_close_matches(str(key), known, n=1)
            lines.append(f"  {key}: not a setting of params.yaml" + (f" (did you mean {near[0]}?)" if near else ""))
        raise ConfigError("\n".join(lines))
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        node[leaf] = value
    return parse_config(raw, source=source)


def parse_assignments(items: list[str], source: str) -> dict[str, Any]:
    """``section.key=value`` strings (a command line's) as dotted settings; values are read as YAML."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source} {item!r}: expected section.key=value")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"{source} {item!r}: the value is not valid YAML: {err}") from None
    return out
