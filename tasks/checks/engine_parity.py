"""Acceptance check of the compiled engine against PyTorch + PEFT (merged), on a test split.

Three measures (``LogitAgreement``, ``greedy_mismatches_beyond_ties``): at every position of every test prompt's
prefill, the logit difference in units of float32 rounding (eps32 x depth x the logits' size) and the KL of the
next-token distributions; and greedy answers, where any difference must be a near-tie of the reference (the PyTorch
side is ``tasks.scoring.greedy_completions``, the engine side ``runtime.engine.generate.generate_text``, with the same
batch size and max new tokens).

    python -m tasks.checks.engine_parity --base-dir B --adapter-dir A --engine-dir E --test test.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from runtime.engine.kv_pages import PagesCache, page_scheme
from runtime.engine.tokenizer import ChatPrompt, encode_prompt
from tasks.artifacts import write_json
from tasks.config import PARITY_MAX_KL, PARITY_MAX_LOGIT_ERROR
from tasks.scoring import log_softmax

FLOAT32_EPS = float(np.finfo(np.float32).eps)
DECODE_STEPS = 4  # a prompt's last tokens the engine reads one at a time through its cache (teacher_forced_agreement)


class LogitAgreement:
    """The engine's logits against a reference's, position by position, over many prompts: the measures of "the
    engine computes the same function", which a float32 reordering passes and a defect does not.

    - ``max_logit_error``: the largest |logit difference| at a position, in units of that position's float32
      rounding budget, ``eps32 x num_layers x max |reference logit|``. Two correct fp32 implementations differ by
      reassociation: every sum rounds at eps32 relative to its size, each layer adds its own on the residual stream,
      and a logit's error is relative to the logits' size. So the budget grows with depth and with the logits'
      magnitude, where an absolute tolerance tuned on one data set does not (issue 40: a correct engine refused at
      5.6e-4 against 2e-4 on a user's longer prompts).
    - ``max_kl``: the largest KL(reference || engine) of the next-token distributions at a position (nats): what a
      difference does to what the model says, whatever the logits' scale.
    - ``max_abs_logit_diff``: the absolute figure, reported beside them.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.max_abs_logit_diff = self.max_logit_error = self.max_kl = self.kl_sum = 0.0
        self.positions = 0

    def add(self, got: np.ndarray, want: np.ndarray, chunk: int = 64) -> None:
        """One prompt's logits, (..., vocab) each, the engine's and the reference's (``chunk`` positions at a time:
        a long prompt's float64 copies of a 49k vocabulary would take gigabytes at once)."""
        got, want = (np.asarray(x).reshape(-1, x.shape[-1]) for x in (got, want))
        for start in range(0, len(want), chunk):
            g, w = (np.asarray(x[start : start + chunk], np.float64) for x in (got, want))
            diff = np.abs(g - w).max(-1)
            log_p, log_q = log_softmax(w), log_softmax(g)
            kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
            self.max_abs_logit_diff = max(self.max_abs_logit_diff, float(diff.max()))
            self.max_logit_error = max(self.max_logit_error, float((diff / self.rounding_budget(w)).max()))
            self.max_kl = max(self.max_kl, float(kl.max()))
            self.kl_sum += float(kl.sum())
            self.positions += len(kl)

    def rounding_budget(self, logits: np.ndarray) -> np.ndarray:
        """Float32 rounding budget of each position's logits (..., vocab) -> (...): eps32 x depth x max |logit|."""
        return FLOAT32_EPS * self.num_layers * np.maximum(np.abs(logits).max(-1), 1e-30)

    def report(self) -> dict:
        return {
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "max_logit_error": self.max_logit_error,
            "max_kl": self.max_kl,
            "mean_kl": self.kl_sum / max(self.positions, 1),
            "positions_compared": self.positions,
        }


def teacher_forced_agreement(engine, model, tokenizer, prompts: list[str | ChatPrompt],
                             decode_steps: int = DECODE_STEPS) -> LogitAgreement:
    """Every position of each prompt, engine vs a PyTorch model (``LogitAgreement``): the engine reads the prompt but
    its last ``decode_steps`` tokens as a prefill, then those one at a time through its cache, as decoding does. A
    defect of the decode path (a step's RoPE position, what the cache keeps) shows there and nowhere in a prefill: RoPE
    attention sees only differences of positions, so a prefill shifted as a whole computes the same logits."""
    import torch

    agreement = LogitAgreement(engine.interface.num_layers)
    for prompt in prompts:
        ids = np.asarray([encode_prompt(tokenizer, prompt)], dtype=np.int64)  # (1, T)
        T = ids.shape[1]
        split = max(T - decode_steps, 1)
        logits, cache = engine.forward(ids[:, :split], np.arange(split)[None], np.ones((1, split), np.int64), None)
        got = [logits]
        for t in range(split, T):
            logits, cache = engine.forward(ids[:, t : t + 1], np.asarray([[t]]), np.ones((1, t + 1), np.int64), cache)
            got.append(logits)
        with torch.no_grad():
            want = model(torch.from_numpy(ids)).logits.numpy()
        agreement.add(np.concatenate(got, axis=1), want)
    return agreement


def pages_parity(engine, backbone, tokenizer, prompts: list[str | ChatPrompt]) -> dict:
    """The pages a quantized-pages engine (interface version 9) stores for each prompt's prefill against the PyTorch
    reference's (``kernels.page_quant.seal_packed``), byte for byte: codes, fp16 scales and minima of every sealed page.

    Two comparisons. From the same layer inputs: the reference seals the K/V the engine computed and handed its cache
    (``RecordedPages``), and the pool must hold exactly those bytes (``pages_sealer_bytes_differing``, gated at 0):
    the device's sealer (``runtime.engine.kv_pages.seal_pages``), its packing and the pool's block layout, all at once.
    Across implementations: the pool against the reference sealing PyTorch's own K/V (``kv_code_mismatch``, reported,
    not gated). The two compute K/V in float32 with different kernels, ~1e-7 apart, and a page's fp16 scale and
    minimum come from its extreme values, so a difference that small turns an fp16 rounding of a scale or a code at a
    rounding boundary (SmolLM2, 36 chat prompts: 1,912 of 9,757,440 bytes, 2.0e-4, where the removed static scheme,
    whose scales were fixed, differed on 3.8e-6); what the K/V themselves compute is the logits' parity (a prefill reads
    its own K/V in float: ``teacher_forced_agreement`` without decode steps) and the pages' KL on the engine (``tasks.checks.page_quality``)."""
    import torch

    iface = engine.interface
    spec, bs = page_scheme(iface), iface.kv_block_size
    counts = {"compared": 0, "differing": 0, "sealer_differing": 0, "prompts": 0, "pages": 0}
    for prompt in prompts:
        ids = np.asarray([encode_prompt(tokenizer, prompt)], dtype=np.int64)  # (1, T)
        T = ids.shape[1]
        sealed = T // bs - 1  # pages 1 .. T // bs - 1: full and not the sink
        if sealed < 1:
            continue
        cache = RecordedPages.empty(engine.pool, spec, 1)
        engine.forward(ids, np.arange(T)[None], np.ones((1, T), np.int64), cache)
        stored = cache.to_numpy()  # {pool name: (1, nkv, pages x slots, w)}
        with torch.no_grad():
            _, present = backbone(torch.from_numpy(ids), torch.arange(T)[None], torch.ones(1, T, dtype=torch.long),
                                  backbone.empty_past(1))
        differing = 0
        for layer in range(iface.num_layers):
            handed = [torch.from_numpy(cache.handed[f"pool_{kv}.{layer}"]) for kv in ("key", "value")]
            ours = sealed_reference(handed, spec.layer(layer), bs, sealed)
            theirs = sealed_reference(present[2 * layer : 2 * layer + 2], spec.layer(layer), bs, sealed)
            got = {role: stored[f"pool_{role}.{layer}"][0] for role in ours}  # (nkv, S slots, w) each
            counts["sealer_differing"] += sum(bytes_differing(got[role], want) for role, want in ours.items())
            differing += sum(bytes_differing(got[role], want) for role, want in theirs.items())
            counts["compared"] += sum(g.view(np.uint8).size for g in got.values())
        counts["differing"] += differing
        del cache  # its pages go back to the engine's pool
        counts["prompts"] += bool(differing)
        counts["pages"] += sealed
    return {
        "pages_sealed": counts["pages"],
        "pages_sealer_bytes_differing": counts["sealer_differing"],
        "kv_bytes_compared": counts["compared"],
        "kv_bytes_differing": counts["differing"],
        "kv_code_mismatch": counts["differing"] / max(counts["compared"], 1),
        "prompts_with_differing_kv_bytes": counts["prompts"],
    }


def sealed_reference(kv, spec, bs: int, sealed: int) -> dict[str, np.ndarray]:
    """A prompt's K and V, each (1, nkv, T, d) float32 torch, -> the reference's stored pages 1 .. ``sealed``
    (``kernels.page_quant.seal_packed``), {role: (S, nkv, slots, w)}."""
    from kernels.page_quant import seal_packed

    k, v = (x[0, :, bs : bs * (1 + sealed)] for x in kv)  # (nkv, S bs, d)
    k, v = (x.reshape(x.shape[0], sealed, bs, x.shape[-1]).transpose(0, 1).contiguous() for x in (k, v))
    return {role: x.numpy() for role, x in seal_packed(k, v, spec).items()}


def bytes_differing(stored: np.ndarray, pages: np.ndarray) -> int:
    """Bytes of a row's pool, (nkv, S slots, w), that differ from the reference's pages (S, nkv, slots, w)."""
    return int((stored.view(np.uint8) != pages.transpose(1, 0, 2, 3).reshape(stored.shape).view(np.uint8)).sum())


class RecordedPages(PagesCache):
    """A quantized-pages cache that keeps what the engine handed it on its last append ({float pool name:
    (B, nkv, T, d) float32}, ``handed``): the K/V the device sealed, for ``pages_parity`` to seal again."""

    def append(self, outputs: dict[str, np.ndarray], real: np.ndarray) -> None:
        self.handed = {name: array.copy() for name, array in outputs.items()}
        super().append(outputs, real)


def greedy_mismatches_beyond_ties(model, tokenizer, prompts: list[str | ChatPrompt], on_engine: list[str],
                                  rows: list[int], max_logit_error: float, max_new_tokens: int) -> list[int]:
    """Of the ``rows`` whose greedy outputs differ, those the reference did not see as a near-tie.

    The reference (a PyTorch model) reads the prompt and the engine's answer (teacher-forced, the answer's text
    encoded again). At the first token where its own choice differs from the engine's, the two logits must lie within
    twice the rounding budget ``LogitAgreement`` allows one logit (each may move by that much): a float reordering
    can flip a near-tie, a defect flips clear choices. A row where the reference, reading one row unpadded, chooses
    the engine's every token is a tie too: its own answer came from a padded batch, whose float noise flipped it."""
    import torch

    stop_ids = list(tokenizer.stop_ids)
    budget = LogitAgreement(model.config.num_hidden_layers).rounding_budget
    beyond = []
    for row in rows:
        prompt_ids = encode_prompt(tokenizer, prompts[row])
        answer = tokenizer.encode(on_engine[row], add_special_tokens=False)
        ids = torch.tensor([prompt_ids + answer])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 :].double().numpy()  # (len(answer) + 1, vocab)
        tie = True
        for step, want in enumerate(logits[:max_new_tokens]):
            engine_next = answer[step] if step < len(answer) else max(stop_ids, key=lambda t: want[t])
            choice = int(want.argmax())
            if choice != engine_next and not (step == len(answer) and choice in stop_ids):
                tie = want[choice] - want[engine_next] <= 2 * max_logit_error * budget(want)
                break
        if not tie:
            beyond.append(row)
    return beyond


