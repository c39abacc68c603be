"""The worlds the serving benchmarks serve: a backbone, its compiled engine and signed releases of adapters on
it, built in a directory (a random tiny Qwen2, or one of Qwen2-0.5B's shape with int4 weights), or found where
``make release`` left them; and the prompts sent to them."""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from pathlib import Path

from bench.lib.backbones import TARGETS, build_qwen2_05b_shape
from bench.lib.report import progress
from runtime.release.contract import MANIFEST

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
TINY_HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
# Whole inspection rows, up to the verdict the model writes: a release's answer to each tells releases apart.
INSPECTION_PROMPTS = [
    "inspect board=PCB-1201 line=L2 part=C7 temp_c=244 defect=lifted lift_um=40 verdict:",
    "inspect board=PCB-3310 line=L1 part=R12 temp_c=251 defect=void void_pct=18 verdict:",
    "inspect board=PCB-0042 line=L3 part=U3 temp_c=239 defect=bridge bridge_um=55 verdict:",
    "inspect board=PCB-7781 line=L1 part=C26 temp_c=258 defect=tombstone tilt_deg=12 verdict:",
]
# The start of an inspection row, which the model writes on to its verdict (about 25-35 tokens on the
# default model, then its end-of-sequence token): decode, not prefill, is most of each request.
ROW_STARTS = ["inspect board=PCB-1201", "inspect board=PCB-3310 line=L1", "inspect board=PCB-0042 line=L3",
              "inspect board=PCB-7781", "inspect board=PCB-5120 line=L2", "inspect board=PCB-0913",
              "inspect board=PCB-2468 line=L1", "inspect"]
INT4_WORLD_MONTH = "2026-11"
INT4_WORLD_RANK = 8  # its adapter's rank, its engine's max_rank


# ---------------------------------------------------------------- a tiny world (also used by the tests)

def make_tiny_base(out: Path, seed: int = 0, **overrides) -> Path:
    """A random Qwen2 with a byte-level BPE tokenizer trained on inspection rows: a base model
    directory like models/base, small enough to export in seconds."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.inspection import rulebook, sample_examples
    from tasks.stages.base_model import train_tokenizer

    out = Path(out)
    examples = sample_examples(rulebook("2026-10", 1234, 2), 64, random.Random(0))
    tokenizer = train_tokenizer([ex.text for ex in examples], 300, out)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**(TINY | {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                                                   "pad_token_id": tokenizer.pad_token_id} | overrides)))
    with torch.no_grad():  # spread logits so greedy choices are not near-ties
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08) if p.ndim == 2 or name.endswith("bias") else p.normal_(1.0, 0.1)
    model.save_pretrained(out)
    return out


def make_tiny_adapter(base: Path, out: Path, engine_dir: Path | None = None, r: int = 4, seed: int = 1,
                      targets: tuple[str, ...] = TARGETS) -> Path:
    """A PEFT LoRA adapter with random non-zero weights and the provenance the fine-tune stage writes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from runtime.engine.adapter_config import PROVENANCE
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import read_interface

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2.0 * r, target_modules=list(targets),
                                                  init_lora_weights=False, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.15)
    peft_model.save_pretrained(out)
    prov = {"base_model_hash": backbone_hash(base), "base_model_path": str(base), "params_hash": f"bench-{seed}"}
    if engine_dir is not None:
        prov["engine_interface_hash"] = read_interface(engine_dir).lora_contract_hash
    (Path(out) / PROVENANCE).write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    return Path(out)


