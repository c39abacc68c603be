"""Release gates: every number a candidate must reach before it is packaged, and after, before it is published.

Two groups, because two artifacts answer them. ``evaluation_gates`` read the evaluate stage's
metrics (accuracy on the engine, against the floors and the current champion; KV-cache deltas;
decode latency; engine parity); the ``gates`` stage writes them to ``gates/gates.json``, and the
package stage refuses to run unless they all passed. ``package_gates`` read the package stage's
``check.json`` (size; verification and a load-and-query on the engine). The flow publishes only
when both groups pass. Each gate keeps its value, threshold and verdict for MLflow and the run summary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.release.contract import DEFAULT_PRODUCT, REGISTRY_CHANNELS, REGISTRY_INDEX, parse_channels, product_path
from tasks.config import EngineConfig, GatesConfig, StageError, WeightAccuracyDrop


class GateFailed(StageError):
    """A candidate that did not pass every gate; the message lists the failed ones."""


@dataclass(frozen=True)
class Gate:
    name: str
    value: float | str | None
    threshold: float | str | None
    op: str  # ">=", "<=", "==" or "n/a" (a gate that does not apply passes and says why)
    passed: bool
    detail: str


def _compare(name: str, value: float | None, op: str, threshold: float, detail: str) -> Gate:
    if value is None:
        return Gate(name, None, threshold, op, False, f"{detail}: not measured")
    ok = value >= threshold if op == ">=" else value <= threshold
    return Gate(name, value, threshold, op, ok, detail)


def _not_applicable(name: str, why: str) -> Gate:
    return Gate(name, None, None, "n/a", True, why)


def current_champion(registry_dir: Path, product: str = DEFAULT_PRODUCT) -> dict | None:
    """The published champion's month and headline metrics of ``product``, read from the release registry; None if none."""
    channels = Path(registry_dir) / product_path(REGISTRY_CHANNELS, product)
    index = Path(registry_dir) / product_path(REGISTRY_INDEX, product)
    if not channels.exists() or not index.exists():
        return None
    try:
        month = parse_channels(channels.read_bytes(), str(channels)).get("champion")
    except ValueError as err:
        raise StageError(str(err)) from None
    if month is None:
        return None
    entry = json.loads(index.read_text()).get(month)
    if entry is None:
        raise StageError(f"{channels} names champion {month} but {index} has no entry for it")
    return {"month": month, **entry}


def scored_metrics(metrics: dict) -> dict:
    """The candidate's numbers the gates read from ``metrics.json``: on the engine when it was measured
    there, else in PyTorch."""
    return metrics.get("adapter_on_engine") or metrics.get("adapter", {})


def accuracy_measure(scored: dict) -> str:
    """What the accuracy gates read: ``changed_rules`` (new and regression sets) when the test rows say
    whether their rule changed, else ``overall`` (the data's rows carry no ``changed`` field)."""
    labelled = scored.get("accuracy_new") is not None or scored.get("accuracy_regression") is not None
    return "changed_rules" if labelled else "overall"


def _accuracy_gates(scored: dict, where: str, gates: GatesConfig, champion: dict | None) -> list[Gate]:
    if accuracy_measure(scored) == "changed_rules":
        value, key = scored.get("accuracy_new"), "accuracy_new"
        out = [
            _compare("accuracy_new", value, ">=", gates.min_accuracy_new, f"accuracy on the changed rules {where}"),
            _compare("accuracy_regression", scored.get("accuracy_regression"), ">=", gates.min_accuracy_regression,
                     f"accuracy on the unchanged rules {where}"),
        ]
    else:
        value, key = scored.get("accuracy"), "accuracy"
        out = [_compare("accuracy", value, ">=", gates.min_accuracy,
                        f"overall test accuracy {where} (the rows carry no 'changed' field)")]
    name = f"{key}_vs_champion"
    if champion is None:
        out.append(_not_applicable(name, "no champion from an earlier month to compare with"))
    elif champion.get(key) is None:
        out.append(_not_applicable(name, f"champion {champion['month']} recorded no {key} to compare with"))
    else:
        out.append(_compare(name, value, ">=", champion[key] - gates.champion_tolerance,
                            f"not below champion {champion['month']} ({champion[key]:.3f}) minus {gates.champion_tolerance}"))
    return out


