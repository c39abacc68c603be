"""Quantization quality on a real checkpoint: our engines and llama.cpp on the same model and token ids (issue 25, item 3).

    python -m bench.real_model_quality --params PROFILE.yaml [--docs 4] [--context 1024] [--score 128]
        [--out bench/results/real_model_quality.json] [--work bench/results/real_model] [--no-llama-cpp]

Not in CI nor in ``make bench``. ``PROFILE.yaml`` names the real checkpoint (``base_model.path``, e.g.
``real-models/SmolLM2-135M-Instruct`` from ``make real-model``); the engines are the compile stage's
(the float engine and the served quantized-KV engine, ``tasks.compile.compile_profile_engines``, reused when built)
and weight-quantized copies of them (``tasks.weight_engines``) in ``--work``.

Text: real prose and code this machine has offline, never task rows: the topics of Python's reference
manual (``pydoc_data.topics``) and the standard library's ``*.py`` sources, split by a hash of the
document name into ``calib`` (KV scales are set there) and ``eval`` (every number is read there).
Each eval document gives one row of ``context + score`` token ids; the cache is filled the way decoding
fills it: the first ``context`` tokens in one prefill, then one token per call, and each of the
``score`` next tokens is predicted with at least ``context`` tokens behind it (prose and code alternate).

Every row is compared with one reference on the same positions: our fp32 engine with the float cache.
``ppl`` is the perplexity of the scored tokens, ``ppl_increase_pct`` its increase over the reference's,
``kl_mean`` the mean KL(reference || row) of the next-token distributions, in nats.

Rows:
* ours, weights fp32 / int8 / int4 (the serving recipe: MatMulNBits RTN at ``engine.weight_block_size``,
  LM head int8) with the float cache, int4 with a 4-bit LM head, and int4 at other block sizes (below);
* ours, the served quantized KV cache: the compile stage's KV engine (``engine.kv_cache: quantized``,
  the ``kv`` section's scheme) with static scales calibrated on the calib documents, run by ONNX
  Runtime (``kv_read: engine``);
* the same scheme at 8, 3 and 2 bits (``tasks.kv_quality.grid_specs``) through the reference cache of
  ``kernels.kv_quant`` decoding token by token in PyTorch (``kv_read: reference``: the engine serves
  only the shipped width; the reference reads the new token's own K/V in float, the engine quantized),
  and the shipped width the same way beside it. ``kv_bits`` counts every stored byte per value
  (``kernels.kv_spec.bytes_per_token`` at the row's context: scales, fp16 sink and window tokens);
* llama.cpp (the ``peer`` extra) at F16 and Q8_0 (its converter, ``convert_hf_to_gguf.py``, from the
  bf16 checkpoint), Q4_0 and Q4_K_M (``llama_model_quantize`` from the F16 file, its defaults: it keeps
  some tensors at other types; ``gguf_tensor_types`` lists them), each with an f16, q8_0 and q4_0 KV
  cache (flash attention on, which a quantized V cache needs), fed the same token ids.

The checkpoint's weights sit on a Q4_1 grid (blocks of 32: ``make real-model`` dequantizes a Q4_1 GGUF), so
a 4-bit quantizer whose blocks align with those can land back on the grid and look better than it would on
a float checkpoint; 8-bit weights are lossless on it for the same reason. MatMulNBits takes power-of-two
blocks (>= 16) only, so every block it takes either holds whole Q4_1 blocks or splits one: the int4 rows
at block 32 (aligned: one scale per Q4_1 block), 128 (served: four Q4_1 blocks share a scale and offset)
and 256 show how much the alignment is worth. KV-cache numbers are unaffected (activations are continuous).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.report import write_report
from runtime.engine.interface import CACHE_KEY_FILE
from tasks.calibrate import collect_kv_stats, kv_scales_from_stats

ROW_KEYS = ("engine", "weights", "kv", "ppl", "ppl_increase_pct", "kl_mean")  # every row has these (issue 25)
GGUF_WEIGHTS = ("f16", "q8_0", "q4_0", "q4_k_m")
CONVERTER_WEIGHTS = ("f16", "q8_0")  # written by convert_hf_to_gguf.py; the rest by llama_model_quantize from f16
LLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")
INT4_BLOCKS = (32, 256)  # besides the served block size: aligned with the Q4_1 grid, and coarser
CALIB_WINDOW, CALIB_WINDOWS = 512, 16  # calib documents cut into this many windows of this many tokens
WEIGHT_GRID_NOTE = ("the checkpoint's weights sit on a Q4_1 grid (blocks of 32; make real-model dequantizes a Q4_1 "
                    "GGUF): 8-bit weights are near lossless on it, and a 4-bit quantizer with blocks aligned to it "
                    "looks better than on a float checkpoint; MatMulNBits takes power-of-two blocks only, so int4 is "
                    "also measured at block 32 (one scale per Q4_1 block) and 256 (eight Q4_1 blocks per scale)")


# ---------------------------------------------------------------- pure parts (tested on tiny arrays)

def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities along the last axis, in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def score_logits(ref_logp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> tuple[float, float, int]:
    """(sum of the negative log-likelihoods of ``targets``, sum of KL(ref || these), positions) of
    logits (n, V) whose row t predicts ``targets[t]``; ``ref_logp`` (n, V) the reference's log-probabilities."""
    logp = log_softmax(logits)
    n = len(targets)
    nll = -float(logp[np.arange(n), targets].sum())
    kl = float((np.exp(ref_logp) * (ref_logp - logp)).sum())
    return nll, kl, n


