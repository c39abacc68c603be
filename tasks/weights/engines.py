"""Weight-quantized engine directories: a copy of a compiled engine whose graph stores int8/int4
weights (``tasks/weights/graph.py``), its record and its cache key, and the compile stage's serving
copy, built once per float engine and settings.

    python -m tasks.weights.engines --engine-dir engine --out-dir engine-int4 --weights int4 [--fold-norms]

measures nothing; ``python -m bench.quality.weight_quant_quality`` scores a copy (or every scheme) against the
float engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np

from runtime.engine.interface import CACHE_KEY_FILE, ENGINE_ONNX, INTERFACE_FILE
from tasks.weights.graph import (
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    HEAD_SLICE_MAX_BYTES,
    WEIGHT_FORMATS,
    WeightQuantError,
    quantize_engine_weights,
)

log = logging.getLogger(__name__)

# engine.weights -> bits per weight (None = the float export, untouched)
WEIGHT_BITS = {"fp32": None, "int8": 8, "int4": 4}
WEIGHTS_FILE = "weights.json"  # written next to interface.json: how the engine's weights were stored
# ONNX Runtime fuses DequantizeLinear + MatMul into MatMulNBits at this accuracy level; 0 keeps
# the dequantized weights and fp32 activations exact, so ORT checks a Q/DQ graph against its reference.
QDQ_EXACT_ORT_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}
# The LM head of a serving engine (the compile stage's int8/int4 copy): int8 whatever the body's bits.
# At Qwen2-0.5B's shape it is 136M of the 494M parameters (vocabulary 151,936 x 896) and the largest
# read per token: kept fp32 it is 544 of the int4 engine's 736 MB per token. Measured there
# (bench.flow.scale_bench: random weights, the release's adapter and 4-bit KV cache, past 512, 2 cores under
# other load, one interleaved loop; median / p10 ms): int4 body with an fp32 head 83.4 / 39.8, int8 head
# 53.6 / 27.4, int4 head 59.2 / 25.3; the head's own output error on the calib split (KL against the
# fp32 head) 1.2e-5 nats at int8, 1.9e-3 at int4 (150x), for at most a p10 8% faster. llama.cpp's Q4_0
# keeps this tensor at Q8_0 too (its Q6_K needs rows of a multiple of 256 columns; 896 is not).
SERVING_HEAD_BITS = 8
SERVING_KEEP = ()
# The embedding table of a serving engine: int8 as GatherBlockQuantized (``tasks.weights.graph``), whatever
# the body's bits. Kept fp32 it was 545 of the int4 engine's resident MB at the 0.5B shape; int8 is 137 MB,
# the bits of the LM head it is tied to in Qwen2 (llama.cpp keeps a tied table at Q8_0 likewise).
SERVING_EMBED_BITS = 8


def weights_key_fields(weights: str, block_size: int = DEFAULT_BLOCK_SIZE, fold_norms: bool = False,
                       keep: tuple[str, ...] = ("lm_head", "embed"), accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                       fmt: str = "matmulnbits", head_bits: int | None = None, embed_bits: int | None = None,
                       calibration: dict | None = None, mixed_bits: float | None = None) -> dict:
    """The part of the engine cache key (and of the interface) that says how weights are stored:
    two engines that differ in any of these must never be taken for one another. Empty for
    fp32: a float engine keeps the key (and the cached build) it had before this option existed.
    The accuracy level is MatMulNBits' own; a Q/DQ graph has none. ``calibration`` (``gptq_calibration``'s record,
    or a digest of the statistics a clip search read) is absent for round to nearest, as before it existed; so is
    ``mixed_bits`` (``tasks.weights.mixed``) for a uniform engine."""
    if weights == "fp32":
        return {}
    fields = {"weights": weights, "weights_block_size": block_size, "weights_fold_norms": fold_norms,
              "weights_keep": sorted(keep), "weights_format": fmt}
    if calibration is not None:
        fields["weights_calibration"] = calibration
    if mixed_bits is not None:
        fields["weights_mixed_bits"] = mixed_bits
    if fmt == "matmulnbits":
        fields["weights_accuracy_level"] = accuracy_level
    if "lm_head" not in keep and head_bits not in (None, WEIGHT_BITS[weights]):  # absent with the body's bits, as before
        fields["weights_head_bits"] = head_bits
    if "lm_head" not in keep and fmt == "matmulnbits":  # a large head is written in slices of this size
        fields["weights_head_slice_bytes"] = HEAD_SLICE_MAX_BYTES
    if "embed" not in keep and embed_bits not in (None, WEIGHT_BITS[weights]):
        fields["weights_embed_bits"] = embed_bits
    return fields


def quantized_cache_key(float_key: dict, fields: dict) -> dict:
    """``tasks.stages.compile.cache_key`` of the float engine + the weight fields, re-hashed."""
    key = {k: v for k, v in float_key.items() if k != "key"} | fields
    key["key"] = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return key


def quantize_engine_dir(engine_dir: Path, out_dir: Path, weights: str, block_size: int = DEFAULT_BLOCK_SIZE,
                        fold_norms: bool = False, keep: tuple[str, ...] = ("lm_head", "embed"),
                        accuracy_level: int = DEFAULT_ACCURACY_LEVEL, act_sq: dict | None = None,
                        fmt: str = "matmulnbits", head_bits: int | None = None, embed_bits: int | None = None,
                        hessians: dict | None = None, calibration: dict | None = None,
                        mixed: tuple[dict, dict] | None = None) -> dict:
    """A copy of a compiled engine directory whose model.onnx has ``weights`` precision, in graph
    form ``fmt`` (``WEIGHT_FORMATS``): round to nearest, with the clip search given ``act_sq``, or GPTQ given
    ``hessians`` (``tasks.weights.graph.quantize_engine_weights``). ``calibration`` names the statistics in the
    cache key (``gptq_calibration``); without it they are hashed. ``mixed``: (part codes, record) of
    ``tasks.weights.mixed.mixed_codes``, the body's projections written at their parts' widths.

    Writes ``model.onnx``, ``interface.json`` (the same inputs and hash, plus the weight precision) and
    ``weights.json`` (precision + quantizer settings + summary). The ORT-optimized graph is
    written by the first ``OrtEngine`` that opens the directory.
    """
    import dataclasses

    from runtime.engine.interface import read_interface, write_interface

    if weights not in WEIGHT_BITS:
        raise WeightQuantError(f"weights must be one of {sorted(WEIGHT_BITS)}, got {weights!r}")
    engine_dir, out_dir = Path(engine_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bits = WEIGHT_BITS[weights]
    if bits is None:
        for f in [engine_dir / ENGINE_ONNX, *engine_dir.glob(f"{ENGINE_ONNX}*.data")]:  # the graph and its external data
            shutil.copy2(f, out_dir / f.name)
        summary = {"bits": 32}
    else:
        summary = quantize_engine_weights(engine_dir / ENGINE_ONNX, out_dir / ENGINE_ONNX, bits, block_size,
                                          fold_norms, keep, accuracy_level, act_sq=act_sq, fmt=fmt, head_bits=head_bits,
                                          embed_bits=embed_bits, hessians=hessians,
                                          part_codes=None if mixed is None else mixed[0])
    stats = hessians if hessians is not None else act_sq
    if calibration is None and stats is not None and bits is not None:  # the codes depend on the calibration data
        digest = hashlib.sha256()
        for name in sorted(stats):
            digest.update(name.encode() + np.asarray(stats[name]).tobytes())
        calibration = digest.hexdigest()
    fields = weights_key_fields(weights, block_size, fold_norms, keep, accuracy_level, fmt, head_bits, embed_bits,
                                calibration if bits is not None else None,
                                None if mixed is None else mixed[1]["budget_bits"])
    record = {**summary, **fields, "weights": weights} | ({} if mixed is None else {"mixed": mixed[1]})
    (out_dir / WEIGHTS_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    iface = read_interface(engine_dir)
    stored = None if bits is None else {"precision": weights, "format": fmt, "block_size": block_size}
    exporter = json.loads((engine_dir / INTERFACE_FILE).read_text()).get("exporter")
    write_interface(dataclasses.replace(iface, weights=stored), out_dir / INTERFACE_FILE, exporter)
    src_key = engine_dir / CACHE_KEY_FILE
    if src_key.exists():  # written last, as tasks.stages.compile does: its presence means "complete"
        key = quantized_cache_key(json.loads(src_key.read_text()), fields)
        (out_dir / CACHE_KEY_FILE).write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
    return record


def gptq_calibration(windows: list[list[int]]) -> dict:
    """What of GPTQ's calibration the codes depend on, for the cache key: the token ids (hashed) and their count."""
    digest = hashlib.sha256(json.dumps(windows).encode()).hexdigest()
    return {"method": "gptq", "windows": len(windows), "tokens": sum(map(len, windows)), "ids_sha256": digest}


