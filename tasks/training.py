"""The supervised training loop shared by base-model pre-training and LoRA fine-tuning.

The loss is the mean cross-entropy of the completion tokens plus ``prompt_loss_weight``
times that of the prompt tokens. Fine-tuning uses weight 0 (the prompt is context, the
verdict is what must change); pre-training uses a small weight so the base is a language
model of the records (its held-out perplexity means something) while the verdict signal
is not drowned by the many unpredictable identifier digits of the prompt.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from runtime.tokenizer import encode_prompt
from tasks.config import StageError
from tasks.data import Example

class TrainingDiverged(StageError, RuntimeError):
    """The loss stopped being a finite number; nothing trained in this run is saved."""


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    max_seq_len: int
    seed: int
    prompt_loss_weight: float = 0.0


def encode_example(tokenizer, ex: Example, max_seq_len: int) -> tuple[list[int], int]:
    """Token ids of prompt+completion+eos, and where the completion starts. The prompt carries the
    tokenizer's special tokens (a Llama BOS), as evaluation and the device encode it
    (``runtime.tokenizer.encode_prompt``); the completion none but the eos it must learn to stop with."""
    prompt_ids = encode_prompt(tokenizer, ex.prompt)
    completion_ids = tokenizer(ex.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return (prompt_ids + completion_ids)[:max_seq_len], len(prompt_ids)


def collate(batch: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ids and attention mask, plus a mask of the completion positions."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    completion_mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, (ids, completion_start) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        completion_mask[row, completion_start : len(ids)] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}


def completion_loss(model, batch: dict[str, torch.Tensor], prompt_loss_weight: float) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]  # (B, T-1, V)
    targets = batch["input_ids"][:, 1:]  # (B, T-1)
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    real = batch["attention_mask"][:, 1:].bool()
    completion = real & batch["completion_mask"][:, 1:]
    loss = token_loss[completion].mean()
    if prompt_loss_weight > 0:
        loss = loss + prompt_loss_weight * token_loss[real & ~completion].mean()
    return loss


def _lr_factor(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train_completions(
    model: torch.nn.Module,
    tokenizer,
    examples: list[Example],
    settings: TrainSettings,
    desc: str,
) -> list[float]:
    """Train ``model`` in place with AdamW and a warmup-cosine schedule; return the loss per step."""
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    encoded = [encode_example(tokenizer, ex, settings.max_seq_len) for ex in examples]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, settings))
    model.train()
    losses: list[float] = []
    order: list[int] = []
    with tqdm(range(settings.steps), desc=desc, unit="step", dynamic_ncols=True) as bar:
        for step in bar:
            if len(order) < settings.batch_size:
                refill = list(range(len(encoded)))
                rng.shuffle(refill)
                order.extend(refill)
            batch = collate([encoded[i] for i in order[: settings.batch_size]], tokenizer.pad_token_id)
            del order[: settings.batch_size]
            loss = completion_loss(model, batch, settings.prompt_loss_weight)
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"{desc}: loss became {loss.item()} at step {step + 1}; "
                    "lower the learning rate or check the data"
                )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    model.eval()
    return losses


def write_loss_curve(losses: list[float], csv_path: Path, png_path: Path, title: str) -> None:
    with open(csv_path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["step", "loss"])
        writer.writerows((i + 1, f"{loss:.6f}") for i, loss in enumerate(losses))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("completion loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