def parity_verdict(model, tokenizer, prompts: list[str | ChatPrompt], agreement: dict, reference: list[str],
                   on_engine: list[str], max_logit_error: float, max_kl: float, max_new_tokens: int,
                   float_cache: bool = True) -> dict:
    """The parity verdict of an engine's logit ``agreement`` and its greedy answers against ``model``'s: logits within
    the rounding budget and the KL limit at every position, and every greedy mismatch a near-tie
    (``greedy_mismatches_beyond_ties``). An engine that decodes over a quantized KV cache (``float_cache`` False)
    answers what its cache lets it, not what a float reference does: its greedy answers are reported, not judged
    (what the cache costs them is the KV gates' measure, ``kv_accuracy_drop``)."""
    mismatches = [i for i, (a, b) in enumerate(zip(reference, on_engine, strict=True)) if a != b]
    beyond = greedy_mismatches_beyond_ties(model, tokenizer, prompts, on_engine, mismatches, max_logit_error,
                                           max_new_tokens) if float_cache else []
    return {
        "prompts": len(reference),
        **agreement,
        "max_logit_error_limit": max_logit_error,
        "max_kl_limit": max_kl,
        "greedy_identical": not mismatches,
        "greedy_mismatches": mismatches[:20],
        "greedy_judged": float_cache,
        "greedy_mismatches_beyond_ties": beyond[:20],
        "passed": agreement["max_logit_error"] <= max_logit_error and agreement["max_kl"] <= max_kl and not beyond,
    }