def mixed_applies(weights: str, fmt: str, calibrated: bool) -> bool:
    """Whether ``engine.weight_mixed_bits`` shapes an engine: int4 by GPTQ, as MatMulNBits (a mixed plan is read from
    GPTQ's statistics and written as one MatMulNBits per part); int8 and TensorRT's form keep one width."""
    return weights == "int4" and fmt == "matmulnbits" and calibrated


def ensure_quantized_engine(float_dir: Path, out_dir: Path, weights: str, block_size: int = DEFAULT_BLOCK_SIZE,
                            fmt: str = "matmulnbits", calibration_ids: list[list[int]] | None = None,
                            threads: int = 2, mixed_bits: float | None = None, model_dir: Path | None = None) -> dict:
    """``quantize_engine_dir`` unless ``out_dir`` already holds the build for this float engine and
    these settings; written to a temporary sibling and renamed, like the float engine. The LM head
    is quantized too, at ``SERVING_HEAD_BITS``, and the embedding table at ``SERVING_EMBED_BITS``.
    With ``calibration_ids`` (``tasks.real_model.text.calibration_windows``) by GPTQ, the second moments read on
    those tokens from the graph being quantized (its projections' inputs by name); else round to nearest (the
    benchmarks' random-weight backbones, whose codes nobody scores). ``mixed_bits`` (int4 by GPTQ as MatMulNBits
    only: ``mixed_applies``): the body's parts get int4 or int8 under that many stored bits per weight
    (``tasks.weights.mixed``), their sensitivities read on the same tokens through ``model_dir``'s PyTorch
    backbone."""
    from tasks.artifacts import atomic_output_dir
    from tasks.weights.graph import calibrate_activations

    keep, head_bits, embed_bits = SERVING_KEEP, SERVING_HEAD_BITS, SERVING_EMBED_BITS
    calibration = None if calibration_ids is None else gptq_calibration(calibration_ids)
    if mixed_bits is not None and not mixed_applies(weights, fmt, calibration_ids is not None):
        log.info("engine.weight_mixed_bits does not apply to %s weights (%s, %s): one width for every projection",
                 weights, fmt, "gptq" if calibration_ids is not None else "rtn")
        mixed_bits = None
    fields = weights_key_fields(weights, block_size, keep=keep, fmt=fmt, head_bits=head_bits, embed_bits=embed_bits,
                                calibration=calibration, mixed_bits=mixed_bits)
    expected = quantized_cache_key(json.loads((Path(float_dir) / CACHE_KEY_FILE).read_text()), fields)["key"]
    key_file = Path(out_dir) / CACHE_KEY_FILE
    if key_file.exists() and json.loads(key_file.read_text()).get("key") == expected:
        return {"weights": weights, "weights_builds": 0, "weights_dir": str(out_dir)}
    if mixed_bits is not None:
        from tasks.weights.graph import projection_weights
        from tasks.weights.mixed import check_budget, mixed_codes, output_gradient_energy

        if model_dir is None:
            raise WeightQuantError("engine.weight_mixed_bits needs the base checkpoint (model_dir) for its gradients")
        check_budget([w.shape for _, w, _ in projection_weights(Path(float_dir) / ENGINE_ONNX, None)], block_size,
                     mixed_bits)
    hessians = None
    if calibration_ids is not None:
        hessians = calibrate_activations(Path(float_dir) / ENGINE_ONNX, calibration_ids, threads, second_moments=True)
    mixed = None
    if mixed_bits is not None:
        sensitivity = output_gradient_energy(Path(model_dir), calibration_ids, threads)
        mixed = mixed_codes(projection_weights(Path(float_dir) / ENGINE_ONNX, hessians), sensitivity, block_size,
                            mixed_bits)
    with atomic_output_dir(Path(out_dir)) as tmp:
        record = quantize_engine_dir(Path(float_dir), tmp, weights, block_size, keep=keep, fmt=fmt, head_bits=head_bits,
                                     embed_bits=embed_bits, hessians=hessians, calibration=calibration, mixed=mixed)
    return {"weights": weights, "weights_builds": 1, "weights_dir": str(out_dir), "weights_record": record}