def quality_row(engine: str, weights: str, kv: str, nll: float, kl: float, n: int, ref_ppl: float | None,
                **extra) -> dict:
    """One row of the table; ``ref_ppl`` None: this row is the reference."""
    ppl = math.exp(nll / n)
    base = ppl if ref_ppl is None else ref_ppl
    return {"engine": engine, "weights": weights, "kv": kv, "ppl": ppl, "ppl_increase_pct": 100.0 * (ppl / base - 1.0),
            "kl_mean": kl / n, "tokens": n, **extra}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'engine':<10}{'weights':<14}{'kv':<34}{'read':<11}{'kv bits':>8}{'ppl':>10}{'+ppl %':>9}{'KL mean':>11}"]
    for r in rows:
        bits = f"{r['kv_bits']:.2f}" if r.get("kv_bits") is not None else "-"
        lines.append(f"{r['engine']:<10}{r['weights']:<14}{r['kv']:<34}{r.get('kv_read', '-'):<11}{bits:>8}"
                     f"{r['ppl']:>10.4f}{r['ppl_increase_pct']:>+9.2f}{r['kl_mean']:>11.2e}")
    return "\n".join(lines)


# ---------------------------------------------------------------- real text, offline

def real_documents(split: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prose, code) documents of ``split``, [(name, text)]: ``tasks.real_text``'s, the same text and
    calib/eval split the KV gate's held-out file and ``bench.kv_real_text`` read."""
    from tasks import real_text

    docs = real_text.real_documents(split)
    return [d for d in docs if d[0].startswith("topic:")], [d for d in docs if d[0].startswith("stdlib:")]


def eval_rows(tokenizer, n: int, length: int) -> list[tuple[str, list[int]]]:
    """``n`` rows [(document name, its first ``length`` token ids)], prose and code alternating."""
    prose, code = real_documents("eval")
    rows, sources = [], [iter(prose), iter(code)]
    while len(rows) < n:
        for source in sources:
            for name, text in source:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(ids) >= length:
                    rows.append((name, ids[:length]))
                    break
            else:
                raise SystemExit(f"error: fewer than {n} eval documents have {length} tokens; lower --docs or --context")
            if len(rows) == n:
                break
    return rows


def calib_batches(tokenizer, windows: int = CALIB_WINDOWS, length: int = CALIB_WINDOW) -> list:
    """[(ids (1, length), mask)] cut from the calib documents, prose and code alternating."""
    import torch

    prose, code = real_documents("calib")
    out = []
    for (_, a), (_, b) in zip(prose, code):
        for text in (a, b):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            for i in range(0, len(ids) - length + 1, length):
                if len(out) < windows:
                    out.append((torch.tensor([ids[i : i + length]]), torch.ones(1, length, dtype=torch.long)))
    return out


# ---------------------------------------------------------------- decoding the way a device does

