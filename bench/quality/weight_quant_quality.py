"""Weight-only quantization: quality of each scheme against the float engine, on the release's month.

    python -m bench.quality.weight_quant_quality --engine-dir engine --base-dir models/base --adapter-dir A --data-dir D
        --out-dir DIR [--schemes int4_rtn,int4_clip]     # every scheme of SCHEMES: one engine each + comparison.json
    python -m bench.quality.weight_quant_quality --engine-dir engine --quantized-dir engine-int4 --base-dir B
        --adapter-dir A --data-dir D                      # one copy (python -m tasks.weights.engines), gated

Per scheme: the output error on the calib split (mean KL and top-1 agreement against the float
engine: the selection criterion, so the test split stays untouched by the choice), test accuracy and
held-out perplexity of base + adapter (the acceptance measure) and the release's weights gate
(``tasks.gate_rules.weights_accuracy_gate``, thresholds ``gates.max_weight_accuracy_drop`` of ``--params``).
Latency is ``bench/engine/weight_quant_bench.py``'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from bench.lib.divergence import output_error
from bench.lib.tables import table
from runtime.engine.interface import ENGINE_ONNX
from tasks.config import WeightAccuracyDrop, load_config
from tasks.gate_rules import weights_accuracy_gate
from tasks.weights.engines import WEIGHTS_FILE, open_on_cpu, quantize_engine_dir
from tasks.weights.graph import DEFAULT_BLOCK_SIZE, WeightQuantError, calibrate_activations

log = logging.getLogger(__name__)


def open_with_adapter(engine_dir: Path, adapter_dir: Path, threads: int = 2):
    """``open_on_cpu`` with the adapter's LoRA inputs bound (refuses an adapter made for another interface)."""
    from runtime.engine.adapter import load_adapter

    engine = open_on_cpu(engine_dir, threads)
    engine.set_adapter(load_adapter(adapter_dir, engine.interface))
    return engine


def engine_quality(engine, tokenizer, data_dir: Path, max_new_tokens: int = 8, batch_size: int = 64) -> dict:
    """Accuracy (all / new / regression rules) on ``test`` and perplexity on held-out text of an
    engine with the adapter bound (``open_with_adapter``)."""
    from runtime.engine.generate import generate_text
    from tasks.records import HELDOUT_TEXT, read_jsonl, read_text_corpus
    from tasks.scoring import accuracy_report
    from tasks.stages.evaluate import engine_perplexity

    test = read_jsonl(Path(data_dir) / "test.jsonl")
    report = accuracy_report(test, generate_text(engine, tokenizer, [ex.prompt for ex in test], max_new_tokens, batch_size))
    heldout = Path(data_dir) / HELDOUT_TEXT
    texts = read_text_corpus(heldout) if heldout.exists() else [e.text for e in read_jsonl(Path(data_dir) / "val.jsonl")]
    report["perplexity"] = engine_perplexity(engine, tokenizer, texts)
    return report


_HEAD_FP32, _HEAD_QUANT = ("lm_head", "embed"), ("embed",)
SCHEMES = {  # name -> (weights, fold_norms, keep, calibrated clip search, format)
    "int8_rtn": ("int8", False, _HEAD_FP32, False, "matmulnbits"),
    "int8_fold": ("int8", True, _HEAD_FP32, False, "matmulnbits"),
    "int8_rtn_head": ("int8", False, _HEAD_QUANT, False, "matmulnbits"),
    "int4_rtn": ("int4", False, _HEAD_FP32, False, "matmulnbits"),
    "int4_fold": ("int4", True, _HEAD_FP32, False, "matmulnbits"),
    "int4_clip": ("int4", False, _HEAD_FP32, True, "matmulnbits"),
    "int4_fold_clip": ("int4", True, _HEAD_FP32, True, "matmulnbits"),
    "int4_rtn_head": ("int4", False, _HEAD_QUANT, False, "matmulnbits"),
    "int4_fold_head": ("int4", True, _HEAD_QUANT, False, "matmulnbits"),
    # What TensorRT runs (symmetric codes, fp16 GEMMs), scored here by ONNX Runtime on the same graph.
    "int8_trt": ("int8", False, _HEAD_FP32, False, "qdq_fp16"),
    "int4_trt": ("int4", False, _HEAD_FP32, False, "qdq_fp16"),
}