def weights_accuracy_gate(float_report: dict, quant_report: dict, weights: str, max_drop: WeightAccuracyDrop) -> dict:
    """Pass/fail of a weight-quantized engine against the float model: accuracy overall, on new and
    on regression rules may each drop at most ``max_drop.limit(weights)`` (fraction, 0.005 = 0.5 points).
    The evaluate stage records it as ``weights_gate``; ``evaluation_gates`` reads its verdict."""
    limit = max_drop.limit(weights)
    drops = {}
    for key in ("accuracy", "accuracy_new", "accuracy_regression"):
        if float_report.get(key) is not None and quant_report.get(key) is not None:
            drops[key] = float_report[key] - quant_report[key]
    failures = [f"{k} dropped {d * 100:.2f} points (limit {limit * 100:.2f})" for k, d in drops.items() if d > limit + 1e-12]
    return {
        "weights": weights,
        "max_drop": limit,
        "drops": drops,
        "perplexity_ratio": quant_report["perplexity"] / float_report["perplexity"]
        if float_report.get("perplexity") and quant_report.get("perplexity") else None,
        "passed": not failures,
        "failures": failures,
    }


def forgetting_pct(metrics: dict) -> float | None:
    """How much the adapter costs the base on held-out text: perplexity of base + adapter over the base's, % increase
    (negative: it helps); None when either was not measured."""
    base, adapted = (metrics.get(side, {}).get("perplexity") for side in ("base", "adapter"))
    return None if base is None or adapted is None else 100.0 * (adapted / base - 1.0)


def evaluation_gates(metrics: dict, gates: GatesConfig, champion: dict | None, engine: EngineConfig,
                     kv_enabled: bool) -> list[Gate]:
    """Gates on the evaluate stage's metrics. Accuracy is read on the engine when it was measured there."""
    scored = scored_metrics(metrics)
    where = "on the engine" if "adapter_on_engine" in metrics else "in PyTorch"
    out = _accuracy_gates(scored, where, gates, champion)
    out.append(_compare("forgetting_pct", forgetting_pct(metrics), "<=", gates.max_forgetting_pct,
                        "held-out perplexity of base + adapter over the base's, % increase (PyTorch): what the adapter "
                        "costs the base on text it was not trained for"))
    kv = metrics.get("kv_cache")
    if not kv_enabled:
        out += [_not_applicable(n, "KV quantization disabled (kv.enabled: false)")
                for n in ("kv_accuracy_drop", "kv_ppl_increase_pct")]
    else:
        kv = kv or {}
        # An engine serving the pages is measured on itself (its pages against float pages), else the pages in PyTorch.
        where = "on the quantized-pages engine vs its float pages" if "on_engine" in kv else "the pages in PyTorch"
        kv = kv.get("on_engine", kv)
        out += [
            _compare("kv_accuracy_drop", kv.get("accuracy_drop"), "<=", gates.max_kv_accuracy_drop,
                     f"test accuracy lost by the quantized KV cache ({where})"),
            _compare("kv_ppl_increase_pct", kv.get("ppl_increase_pct"), "<=", gates.max_kv_ppl_increase_pct,
                     f"held-out perplexity increase from the quantized KV cache, % ({where})"),
        ]
    latency = (metrics.get("adapter_on_engine") or {}).get("decode_latency")
    out.append(_compare("decode_step_ratio", latency and latency["step_ratio"], "<=", gates.max_decode_step_ratio,
                        "the serving engine's decode step (batch 1, adapter bound, 10th percentile) over the float "
                        "engine's, timed beside it" + (f" (p50 {latency['p50_ms']:.1f} ms, p95 {latency['p95_ms']:.1f} ms; "
                                                       f"load {latency['loadavg_1m'][0]:.1f})" if latency else "")))
    parity = metrics.get("engine_parity")
    if parity is None:
        out.append(Gate("engine_parity", None, engine.parity_max_logit_error, "<=", False, "the engine was not evaluated"))
    elif parity.get("weights", "fp32") != "fp32":
        weights_gate = metrics.get("weights_gate", {})
        out.append(Gate("engine_parity", str(weights_gate.get("passed")), "True", "==", bool(weights_gate.get("passed")),
                        f"{parity['weights']} weights: accuracy gate against float PyTorch"))
    else:
        out += _parity_gates(parity, engine)
    return out


