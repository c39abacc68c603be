"""Quantization quality on a real checkpoint: our engines and llama.cpp on the same model and token ids (issue 25, item 3).

    python -m bench.quality.real_model_quality --params PROFILE.yaml [--docs 8] [--context 1024] [--score 512]
        [--out bench/results/real_model_quality.json] [--work bench/results/real_model] [--no-llama-cpp] [--kv-only]
        [--calibrated BITS:BUDGET,...]

Not in CI nor in ``make bench``. ``PROFILE.yaml`` names the real checkpoint (``base_model.path``, e.g.
``real-models/SmolLM2-135M-Instruct`` from ``make real-model``) and serves ``engine.kv_cache: quantized_pages``; the
engines are the compile stage's (the float engine and the serving engine with quantized pages,
``tasks.stages.compile.compile_profile_engines``, reused when built) and weight-quantized copies of the float one
(``tasks.weights.engines``) in ``--work``.

Text: real prose and code this machine has offline, never task rows: the topics of Python's reference
manual (``pydoc_data.topics``) and the standard library's ``*.py`` sources, split by a hash of the
document name into ``calib`` and ``eval``; every number is read on ``eval``.
Each eval document gives one row of ``context + score`` token ids; the cache is filled the way decoding
fills it: the first ``context`` tokens in one prefill, then the scored tokens, each predicted with at least
``context`` tokens behind it (prose and code alternate). Our engines take the scored tokens in chunks of one KV
page (``engine.kv_block_size``, 16), aligned to page boundaries: what a token reads is then exactly what it reads
when decoded alone (a float cache reads the same K/V however it is chunked; quantized pages read their own page in
float and every earlier full page sealed, in a chunk as in decoding), at a sixteenth of the calls. llama.cpp is fed
the scored tokens in one call (it reads every token, its own included, from its cache: chunking changes nothing).

Every row is compared with one reference on the same positions: our fp32 engine with the float cache.
``ppl`` is the perplexity of the scored tokens, ``ppl_increase_pct`` its increase over the reference's, with
``ppl_increase_ci95``, a bootstrap 95% interval over documents (the same resampled documents for the row and the
reference); ``kl_mean`` the mean KL(reference || row) of the next-token distributions, in nats. llama.cpp's rows also
carry ``own_float_cache_ppl_increase_pct``: the increase over llama.cpp's own f16 cache on the same weights (what its
cache type alone costs), with its interval. Rows with a KV cache carry ``k_bits``, ``v_bits``, ``kv_bits`` (average
stored bits per value at the row's length, everything counted) and ``served`` (the scheme the profile's engine serves).

Rows:
* ours, weights fp32 / int8 / int4 (the serving recipe: MatMulNBits at ``engine.weight_block``, LM head and
  embedding int8, codes by ``engine.weight_method``: GPTQ on the calib split by default, int4 mixed under
  ``engine.weight_mixed_bits``) with the float cache, int4 uniform at the served block beside it (``int4/uniform``), by
  round to nearest (``int4/rtn``), with a 4-bit LM head, and at other block sizes (below; int8 too, ``int8/b128``); each
  row carries ``method`` and ``bits_per_weight`` (codes, scales and zero points over the quantized parameters);
* ours, the served KV cache, run by ONNX Runtime (``kv_read: engine``): the serving engine's quantized pages
  (``kernels.kv_spec.PageQuantSpec``, sealed by the runtime as the pages fill);
* the same scheme at the other widths in PyTorch (``kv_read: reference``): quantized pages at 8, 3 and 2 bits through
  ``tasks.checks.page_quality.page_read_logits`` (the decode above in one forward), the shipped width beside them.
  ``kv_bits`` counts every stored byte per value at the row's length (``PageQuantSpec.stored_bits_per_value``);
* ``--calibrated 2:0.12``: the same read at K2/V2 with the per-layer widths calibration chooses under a KL budget of
  0.12 (``kv.layer_kl_budget``, ``tasks.checks.page_widths``: on the calib split, cached in ``--work``), its row carrying
  ``layer_kl_budget`` and the stored bits of those widths;
* llama.cpp (the ``peer`` extra) at F16 and Q8_0 (its converter, ``convert_hf_to_gguf.py``, from the
  bf16 checkpoint), Q4_0 and Q4_K_M (``llama_model_quantize`` from the F16 file, its defaults: it keeps
  some tensors at other types; ``gguf_tensor_types`` lists them), each with an f16, q8_0 and q4_0 KV
  cache (flash attention on, which a quantized V cache needs), fed the same token ids. ``--kv-only``: the
  reference, the KV rows and llama.cpp's F16 weights with each cache type (the KV comparison; no weight rows).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from pathlib import Path

import numpy as np

from bench.lib.llama_cpp_peer import checkpoint_ggufs, converter_dir, gguf_tensor_types, load_llama, require_llama_cpp
from bench.lib.real_checkpoint import real_documents, served_engine
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import table
from runtime.engine.interface import CACHE_KEY_FILE
from tasks.scoring import kl_sum, log_softmax

ROW_KEYS = ("engine", "weights", "kv", "ppl", "ppl_increase_pct", "kl_mean")  # every row has these (issue 25)
LLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")
LLAMA_KV_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5}  # stored bits per value: blocks of 32 with one fp16 scale
LLAMA_KV_WIDTH = {"f16": 16, "q8_0": 8, "q4_0": 4}
INT4_BLOCKS = (32, 64, 256)  # besides the served block size: aligned with the Q4_1 grid, 4.56 bits, and coarser
INT8_BLOCKS = (32, 64, 128)  # besides the served one: what int8 compute's activation rounding per block costs
WEIGHT_GRID_NOTE = ("the checkpoint's weights sit on a Q4_1 grid (blocks of 32; make real-model dequantizes a Q4_1 "
                    "GGUF): 8-bit weights are near lossless on it, and a 4-bit quantizer with blocks aligned to it "
                    "looks better than on a float checkpoint; MatMulNBits takes power-of-two blocks only, so int4 is "
                    "also measured at block 32 (one scale per Q4_1 block) and 256 (eight Q4_1 blocks per scale)")
# The table's columns; their widths line the rows printed one at a time (as measured) up under the header.
COLUMNS = ("engine", "weights", "w bits", "kv", "read", "kv bits", "KL mean", "+ppl %", "95% interval", "ppl",
           "+ppl % own f16 kv")
COLUMN_WIDTHS = (9, 18, 6, 33, 10, 7, 10, 8, 16, 9, 17)


# ---------------------------------------------------------------- pure parts (tested on tiny arrays)

def score_logits(ref_logp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> tuple[float, float, int]:
    """(sum of the negative log-likelihoods of ``targets``, sum of KL(ref || these), positions) of
    logits (n, V) whose row t predicts ``targets[t]``; ``ref_logp`` (n, V) the reference's log-probabilities."""
    logp = log_softmax(logits)
    n = len(targets)
    nll = -float(logp[np.arange(n), targets].sum())
    return nll, kl_sum(ref_logp, logp), n