def compare_schemes(engine_dir: Path, base_dir: Path, adapter_dir: Path, data_dir: Path, work_dir: Path,
                    max_drop: WeightAccuracyDrop, schemes: list[str] | None = None,
                    block_size: int = DEFAULT_BLOCK_SIZE, threads: int = 2) -> dict:
    """Every scheme vs the float engine: calib-split output error (the selection criterion) and
    test accuracy + held-out perplexity of base + adapter (the acceptance measure)."""
    from tasks.models import load_tokenizer
    from tasks.records import read_jsonl

    unknown = set(schemes or ()) - set(SCHEMES)
    if unknown:
        raise WeightQuantError(f"unknown schemes {sorted(unknown)}; known: {sorted(SCHEMES)}")
    tokenizer = load_tokenizer(Path(base_dir))
    calib = [ex.text for ex in read_jsonl(Path(data_dir) / "calib.jsonl")]
    reference = open_with_adapter(engine_dir, adapter_dir, threads)
    results = {"fp32": {"quality": engine_quality(reference, tokenizer, data_dir)}}
    act_sq = None
    for name in schemes or list(SCHEMES):
        weights, fold, keep, calibrated, fmt = SCHEMES[name]
        if calibrated and act_sq is None:
            act_sq = calibrate_activations(Path(engine_dir) / ENGINE_ONNX, [tokenizer(t)["input_ids"] for t in calib], threads)
        out = Path(work_dir) / name
        record = quantize_engine_dir(engine_dir, out, weights, block_size, fold, keep,
                                     act_sq=act_sq if calibrated else None, fmt=fmt)
        engine = open_with_adapter(out, adapter_dir, threads)
        quality = engine_quality(engine, tokenizer, data_dir)
        results[name] = {
            "calib_error": output_error(reference, engine, tokenizer, calib),
            "quality": quality,
            "gate": weights_accuracy_gate(results["fp32"]["quality"], quality, weights, max_drop),
            "weight_bytes_ratio": record["quantized_weight_bytes"] / record["quantized_weight_bytes_fp32"],
        }
        log.info("%s: %s", name, {k: results[name]["calib_error"][k] for k in ("kl_mean", "top1_agreement")})
    return results


def render_comparison(results: dict) -> str:
    rows = []
    for name, r in results.items():
        q, c = r["quality"], r.get("calib_error", {"kl_mean": 0.0, "top1_agreement": 1.0})
        gate = "-" if "gate" not in r else ("pass" if r["gate"]["passed"] else "FAIL")
        # new/regression are None on a month whose rows carry no `changed` field
        new, regression = (("n/a" if q[k] is None else f"{q[k]:.4f}") for k in ("accuracy_new", "accuracy_regression"))
        rows.append([name, f"{c['kl_mean']:.2e}", f"{c['top1_agreement']:.4f}", f"{q['accuracy']:.4f}", new, regression,
                     f"{q['perplexity']:.4f}", gate])
    header = ["scheme", "calib KL (nats)", "calib top-1 agree", "accuracy", "new", "regression", "perplexity", "gate"]
    return table(header, rows, align="<" * len(header), markdown=True) + "\n"


def score_quantized(engine_dir: Path, quantized_dir: Path, base_dir: Path, adapter_dir: Path, data_dir: Path,
                    max_drop: WeightAccuracyDrop, threads: int = 2) -> dict:
    """One quantized copy vs its float engine: quality of both, and the weights gate unless it is fp32."""
    from tasks.models import load_tokenizer

    record = json.loads((Path(quantized_dir) / WEIGHTS_FILE).read_text())
    tokenizer = load_tokenizer(Path(base_dir))
    ref, got = (engine_quality(open_with_adapter(d, adapter_dir, threads), tokenizer, data_dir)
                for d in (engine_dir, quantized_dir))
    result = {"weights": record, "float": ref, "quantized": got}
    if record["weights"] != "fp32":
        result["gate"] = weights_accuracy_gate(ref, got, record["weights"], max_drop)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Quality of weight-quantized engines against the float engine.")
    ap.add_argument("--engine-dir", type=Path, required=True, help="a compiled float engine (tasks.stages.compile)")
    ap.add_argument("--base-dir", type=Path, required=True)
    ap.add_argument("--adapter-dir", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--out-dir", type=Path, help="compare every scheme of SCHEMES: one engine each + comparison.json")
    ap.add_argument("--schemes", help="with --out-dir: a comma-separated subset of SCHEMES")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--quantized-dir", type=Path, help="instead: score and gate this copy (tasks.weights.engines)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="gates.max_weight_accuracy_drop from here")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if (args.out_dir is None) == (args.quantized_dir is None):
        ap.error("give exactly one of --out-dir (compare the schemes) and --quantized-dir (score one copy)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    max_drop = load_config(args.params).gates.max_weight_accuracy_drop
    if args.quantized_dir is not None:
        result = score_quantized(args.engine_dir, args.quantized_dir, args.base_dir, args.adapter_dir, args.data_dir,
                                 max_drop, args.threads)
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0 if result.get("gate", {"passed": True})["passed"] else 1
    results = compare_schemes(args.engine_dir, args.base_dir, args.adapter_dir, args.data_dir, args.out_dir, max_drop,
                              args.schemes.split(",") if args.schemes else None, args.block_size, args.threads)
    (args.out_dir / "comparison.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(render_comparison(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
