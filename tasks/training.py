"""The supervised training loop shared by base-model pre-training and LoRA fine-tuning.

The loss is the mean cross-entropy of the completion tokens (a chat's assistant turns) plus ``prompt_loss_weight``
times that of the prompt tokens. Fine-tuning uses weight 0 (the prompt is context, the
verdict is what must change); pre-training uses a small weight so the base is a language
model of the records (its held-out perplexity means something) while the verdict signal
is not drowned by the many unpredictable identifier digits of the prompt.

Rehearsal (``TrainSettings.rehearsal_rows``): that many rows of each batch are pieces of general text, every token
learned, and the loss is the task rows' loss and the text rows' (the mean over their tokens) weighed by their share of
the batch's rows, so the text's many tokens do not drown the task's few answer tokens.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.engine.tokenizer import ChatPrompt, encode_prompt
from tasks.config import StageError
from tasks.device import ON_CPU, Placement
from tasks.progress import Progress
from tasks.records import DataError, Example


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
    rehearsal_rows: int = 0  # rows of each batch that are general text (rehearsal); the rest are task rows


def encode_example(tokenizer, ex: Example, max_seq_len: int) -> tuple[list[int], list[bool]]:
    """Token ids of prompt+completion+eos, and which of them the loss learns: the completion and its
    eos. The prompt is encoded as evaluation and the device encode it (``runtime.engine.tokenizer.encode_prompt``:
    a text with the tokenizer's special tokens, a Llama BOS; a chat through the device's chat template);
    the completion carries no special token but the eos it must learn to stop with. In a chat, every
    earlier assistant turn is learned too, and nothing of a system or user turn."""
    prompt_ids = encode_prompt(tokenizer, ex.prompt)
    learned = [False] * len(prompt_ids)
    if isinstance(ex.prompt, ChatPrompt):
        for turn, message in enumerate(ex.prompt.messages):
            if message["role"] == "assistant":
                start, end = _assistant_span(tokenizer, ex.prompt.messages, turn, prompt_ids)
                learned[start:end] = [True] * (end - start)
    completion_ids = _answer_ids(tokenizer, ex.completion)
    return (prompt_ids + completion_ids)[:max_seq_len], (learned + [True] * len(completion_ids))[:max_seq_len]


def encode_text(tokenizer, text: str, max_seq_len: int) -> list[tuple[list[int], list[bool]]]:
    """A plain-text document as rows of at most ``max_seq_len`` tokens whose every token the loss learns (language
    modelling: rehearsal), encoded as held-out perplexity encodes a text: special tokens (a BOS) first, eos last."""
    ids = encode_prompt(tokenizer, text) + [tokenizer.eos_token_id]
    pieces = [ids[start : start + max_seq_len] for start in range(0, len(ids), max_seq_len)]
    return [(piece, [True] * len(piece)) for piece in pieces if len(piece) > 1]  # one token predicts nothing


def _answer_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _assistant_span(tokenizer, messages: tuple[dict, ...], turn: int, chat_ids: list[int]) -> tuple[int, int]:
    """Where assistant turn ``turn`` lies in ``chat_ids`` (the whole chat rendered): right after the
    chat before it rendered with the generation prompt, as its content and eos; a template that renders
    past turns otherwise (one that drops them, say) is refused rather than trained on the wrong tokens."""
    prefix = encode_prompt(tokenizer, ChatPrompt(messages[:turn]))
    answer = _answer_ids(tokenizer, messages[turn]["content"])
    end = len(prefix) + len(answer)
    if chat_ids[: len(prefix)] != prefix or chat_ids[len(prefix) : end] != answer:
        raise DataError(f"the chat template does not render assistant turn {turn} ({messages[turn]['content'][:40]!r}) "
                        "as the generation prompt, its content and eos: its tokens cannot be told apart for the "
                        "loss; give chats with one assistant turn, the answer")
    return len(prefix), end


def collate(batch: list[tuple[list[int], list[bool]]], pad_id: int, text_rows: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ids and attention mask, plus the mask of the positions the loss learns; the last ``text_rows``
    rows are general text (``text_row``: rehearsal)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    completion_mask = torch.zeros((len(batch), width), dtype=torch.bool)
    text_row = torch.zeros(len(batch), dtype=torch.bool)
    text_row[len(batch) - text_rows :] = True  # none when text_rows is 0
    for row, (ids, learned) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        completion_mask[row, : len(ids)] = torch.tensor(learned)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
            "text_row": text_row}


def completion_loss(model, batch: dict[str, torch.Tensor], prompt_loss_weight: float) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]  # (B, T-1, V)
    targets = batch["input_ids"][:, 1:]  # (B, T-1)
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    real = batch["attention_mask"][:, 1:].bool()
    text = batch["text_row"][:, None]  # (B, 1)
    task = real & ~text
    completion = task & batch["completion_mask"][:, 1:]
    loss = token_loss[completion].mean()
    if prompt_loss_weight > 0:
        loss = loss + prompt_loss_weight * token_loss[task & ~completion].mean()
    share = batch["text_row"].float().mean()  # of the rows; 0 without rehearsal, and the loss is the task's alone
    if share > 0:
        loss = (1 - share) * loss + share * token_loss[real & text].mean()
    return loss


def _lr_factor(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class TrainHistory:
    train: list[float]  # the loss of every step; step i + 1 is train[i]
    val: list[tuple[int, float]]  # (step, validation loss) every ``eval_every`` steps and after the last


def _rank_and_world(accelerator) -> tuple[int, int]:
    return (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)


def _on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: tensor.to(device) for name, tensor in batch.items()}


def validation_loss(model, tokenizer, encoded: list[tuple[list[int], int]], batch_size: int,
                    prompt_loss_weight: float, placement: Placement = ON_CPU, accelerator=None) -> float:
    """The training loss on held-back rows (eval mode, no gradient: no dropout, no random draw), in the
    precision of training. With several ranks (``accelerator``) each scores every world-size-th row and
    the mean is over all rows."""
    rank, world = _rank_and_world(accelerator)
    device = next(model.parameters()).device
    mine = encoded[rank::world]
    model.eval()
    total, rows = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(mine), batch_size):
            chunk = mine[start : start + batch_size]
            batch = _on(collate(chunk, tokenizer.pad_token_id), device)
            with placement.autocast():
                total += completion_loss(model, batch, prompt_loss_weight).item() * len(chunk)
            rows += len(chunk)
    model.train()
    if world > 1:
        total, rows = accelerator.reduce(torch.tensor([total, rows], dtype=torch.float64, device=device), "sum").tolist()
    return total / rows


def train_completions(
    model: torch.nn.Module,
    tokenizer,
    examples: list[Example],
    settings: TrainSettings,
    desc: str,
    val_examples: list[Example] | None = None,
    eval_every: int = 0,
    placement: Placement = ON_CPU,
    accelerator=None,
    rehearsal_texts: list[str] = (),
) -> TrainHistory:
    """Train ``model`` in place with AdamW and a warmup-cosine schedule; return the loss per step, and
    the loss on ``val_examples`` every ``eval_every`` steps and after the last (given both).

    With ``settings.rehearsal_rows``, each batch is that many pieces of ``rehearsal_texts`` (``encode_text``, drawn in
    their own seeded order) and ``batch_size`` less that many rows of ``examples``; without, the texts are not read.

    It trains on ``placement``'s device, under its autocast. In a rank of a data-parallel launch
    (``accelerator``: ``tasks.device.rank_accelerator``) every rank draws the same seeded order, takes
    its slice of each global batch of ``settings.batch_size`` rows, and the gradients are averaged over
    ranks (DDP). The loss checked for NaN and returned is the mean over ranks, so every rank stops at the
    same step; only the main rank shows and reports progress."""
    rank, world = _rank_and_world(accelerator)
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    text_rng = random.Random(f"{settings.seed}:rehearsal")  # its own: the task rows' order is the same with or without
    encoded = [encode_example(tokenizer, ex, settings.max_seq_len) for ex in examples]
    text_encoded = [piece for text in rehearsal_texts
                    for piece in encode_text(tokenizer, text, settings.max_seq_len)] if settings.rehearsal_rows else []
    if settings.rehearsal_rows and not text_encoded:
        raise DataError(f"{desc}: {settings.rehearsal_rows} rehearsal row(s) per batch, but no rehearsal text to draw from")
    val_encoded = [encode_example(tokenizer, ex, settings.max_seq_len) for ex in val_examples or []]
    params = [p for p in model.parameters() if p.requires_grad]
    device = accelerator.device if accelerator is not None else torch.device(placement.device)
    model.to(device)
    trained = accelerator.prepare_model(model) if accelerator is not None else model  # DDP over the ranks
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, settings))
    model.train()
    losses: list[float] = []
    val: list[tuple[int, float]] = []
    order: list[int] = []
    text_order: list[int] = []
    with Progress(desc, settings.steps, enabled=rank == 0) as progress:
        for step in range(settings.steps):
            rows = _draw(order, len(encoded), settings.batch_size - settings.rehearsal_rows, rng, rank, world)
            texts = _draw(text_order, len(text_encoded), settings.rehearsal_rows, text_rng, rank, world)
            batch = collate([encoded[i] for i in rows] + [text_encoded[i] for i in texts], tokenizer.pad_token_id,
                            text_rows=len(texts))
            batch = _on(batch, device)
            with placement.autocast():
                loss = completion_loss(trained, batch, settings.prompt_loss_weight)
            global_loss = accelerator.reduce(loss.detach(), "mean") if world > 1 else loss.detach()
            if not torch.isfinite(global_loss):
                raise TrainingDiverged(
                    f"{desc}: loss became {global_loss.item()} at step {step + 1}; "
                    "lower the learning rate or check the data"
                )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(global_loss.item())
            shown = {"loss": losses[-1]}
            if val_encoded and eval_every and ((step + 1) % eval_every == 0 or step + 1 == settings.steps):
                val.append((step + 1, validation_loss(model, tokenizer, val_encoded, settings.batch_size,
                                                      settings.prompt_loss_weight, placement, accelerator)))
                shown["val_loss"] = val[-1][1]
            progress.advance(**shown)
    model.eval()
    return TrainHistory(losses, val)


def _draw(order: list[int], pool: int, count: int, rng: random.Random, rank: int, world: int) -> list[int]:
    """The next ``count`` indices of a pool of ``pool`` rows (``order`` refilled with shuffled passes while short,
    the same on every rank), this rank's equal slice of them; ``order`` loses all ``count``."""
    while pool and len(order) < count:
        refill = list(range(pool))
        rng.shuffle(refill)
        order.extend(refill)
    per_rank = count // world
    rows = order[:count][rank * per_rank : (rank + 1) * per_rank]
    del order[:count]
    return rows


def write_loss_curve(history: TrainHistory, out_dir: Path, title: str, prefix: str = "") -> None:
    """``loss.csv`` (step, train_loss), ``val_loss.csv`` (step, val_loss) when validated, and ``loss.png``."""
    from tasks.plots import LOSS_CSV, LOSS_PNG, VAL_LOSS_CSV, loss_figure, save_figure

    train_rows = [(i + 1, loss) for i, loss in enumerate(history.train)]
    with open(Path(out_dir) / f"{prefix}{LOSS_CSV}", "w", newline="") as fh:
        csv.writer(fh).writerows([("step", "train_loss"), *((s, f"{v:.6f}") for s, v in train_rows)])
    if history.val:
        with open(Path(out_dir) / f"{prefix}{VAL_LOSS_CSV}", "w", newline="") as fh:
            csv.writer(fh).writerows([("step", "val_loss"), *((s, f"{v:.6f}") for s, v in history.val)])
    save_figure(loss_figure(train_rows, history.val, title), Path(out_dir) / f"{prefix}{LOSS_PNG}")