def bootstrap_ppl_increase(doc_nll: list[float], ref_doc_nll: list[float], doc_tokens: list[int],
                           draws: int = 2000, seed: int = 0) -> list[float]:
    """[2.5th, 97.5th] percentile of the perplexity increase in % over the reference when documents are resampled
    with replacement (the same documents for both), from per-document NLL sums and scored tokens."""
    nll, ref, tokens = (np.asarray(a, dtype=np.float64) for a in (doc_nll, ref_doc_nll, doc_tokens))
    picks = np.random.default_rng(seed).integers(0, len(nll), (draws, len(nll)))  # (draws, docs)
    increase = 100.0 * np.expm1((nll[picks].sum(1) - ref[picks].sum(1)) / tokens[picks].sum(1))
    return [float(x) for x in np.percentile(increase, [2.5, 97.5])]


def quality_row(engine: str, weights: str, kv: str, nll: float, kl: float, n: int, ref_ppl: float | None,
                **extra) -> dict:
    """One row of the table; ``ref_ppl`` None: this row is the reference."""
    ppl = math.exp(nll / n)
    base = ppl if ref_ppl is None else ref_ppl
    return {"engine": engine, "weights": weights, "kv": kv, "ppl": ppl, "ppl_increase_pct": 100.0 * (ppl / base - 1.0),
            "kl_mean": kl / n, "tokens": n, **extra}


def format_table(rows: list[dict]) -> str:
    return table(COLUMNS, ([r["engine"], r["weights"] + (f" {r['method']}" if r.get("method") else ""),
                            f"{r['bits_per_weight']:.2f}" if r.get("bits_per_weight") else "-", r["kv"], r.get("kv_read", "-"),
                            f"{r['kv_bits']:.2f}" if r.get("kv_bits") is not None else "-", f"{r['kl_mean']:.2e}",
                            f"{r['ppl_increase_pct']:+.2f}", ci_text(r).strip() or "-", f"{r['ppl']:.4f}",
                            f"{r['own_float_cache_ppl_increase_pct']:+.2f}" if "own_float_cache_ppl_increase_pct" in r
                            else "-"] for r in rows),
                 align="<<><>>>>>>>", widths=COLUMN_WIDTHS)


# ---------------------------------------------------------------- real text, offline

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