def engine_decode_logits(engine, ids: list[int], prefix: int) -> np.ndarray:
    """(len(ids) - prefix, V) logits of an ``runtime.engine.engine.Engine``: ``ids[:prefix]`` prefilled, then one
    token per call through the cache the engine returns; row t predicts ``ids[prefix + t]``."""
    x = np.asarray(ids, dtype=np.int64)[None]  # (1, T)
    logits, cache = engine.forward(x[:, :prefix], np.arange(prefix)[None], np.ones((1, prefix), np.int64), None)
    out = [logits[0, -1].copy()]
    for t in range(prefix, len(ids) - 1):
        logits, cache = engine.forward(x[:, t : t + 1], np.array([[t]]), np.ones((1, t + 1), np.int64), cache)
        out.append(logits[0, -1].copy())
    return np.stack(out)


def reference_decode_logits(backbone, ids: list[int], prefix: int, spec, scales: dict) -> np.ndarray:
    """``engine_decode_logits`` through ``kernels.kv_quant.QuantizedKVCache`` with the PyTorch backbone:
    every token's K/V appended quantized, each step reading the past from the cache."""
    import torch

    from tasks.kv_quality import fill_cache

    x = torch.tensor([ids])
    L = backbone.cfg.num_layers
    with torch.no_grad():
        pos = torch.arange(prefix)[None]
        logits, present = backbone(x[:, :prefix], pos, torch.ones(1, prefix, dtype=torch.long), backbone.empty_past(1))
        cache = fill_cache(backbone, present, pos, spec, scales)
        out = [logits[0, -1]]
        for t in range(prefix, len(ids) - 1):
            pos = torch.tensor([[t]])
            logits, present = backbone(x[:, t : t + 1], pos, torch.ones(1, t + 1, dtype=torch.long), cache.past())
            for i in range(L):
                cache.append(i, present[2 * i][:, :, -1:], present[2 * i + 1][:, :, -1:], pos)
            out.append(logits[0, -1])
    return torch.stack(out).numpy()


def llama_decode_logits(llm, ids: list[int], prefix: int) -> np.ndarray:
    """``engine_decode_logits`` for llama.cpp (``logits_all``: ``scores`` holds every evaluated position)."""
    llm.reset()
    llm.eval(ids[:prefix])
    for t in range(prefix, len(ids) - 1):
        llm.eval(ids[t : t + 1])
    return np.array(llm.scores[prefix - 1 : len(ids) - 1], dtype=np.float32)


# ---------------------------------------------------------------- engines and GGUF files

def kv_label(spec) -> str:
    """The scheme, with what counts toward its bits spelled out."""
    return "float (fp32)" if spec is None else spec.name


def kv_bits(spec, cfg, context_len: int) -> float:
    """Stored bits per K or V value at ``context_len`` (``kernels.kv_spec.bytes_per_token``, all overheads)."""
    from kernels.kv_spec import bytes_per_token

    per_token = bytes_per_token(spec, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len)
    return 8.0 * per_token / (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)


def weight_engines(float_dir: Path, work: Path, block_size: int) -> dict[str, Path]:
    """The float engine and its int8 / int4 copies, the serving recipe (LM head and embedding int8), int4 also at
    ``INT4_BLOCKS`` and with a 4-bit LM head."""
    from tasks.weight_engines import (
        SERVING_EMBED_BITS,
        SERVING_HEAD_BITS,
        SERVING_KEEP,
        ensure_quantized_engine,
        quantize_engine_dir,
    )
    from tasks.artifacts import atomic_output_dir

    dirs = {"fp32": float_dir}
    for weights in ("int8", "int4"):
        out = work / f"{weights}-b{block_size}"
        ensure_quantized_engine(float_dir, out, weights, block_size)
        dirs[weights] = out
    variants = {f"int4/b{block}": (block, SERVING_HEAD_BITS) for block in INT4_BLOCKS}
    variants["int4/head4"] = (block_size, 4)  # the served int4 engine with its LM head at 4 bits too
    for name, (block, head_bits) in variants.items():
        out = work / name.replace("/", "-")
        if not (out / "weights.json").is_file():
            with atomic_output_dir(out) as tmp:
                quantize_engine_dir(float_dir, tmp, "int4", block, keep=SERVING_KEEP, head_bits=head_bits,
                                    embed_bits=SERVING_EMBED_BITS)
        dirs[name] = out
    return dirs