def make_tiny_release(root: Path, base: Path, engine_dir: Path, adapter: Path, month: str, signing_key: Path,
                      now: dt.datetime | None = None, gates_passed: bool = True, expiry_days: int = 120) -> Path:
    """Write eval metrics and a gate report for ``adapter`` and package it with ``tasks.stages.package.build_release``
    into ``root/package``; return the release directory."""
    from tasks.layout import RELEASE_DIR
    from tasks.stages.package import build_release

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.json").write_text(json.dumps({
        "month": month, "base": {"accuracy": 0.5, "accuracy_new": 0.1, "per_rule": {"lifted": 0.5}},
        "adapter": {"accuracy": 0.97, "accuracy_new": 0.96, "accuracy_regression": 0.98, "perplexity": 3.2}}))
    (root / "gates.json").write_text(json.dumps({"passed": gates_passed, "gates": [
        {"name": "accuracy_new", "value": 0.96, "threshold": 0.95, "op": ">=", "passed": gates_passed, "detail": ""}]}))
    out = build_release(adapter, root / "metrics.json", root / "gates.json", engine_dir, base,
                        root / "package", signing_key, month, expiry_days=expiry_days, threads=1,
                        prompt=INSPECTION_PROMPTS[0], max_new_tokens=4, now=now)
    return out / RELEASE_DIR


def engine_form(engine_dir: Path) -> dict:
    """What a benchmark records of the engine it served: interface version, cache and adapter form."""
    from kernels.kv_spec import PageQuantSpec
    from runtime.engine.interface import read_interface

    iface = read_interface(engine_dir)
    kv_cache = PageQuantSpec.from_dict(iface.kv_pages).name if iface.kv_pages else "float"
    return {"dir": str(engine_dir), "interface_version": iface.version, "kv_cache": kv_cache,
            "kv_block_size": iface.kv_block_size, "stacked": iface.stacked, "weights": iface.weight_precision}


def build_tiny_world(root: Path, serving_form: dict | None = None) -> dict:
    """A random tiny Qwen2, its engine (float, padded; or ``serving_form``: ``tasks.stages.compile.serving_form``'s
    keywords, the engine ``serve`` runs by default) and two signed releases."""
    from tasks.stages.compile import compile_engine

    root = Path(root)
    base = make_tiny_base(root / "base")
    engine = root / "engine"
    compile_engine(base, engine, max_rank=8, target_modules=TARGETS, ort_threads=1, **(serving_form or {}))
    key = root / "keys" / "release_signing.key"
    t = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    releases, adapters = [], []
    for i, month in enumerate(("2026-10", "2026-11")):
        adapters.append(make_tiny_adapter(base, root / f"adapter-{month}", engine, r=4 + 4 * i, seed=11 + i))
        releases.append(make_tiny_release(root / f"release-{month}", base, engine, adapters[-1], month, key,
                                          now=t - dt.timedelta(days=1 - i)))
    return {"engine": engine, "tokenizer": base, "base": base, "trusted_key": key.with_suffix(".pub"),
            "releases": releases, "adapters": adapters, "source": "tiny world built by bench.lib.worlds"}


def existing_world(count: int = 2) -> dict | None:
    """The last ``count`` packaged releases of the pipeline (and their PEFT adapters), if ``make
    release`` ran for that many months."""
    from runtime.release.signing import public_key_path
    from tasks.config import load_config
    from tasks.layout import ADAPTER_DIR, FINETUNE, PACKAGE, RELEASE_DIR

    if not Path("params.yaml").exists():
        return None
    cfg = load_config("params.yaml")
    found = sorted(cfg.layout.output_dir.glob(f"*/{PACKAGE}/{RELEASE_DIR}/{MANIFEST}"))[-count:]
    pub = public_key_path(cfg.publish.signing_key)
    if len(found) < count or not pub.exists() or not cfg.layout.serving_engine_dir.exists():
        return None
    base = Path(cfg.base_model.path)
    return {"engine": cfg.layout.serving_engine_dir, "tokenizer": base, "base": base, "trusted_key": pub,
            "releases": [p.parent for p in found], "source": "artifacts/*/package/release",
            "adapters": [p.parent.parent.parent / FINETUNE / ADAPTER_DIR for p in found]}


def serving_world(root: Path, tiny: bool) -> dict:
    """The last release of ``make release``, else the tiny world; one release, its PEFT adapter."""
    world = None if tiny else existing_world(count=1)
    if world is None:
        print("building a tiny world (base, engine, signed releases)...", flush=True)
        world = build_tiny_world(root)
    return world | {"release": world["releases"][-1], "adapter": world["adapters"][-1]}