# ---------------------------------------------------------------- decoding the way a device does

def engine_decode_logits(engine, ids: list[int], prefix: int, chunk: int = 1) -> np.ndarray:
    """(len(ids) - prefix, V) logits of an ``runtime.engine.engine.Engine``: ``ids[:prefix]`` prefilled, then the
    rest through the cache the engine returns, in calls that end on multiples of ``chunk`` (1: one token per call;
    a KV page: page by page, as the module's docstring says why); row t predicts ``ids[prefix + t]``."""
    x = np.asarray(ids, dtype=np.int64)[None]  # (1, T)
    logits, cache = engine.forward(x[:, :prefix], np.arange(prefix)[None], np.ones((1, prefix), np.int64), None)
    out = [logits[0, -1:].copy()]
    t = prefix
    while t < len(ids) - 1:
        end = min(len(ids) - 1, (t // chunk + 1) * chunk)
        logits, cache = engine.forward(x[:, t:end], np.arange(t, end)[None], np.ones((1, end), np.int64), cache)
        out.append(logits[0].copy())
        t = end
    return np.concatenate(out)


def llama_decode_logits(llm, ids: list[int], prefix: int) -> np.ndarray:
    """``engine_decode_logits`` for llama.cpp (``logits_all``: ``scores`` holds every evaluated position)."""
    llm.reset()
    llm.eval(ids[:prefix])
    llm.eval(ids[prefix:-1])
    return np.array(llm.scores[prefix - 1 : len(ids) - 1], dtype=np.float32)


# ---------------------------------------------------------------- engines and GGUF files

def kv_label(spec) -> str:
    """The scheme, with what counts toward its bits spelled out."""
    return "float (fp32)" if spec is None else spec.name


def kv_bits(spec, cfg, context_len: int, block_size: int) -> float:
    """Stored bits per K or V value at ``context_len`` in quantized pages of ``block_size`` tokens, all overheads
    (``PageQuantSpec.stored_bits_per_value``)."""
    return spec.stored_bits_per_value(cfg.head_dim, block_size, context_len)


class WeightEngines(Mapping):
    """Engine directories by row name, each built (or found built) when its row first asks for it: a run stopped part
    way, or one whose ``--time-budget`` is spent, has measured the rows before instead of building every engine up
    front. Each added row: its directory, and a callable that builds it there unless it is built."""

    def __init__(self, float_dir: Path):
        """The compile stage's float engine (``fp32``, built before any row asks), and what ``add`` adds."""
        self._builders: dict[str, tuple[Path, Callable[[], None]]] = {"fp32": (Path(float_dir), lambda: None)}
        self._built: set[str] = set()

    def add(self, name: str, out: Path, build: Callable[[], None]) -> None:
        self._builders[name] = (out, build)

    def __getitem__(self, name: str) -> Path:
        out, build = self._builders[name]
        if name not in self._built:
            build()
            self._built.add(name)
        return out

    def __iter__(self):
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)

    def directory(self, name: str) -> Path:
        """Where ``name``'s engine is (or will be) built, without building it."""
        return self._builders[name][0]

    def paths(self) -> dict[str, str]:
        return {name: str(out) for name, (out, _) in self._builders.items()}


def weight_engines(float_dir: Path, work: Path, blocks: dict[str, int], calibration_ids: list[list[int]] | None,
                   threads: int, mixed_bits: float | None = None, model_dir: Path | None = None) -> WeightEngines:
    """The float engine and its int8 / int4 copies at their served ``blocks`` ({"int8": 32, "int4": 128}), the
    serving recipe (LM head and embedding int8; GPTQ on ``calibration_ids`` when the profile's ``engine.weight_method``
    is gptq, else round to nearest; int4 mixed under ``mixed_bits``, ``tasks.weights.mixed``), int8 also at the other
    ``INT8_BLOCKS`` (``int8/b128``), int4 also at ``INT4_BLOCKS``, with a 4-bit LM head, by round to nearest
    (``int4/rtn``: what the calibration is worth) and, beside a mixed int4, uniform at the served block
    (``int4/uniform``: what the mix is worth); each built when its row asks for it."""
    from tasks.artifacts import atomic_output_dir
    from tasks.weights.engines import (
        SERVING_EMBED_BITS,
        SERVING_HEAD_BITS,
        SERVING_KEEP,
        ensure_quantized_engine,
        gptq_calibration,
        quantize_engine_dir,
    )
    from tasks.weights.graph import calibrate_activations

    engines = WeightEngines(float_dir)
    served = [("int8", "int8", blocks["int8"]), ("int4", "int4", blocks["int4"])]
    int8_others = [(f"int8/b{block}", "int8", block) for block in INT8_BLOCKS if block != blocks["int8"]]
    for name, weights, block in served + int8_others:
        out = work / f"{weights}-b{block}"
        engines.add(name, out, partial(ensure_quantized_engine, float_dir, out, weights, block,
                                       calibration_ids=calibration_ids, threads=threads, mixed_bits=mixed_bits,
                                       model_dir=model_dir))
    block_size = blocks["int4"]
    calibrated = calibration_ids is not None
    variants = {f"int4/b{block}": (block, SERVING_HEAD_BITS, calibrated) for block in INT4_BLOCKS}
    variants["int4/head4"] = (block_size, 4, calibrated)  # the served int4 engine with its LM head at 4 bits too
    if calibrated:
        variants["int4/rtn"] = (block_size, SERVING_HEAD_BITS, False)
    if mixed_bits is not None and calibrated:
        variants["int4/uniform"] = (block_size, SERVING_HEAD_BITS, True)
    hessians: dict = {}  # read once, for the first variant by GPTQ that is built

    def build_variant(out: Path, block: int, head_bits: int, gptq: bool) -> None:
        if (out / "weights.json").is_file():
            return
        if gptq and not hessians:
            hessians.update(calibrate_activations(Path(float_dir) / "model.onnx", calibration_ids, threads,
                                                  second_moments=True))
        with atomic_output_dir(out) as tmp:
            quantize_engine_dir(float_dir, tmp, "int4", block, keep=SERVING_KEEP, head_bits=head_bits,
                                embed_bits=SERVING_EMBED_BITS, hessians=hessians if gptq else None,
                                calibration=gptq_calibration(calibration_ids) if gptq else None)

    for name, (block, head_bits, gptq) in variants.items():
        out = work / (name.replace("/", "-") + ("-gptq" if gptq else ""))
        engines.add(name, out, partial(build_variant, out, block, head_bits, gptq))
    return engines


def weight_storage(engine_dir: Path) -> dict:
    """How an engine's weights are stored (its ``weights.json``): the method (``gptq mixed 4.60``: a mixed plan and
    its body's stored bits per weight), and ``bits_per_weight`` over the quantized projections' parameters (codes,
    scales and zero points), the LM head and embedding table included."""
    from tasks.weights.engines import WEIGHTS_FILE

    file = Path(engine_dir) / WEIGHTS_FILE
    if not file.is_file():  # the float export
        return {"method": None, "bits_per_weight": 32.0}
    record = json.loads(file.read_text())
    bits = 8 * record["quantized_weight_bytes"] / (record["quantized_weight_bytes_fp32"] / 4)
    mixed = record.get("mixed")
    method = record.get("method", "rtn") + (f" mixed {mixed['bits_per_weight']:.2f}" if mixed else "")
    return {"method": method, "bits_per_weight": round(bits, 3)}


def release_task_accuracy(cfg) -> dict:
    """Base and adapter accuracy on the engine, from the evaluate stage of the profile's release, if one exists."""
    metrics = cfg.layout.eval_dir / "metrics.json"
    if not metrics.is_file():
        return {"measured": False, "reason": f"no release of this profile yet ({metrics} is absent): run the monthly "
                                             "flow on it, then this bench again"}
    data = json.loads(metrics.read_text())
    return {"measured": True, "source": str(metrics), **{k: v for k, v in data.items() if "accuracy" in k}}


# ---------------------------------------------------------------- one row of the table

@dataclass
class QualityRun:
    """What every row of one run is scored on and against: the eval rows' token ids, the reference's
    log-probabilities (the first row measured is the reference), the rows so far, where measured rows are kept,
    and the time budget."""

    rows_ids: list[tuple[str, list[int]]]  # (document name, its context + score token ids)
    context: int
    cache: Path  # measured rows, keyed by what each one's numbers depend on, and the reference's logits
    deadline: float  # time.monotonic() after which rows not measured yet are listed instead
    backbone_cfg: object  # the checkpoint's shape: a KV scheme's stored bits per value
    block_size: int  # tokens per KV page: our engines' chunks, and the quantized pages' stored bits
    served: object = None  # the KV scheme the profile's engine serves (its rows say ``served: true``)
    rows: list[dict] = field(default_factory=list)
    ref_logp: list[np.ndarray] = field(default_factory=list)
    ref_source: str | None = None  # what the reference's numbers depend on: part of every row's key
    not_measured: list[str] = field(default_factory=list)  # rows left out once the budget was spent

    @property
    def length(self) -> int:
        return len(self.rows_ids[0][1])

    @property
    def ref_files(self) -> list[Path]:
        return [self.cache / f"reference-{d}.npy" for d in range(len(self.rows_ids))]


def measure_row(run: QualityRun, engine: str, weights: str, spec, source: str, open_logits: Callable, **extra) -> None:
    """One row; ``open_logits()`` gives the function from token ids to logits, called only if the row was not
    measured before on the same token ids from the same ``source`` (then its kept numbers are the row)."""
    reference = not run.rows
    run.ref_source = run.ref_source or source
    ident = json.dumps([engine, weights, spec and spec.to_dict(), type(spec).__name__, source, run.ref_source, extra,
                        "per-document scores"], sort_keys=True)
    cached = run.cache / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
    if cached.is_file() and (not reference or all(f.is_file() for f in run.ref_files)):
        run.rows.append(json.loads(cached.read_text()))
        run.ref_logp.extend(log_softmax(np.load(f)) for f in (run.ref_files if reference else []))
        print(format_table([run.rows[-1]]).splitlines()[1] + "  (measured before)", flush=True)
        return
    if time.monotonic() > run.deadline and not reference:  # the reference is always measured
        run.not_measured.append(f"{engine} {weights} {kv_label(spec) if engine == 'ours' else extra['kv']} "
                                f"({extra.get('kv_read')})")
        return
    logits_of = open_logits()
    per_doc = []  # (nll, kl, tokens) of each document
    t = time.perf_counter()
    for d, (_, ids) in enumerate(run.rows_ids):
        logits = logits_of(ids)
        if reference:
            np.save(run.ref_files[d], logits)
            run.ref_logp.append(log_softmax(logits))
        per_doc.append(score_logits(run.ref_logp[d], logits, np.asarray(ids[run.context :])))
    nll, kl, n = (sum(x) for x in zip(*per_doc))
    ref = None if reference else run.rows[0]["ppl"]
    if engine == "ours" and spec is not None:
        extra |= {"k_bits": spec.k_bits, "v_bits": spec.v_bits, "served": spec == run.served,
                  "kv_bits": kv_bits(spec, run.backbone_cfg, run.length, run.block_size)}
    doc_nll, doc_kl, doc_tokens = ([x[i] for x in per_doc] for i in range(3))
    if not reference:
        extra["ppl_increase_ci95"] = bootstrap_ppl_increase(doc_nll, run.rows[0]["doc_nll"], doc_tokens)
    row = quality_row(engine, weights, kv_label(spec) if engine == "ours" else extra.pop("kv"), nll, kl, n, ref,
                      seconds=round(time.perf_counter() - t, 1), doc_nll=doc_nll, doc_kl=doc_kl, doc_tokens=doc_tokens,
                      **extra)
    cached.write_text(json.dumps(row, sort_keys=True))
    run.rows.append(row)
    print(format_table([row]).splitlines()[1], flush=True)


def build_key(engine_dir: Path) -> str:
    """What an engine's numbers depend on: the key it was built under."""
    return (engine_dir / CACHE_KEY_FILE).read_text()


@dataclass
class BaseModel:
    """The checkpoint in PyTorch, loaded by the first row that needs it (a run whose rows were all measured before
    loads none)."""

    model_dir: Path

    @cached_property
    def backbone(self):
        from runtime.engine.model import load_backbone

        return load_backbone(self.model_dir)


# ---------------------------------------------------------------- how a row's logits are made

def engine_logits(engine, context: int, chunk: int) -> Callable[[list[int]], np.ndarray]:
    return lambda ids: engine_decode_logits(engine, ids, context, chunk)


def weight_logits(engine_dir: Path, context: int, chunk: int, threads: int) -> Callable[[list[int]], np.ndarray]:
    """Ours at the engine's weights with the float cache, on the CPU."""
    from tasks.weights.engines import open_on_cpu

    return engine_logits(open_on_cpu(engine_dir, threads), context, chunk)


def pages_engine_logits(engine_dir: Path, context: int, chunk: int, threads: int) -> Callable:
    """Ours on the serving engine with quantized pages."""
    return engine_logits(served_engine(engine_dir, threads), context, chunk)


def page_reference_logits(base: BaseModel, spec, context: int, block_size: int) -> Callable:
    """``spec``'s pages in PyTorch: ``tasks.checks.page_quality.page_read_logits`` (prefill, then decode)."""
    import torch

    from tasks.checks.page_quality import page_read_logits

    return lambda ids: page_read_logits(base.backbone, torch.tensor([ids]), spec, block_size, context)[0, context - 1 : -1].numpy()


def llama_logits(llama_cpp, path: Path, kv: str, run: QualityRun, threads: int) -> Callable:
    """llama.cpp on the GGUF file ``path`` with a ``kv`` cache (flash attention on, extra buffer types off)."""
    llm = load_llama(llama_cpp, path, run.length + 1, threads, True,
                     kv_type=getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}"), extra_bufts=False)
    return lambda ids: llama_decode_logits(llm, ids, run.context)


# ---------------------------------------------------------------- the rows, in the order of what they tell

def weight_row(run: QualityRun, engines: WeightEngines, weights: str, threads: int) -> None:
    if time.monotonic() > run.deadline and not (engines.directory(weights) / CACHE_KEY_FILE).is_file():
        run.not_measured.append(f"ours {weights} (engine not built: the time budget was spent)")
        return  # building it would spend minutes on a row the budget leaves out
    engine_dir = engines[weights]  # built here unless it is on disk
    measure_row(run, "ours", weights, None, build_key(engine_dir),
                partial(weight_logits, engine_dir, run.context, run.block_size, threads), kv_read="engine",
                **weight_storage(engine_dir))


def served_kv_row(run: QualityRun, cfg, threads: int) -> None:
    """The served KV cache on its engine: the serving engine's quantized pages."""
    engine_dir = cfg.engine.cache_engine_dir  # fp32 weights, the pages: the cache alone against the reference
    measure_row(run, "ours", "fp32", run.served, build_key(engine_dir),
                partial(pages_engine_logits, engine_dir, run.context, run.block_size, threads),
                kv_read="engine", note="the served cache: the serving engine's quantized pages")


def measure_served(run: QualityRun, cfg, engines: WeightEngines, threads: int, kv_only: bool) -> None:
    """The reference (ours, fp32 weights, float cache), the served cache, and unless ``kv_only`` the served weight
    precisions (int8 at its other blocks beside it)."""
    weight_row(run, engines, "fp32", threads)
    served_kv_row(run, cfg, threads)
    if kv_only:
        return
    weight_row(run, engines, "int8", threads)
    for name in [n for n in engines if n.startswith("int8/")]:  # int8 at the other blocks: what the served one buys
        weight_row(run, engines, name, threads)
    weight_row(run, engines, "int4", threads)


def measure_int4_variants(run: QualityRun, engines: WeightEngines, threads: int) -> None:
    """What the served int4 is made of: uniform at the served block, by round to nearest, with a 4-bit LM head, at
    every block size (the first aligned with the checkpoint's grid)."""
    if "int4/uniform" in engines:
        weight_row(run, engines, "int4/uniform", threads)  # every part at the served block: what the mix is worth
    if "int4/rtn" in engines:
        weight_row(run, engines, "int4/rtn", threads)  # the served block by round to nearest: what GPTQ is worth
    weight_row(run, engines, "int4/head4", threads)  # what 4 bits in the LM head add (0.5B shape: 147 -> 80 MB resident)
    for block in INT4_BLOCKS:  # the first aligned with the checkpoint's Q4_1 grid: how much of int4's cost is the grid
        weight_row(run, engines, f"int4/b{block}", threads)


def measure_llama_cpp(run: QualityRun, model_dir: Path, work: Path, llama_cpp_src: str | None,
                      threads: int, kv_only: bool) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """llama.cpp at each GGUF weight type (``kv_only``: F16 alone) with each of its KV cache types; (the GGUF files,
    their tensor types)."""
    llama_cpp = require_llama_cpp()
    llama_dir = converter_dir(llama_cpp_src)
    ggufs = checkpoint_ggufs(llama_cpp, llama_dir, model_dir, work / "gguf", threads)
    if kv_only:
        ggufs = {t: p for t, p in ggufs.items() if t == "f16"}
    types = {t: gguf_tensor_types(p, llama_dir) for t, p in ggufs.items()}
    # llama.cpp's float row and the counterparts of ours first (its 4-bit KV, its Q4_0 and Q4_K_M weights, which the
    # int4 target is judged against, then Q8_0)
    first = [("f16", "f16"), ("f16", "q4_0"), ("q4_0", "f16"), ("q4_k_m", "f16"), ("q8_0", "f16"), ("q4_0", "q4_0")]
    for weights, kv in [r for r in first if r[0] in ggufs] + [(w, kv) for w in ggufs for kv in LLAMA_KV_TYPES
                                                              if (w, kv) not in first]:
        path = ggufs[weights]
        measure_row(run, "llama.cpp", weights.upper(), None, f"{path.name} {path.stat().st_size} {llama_cpp.__version__}",
                    partial(llama_logits, llama_cpp, path, kv, run, threads), kv=kv,
                    kv_bits=LLAMA_KV_BITS[kv], k_bits=LLAMA_KV_WIDTH[kv], v_bits=LLAMA_KV_WIDTH[kv], kv_read="engine")
    own_float_cache_increase(run.rows)
    return ggufs, types


def own_float_cache_increase(rows: list[dict]) -> None:
    """Give each llama.cpp row with a quantized cache its perplexity increase over llama.cpp's f16 cache on the same
    weights, and its bootstrap interval: what the cache type alone costs it."""
    own = {r["weights"]: r for r in rows if r["engine"] == "llama.cpp" and r["kv"] == "f16"}
    for r in rows:
        base = own.get(r["weights"]) if r["engine"] == "llama.cpp" and r["kv"] != "f16" else None
        if base is not None:
            r["own_float_cache_ppl_increase_pct"] = 100.0 * (r["ppl"] / base["ppl"] - 1.0)
            r["own_float_cache_ppl_increase_ci95"] = bootstrap_ppl_increase(r["doc_nll"], base["doc_nll"], r["doc_tokens"])


def measure_other_widths(run: QualityRun, cfg, engines: WeightEngines, base: BaseModel, threads: int,
                         kv_only: bool, work: Path, calibrated: list[tuple[int, float]]) -> None:
    """Unless ``kv_only``, the int4 variants (``measure_int4_variants``); the served pages at other widths (and the
    shipped one beside them) in PyTorch, and for each (bits, KL budget) of ``calibrated`` the pages at those widths
    with the per-layer widths calibration chooses under that budget."""
    from tasks.checks.page_quality import GRID_BITS
    from tasks.stages.compile import graph_source_hash

    if not kv_only:
        measure_int4_variants(run, engines, threads)
    source = graph_source_hash() + build_key(cfg.layout.engine_dir)
    for bits in GRID_BITS:
        spec = replace(run.served, k_bits=bits, v_bits=bits, layer_bits=())
        measure_row(run, "ours", "fp32", spec, source,
                    partial(page_reference_logits, base, spec, run.context, run.block_size), kv_read="reference")
    for bits, budget in calibrated:
        spec = calibrated_widths(cfg, work, replace(run.served, k_bits=bits, v_bits=bits, layer_bits=()),
                                 run.block_size, budget)
        measure_row(run, "ours", "fp32", spec, source,
                    partial(page_reference_logits, base, spec, run.context, run.block_size), kv_read="reference",
                    layer_kl_budget=budget)


def calibrated_widths(cfg, work: Path, spec, block_size: int, budget: float):
    """``spec`` with the per-layer widths calibration chooses under ``budget`` (``tasks.checks.page_widths``, on the calib
    split: never the eval documents), cached in ``work``."""
    from tasks.checks.page_widths import CALIBRATION_WINDOW, ensure_layer_widths
    from tasks.real_model.text import calibration_windows

    cache = work / "kv_widths" / f"K{spec.k_bits}V{spec.v_bits}-{budget:g}"
    model_dir = Path(cfg.base_model.path)
    windows = calibration_windows(model_dir, cfg.kv.layer_calibration_tokens, CALIBRATION_WINDOW)
    return ensure_layer_widths(model_dir, cache, spec, block_size, budget, windows)[0]


def measure(args, cfg) -> dict:
    import torch

    from runtime.engine.model import read_config
    from tasks.checks.page_widths import served_pages
    from tasks.models import load_tokenizer
    from tasks.stages.compile import compile_profile_engines, weight_calibration_ids

    model_dir = Path(cfg.base_model.path)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(model_dir)
    rows_ids = eval_rows(tokenizer, args.docs, args.context + args.score)
    print(f"{len(rows_ids)} eval documents ({', '.join(n for n, _ in rows_ids)}), {args.context} tokens of context, "
          f"{args.score} scored each", flush=True)

    if cfg.engine.kv_cache != "quantized_pages":
        raise SystemExit(f"error: {args.params}: engine.kv_cache is {cfg.engine.kv_cache}; the bench measures the served "
                         "quantized pages")
    t0 = time.perf_counter()
    built = compile_profile_engines(cfg)  # the compile stage's engines, reused when the flow built them
    engines = (WeightEngines(cfg.layout.engine_dir) if args.kv_only
               else weight_engines(cfg.layout.engine_dir, work, {w: cfg.engine.weight_block(w) for w in ("int8", "int4")},
                                   weight_calibration_ids(cfg),
                                   args.threads, cfg.engine.weight_mixed_bits, model_dir))
    print(f"the compile stage's engines ready in {time.perf_counter() - t0:.0f} s (builds: {built['engine_builds']}); "
          "the weight copies are built as their rows come", flush=True)

    # Measured rows are kept in --work, keyed by the token ids and by what each row's numbers depend on (the
    # engine's build key, the graph sources, the GGUF file), so a second run measures only what changed.
    cache = work / "rows" / hashlib.sha256(json.dumps([[ids for _, ids in rows_ids], args.context]).encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    served = served_pages(cfg)  # the serving engine's: compile_profile_engines built it above
    run = QualityRun(rows_ids, args.context, cache, time.monotonic() + 60.0 * args.time_budget, read_config(model_dir),
                     cfg.engine.kv_block_size or 16, served)
    base = BaseModel(model_dir)
    # A slow machine may be stopped part way (measured rows are kept): the reference, the served cache, the served
    # weight precisions, llama.cpp, then the int4 variants and the other KV widths.
    print(format_table([]), flush=True)
    measure_served(run, cfg, engines, args.threads, args.kv_only)
    ggufs, types = {}, {}
    if not args.no_llama_cpp:
        ggufs, types = measure_llama_cpp(run, model_dir, work, args.llama_cpp_src, args.threads, args.kv_only)
    measure_other_widths(run, cfg, engines, base, args.threads, args.kv_only, work, args.calibrated)
    return {"rows": run.rows, "not_measured": run.not_measured, "documents": [n for n, _ in rows_ids],
            "gguf_files": {t: str(p) for t, p in ggufs.items()}, "gguf_tensor_types": types,
            "engines": engines.paths(),
            "served_kv": {"kv_cache": cfg.engine.kv_cache, "spec": served.to_dict(), "block_size": run.block_size}}


def ci_text(row: dict) -> str:
    ci = row.get("ppl_increase_ci95")
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}] " if ci else ""


