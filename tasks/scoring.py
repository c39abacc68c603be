"""How the reference model's answers are made and scored: greedy completions through PyTorch and their
exact-match accuracy; log-probabilities of logits.

The evaluate stage scores the release with them, and so do the checks it runs (``tasks.checks.engine_parity``,
``tasks.checks.page_quality``), which is why they live below all three.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from runtime.engine.tokenizer import encode_prompt, until_stop
from tasks.records import Example


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities along the last axis, in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def kl_sum(ref_logp, logp) -> float:
    """Sum over positions of KL(reference || these) of log-probabilities (n, V), numpy arrays or CPU tensors."""
    ref, logp = np.asarray(ref_logp, dtype=np.float64), np.asarray(logp, dtype=np.float64)
    return float((np.exp(ref) * (ref - logp)).sum())


def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int,
                       desc: str = "greedy decode") -> list[str]:
    """Greedy-decode each prompt (left-padded batches) and return the text before the first of the
    tokenizer's ``stop_ids``: the prompt ids and the stop rule of ``runtime.engine.generate.generate_text``.
    ``desc`` names the progress bar (a log file keeps each bar's first frame: each says what it scores)."""
    import torch
    from tqdm import tqdm

    tokenizer.padding_side = "left"
    outputs: list[str] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", leave=False):
        rows = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt").to(model.device)
        with torch.no_grad():
            generated = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=list(tokenizer.stop_ids),
                pad_token_id=tokenizer.pad_token_id,
            )
        # A stop id need not be a special token, so cut at it rather than rely on skip_special_tokens.
        for row in generated[:, batch["input_ids"].shape[1] :].tolist():
            outputs.append(tokenizer.decode(until_stop(row, tokenizer.stop_ids), skip_special_tokens=True))
    return outputs


def accuracy_report(examples: list[Example], predictions: list[str]) -> dict:
    """Exact match (whitespace-trimmed) overall, on new and regression rules, and per rule."""
    hits = [pred.strip() == ex.completion.strip() for ex, pred in zip(examples, predictions, strict=True)]

    def rate(selected: list[bool]) -> float | None:
        return sum(selected) / len(selected) if selected else None

    per_rule: dict[str, list[bool]] = defaultdict(list)
    for ex, hit in zip(examples, hits, strict=True):
        if ex.rule is not None:
            per_rule[ex.rule].append(hit)
    return {
        "accuracy": rate(hits),
        "accuracy_new": rate([h for ex, h in zip(examples, hits) if ex.changed is True]),
        "accuracy_regression": rate([h for ex, h in zip(examples, hits) if ex.changed is False]),
        "count": len(hits),
        "count_new": sum(ex.changed is True for ex in examples),
        "count_regression": sum(ex.changed is False for ex in examples),
        "per_rule": {rule: rate(h) for rule, h in sorted(per_rule.items())},
    }
