"""Peer benchmark: llama.cpp against our ONNX Runtime engines, same backbone, same run (issue 8).

    make bench-peer    # installs the `peer` extra (compiles llama.cpp, 10-20 min on 2 cores, once) and runs this
    python -m bench.engine.llama_cpp_bench [--configs tiny,0.5b-width] [--pasts 512,2048] [--iters 400] \
        [--out bench/results/llama_cpp_bench.json] [--llama-cpp-src SDIST_OR_DIR] [--flash-attn on|off]

Not part of CI nor of ``make bench``. Per config of ``bench.lib.backbones.WEIGHT_QUANT_SHAPES`` (the tiny
default widths and the Qwen2-0.5B widths with 6 layers, both vocabulary 512):

* the random-weight Hugging Face backbone and LoRA adapter of ``bench.lib.backbones``, and our
  engines fp32 / int8 / int4 (ONNX Runtime, ``MatMulNBits`` RTN at each width's release block size, adapter
  bound as inputs) and int8 / int4 with the adapter merged into the weights before quantizing
  (``_merged``), built by ``bench.lib.backbones.build_weight_variants``;
* the *same* backbone directory converted to GGUF with the converter that the llama-cpp-python
  sdist vendors (``vendor/llama.cpp/convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``): F32,
  F16 and Q8_0 by the converter, Q4_0 by ``llama_model_quantize`` (llama.cpp's own quantizer, the
  one behind ``llama-quantize``) from the F32 file, with its defaults (e.g. the output matrix at a
  higher precision); and the *same* PEFT adapter converted by the sdist's ``convert_lora_to_gguf.py``
  (F32), which llama.cpp applies at run time on Q8_0 and Q4_0 (``llama_q8_0_lora``, ``llama_q4_0_lora``:
  the base weights untouched, as our LoRA inputs);
* every engine of the config timed in one ``interleaved`` call per case (A B C ..., A B C ...), so
  load from other processes hits them alike, each round of an engine after 3 untimed calls (the
  first calls after the other engine ran are slowed by its threads, both ways: ``interleaved``):
  one decoded token after a past of P (the past is restored after every call: ``engine_steps``
  does not extend our cache; llama.cpp gets its ``n_tokens`` reset to P, and ``Llama.eval`` drops
  KV cells >= P before decoding), and a prefill of 128 tokens. Batch 1, 2 threads (``n_threads =
  n_threads_batch = 2``), the same token ids for both engines. Median and p10 per case. Under load
  from other processes llama.cpp's medians grow far more than ours (5-60x against 3x at a 1-min
  load of 4 on 2 cores): compare runs whose load
  average stays below the thread count (the bench warns when it starts above).

Pairs are judged like for like: ours with the rank-8 LoRA on q/k/v/o as inputs (as served) against
llama.cpp with the same adapter applied at run time, and ours with the adapter merged against
llama.cpp's base alone (the same compute: no adapter term on either side). Ours with the adapter
against llama.cpp without one (the pairing of the first runs) is printed as information. llama.cpp's KV
cache is F16 (its default), ours fp32; flash attention is on (what llama.cpp's ``auto`` picks on CPU; ``--flash-attn off`` to compare).

Roofline: read bandwidth is measured before and after the timings (sums and maxima over a 512 MiB
float32 array split over the threads, best of 10; the better of the two). Weight bytes read per
decoded token, the same rule for both engines: every stored weight tensor except the token-embedding
matrix, which is gathered (one row per token), not streamed. ORT: the initializers of ``model.onnx``
except those read only by ``Gather`` (the embedding) plus the bound LoRA inputs. GGUF: the tensor
bytes of the file except ``token_embd.weight``, plus the adapter file's tensors where one is
applied. Achieved GB/s = bytes per token / decode time; share = achieved / measured bandwidth.
The KV cache read is not counted (it grows with P). A share above 1 means the weights sat in cache
(tiny: 2-16 MiB against a 32 MiB L3) or the probe was slowed by other load more than the engine was.

The tokenizer does not affect any measured number (both engines are fed token ids). It is needed
only because the converter writes a vocabulary: the random backbones get the embedded tokenizer of
``models/base/`` (trained again with ``tasks.stages.base_model.train_tokenizer`` if absent), padded by the
converter to the config's vocabulary with unused ``[PAD<i>]`` tokens. That tokenizer (byte-level BPE
with single digits, trained with ``tokenizers``) is not among the converter's known BPE
pre-tokenizers: ``bench.lib.llama_cpp_peer`` writes it as ``"qwen2"``.

Acceptance (issue 8): at 0.5B width, our int8 decode no slower than llama.cpp Q8_0, int4 no slower
than Q4_0, and prefill no slower than llama.cpp at the same precision (int8/Q8_0, int4/Q4_0,
fp32/F32), measured in the same run (medians), in both like-for-like pairings.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.lib.backbones import WEIGHT_QUANT_SHAPES, build_weight_variants, embedded_tokenizer_dir
from bench.lib.llama_cpp_peer import (
    DEFAULT_SRC_DIR,
    PRE_TOKENIZER,
    SRC_ENV,
    convert_adapter_to_gguf,
    convert_to_gguf,
    converter_dir,
    gguf_source_dir,
    gguf_tensor_bytes,
    llama_steps,
    load_llama,
    quantize_gguf,
    require_llama_cpp,
)
from bench.lib.report import RESULTS, Figure, write_report
from bench.lib.tables import table
from bench.lib.timing import engine_steps, interleaved
from kernels.weight_quant import DEFAULT_BLOCK_SIZES
from runtime.engine.interface import ENGINE_ONNX

ORT_VARIANTS = ("fp32", "int8", "int4", "int8_merged", "int4_merged")  # _merged: the adapter folded into the weights
GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")
LORA_GGUF_TYPES = ("q8_0", "q4_0")  # also loaded with the adapter applied at run time, as llama_<type>_lora
CONVERTER_TYPES = ("f32", "f16", "q8_0")  # q4_0: llama_model_quantize from the f32 file
EMBEDDING_GGUF = "token_embd.weight"
PREFILL = 128
# (our variant, llama.cpp type, cases the acceptance covers: "decode" = every past, "prefill")
# Judged like for like: the adapter a runtime input on both sides, or on neither (ours merged into the
# weights before quantizing; llama.cpp's base alone, the same compute). The rest is information.
PAIRS = (("int8", "q8_0_lora", ("decode", "prefill")), ("int4", "q4_0_lora", ("decode", "prefill")),
         ("int8_merged", "q8_0", ("decode", "prefill")), ("int4_merged", "q4_0", ("decode", "prefill")),
         ("fp32", "f32", ("prefill",)),  # ours carries the adapter, llama.cpp not
         ("int8", "q8_0", ()), ("int4", "q4_0", ()))  # the same mismatch, the pairing of the first runs
ACCEPTANCE_CONFIG = "0.5b-width"


# ---------------------------------------------------------------- pure rules (tested without llama.cpp)

def gguf_streamed_bytes(tensor_bytes: dict[str, int]) -> int:
    """Weight bytes a decoded token reads from a GGUF model: every tensor but the token embedding."""
    return sum(n for name, n in tensor_bytes.items() if name != EMBEDDING_GGUF)


def onnx_streamed_bytes(model) -> int:
    """Weight bytes a decoded token reads from an ONNX model: every initializer except those read
    only as the table of a ``Gather`` (the token embedding: one row per token). Sizes come from the
    shapes, so a model saved with external data needs no data loaded."""
    from onnx import TensorProto, helper

    graph = model.graph
    uses: dict[str, list[bool]] = {}  # initializer -> [is this use a Gather's table?]
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append(node.op_type == "Gather" and i == 0)
    total = 0
    for init in graph.initializer:
        if uses.get(init.name) and all(uses[init.name]):
            continue
        n = int(np.prod(init.dims, dtype=np.int64))
        if init.data_type in (TensorProto.INT4, TensorProto.UINT4):
            total += (n + 1) // 2
        else:
            total += n * np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    return total


def roofline(bytes_per_token: int, decode_ms: float, bandwidth_gb_s: float) -> dict[str, float]:
    """Achieved weight-read rate of one decoded token and its share of the measured bandwidth."""
    achieved = bytes_per_token / (decode_ms * 1e-3) / 1e9
    return {"achieved_gb_s": achieved, "share": achieved / bandwidth_gb_s}


def compare(rows: dict[str, dict[str, float]], p10: dict[str, dict[str, float]], pasts: list[int]) -> list[dict]:
    """Ours over llama.cpp's median at the same precision; <= 1 passes. The p10 ratio (the least
    disturbed calls of each) is reported beside it, not judged."""
    out = []
    for ours, peer, cases in PAIRS:
        keys = [f"decode_{P}_ms" for P in pasts] + [f"prefill_{PREFILL}_ms"]
        for key in keys:
            a, b = rows.get(f"ort_{ours}", {}).get(key), rows.get(f"llama_{peer}", {}).get(key)
            if a is None or b is None:
                continue
            in_acceptance = key.split("_")[0] in cases
            out.append({"ours": f"ort_{ours}", "peer": f"llama_{peer}", "case": key, "ours_ms": a, "peer_ms": b,
                        "ratio": a / b, "ratio_p10": p10[f"ort_{ours}"][key] / p10[f"llama_{peer}"][key],
                        "acceptance": in_acceptance, "pass": a <= b})
    return out


# ---------------------------------------------------------------- the measurement

def build_ggufs(llama_cpp, llama_dir: Path, hf_dir: Path, out: Path, threads: int) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {t: convert_to_gguf(llama_dir, hf_dir, out / f"model-{t}.gguf", t) for t in CONVERTER_TYPES}
    paths["q4_0"] = quantize_gguf(llama_cpp, paths["f32"], out / "model-q4_0.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, threads)
    return {t: paths[t] for t in GGUF_TYPES}


def read_bandwidth(mib: int = 512, threads: int = 2, repeats: int = 5) -> dict:
    """Read rate of a ``mib`` MiB float32 array split over ``threads`` threads (numpy releases the
    GIL in reductions): the best of ``repeats`` sums and ``repeats`` maxima, alternated."""
    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            for reduce in (np.sum, np.max):
                t0 = time.perf_counter()
                list(pool.map(reduce, parts))
                best = min(best, time.perf_counter() - t0)
    return {"gb_s": a.nbytes / best / 1e9, "mib": mib, "threads": threads, "runs": 2 * repeats}


def bench_config(llama_cpp, llama_dir: Path, name: str, pasts: list[int], iters: int, threads: int, work: Path,
                 flash_attn: bool) -> dict:
    import onnx

    from runtime.engine.adapter import load_adapter

    dims = WEIGHT_QUANT_SHAPES[name]
    t0 = time.perf_counter()
    cfg, engines, _ = build_weight_variants(name, dims, threads, work, list(ORT_VARIANTS))
    root = work / name  # build_weight_variants wrote base/ and adapter/ there
    lora = load_adapter(root / "adapter", engines["fp32"].interface)
    lora_bytes = sum(np.asarray(v).nbytes for v in lora.values())
    streamed = {f"ort_{v}": onnx_streamed_bytes(onnx.load(str(e.engine_dir / ENGINE_ONNX), load_external_data=False))
                + (0 if v.endswith("_merged") else lora_bytes) for v, e in engines.items()}
    t1 = time.perf_counter()
    hf_dir = gguf_source_dir(root / "base", embedded_tokenizer_dir(work), root / "gguf_src")
    ggufs = build_ggufs(llama_cpp, llama_dir, hf_dir, root / "gguf", threads)
    lora_gguf = convert_adapter_to_gguf(llama_dir, root / "adapter", hf_dir, root / "gguf" / "adapter-f32.gguf")
    streamed |= {f"llama_{t}": gguf_streamed_bytes(gguf_tensor_bytes(p, llama_dir)) for t, p in ggufs.items()}
    lora_gguf_bytes = sum(gguf_tensor_bytes(lora_gguf, llama_dir).values())
    streamed |= {f"llama_{t}_lora": streamed[f"llama_{t}"] + lora_gguf_bytes for t in LORA_GGUF_TYPES}
    files = {f"ort_{v}": (e.engine_dir / ENGINE_ONNX).stat().st_size for v, e in engines.items()}
    files |= {f"llama_{t}": p.stat().st_size for t, p in ggufs.items()} | {"llama_lora_adapter": lora_gguf.stat().st_size}
    llms = {f"llama_{t}": load_llama(llama_cpp, p, max(pasts) + 1, threads, flash_attn) for t, p in ggufs.items()}
    llms |= {f"llama_{t}_lora": load_llama(llama_cpp, ggufs[t], max(pasts) + 1, threads, flash_attn, lora=lora_gguf)
             for t in LORA_GGUF_TYPES}
    t2 = time.perf_counter()
    print(f"[{name}] engines built in {t1 - t0:.0f} s, GGUF converted in {t2 - t1:.0f} s; timing ...", flush=True)

    names = [f"ort_{v}" for v in engines] + list(llms)
    rows: dict[str, dict] = {n: {} for n in names}
    p10: dict[str, dict] = {n: {} for n in names}
    cases = [(P, f"decode_{P}_ms", iters, 20) for P in pasts] + [(None, f"prefill_{PREFILL}_ms", max(10, iters // 10), 5)]
    for P, key, n, rounds in cases:
        steps = {f"ort_{v}": engine_steps(e, cfg, P, PREFILL) for v, e in engines.items()}
        steps |= {k: llama_steps(llm, cfg.vocab_size, P) for k, llm in llms.items()}
        for k, s in interleaved(steps, n, rounds).items():
            rows[k][key], p10[k][key] = s["median"], s["p10"]
        print(f"[{name}] {key} done (1-min load average {os.getloadavg()[0]:.2f})", flush=True)
    for llm in llms.values():
        llm.close()
    return {"dims": dims, "rows": rows, "rows_p10": p10, "streamed_weight_bytes": streamed, "file_bytes": files,
            "lora_input_bytes": lora_bytes, "comparisons": compare(rows, p10, pasts), "loadavg_1m_after": os.getloadavg()[0]}


def print_results(results: dict, bandwidth: dict) -> None:
    print(f"\nread bandwidth: {bandwidth['gb_s']:.1f} GB/s (the better of {bandwidth['start']['gb_s']:.1f} before and "
          f"{bandwidth['end']['gb_s']:.1f} after the timings; {bandwidth['threads']} threads, sum and max over "
          f"{bandwidth['mib']} MiB float32, best of {bandwidth['start']['runs']})")
    for name, res in results.items():
        print(f"\n== {name}: {res['dims']}  (1-min load average after: {res['loadavg_1m_after']:.2f})")
        cols = list(next(iter(res["rows"].values())))
        decodes = list(next(iter(res["roofline"].values())))
        header = ["engine", "MiB/token", *(f"{c} [p10]" for c in cols), *(f"GB/s|share {d[7:]}" for d in decodes)]
        print(table(header, ([k, f"{res['streamed_weight_bytes'][k] / 2**20:.1f}",
                              *(f"{row[c]:.3f} [{res['rows_p10'][k][c]:.2f}]" for c in cols),
                              *(f"{r['achieved_gb_s']:.1f} |{r['share']:>5.0%}" for r in res["roofline"][k].values())]
                             for k, row in res["rows"].items())))
        print("  ours / llama.cpp at the same precision (median ms; <= 1.00: ours no slower; p10 ratio beside):")
        print(table(["ours", "llama.cpp", "case", "ours ms", "llama.cpp ms", "ratio", "p10 ratio", ""],
                    ([c["ours"], c["peer"], c["case"], f"{c['ours_ms']:.3f}", f"{c['peer_ms']:.3f}", f"{c['ratio']:.2f}x",
                      f"{c['ratio_p10']:.2f}x",
                      ("PASS" if c["pass"] else "FAIL") if c["acceptance"] and name == ACCEPTANCE_CONFIG else "info"]
                     for c in res["comparisons"]), align="<<<>>>><"))


def figures(p: dict) -> list[Figure]:
    """The read bandwidth, and ours over llama.cpp in each pairing the acceptance judges (like for like)."""
    rows = [Figure("read bandwidth", p["read_bandwidth"]["gb_s"], f"{p['read_bandwidth']['gb_s']:.1f} GB/s")]
    for cfg, res in p["results"].items():
        rows += [Figure(f"{cfg}: {c['ours']} / {c['peer']} median, {c['case'].removesuffix('_ms')}", c["ratio"],
                        f"{c['ratio']:.2f}x ({'no slower' if c['pass'] else 'slower'}; p10 {c['ratio_p10']:.2f}x)")
                 for c in res["comparisons"] if c["acceptance"]]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="llama.cpp vs our ONNX Runtime engines: decode, prefill, roofline share")
    ap.add_argument("--out", type=Path, default=RESULTS / "llama_cpp_bench.json")
    ap.add_argument("--configs", default="tiny,0.5b-width")
    ap.add_argument("--pasts", default="512,2048")
    ap.add_argument("--iters", type=int, default=400,
                    help="decode calls per engine and case, in 20 rounds (prefill: a tenth, in 5 rounds)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp-src", default=None,
                    help=f"llama-cpp-python sdist or llama.cpp directory (default ${SRC_ENV}, else {DEFAULT_SRC_DIR})")
    ap.add_argument("--flash-attn", choices=("on", "off"), default="on")
    ap.add_argument("--bandwidth-mib", type=int, default=512)
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in WEIGHT_QUANT_SHAPES]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; known: {', '.join(WEIGHT_QUANT_SHAPES)}")
    llama_cpp = require_llama_cpp()
    llama_dir = converter_dir(args.llama_cpp_src)
    import onnxruntime
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]  # > threads: another process competed for the cores
    if load_before > args.threads - 0.5:
        print(f"warning: 1-min load average {load_before:.2f} on {os.cpu_count()} cores: other processes compete for "
              "the cores; llama.cpp's threads wait at every barrier of the graph for a descheduled peer, so its "
              "medians can grow many times (compare the p10 column, or run on a quiet machine)")
    pasts = [int(p) for p in args.pasts.split(",")]
    bandwidth_start = read_bandwidth(args.bandwidth_mib, args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in configs:
            results[name] = bench_config(llama_cpp, llama_dir, name, pasts, args.iters, args.threads, Path(work),
                                         args.flash_attn == "on")
    # measured again after the timings: the better of the two is the one less disturbed by other load
    bandwidth_end = read_bandwidth(args.bandwidth_mib, args.threads)
    bandwidth = {"gb_s": max(bandwidth_start["gb_s"], bandwidth_end["gb_s"]), "mib": args.bandwidth_mib,
                 "threads": args.threads, "start": bandwidth_start, "end": bandwidth_end}
    for res in results.values():
        res["roofline"] = {k: {key[:-3]: roofline(res["streamed_weight_bytes"][k], ms, bandwidth["gb_s"])
                               for key, ms in row.items() if key.startswith("decode_")}
                           for k, row in res["rows"].items()}
    print_results(results, bandwidth)
    acceptance = [c for c in results.get(ACCEPTANCE_CONFIG, {}).get("comparisons", []) if c["acceptance"]]
    if acceptance:
        failed = [f"{c['ours']} vs {c['peer']} {c['case']}" for c in acceptance if not c["pass"]]
        print(f"\nacceptance at {ACCEPTANCE_CONFIG}: " + ("all pass" if not failed else "FAIL: " + "; ".join(failed)))
    payload = {
        "batch": 1, "threads": args.threads, "iters": args.iters, "pasts": pasts, "prefill": PREFILL,
        "flash_attn": args.flash_attn, "llama_cpp_kv_type": "f16", "ort_kv_type": "fp32",
        "ort_variants": list(ORT_VARIANTS), "block_sizes": DEFAULT_BLOCK_SIZES,
        "gguf_types": list(GGUF_TYPES) + [f"{t}_lora" for t in LORA_GGUF_TYPES], "pre_tokenizer_fallback": PRE_TOKENIZER,
        "weight_bytes_rule": "stored weight tensors except the token embedding (gathered, not streamed); "
                             "ORT: initializers not read only by Gather + bound LoRA inputs; GGUF: tensors but token_embd.weight",
        "read_bandwidth": bandwidth, "converter": str(llama_dir),
        "versions": {"llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
                     "onnxruntime": onnxruntime.__version__},
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0], "results": results,
    }
    write_report(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
