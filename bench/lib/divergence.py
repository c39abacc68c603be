"""How far one model's next-token distributions are from another's: log-probabilities, and the mean KL and top-1
agreement of two engines over prompts."""

from __future__ import annotations

import numpy as np

from runtime.engine.tokenizer import encode_prompt
from tasks.scoring import log_softmax


def output_error(reference, candidate, tokenizer, prompts: list[str]) -> dict:
    """How far ``candidate``'s next-token distributions are from ``reference``'s on every prompt
    token (prefill): mean KL(ref || cand) in nats and top-1 agreement. Used on the calib split
    to choose a quantization scheme, so the test split stays untouched by the choice."""
    kls, agree, total = 0.0, 0, 0
    for prompt in prompts:
        ids = np.asarray([encode_prompt(tokenizer, prompt)], dtype=np.int64)  # (1, T)
        T = ids.shape[1]
        args = (ids, np.arange(T)[None], np.ones((1, T), np.int64), None)
        p, q = (e.forward(*args)[0][0] for e in (reference, candidate))  # (T, V)
        lp, lq = log_softmax(p), log_softmax(q)
        kls += float((np.exp(lp) * (lp - lq)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        total += T
    return {"kl_mean": kls / total, "top1_agreement": agree / total, "tokens": total}