def calibration_stats(backbone, tokenizer, cfg) -> dict:
    """K/V statistics of the base model on the calib documents, as the calibrate stage collects them for a release."""
    return collect_kv_stats(backbone, calib_batches(tokenizer), cfg.kv.spec().pre_rope_keys, cfg.kv.clip_percentile,
                            progress=False)


def served_engine(engine_dir: Path, stats: dict, spec, threads: int):
    """A quantized-KV engine (the compile stage's, or a weight-quantized copy) with scales for ``spec`` bound."""
    from runtime.engine.backends.onnxruntime import OrtEngine

    engine = OrtEngine(engine_dir, threads=threads)
    engine.set_adapter(None, kv_scales=kv_scales_from_stats(stats, spec, {"base_model_hash": engine.interface.backbone_hash}))
    return engine


def build_real_ggufs(llama_cpp, llama_dir: Path, model_dir: Path, out: Path, threads: int) -> dict[str, Path]:
    """``GGUF_WEIGHTS`` of a Hugging Face checkpoint, each written once (a file present is complete:
    written under another name and renamed)."""
    from bench.llama_cpp_bench import convert_to_gguf, quantize_gguf

    out.mkdir(parents=True, exist_ok=True)
    ftypes = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    paths = {}
    for t in GGUF_WEIGHTS:
        path, part = out / f"model-{t}.gguf", out / f"model-{t}.gguf.part"
        if not path.is_file():
            if t in CONVERTER_WEIGHTS:
                convert_to_gguf(llama_dir, model_dir, part, t)
            else:
                quantize_gguf(llama_cpp, paths["f16"], part, ftypes[t], threads)
            os.replace(part, path)
        paths[t] = path
    return paths


def gguf_tensor_types(path: Path, llama_dir: Path) -> dict[str, int]:
    """How many tensors of the file have each GGML type (llama.cpp's quantizer keeps some at others)."""
    if str(llama_dir / "gguf-py") not in sys.path:
        sys.path.insert(0, str(llama_dir / "gguf-py"))
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors))


def release_task_accuracy(cfg) -> dict:
    """Base and adapter accuracy on the engine, from the evaluate stage of the profile's release, if one exists."""
    metrics = cfg.layout.eval_dir / "metrics.json"
    if not metrics.is_file():
        return {"measured": False, "reason": f"no release of this profile yet ({metrics} is absent): run the monthly "
                                             "flow on it, then this bench again"}
    data = json.loads(metrics.read_text())
    return {"measured": True, "source": str(metrics), **{k: v for k, v in data.items() if "accuracy" in k}}


# ---------------------------------------------------------------- the measurement