def open_on_cpu(engine_dir: Path, threads: int = 2):
    """An ``OrtEngine`` on any engine directory this module writes. A Q/DQ graph (TensorRT's form)
    runs with exact fp32 dequantization (``QDQ_EXACT_ORT_CONFIG``), as TensorRT computes it,
    not with ONNX Runtime's int8 activation rounding."""
    from runtime.engine.backends.onnxruntime import OrtEngine
    from runtime.engine.interface import read_interface

    stored = read_interface(engine_dir).weights  # the format is recorded in the interface
    qdq = stored is not None and stored["format"] != "matmulnbits"
    return OrtEngine(engine_dir, threads=threads, session_config=QDQ_EXACT_ORT_CONFIG if qdq else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Quantize a compiled engine's weights (MatMulNBits or TensorRT's Q/DQ form).")
    ap.add_argument("--engine-dir", type=Path, required=True, help="a compiled float engine (tasks.stages.compile)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--weights", choices=sorted(WEIGHT_BITS), default="int8")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--fold-norms", action="store_true")
    ap.add_argument("--quantize-lm-head", action="store_true", help="also quantize the LM head (kept fp32 by default)")
    ap.add_argument("--accuracy-level", type=int, default=DEFAULT_ACCURACY_LEVEL, choices=(0, 1, 4))
    ap.add_argument("--format", choices=WEIGHT_FORMATS, default="matmulnbits",
                    help="matmulnbits (ONNX Runtime) or qdq / qdq_fp16 (TensorRT weight-only; symmetric)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    keep = ("embed",) if args.quantize_lm_head else ("lm_head", "embed")
    try:
        record = quantize_engine_dir(args.engine_dir, args.out_dir, args.weights, args.block_size, args.fold_norms,
                                     keep, args.accuracy_level, fmt=args.format)
    except WeightQuantError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"weights": record}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