def weights_label(row: dict) -> str:
    """``int4 gptq, 4.56 bits``: the weights, how their codes were chosen and what they store per weight (ours)."""
    if not row.get("method"):
        return row["weights"]
    return f"{row['weights']} {row['method']}, {row['bits_per_weight']:.2f} bits"


def figures(p: dict) -> list[Figure]:
    """Each row of the table against its reference (ours, fp32, float cache), and the rows the budget left out."""
    text = f"{len(p['documents'])} docs x {p['scored_per_document']} tokens at context {p['context']}"
    rows = [Figure(f"real model ({text}): {r['engine']} {weights_label(r)} weights, {r['kv']} KV ({r.get('kv_read', '-')}): "
                   "Δ perplexity vs ours fp32 float cache", r["ppl_increase_pct"],
                   f"{r['ppl_increase_pct']:+.2f} % {ci_text(r)}(ppl {r['ppl']:.3f}, KL {r['kl_mean']:.2e}"
                   + (f", {r['kv_bits']:.2f} stored bits per KV value" if r.get("kv_bits") is not None else "")
                   + (f", per-layer widths at KL budget {r['layer_kl_budget']:g}" if r.get("layer_kl_budget") else "") + ")")
            for r in p["rows"]]
    if p.get("not_measured"):
        rows.append(Figure("real model: rows not measured (time budget spent)", len(p["not_measured"]),
                           "; ".join(p["not_measured"])))
    return rows


