"""Random backbones the engine benchmarks time: Hugging Face directories of a given shape, random LoRA adapters of
them, the engines built from them (weight-quantized variants), and a backbone of Qwen2-0.5B's whole shape. Random
weights measure cost, never quality."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from bench.lib.report import REPO
from kernels.weight_quant import DEFAULT_BLOCK_SIZES
from runtime.engine.interface import ENGINE_ONNX

SHAPES = {
    # The default backbone of the foundation issue.
    "tiny": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                 num_hidden_layers=4, vocab_size=512),
    # Qwen2-0.5B widths; 4 layers of random weights are enough to measure per-layer costs.
    "0.5b-width": dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                       num_hidden_layers=4, vocab_size=512),
}
# The weight-quantization and llama.cpp benchmarks: Qwen2-0.5B widths with 6 layers, as in the measurements
# (llama.cpp numbers are for the same).
WEIGHT_QUANT_SHAPES = SHAPES | {"0.5b-width": SHAPES["0.5b-width"] | {"num_hidden_layers": 6}}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK, ALPHA = 8, 16.0
_B4, _B8 = DEFAULT_BLOCK_SIZES["int4"], DEFAULT_BLOCK_SIZES["int8"]  # each width's release block, for the table below
# name -> (weights, fold_norms, accuracy_level, merged LoRA, block size)
WEIGHT_VARIANTS = {
    "fp32": ("fp32", False, 0, False, _B4),
    "fp32_merged": ("fp32", False, 0, True, _B4),
    "int8": ("int8", False, 4, False, _B8),
    "int8_merged": ("int8", False, 4, True, _B8),
    "int8_b128": ("int8", False, 4, False, 128),
    "int8_acc0": ("int8", False, 0, False, _B8),
    "int4": ("int4", False, 4, False, _B4),
    "int4_merged": ("int4", False, 4, True, _B4),
    "int4_b32": ("int4", False, 4, False, 32),
    "int4_b64": ("int4", False, 4, False, 64),
    "int4_acc0": ("int4", False, 0, False, _B4),
    "int4_fold": ("int4", True, 4, False, _B4),
}
# Qwen2-0.5B's config.json, but the weights are random (no model hub here): 494,032,768 parameters,
# 988 MB in bf16 with the LM head tied to the embedding table.
QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=21)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_backbone_and_adapter(root: Path, dims: dict) -> tuple[Path, Path]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**dims, max_position_embeddings=4096))
    model.save_pretrained(root / "base")
    return root / "base", random_adapter(model, root / "base", root / "adapter")


def random_adapter(model, base_dir: Path, out_dir: Path) -> Path:
    """A rank-RANK adapter of TARGETS with random A and B (PEFT would start B at zero) on ``model``, the
    backbone saved at ``base_dir``, with the provenance that binds it there; drawn from torch's RNG."""
    from peft import LoraConfig, get_peft_model

    from runtime.engine.adapter_config import PROVENANCE
    from runtime.engine.hashing import backbone_hash

    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                                                  init_lora_weights=False))
    peft_model.save_pretrained(out_dir)
    (out_dir / PROVENANCE).write_text(json.dumps({"base_model_hash": backbone_hash(base_dir)}))
    return out_dir


def build_weight_variants(name: str, dims: dict, threads: int, work: Path, variants: list[str]):
    """A random backbone of ``dims`` and its adapter in ``work / name``, and an ONNX Runtime engine per
    ``WEIGHT_VARIANTS`` name: (the backbone's config, {variant: engine}, {variant: model.onnx bytes})."""
    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.interface import INTERFACE_FILE, write_interface
    from runtime.engine.model import read_config
    from tasks.stages.compile import compile_engine, export_backbone
    from tasks.weights.engines import quantize_engine_dir

    root = work / name
    model_dir, adapter_dir = make_backbone_and_adapter(root, dims)
    cfg = read_config(model_dir)
    compile_engine(model_dir, root / "engine", RANK, TARGETS, ort_threads=threads)
    iface_lora = OrtEngine(root / "engine", threads=threads).interface
    lora = load_adapter(adapter_dir, iface_lora)
    merged_dir = root / "engine_merged"
    merged_dir.mkdir()
    iface = export_backbone(model_dir, merged_dir / ENGINE_ONNX, RANK, (), merged_lora=lora)
    write_interface(iface, merged_dir / INTERFACE_FILE)
    engines, sizes = {}, {}
    for v in variants:
        weights, fold, level, merged, block = WEIGHT_VARIANTS[v]
        src = merged_dir if merged else root / "engine"
        out = root / f"v_{v}"
        quantize_engine_dir(src, out, weights, block, fold, ("lm_head", "embed"), level)
        sizes[v] = (out / ENGINE_ONNX).stat().st_size
        engine = OrtEngine(out, threads=threads)
        if not merged:
            engine.set_adapter(lora)
        engines[v] = engine
    return cfg, engines, sizes


def embedded_tokenizer_dir(work: Path) -> Path:
    """The embedded default's tokenizer: ``models/base`` after ``make release``, else trained the
    same way (``tasks.stages.base_model``: same examples, same settings) into ``work``."""
    from tasks.layout import BASE_MODEL_STAGE_DIR

    base = REPO / BASE_MODEL_STAGE_DIR
    if (base / "tokenizer.json").is_file():
        return base
    from tasks.config import BaseModelConfig, DataConfig
    from tasks.inspection import rulebook, sample_examples
    from tasks.stages.base_model import train_tokenizer

    b, d = BaseModelConfig(), DataConfig()
    print(f"note: {base} has no tokenizer (run `make release` once); training the embedded one into {work}")
    rng = random.Random(f"{d.seed}:{b.trained_through}:pretrain")
    examples = sample_examples(rulebook(b.trained_through, d.seed, d.rules_changed_per_month), b.pretrain_examples, rng)
    out = work / "embedded_tokenizer"
    train_tokenizer([ex.text for ex in examples], b.vocab_size, out)
    return out


def build_qwen2_05b_shape(out: Path, work: Path, seed: int = 0) -> Path:
    """A Hugging Face directory with Qwen2-0.5B's config (``QWEN2_05B``), bf16 safetensors of random weights (about
    988 MB) and the embedded default's tokenizer (ids below the vocabulary are all the backbone needs; no tokenizer
    of 151,936 tokens can be trained on this data); an existing one is reused."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok_dir = embedded_tokenizer_dir(work)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory of an fp32 model and its cast
    try:
        config = Qwen2Config(**QWEN2_05B, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy2(tok_dir / name, tmp / name)
    tmp.rename(out)
    return out