def check_parity(engine, model, tokenizer, prompts: list[str | ChatPrompt], max_new_tokens: int, batch_size: int,
                 max_logit_error: float = PARITY_MAX_LOGIT_ERROR, max_kl: float = PARITY_MAX_KL) -> dict:
    """``parity_verdict`` of an engine (its adapter bound) against a PyTorch model (the base with the adapter merged):
    every position's logits (``teacher_forced_agreement``), then greedy answers (``max_new_tokens``, ``batch_size`` rows at a time)."""
    from runtime.engine.generate import generate_text
    from tasks.scoring import greedy_completions

    agreement = teacher_forced_agreement(engine, model, tokenizer, prompts)
    return parity_verdict(model, tokenizer, prompts, agreement.report(),
                          greedy_completions(model, tokenizer, prompts, max_new_tokens, batch_size),
                          generate_text(engine, tokenizer, prompts, max_new_tokens, batch_size),
                          max_logit_error, max_kl, max_new_tokens)


def engine_parity(
    base_dir: Path,
    adapter_dir: Path,
    engine_dir: Path,
    test_jsonl: Path,
    max_new_tokens: int = 8,
    batch_size: int = 64,
    threads: int = 2,
    out_path: Path | None = None,
) -> dict:
    from peft import PeftModel

    from runtime.engine.adapter import load_adapter
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.models import load_base_model
    from tasks.records import read_jsonl

    prompts = [ex.prompt for ex in read_jsonl(Path(test_jsonl))]
    engine = OrtEngine(engine_dir, threads=threads)
    engine.set_adapter(load_adapter(adapter_dir, engine.interface))  # refuses a foreign adapter first
    model, tokenizer = load_base_model(Path(base_dir))
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    metrics = check_parity(engine, merged, tokenizer, prompts, max_new_tokens, batch_size)
    metrics["interface_hash"] = engine.interface.interface_hash
    if out_path is not None:
        write_json(Path(out_path), metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-dir", type=Path, required=True)
    ap.add_argument("--adapter-dir", type=Path, required=True)
    ap.add_argument("--engine-dir", type=Path, required=True)
    ap.add_argument("--test", type=Path, required=True)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    metrics = engine_parity(args.base_dir, args.adapter_dir, args.engine_dir, args.test, args.max_new_tokens,
                            args.batch_size, args.threads, args.out)
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0 if metrics["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