def _parity_gates(parity: dict, engine: EngineConfig) -> list[Gate]:
    """An fp32 engine computes the same function as its PyTorch reference (tasks/checks/engine_parity.py)."""
    against = ("PyTorch + merged PEFT (a prefill reads its own K/V in float)" if parity.get("kv_cache") == "quantized_pages"
               else "PyTorch + merged PEFT")
    where = f"{parity['positions_compared']} positions of {parity['prompts']} test prompts, engine vs {against}"
    out = [
        _compare("engine_parity", parity["max_logit_error"], "<=", engine.parity_max_logit_error,
                 f"largest logit difference at a position, in float32 rounding budgets (eps32 x layers x the "
                 f"position's largest |logit|; max abs {parity['max_abs_logit_diff']:.2e}), {where}"),
        _compare("engine_parity_kl", parity["max_kl"], "<=", engine.parity_max_kl,
                 f"largest KL of the next-token distributions, nats (mean {parity['mean_kl']:.1e}), {where}"),
    ]
    differ = f"{len(parity['greedy_mismatches'])} of {parity['prompts']} differ: rows {parity['greedy_mismatches']}"
    if parity.get("greedy_judged", True):
        out.append(_compare("greedy_parity", float(len(parity["greedy_mismatches_beyond_ties"])), "<=", 0.0,
                            f"test rows whose greedy answer differs from the reference's where it saw no near-tie ({differ})"))
    else:
        out.append(_not_applicable("greedy_parity", f"the engine decodes over its quantized KV cache, the reference over "
                                                    f"float: what that costs the answers is kv_accuracy_drop's ({differ})"))
    if parity.get("kv_cache") == "quantized_pages":
        out.append(_compare("pages_sealer_parity", parity.get("pages_sealer_bytes_differing"), "<=", 0,
                            f"bytes of {parity.get('pages_sealed')} sealed pages the device stores otherwise than "
                            "the PyTorch reference sealing the K/V the engine computed (besides, sealing PyTorch's "
                            f"own K/V: {parity.get('kv_bytes_differing')} of {parity.get('kv_bytes_compared')} "
                            "bytes, float rounding of a scale or code, not gated)"))
    return out


def package_gates(check: dict, gates: GatesConfig) -> list[Gate]:
    """Gates on the package stage's ``check.json``: size, verification, and a query on the engine."""
    verify, query = check.get("verify", {}), check.get("load_and_query", {})
    return [
        _compare("package_pct_of_base", check.get("pct_of_base"), "<=", gates.max_package_pct_of_base,
                 f"package {check.get('package_bytes')} bytes against base {check.get('base_bytes')} bytes, %"),
        Gate("package_verifies", str(bool(verify.get("ok"))), "True", "==", bool(verify.get("ok")),
             verify.get("error") or "checksums, signature, backbone and interface as a device checks them"),
        Gate("load_and_query", str(bool(query.get("ok"))), "True", "==", bool(query.get("ok")),
             query.get("error") or f"engine loaded the package and answered {query.get('output')!r}"),
    ]


def gate_report(gates: list[Gate]) -> dict:
    return {"passed": all(g.passed for g in gates), "gates": [asdict(g) for g in gates]}


def failed_reason(report: dict) -> str:
    failed = [g for g in report["gates"] if not g["passed"]]
    return "; ".join(f"{g['name']} = {_fmt(g['value'])} (needs {g['op']} {_fmt(g['threshold'])}: {g['detail']})"
                     for g in failed)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def render_gate_table(report: dict) -> str:
    lines = ["| gate | value | threshold | verdict | detail |", "|---|---|---|---|---|"]
    for g in report["gates"]:
        verdict = "pass" if g["passed"] else "**FAIL**"
        threshold = "" if g["threshold"] is None else f"{g['op']} {_fmt(g['threshold'])}"
        lines.append(f"| {g['name']} | {_fmt(g['value'])} | {threshold} | {verdict} | {g['detail']} |")
    return "\n".join(lines) + "\n"


def kv_size_vs_fp16(kv: dict) -> str:
    """The quantized cache's bytes against an fp16 cache's, said the way round that reads: quantized pages keep
    the first and the open page float, so on rows of a few dozen tokens they hold more than fp16 would."""
    ratio = 1 / kv["compression_vs_fp16"]
    at = f" at {kv['context_len']} tokens" if "context_len" in kv else ""
    if ratio <= 1:
        return f"{kv['compression_vs_fp16']:.2f}x fewer than fp16{at}"
    return f"{ratio:.2f}x an fp16 cache's{at} (short rows are mostly the float first and open pages)"