def calibrated_arg(text: str) -> list[tuple[int, float]]:
    """``2:0.05,3:0.01`` -> [(2, 0.05), (3, 0.01)]."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item]
        return [(int(bits), float(budget)) for bits, budget in pairs]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BITS:BUDGET pairs, e.g. 2:0.05,3:0.01") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Perplexity and KL of our engines and llama.cpp on a real checkpoint.")
    ap.add_argument("--params", type=Path, required=True, help="the real-model profile (base_model.path: the checkpoint)")
    ap.add_argument("--out", type=Path, default=RESULTS / "real_model_quality.json")
    ap.add_argument("--work", type=Path, default=RESULTS / "real_model",
                    help="weight-quantized engine copies and GGUF files (kept: a second run reuses them)")
    ap.add_argument("--docs", type=int, default=8, help="eval documents (prose and code alternating)")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the cache before the first scored one")
    ap.add_argument("--score", type=int, default=512, help="tokens scored per document, after the context")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-budget", type=float, default=float("inf"),
                    help="minutes: rows not measured yet are left out (listed as not_measured) once this is spent")
    ap.add_argument("--no-llama-cpp", action="store_true", help="our rows only (without the peer extra)")
    ap.add_argument("--kv-only", action="store_true",
                    help="the KV comparison alone: no weight-quantized rows; llama.cpp's F16 weights only")
    ap.add_argument("--calibrated", type=calibrated_arg, default=[],
                    help="BITS:BUDGET,...: also the pages at K/V BITS with per-layer widths calibrated under that KL "
                         "budget (kv.layer_kl_budget), e.g. 2:0.05")
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
        "weight_grid_note": WEIGHT_GRID_NOTE, "weight_block_size": {w: cfg.engine.weight_block(w) for w in ("int8", "int4")},
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