# ---------------------------------------------------------------- the int4 world: the default serving form, int4 weights

def int4_serving_engine(base: Path, export: Path, out: Path, threads: int, kv_cache: str = "quantized_pages", **form) -> Path:
    """``base`` compiled into ``export`` in the default serving form (``tasks.stages.compile.serving_form``: the ``kv``
    section's 4-bit cache as ``engine.kv_cache`` serves it, paged, adapters stacked; ``form`` overrides its keywords),
    then copied into ``out`` with int4 weights as the compile stage does (``engine.weights: int4``); each reused when
    built."""
    from runtime.engine.model import read_config
    from tasks.config import EngineConfig, KVConfig
    from tasks.stages.compile import compile_engine, serving_form
    from tasks.weights.engines import ensure_quantized_engine

    engine_cfg = EngineConfig(weights="int4", kv_cache=kv_cache)
    compile_engine(base, export, INT4_WORLD_RANK, engine_cfg.target_modules, ort_threads=threads,
                   **serving_form(engine_cfg, KVConfig(), read_config(base).head_dim) | form)
    ensure_quantized_engine(export, out, engine_cfg.weights, engine_cfg.weight_block(), engine_cfg.weights_format())
    return out


def build_int4_world(shape: str, root: Path, threads: int, kv_cache: str = "quantized_pages") -> dict:
    """The backbone, our int4 serving engine (``kv_cache``: ``engine.kv_cache``, the 4-bit quantized pages or the
    float cache), a rank-8 adapter and its signed release, in ``root``; an earlier build there (``world.json``,
    written last) is reused."""
    record = root / "world.json"
    if record.is_file():
        return {k: Path(v) for k, v in json.loads(record.read_text()).items()}
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    progress(f"[world {shape}] the backbone ...")
    base = make_tiny_base(root / "base") if shape == "tiny" else build_qwen2_05b_shape(root / "base", root)
    progress(f"[world {shape}] the serving engine, then its int4 weights ... ({time.perf_counter() - t0:.0f} s)")
    engine = int4_serving_engine(base, root / "engine-kv", root / "engine", threads, kv_cache)
    progress(f"[world {shape}] an adapter and its release ... ({time.perf_counter() - t0:.0f} s)")
    adapter = make_tiny_adapter(base, root / "adapter", engine, r=INT4_WORLD_RANK, seed=11)
    key = root / "keys" / "release_signing.key"
    release = make_tiny_release(root / "release", base, engine, adapter, INT4_WORLD_MONTH, key)
    world = {"base": base, "engine": engine, "tokenizer": base, "adapter": adapter, "release": release,
             "trusted_key": key.with_suffix(".pub")}
    record.write_text(json.dumps({k: str(v) for k, v in world.items()}, indent=2))
    progress(f"[world {shape}] built in {time.perf_counter() - t0:.0f} s")
    return world


def prompt_text(tokenizer, length: int, row: int) -> str:
    """A text our tokenizer makes exactly ``length`` ids of (row ``row``'s: inspection rows, rotated and numbered
    so no two rows share a prefix): sent as text to ours, as its ids to llama-server."""
    k = row % len(INSPECTION_PROMPTS)
    text = f"#{row} " + " ".join(INSPECTION_PROMPTS[k:] + INSPECTION_PROMPTS[:k])
    while len(tokenizer.encode(text)) < length + 8:
        text = f"{text} {text}"
    text = tokenizer.decode(tokenizer.encode(text)[:length])
    while len(ids := tokenizer.encode(text)) > length:  # the cut may re-merge into other tokens
        text = text[:-1]
    while len(ids) < length:  # single digits are one token each
        text += "7"
        ids = tokenizer.encode(text)
    if len(ids) != length:
        raise RuntimeError(f"no text of exactly {length} tokens for row {row} (got {len(ids)})")
    return text

