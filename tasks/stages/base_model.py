"""The backbone: build and pre-train the embedded default, or load a user's own.

The embedded default is a tiny Qwen2 (grouped-query attention, 4 layers) with a byte-level
BPE tokenizer trained on the inspection records, pre-trained on the rule book in force in
``base_model.trained_through``. It is saved as a standard Hugging Face directory, so the
same loader (``tasks.models``) takes a user's local Qwen2 or Llama checkpoint (for example Qwen2-0.5B),
which this stage only records: the sha256 of each of its files in the base-model card.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from runtime.engine.hashing import sha256_file
from tasks.artifacts import atomic_output_dir, write_json
from tasks.cli import stage_main
from tasks.config import BaseModelConfig, DataConfig, ReleaseConfig, TrainConfig
from tasks.inspection import rulebook, sample_examples
from tasks.models import CARD, check_base_model_dir
from tasks.records import Example

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE with digits split one per token, so numbers compare digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.save_pretrained(out_dir)
    return fast


def build_base_model(
    cfg: BaseModelConfig, data_cfg: DataConfig, train_cfg: TrainConfig, out_dir: Path, build_hash: str = ""
) -> Path:
    """Train the tokenizer, initialise a Qwen2 and pre-train it on the ``trained_through`` book."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from runtime.engine.hashing import backbone_hash
    from tasks.training import TrainSettings, train_completions, write_loss_curve

    torch.set_num_threads(train_cfg.threads)
    book = rulebook(cfg.trained_through, data_cfg.seed, data_cfg.rules_changed_per_month)
    rng = random.Random(f"{data_cfg.seed}:{cfg.trained_through}:pretrain")
    examples: list[Example] = sample_examples(book, cfg.pretrain_examples, rng)

    with atomic_output_dir(Path(out_dir)) as tmp:
        tokenizer = train_tokenizer([ex.text for ex in examples], cfg.vocab_size, tmp)
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=len(tokenizer),
                hidden_size=cfg.hidden_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                intermediate_size=cfg.intermediate_size,
                rope_theta=cfg.rope_theta,
                max_position_embeddings=512,
                tie_word_embeddings=True,
                bos_token_id=tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        settings = TrainSettings(
            steps=cfg.pretrain_steps,
            batch_size=cfg.pretrain_batch_size,
            lr=cfg.pretrain_lr,
            weight_decay=0.01,
            warmup_steps=min(50, cfg.pretrain_steps // 10),
            max_seq_len=train_cfg.max_seq_len,
            seed=cfg.seed,
            prompt_loss_weight=cfg.prompt_loss_weight,
        )
        history = train_completions(model, tokenizer, examples, settings, desc="pre-train base")
        model.save_pretrained(tmp)
        write_loss_curve(history, tmp, "base model pre-training", prefix="pretrain_")
        write_json(
            tmp / CARD,
            {
                "trained_through": cfg.trained_through,
                "pretrain_examples": cfg.pretrain_examples,
                "pretrain_steps": cfg.pretrain_steps,
                "final_loss": history.train[-1],
                "parameters": sum(p.numel() for p in model.parameters()),
                "backbone_hash": backbone_hash(tmp),
                "build_hash": build_hash,
            },
        )
    return Path(out_dir)


def record_local_model(path: Path, out_dir: Path) -> Path:
    """Check a user's checkpoint and write its card, the base_model stage's whole output with source local.

    The card holds the sha256 of every file of the checkpoint (tokenizer and generation config
    included): the stages that read the model depend on the card, so DVC re-runs them exactly
    when the checkpoint changed, without the checkpoint ever being a DVC output. It is only read.
    """
    from runtime.engine.hashing import backbone_hash

    path = Path(path)
    config = check_base_model_dir(path)
    files = sorted(f for f in path.rglob("*") if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts))
    with atomic_output_dir(Path(out_dir)) as tmp:
        write_json(tmp / CARD, {
            "source": "local",
            "path": str(path.resolve()),
            "model_type": config.get("model_type"),
            "backbone_hash": backbone_hash(path),
            "files": {str(f.relative_to(path)): sha256_file(f) for f in files},
        })
    return Path(out_dir)


def prepare_base_model(cfg: ReleaseConfig) -> Path:
    """The base-model stage: record the user's checkpoint, or build the embedded default.

    The embedded base is built once and reused while every setting it was built from is
    unchanged (recorded as ``build_hash`` in its card); the monthly adapters depend on it.
    Returns the directory the other stages read the model from.
    """
    path = Path(cfg.base_model.path)
    if cfg.base_model.source == "local":
        record_local_model(path, cfg.layout.base_model_dir)
        return path
    card = path / CARD
    if card.exists() and json.loads(card.read_text()).get("build_hash") == cfg.base_build_hash():
        print(f"base model at {path} is up to date (build settings unchanged); not rebuilding")
        return path
    return build_base_model(cfg.base_model, cfg.data, cfg.train, path, cfg.base_build_hash())


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        "Build (embedded) or check (local) the base model.",
        lambda cfg: f"base model ready at {prepare_base_model(cfg)}",
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