def measure(args, cfg) -> dict:
    import torch

    from runtime.engine.model import load_backbone, read_config
    from tasks.base_model import load_tokenizer
    from tasks.calibrate import scales_from_stats
    from tasks.compile import compile_profile_engines, graph_source_hash
    from tasks.kv_quality import grid_specs
    from tasks.weight_engines import open_on_cpu

    model_dir = Path(cfg.base_model.path)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(model_dir)
    length = args.context + args.score
    rows_ids = eval_rows(tokenizer, args.docs, length)
    targets = [np.asarray(ids[args.context :]) for _, ids in rows_ids]
    print(f"{len(rows_ids)} eval documents ({', '.join(n for n, _ in rows_ids)}), {args.context} tokens of context, "
          f"{args.score} scored each", flush=True)

    if cfg.engine.kv_cache != "quantized":
        raise SystemExit(f"error: {args.params}: engine.kv_cache is float; the bench measures the served quantized cache")
    t0 = time.perf_counter()
    built = compile_profile_engines(cfg)  # the compile stage's engines, reused when the flow built them
    engines = weight_engines(cfg.layout.engine_dir, work, cfg.engine.weight_block_size)
    print(f"engines ready in {time.perf_counter() - t0:.0f} s (compile stage builds: {built['engine_builds']})", flush=True)

    rows: list[dict] = []
    ref_logp: list[np.ndarray] = []
    # Measured rows are kept in --work, keyed by the token ids and by what each row's numbers depend on (the
    # engine's build key, the graph sources, the GGUF file), so a second run measures only what changed.
    cache = work / "rows" / hashlib.sha256(json.dumps([[ids for _, ids in rows_ids], args.context]).encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    ref_files = [cache / f"reference-{d}.npy" for d in range(len(rows_ids))]
    ref_source: list[str] = []
    not_measured: list[str] = []  # rows not measured before --time-budget ran out (measured ones are kept)
    deadline = time.monotonic() + 60.0 * args.time_budget

    def add(engine: str, weights: str, spec, source: str, open_logits, **extra) -> None:
        """One row; ``open_logits()`` gives the function from token ids to logits, called only if not cached."""
        reference = not rows
        ref_source[:] = ref_source or [source]
        ident = json.dumps([engine, weights, spec and spec.to_dict(), source, ref_source[0], extra], sort_keys=True)
        cached = cache / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
        if cached.is_file() and (not reference or all(f.is_file() for f in ref_files)):
            rows.append(json.loads(cached.read_text()))
            ref_logp.extend(log_softmax(np.load(f)) for f in (ref_files if reference else []))
            print(format_table([rows[-1]]).splitlines()[1] + "  (measured before)", flush=True)
            return
        if time.monotonic() > deadline and not reference:  # the reference is always measured
            not_measured.append(f"{engine} {weights} {kv_label(spec) if engine == 'ours' else extra['kv']} "
                                f"({extra.get('kv_read')})")
            return
        logits_of = open_logits()
        nll = kl = 0.0
        n = 0
        t = time.perf_counter()
        for d, (_, ids) in enumerate(rows_ids):
            logits = logits_of(ids)
            if reference:
                np.save(ref_files[d], logits)
                ref_logp.append(log_softmax(logits))
            a, b, c = score_logits(ref_logp[d], logits, targets[d])
            nll, kl, n = nll + a, kl + b, n + c
        ref = None if reference else rows[0]["ppl"]
        bits = kv_bits(spec, backbone_cfg, length) if engine == "ours" and spec is not None else extra.pop("kv_bits", None)
        row = quality_row(engine, weights, kv_label(spec) if engine == "ours" else extra.pop("kv"), nll, kl, n, ref,
                          kv_bits=bits, seconds=round(time.perf_counter() - t, 1), **extra)
        cached.write_text(json.dumps(row, sort_keys=True))
        rows.append(row)
        print(format_table([row]).splitlines()[1], flush=True)

    def build_key(engine_dir: Path) -> str:
        return (engine_dir / CACHE_KEY_FILE).read_text()

    def engine_logits(engine) -> callable:
        return lambda ids: engine_decode_logits(engine, ids, args.context)

    def weight_row(weights: str) -> None:
        add("ours", weights, None, build_key(engines[weights]),
            lambda: engine_logits(open_on_cpu(engines[weights], args.threads)), kv_read="engine")

    spec = cfg.kv.spec()
    memo: dict = {}

    def backbone_and_stats() -> tuple:
        if not memo:
            memo["backbone"] = load_backbone(model_dir)
            memo["stats"] = calibration_stats(memo["backbone"], tokenizer, cfg)
        return memo["backbone"], memo["stats"]

    # The rows in the order of what they tell (a slow machine may be stopped part way; measured rows are kept):
    # the reference, the served cache, the served weight precisions, llama.cpp, then the other block sizes
    # and KV widths.
    backbone_cfg = read_config(model_dir)
    print(format_table([]), flush=True)
    weight_row("fp32")
    calibration = f"{CALIB_WINDOWS}x{CALIB_WINDOW} clip {cfg.kv.clip_percentile}"
    add("ours", "fp32", spec, build_key(cfg.layout.kv_engine_dir) + calibration,
        lambda: engine_logits(served_engine(cfg.layout.kv_engine_dir, backbone_and_stats()[1], spec, args.threads)),
        kv_read="engine", note="the served cache: the compile stage's KV engine")
    weight_row("int8")
    weight_row("int4")
    weight_row("int4/head4")  # what 4 bits in the LM head add (0.5B shape: 147 -> 80 MB resident)
    weight_row(f"int4/b{INT4_BLOCKS[0]}")  # aligned with the checkpoint's Q4_1 grid: how much of int4's cost is the grid

    ggufs, types = {}, {}
    if not args.no_llama_cpp:
        from bench.llama_cpp_bench import converter_dir, load_llama, require_llama_cpp

        llama_cpp = require_llama_cpp()
        llama_dir = converter_dir(args.llama_cpp_src)
        ggufs = build_real_ggufs(llama_cpp, llama_dir, model_dir, work / "gguf", args.threads)
        types = {t: gguf_tensor_types(p, llama_dir) for t, p in ggufs.items()}
        # llama.cpp's float row and the counterparts of ours first (its 4-bit KV, its Q4_0 weights, which the int4
        # target is judged against, then Q8_0)
        first = [("f16", "f16"), ("f16", "q4_0"), ("q4_0", "f16"), ("q8_0", "f16"), ("q4_0", "q4_0")]
        for weights, kv in first + [(w, kv) for w in ggufs for kv in LLAMA_KV_TYPES if (w, kv) not in first]:
            path = ggufs[weights]

            def llama_logits(path=path, kv=kv):
                llm = load_llama(llama_cpp, path, length + 1, args.threads, True,
                                 kv_type=getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}"), extra_bufts=False)
                return lambda ids: llama_decode_logits(llm, ids, args.context)

            add("llama.cpp", weights.upper(), None, f"{path.name} {path.stat().st_size} {llama_cpp.__version__}",
                llama_logits, kv=kv, kv_bits={"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}[kv], kv_read="engine")

    for block in INT4_BLOCKS[1:]:
        weight_row(f"int4/b{block}")
    for s in grid_specs(spec).values():
        def reference_logits(s=s):
            backbone, stats = backbone_and_stats()
            kw = scales_from_stats(stats, s)
            return lambda ids: reference_decode_logits(backbone, ids, args.context, s, kw)

        add("ours", "fp32", s, graph_source_hash() + build_key(cfg.layout.engine_dir) + calibration, reference_logits,
            kv_read="reference")
    return {"rows": rows, "not_measured": not_measured, "documents": [n for n, _ in rows_ids], "gguf_files": {t: str(p) for t, p in ggufs.items()},
            "gguf_tensor_types": types, "engines": {k: str(v) for k, v in engines.items()},
            "kv_calibration": {"windows": CALIB_WINDOWS, "tokens_per_window": CALIB_WINDOW,
                               "clip_percentile": cfg.kv.clip_percentile, "spec": spec.to_dict()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Perplexity and KL of our engines and llama.cpp on a real checkpoint.")
    ap.add_argument("--params", type=Path, required=True, help="the real-model profile (base_model.path: the checkpoint)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/real_model_quality.json"))
    ap.add_argument("--work", type=Path, default=Path("bench/results/real_model"),
                    help="weight-quantized engine copies and GGUF files (kept: a second run reuses them)")
    ap.add_argument("--docs", type=int, default=4, help="eval documents (prose and code alternating)")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the cache before the first scored one")
    ap.add_argument("--score", type=int, default=128, help="tokens scored per document, decoded one at a time")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-budget", type=float, default=float("inf"),
                    help="minutes: rows not measured yet are left out (listed as not_measured) once this is spent")
    ap.add_argument("--no-llama-cpp", action="store_true", help="our rows only (without the peer extra)")
    ap.add_argument("--llama-cpp-src", default=None, help="llama-cpp-python sdist or llama.cpp directory (the converter)")
    args = ap.parse_args(argv)
    from tasks.config import load_config

    cfg = load_config(args.params)
    load_before = os.getloadavg()[0]
    result = measure(args, cfg)
    import onnxruntime
    import torch

    payload = {
        "model": cfg.base_model.path, "context": args.context, "scored_per_document": args.score,
        "reference": "ours, fp32 weights, float cache (every ppl_increase_pct and kl_mean is against it)",
        "weight_grid_note": WEIGHT_GRID_NOTE, "weight_block_size": cfg.engine.weight_block_size,
        "task_accuracy": release_task_accuracy(cfg), **result,
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
        "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
    }
    write_report(args.out, payload)
    print("\n" + format_table(result["rows"]))
    if result["not_measured"]:
        print("\nnot measured (--time-budget spent): " + "; ".join(result["not_measured"]))
    print(f"\n{WEIGHT_GRID_NOTE}\ntask accuracy: {payload['task_accuracy']}\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
