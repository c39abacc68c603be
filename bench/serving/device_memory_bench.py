"""Device memory at the real size: ``serve``'s resident set and KV bytes against llama.cpp's ``llama-server`` (issue 27, item 4).

    python -m bench.serving.device_memory_bench [--shape 0.5b|tiny] [--loads 8x2048,1x8192,mixed] [--servers ours,llama]
        [--max-tokens 64] [--threads 2] [--arrival staggered|together] [--rss-limit-gb 12] [--workdir DIR]
        [--ort-memory arena|shrink|no_arena] [--prefill-chunk N] [--kv-cache quantized_pages|float]
        [--llama-server PATH] [--llama-cpp-src SDIST_OR_DIR] [--out bench/results/device_memory_bench.json]

Not in CI nor in ``make bench`` (the 0.5B world takes minutes to build and GBs of memory). The model, built
once into ``--workdir`` (reused when given; a temporary directory otherwise):

* ``--shape 0.5b``: Qwen2-0.5B's shape with random weights (``bench.lib.backbones.build_qwen2_05b_shape``: 24
  layers, hidden 896, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151,936); ``tiny``: the tiny world's
  random Qwen2 (``bench.lib.worlds.make_tiny_base``), for the tests;
* ours: the serving engine the compile stage builds with ``engine.weights: int4`` (the ``kv`` section's default
  4-bit quantized pages, or with ``--kv-cache float`` the float cache, in the ``engine`` section's default serving
  form, a paged cache and stacked adapters, ``tasks.stages.compile.compile_engine``, then
  ``tasks.weights.engines.ensure_quantized_engine``), a random rank-8 adapter and its signed release
  (``bench.lib.worlds.build_int4_world``), served by ``python -m runtime serve`` as a device runs it (a device config for the
  threads);
* llama.cpp: the same backbone converted to GGUF F16 and quantized to Q4_0 (``bench.lib.llama_cpp_peer``), the
  same adapter as a GGUF LoRA, served by ``llama-server -m Q4_0 --lora ADAPTER -ctk q4_0 -ctv q4_0 -fa on
  --no-repack -np N -c N x LONGEST`` (a quantized V cache needs flash attention; ``--no-repack``: llama.cpp's
  AMX matmul of repacked Q4_0 weights dies of a general protection fault in this VM, ``load_llama`` there).

Loads (``--loads``; ``NAME=L1/L2/...`` adds one): ``8x2048`` (8 clients at 2,048 tokens of context), ``1x8192``,
``mixed`` (8 clients: 128, 256, 512, 1,024 tokens, two of each). A client's context is its prompt plus
``--max-tokens`` generated tokens: the prompt is that many tokens shorter. Each client is a thread streaming
one ``/v1/completions`` request through the official ``openai`` SDK, greedy; the prompts are inspection rows cut
to their exact length by our tokenizer, sent as text to ours and as the same token ids to llama-server.
``--arrival staggered`` (the default): each client sends once the row before it decodes (its first streamed token;
on ours, whose stream carries a token only once it decodes to text, and the random backbone's ids above the
tokenizer's vocabulary decode to none, once ``adapter_kv_cache_needed_bytes`` counts that row's prompt), so one
prompt prefills at a time and every row then decodes together (on both servers a joining prompt costs the rows
already decoding a step or two, not their whole answer: with 64 tokens the first row still runs when the last
joins). ``together``: all send at once; ours then prefills them in one forward, whose logits alone are rows x
prompt x vocabulary floats (8 x 1,984 x 151,936 x 4 B = 9.6 GB at the 0.5B shape).

Per load and server, each server started fresh (its peak is its own): the resident set from
``/proc/PID/status`` (``VmHWM``, the peak, or the largest sample where the kernel's VmHWM lags it; ``VmRSS`` sampled every ``--sample-s`` seconds; when ready, before any
request; and at the end, every answer done: what it keeps), above ``--rss-limit-gb`` the server is killed and the
load recorded as over the limit (the machine is shared); KV bytes: ours from its gauges
(``adapter_kv_cache_bytes``: what the batch's cache holds, padding included; ``adapter_kv_cache_needed_bytes``:
the rows' real tokens; scraped from ``/metrics`` at every sample, the sample holding the most kept),
llama-server's from its log (the cells it allocates at start: slots x their context) against its rows' tokens,
both x its bytes per token (q4_0: 18 bytes per 32 values); tokens and tokens/s (information: 2 shared cores).

Writes ``bench/results/device_memory_bench.json`` with, among the rest, ``kv_allocated_over_needed`` (ours,
mixed lengths; issue 27's target <= 1.1), ``rss_vs_llama_server`` (ours over llama-server's peak, 8 x 2,048;
target <= 1) and ``mixed_adapters_vs_one`` (null: ``bench.serving.mixed_adapters_bench`` measures it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.llama_cpp_peer import (
    convert_adapter_to_gguf,
    convert_to_gguf,
    converter_dir,
    llama_server_binary,
    quantize_gguf,
    require_llama_cpp,
)
from bench.lib.report import RESULTS, Figure, progress, write_report
from bench.lib.servers import ServerProcess, free_port, our_server
from bench.lib.tables import table
from bench.lib.worlds import build_int4_world, prompt_text
from runtime.engine.backends.onnxruntime import DEFAULT_ORT_MEMORY, ORT_MEMORY_MODES
from runtime.engine.interface import read_interface
from runtime.serve.batcher import DEFAULT_PREFILL_CHUNK
from runtime.serve.residents import CHAMPION

SHAPES = ("0.5b", "tiny")
LOADS = {"8x2048": (2048,) * 8, "1x8192": (8192,), "mixed": (128, 256, 512, 1024) * 2}
SERVERS = ("ours", "llama")
Q4_0_BLOCK = (32, 18)  # llama.cpp's q4_0: 32 values in 18 bytes (an fp16 scale and 16 bytes of nibbles)
REQUEST_TIMEOUT_S = 3600.0  # a 0.5B-shape prefill of 8,192 tokens takes minutes on 2 shared cores
MIXED_ADAPTERS_NOTE = "measured by bench.serving.mixed_adapters_bench (bench/results/mixed_adapters_bench.json)"
POLL_S = 0.25  # a staggered client looks this often whether the row before it decodes
GB = 1e9


# ---------------------------------------------------------------- what each server runs

def our_options(args) -> dict:
    """The device config keys ``--ort-memory`` and ``--prefill-chunk`` set (absent: the server's defaults)."""
    return {k: v for k, v in (("ort_memory", args.ort_memory), ("prefill_chunk", args.prefill_chunk)) if v is not None}


def stored_weights(engine: Path) -> dict:
    """What the engine's weight quantization wrote about itself (``tasks.weights.engines.WEIGHTS_FILE``): bits of
    the body, the LM head and the embedding table."""
    from tasks.weights.engines import WEIGHTS_FILE

    record = json.loads((engine / WEIGHTS_FILE).read_text())
    return {k: record.get(k) for k in ("bits", "head_bits", "embed_bits", "block_size", "keep")}


def llama_files(world: dict, root: Path, src: str | None, threads: int, server: Path) -> dict:
    """The backbone as GGUF Q4_0 (F16 by the sdist's converter, then llama.cpp's quantizer: the ``llama-quantize``
    built beside ``server`` by ``make bench-peer-server``, else llama-cpp-python's) and the adapter as a GGUF LoRA,
    in ``root``; files already there are reused (each written under another name, then renamed)."""
    out = root / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    model, lora = out / "model-q4_0.gguf", out / "adapter-f32.gguf"
    if not (model.is_file() and lora.is_file()):
        llama_dir, quantizer = converter_dir(src), server.with_name("llama-quantize")
        progress("[llama] GGUF F16 -> Q4_0 and the adapter's GGUF LoRA ...")
        f16 = out / "model-f16.gguf"
        if not f16.is_file():
            os.replace(convert_to_gguf(llama_dir, world["base"], out / "model-f16.gguf.part", "f16"), f16)
        part = out / "model-q4_0.gguf.part"
        if quantizer.is_file():
            subprocess.run([str(quantizer), str(f16), str(part), "Q4_0", str(threads)], check=True,
                           stdout=subprocess.DEVNULL)
        else:
            llama_cpp = require_llama_cpp()
            quantize_gguf(llama_cpp, f16, part, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, threads)
        os.replace(part, model)
        f16.unlink()
        os.replace(convert_adapter_to_gguf(llama_dir, world["adapter"], world["base"], out / "adapter-f32.gguf.part"),
                   lora)
    return {"model": model, "lora": lora}


def shape_dims(world: dict) -> dict:
    config = json.loads((Path(world["base"]) / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size")
    return {k: config[k] for k in keys}


def llama_kv_bytes_per_token(dims: dict) -> int:
    """llama.cpp's q4_0 K and V per token, every layer: (KV heads x head dim) values each, 18 bytes per 32."""
    values = dims["num_key_value_heads"] * dims["hidden_size"] // dims["num_attention_heads"]
    return dims["num_hidden_layers"] * 2 * values // Q4_0_BLOCK[0] * Q4_0_BLOCK[1]


# ---------------------------------------------------------------- the loads

def parse_loads(text: str) -> dict[str, tuple[int, ...]]:
    """``8x2048,mixed,long=4096/512``: named loads of ``LOADS`` and ``NAME=L1/L2/...`` (one context per client)."""
    loads = {}
    for item in filter(None, text.split(",")):
        name, _, lengths = item.partition("=")
        if lengths:
            loads[name] = tuple(int(n) for n in lengths.split("/"))
        elif name in LOADS:
            loads[name] = LOADS[name]
        else:
            raise SystemExit(f"error: --loads: unknown load {name!r}; known: {', '.join(LOADS)}, or NAME=L1/L2/...")
    return loads


@dataclass
class ClientRun:
    sent: float = 0.0
    first: float | None = None
    done: float = 0.0
    completion_tokens: int = 0
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)  # first token (or failure): the next may send
    posted: threading.Event = field(default_factory=threading.Event)  # sent: the next never sends before it


def drive(port: int, prompts: list, runs: list[ClientRun], model: str, max_tokens: int, staggered: bool,
          extra: dict, decoding=lambda row: False) -> None:
    """One thread per prompt, each streaming one greedy completion through the openai SDK into its ``runs`` entry;
    with ``staggered`` each sends after the one before it, once that one has its first token (or ended), or
    ``decoding(row)`` says the server decodes it (polled every ``POLL_S``)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="device-memory-bench", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)

    def one(i: int) -> None:
        run = runs[i]
        if staggered and i:
            # ``decoding`` reads a KV gauge that the rows already decoding grow too: it can pass the next row's
            # threshold before the row before it was sent
            runs[i - 1].posted.wait()
            while not runs[i - 1].started.wait(POLL_S) and not decoding(i - 1):
                pass
        run.sent = time.perf_counter()
        run.posted.set()
        try:
            stream = client.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}, extra_body=extra)
            chunks = 0
            for chunk in stream:
                if chunk.choices and run.first is None:
                    run.first = time.perf_counter()
                    run.started.set()
                chunks += bool(chunk.choices)
                if chunk.usage is not None:
                    run.completion_tokens = chunk.usage.completion_tokens
            run.completion_tokens = run.completion_tokens or chunks  # a server without usage: one token a chunk
        except (openai.OpenAIError, OSError) as err:
            run.error = f"{type(err).__name__}: {err}"[:300]
        finally:
            run.done = time.perf_counter()
            run.started.set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()


# ---------------------------------------------------------------- memory, watched while a load runs

def proc_status(pid: int) -> dict[str, int]:
    """The ``kB`` lines of ``/proc/PID/status`` (VmRSS, VmHWM, RssAnon, RssFile, ...) in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if value.strip().endswith(" kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


def our_kv_gauges(port: int) -> tuple[float, float]:
    """(bytes the batches' KV caches hold, bytes their rows need) from our server's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["adapter_kv_cache_bytes"], values["adapter_kv_cache_needed_bytes"]


class MemoryWatch:
    """Samples a server's ``VmRSS`` (and, given ``kv``, its KV reading) every ``interval`` seconds on a thread, prints
    progress every ``report_s``, and kills the server (SIGKILL) once its resident set passes ``limit`` bytes."""

    def __init__(self, label: str, server: ServerProcess, interval: float, limit: float, report_s: float, kv,
                 runs: list[ClientRun]):
        self.label, self.server, self.interval, self.limit, self.report_s = label, server, interval, limit, report_s
        self.kv, self.runs = kv, runs
        self.samples: list[tuple[float, int]] = []  # (time, VmRSS)
        self.kv_peak: tuple[float, float] = (0.0, 0.0)  # the (held, needed) sample holding the most
        self.over_limit_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self.t0 = time.perf_counter()
        self._thread.start()

    def _watch(self) -> None:
        last_report = self.t0
        while not self._stop.is_set():
            now = time.perf_counter()
            try:
                rss = proc_status(self.server.proc.pid)["VmRSS"]
            except (OSError, KeyError):  # the process has gone
                return
            self.samples.append((now, rss))
            if self.kv is not None:
                try:
                    held, needed = self.kv()
                    if held >= self.kv_peak[0]:
                        self.kv_peak = (held, needed)
                except OSError:
                    pass
            if rss > self.limit:
                self.over_limit_at = now - self.t0
                progress(f"[{self.label}] resident set {rss / GB:.2f} GB over the limit of {self.limit / GB:.1f} GB: "
                         "server killed")
                self.server.proc.send_signal(signal.SIGKILL)
                return
            if now - last_report >= self.report_s:
                last_report = now
                answering = sum(r.first is not None for r in self.runs)
                kv = (f", KV held {self.kv_peak[0] / 1e6:.1f} MB / needed {self.kv_peak[1] / 1e6:.1f} MB (peak)"
                      if self.kv is not None else "")
                progress(f"[{self.label}] {now - self.t0:.0f} s: {answering}/{len(self.runs)} clients answering, "
                         f"RSS {rss / GB:.2f} GB (max {max(s for _, s in self.samples) / GB:.2f}){kv}")
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()



# ---------------------------------------------------------------- one load on one server

def llama_server(binary: Path, files: dict, contexts: tuple[int, ...], threads: int, work: Path,
                 label: str) -> ServerProcess:
    """llama-server with a slot per client, each as long as the longest context (its -c is shared by the slots)."""
    port = free_port()
    slot = -(-max(contexts) // 256) * 256  # llama.cpp pads its context to 256 cells
    cmd = [str(binary), "-m", str(files["model"]), "--lora", str(files["lora"]), "-np", str(len(contexts)), "-cb",
           "-c", str(slot * len(contexts)), "-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on", "--no-repack",
           "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    return ServerProcess(label, cmd, work / f"{label.replace(' ', '-')}.log", port=port, ready="/health")


# llama-server's start-up line naming its slots; its KV cache is one buffer of n_ctx_slot cells per slot (one shared
# by all with kv_unified). llama.cpp's own ``llama_kv_cache: size = ...`` line is not printed at the server's
# default verbosity.
LLAMA_SLOTS_LINE = re.compile(r"n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'")


def llama_kv_allocated(log: Path, per_token: int) -> tuple[int, int] | None:
    """(bytes, cells) of the KV cache llama-server allocated at start, from its log; None if not found."""
    found = LLAMA_SLOTS_LINE.search(log.read_text(errors="replace"))
    if found is None:
        return None
    slots, per_slot, unified = int(found[1]), int(found[2]), found[3] == "true"
    cells = per_slot if unified else slots * per_slot
    return cells * per_token, cells


def measure_load(server_name: str, load: str, contexts: tuple[int, ...], texts: list[str], prompts: list[list[int]],
                 world: dict, args, work: Path, binary: Path | None = None, files: dict | None = None) -> dict:
    """Start the server fresh, drive the load (``texts`` to ours, their ids ``prompts`` to llama-server), watch its
    memory, stop it; its resident set, KV bytes, tokens and errors."""
    label = f"{server_name} {load}"
    progress(f"[{label}] starting the server ...")
    decoding = lambda row: False  # noqa: E731
    if server_name == "ours":
        server = our_server(world, contexts, args.max_tokens, args.threads, work, label, our_options(args))
        bodies, model, extra = texts, CHAMPION, {}
        kv = lambda: our_kv_gauges(server.port)  # noqa: E731
        per_token = read_interface(world["engine"]).kv_bytes_per_token
        # the rows up to ``row`` joined the batch: its gauge counts at least their prompts
        decoding = lambda row: kv()[1] >= per_token * sum(map(len, prompts[: row + 1]))  # noqa: E731
    else:
        server = llama_server(binary, files, contexts, args.threads, work, label)
        bodies, model, extra, kv = prompts, "q4_0", {"cache_prompt": False}, None
    ready = proc_status(server.proc.pid)
    runs = [ClientRun() for _ in bodies]
    watch = MemoryWatch(label, server, args.sample_s, args.rss_limit_gb * GB, args.report_s, kv, runs)
    t0 = time.perf_counter()
    try:
        drive(server.port, bodies, runs, model, args.max_tokens, args.arrival == "staggered", extra, decoding)
        wall = time.perf_counter() - t0
        watch.stop()  # before the peak is read: a sample taken after it could exceed the VmHWM read here
        end = proc_status(server.proc.pid) if server.proc.poll() is None else {}
    finally:
        watch.stop()
        exit_code = server.stop()
    tokens = sum(r.completion_tokens for r in runs if r.error is None)
    # The kernel records VmHWM only at some points (an unmap, an exit): a resident set that rose and fell between
    # them is missing from it (CI measured a sample 0.14 MB above the VmHWM read after it). The peak is the
    # larger of the two.
    sampled = max((s for _, s in watch.samples), default=None)
    peak = max((v for v in (end.get("VmHWM"), sampled) if v is not None), default=None)
    out = {"clients": len(contexts), "contexts": list(contexts), "prompt_tokens": [len(p) for p in prompts],
           "ready_rss_bytes": ready["VmRSS"], "peak_rss_bytes": peak, "end_rss_bytes": end.get("VmRSS"),
           "max_sampled_rss_bytes": sampled,
           "over_rss_limit_at_s": watch.over_limit_at, "errors": sum(r.error is not None for r in runs),
           "error_examples": [r.error for r in runs if r.error][:3], "completion_tokens": tokens,
           "wall_s": round(wall, 2), "tokens_per_s": tokens / wall if wall else None,
           "sent_s": [round(r.sent - t0, 2) for r in runs],
           "first_token_s": [None if r.first is None else round(r.first - t0, 2) for r in runs],
           "exit_code": exit_code, "log": str(server.log)}
    finished = [len(p) + r.completion_tokens for p, r in zip(prompts, runs) if r.error is None]
    if server_name == "ours":
        held, needed = watch.kv_peak
        out |= {"kv_allocated_bytes": held, "kv_needed_bytes": needed,
                "kv_allocated_over_needed": held / needed if needed else None,
                "kv_reading": "adapter_kv_cache_bytes / adapter_kv_cache_needed_bytes at the sample holding the most"}
    else:
        per_token = llama_kv_bytes_per_token(shape_dims(world))
        allocated = llama_kv_allocated(server.log, per_token)
        needed = sum(finished) * per_token
        out |= {"kv_allocated_bytes": allocated and allocated[0], "kv_cells": allocated and allocated[1],
                "kv_needed_bytes": needed,
                "kv_allocated_over_needed": allocated[0] / needed if allocated and needed else None,
                "kv_reading": "its slots' cells at start (its log) / the rows' final tokens, both x q4_0 bytes per token"}
    progress(f"[{label}] done in {wall:.0f} s: peak RSS {fmt_gb(peak)}, KV {fmt_mb(out['kv_allocated_bytes'])} "
             f"allocated / {fmt_mb(out['kv_needed_bytes'])} needed, {out['errors']} errors")
    return out


# ---------------------------------------------------------------- the run

def measure(world: dict, loads: dict, servers: list[str], args, work: Path, checkpoint=lambda result: None) -> dict:
    """Each load on each server in turn (llama-server's binary looked for at its turn: a build may finish
    meanwhile); ``checkpoint(result)`` after each, so a run cut short keeps what it measured."""
    from runtime.engine.tokenizer import DeviceTokenizer

    tokenizer = DeviceTokenizer(world["tokenizer"])
    iface = read_interface(world["engine"])
    dims = shape_dims(world)
    result = {"shape": args.shape, "dims": dims, "threads": args.threads, "max_tokens": args.max_tokens,
              "arrival": args.arrival, "rss_limit_gb": args.rss_limit_gb,
              "ours": {"engine": str(world["engine"]), "weights": iface.weights,
                       "kv_cache": "quantized_pages" if iface.kv_pages else "float", "kv_pages": iface.kv_pages,
                       "kv_bytes_per_token": iface.kv_bytes_per_token, "logit_positions": iface.logit_positions,
                       "ort_memory": DEFAULT_ORT_MEMORY, "prefill_chunk": DEFAULT_PREFILL_CHUNK, "stored_weights": stored_weights(world["engine"])}
                      | our_options(args),
              "loads": {name: {} for name in loads}, "not_run": [f"{load} {name}" for load in loads for name in servers],
              "failed": {}}
    if "llama" in servers:
        result["llama"] = {"weights": "Q4_0", "kv": "q4_0", "flash_attn": "on",
                           "kv_bytes_per_token": llama_kv_bytes_per_token(dims)}
    for load, contexts in loads.items():
        texts = [prompt_text(tokenizer, c - args.max_tokens, i) for i, c in enumerate(contexts)]
        ids = [tokenizer.encode(t) for t in texts]
        for name in servers:
            binary = files = None
            if name == "llama":
                binary, reason = llama_binary(args.llama_server)
                result["llama"] |= {"binary": binary and str(binary), "absent": reason}
                if binary is None:
                    progress(f"[llama {load}] skipped: {reason}")
                    continue
                files = llama_files(world, work, args.llama_cpp_src, args.threads, binary)
            try:
                result["loads"][load][name] = measure_load(name, load, contexts, texts, ids, world, args, work,
                                                           binary, files)
            except RuntimeError as err:  # the server did not start: the other runs go on
                result["failed"][f"{load} {name}"] = str(err)[-2000:]
                progress(f"[{name} {load}] failed: {str(err)[-500:]}")
            else:
                result["not_run"].remove(f"{load} {name}")
            checkpoint(result)
    return result


def llama_binary(given: str | None) -> tuple[Path | None, str | None]:
    try:
        return llama_server_binary(given), None
    except SystemExit as err:
        return None, str(err)


def judge(result: dict) -> dict:
    """The JSON's headline numbers: issue 27's two memory targets, from the numbers as measured."""
    loads = result["loads"]
    mixed = loads.get("mixed", {}).get("ours", {})
    ours, peer = loads.get("8x2048", {}).get("ours", {}), loads.get("8x2048", {}).get("llama", {})
    rss_ratio = ours["peak_rss_bytes"] / peer["peak_rss_bytes"] if ours.get("peak_rss_bytes") and \
        peer.get("peak_rss_bytes") else None
    out = {"kv_allocated_over_needed": mixed.get("kv_allocated_over_needed"),
           "rss_vs_llama_server": rss_ratio,
           "mixed_adapters_vs_one": None, "mixed_adapters_vs_one_note": MIXED_ADAPTERS_NOTE}
    if rss_ratio is None:
        out["rss_vs_llama_server_note"] = ("not measured: " + (result.get("llama", {}).get("absent") or
                                                               "no 8x2048 peak of both servers in this run"))
    out["acceptance"] = {"kv_allocated_over_needed_le_1.1": None if out["kv_allocated_over_needed"] is None
                         else out["kv_allocated_over_needed"] <= 1.1,
                         "rss_at_most_llama_server": None if rss_ratio is None else rss_ratio <= 1.0}
    return out


def fmt_gb(n) -> str:
    return "-" if n is None else f"{n / GB:.2f} GB"


def fmt_mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def print_results(result: dict) -> None:
    d = result["dims"]
    print(f"\nshape {result['shape']} ({d['num_hidden_layers']} layers, hidden {d['hidden_size']}, vocabulary "
          f"{d['vocab_size']}); {result['threads']} threads; {result['max_tokens']} tokens generated per client; "
          f"{result['arrival']} arrival")
    rows = []
    for load, by in result["loads"].items():
        for name, r in by.items():
            ratio = r["kv_allocated_over_needed"]
            limit = f"killed over {result['rss_limit_gb']} GB at {r['over_rss_limit_at_s']:.0f} s" \
                if r["over_rss_limit_at_s"] is not None else ""
            rows.append([load, name, fmt_gb(r["ready_rss_bytes"]), fmt_gb(r["peak_rss_bytes"]), fmt_gb(r["end_rss_bytes"]),
                         fmt_mb(r["kv_allocated_bytes"]), fmt_mb(r["kv_needed_bytes"]),
                         "-" if ratio is None else f"{ratio:.2f}", f"{r['tokens_per_s'] or 0:.1f}", r["errors"], limit])
    print(table(["load", "server", "ready", "peak RSS", "at end", "KV alloc", "KV needed", "ratio", "tok/s", "errors", ""],
                rows, align="<<" + ">" * 8 + "<"))
    print("headline: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in result.items() if k in ("kv_allocated_over_needed", "rss_vs_llama_server",
                                                                       "mixed_adapters_vs_one")))


def figures(p: dict) -> list[Figure]:
    """Per load and server: the peak resident set and the KV bytes allocated over needed; then the headlines."""
    d = p["dims"]
    shape = f"{p['shape']} shape ({d['num_hidden_layers']} layers, hidden {d['hidden_size']}, vocabulary {d['vocab_size']})"
    # a run recorded before ours could serve the float cache has no kv_cache: its cache was 4-bit
    ours = f"ours (int4, {'float' if p.get('ours', {}).get('kv_cache') == 'float' else '4-bit'} KV)"
    rows = []
    for load, by in p["loads"].items():
        for server, r in by.items():
            name = ours if server == "ours" else "llama-server (Q4_0, q4_0 KV)"
            killed = f"; killed over {p['rss_limit_gb']:g} GB" if r["over_rss_limit_at_s"] is not None else ""
            rows.append(Figure(f"{shape}, {load} ({p['arrival']} arrival, {p['max_tokens']} tokens each): {name} peak "
                               "resident set", r["peak_rss_bytes"],
                               f"{fmt_gb(r['peak_rss_bytes'])} (ready {fmt_gb(r['ready_rss_bytes'])}, at the end "
                               f"{fmt_gb(r['end_rss_bytes'])}; {r['errors']} errors{killed})"))
            ratio = r["kv_allocated_over_needed"]
            rows.append(Figure(f"{shape}, {load}: {name} KV bytes allocated / needed", ratio,
                               f"{'-' if ratio is None else f'{ratio:.2f}x'} ({fmt_mb(r['kv_allocated_bytes'])} / "
                               f"{fmt_mb(r['kv_needed_bytes'])})"))
    if p["not_run"]:
        rows.append(Figure("loads not measured (the run cut short, or the server absent)", len(p["not_run"]),
                           ", ".join(f"{run} (failed: {p['failed'][run][-200:]})" if run in p["failed"] else run
                                     for run in p["not_run"])))
    for key in ("kv_allocated_over_needed", "rss_vs_llama_server", "mixed_adapters_vs_one"):
        v = p[key]
        note = p.get(key + "_note", "").removeprefix("not measured: ")  # judge() may have said so already
        rows.append(Figure(key, v, f"{v:.2f}x" if v is not None else f"not measured: {note}".rstrip(": ")))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="0.5b")
    ap.add_argument("--loads", default="mixed,8x2048,1x8192", help=f"of {', '.join(LOADS)}, or NAME=L1/L2/... "
                    "(contexts, one per client)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each client generates (inside its context)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arrival", choices=("staggered", "together"), default="staggered")
    ap.add_argument("--rss-limit-gb", type=float, default=12.0, help="a server whose resident set passes this is killed")
    ap.add_argument("--sample-s", type=float, default=0.25, help="seconds between memory samples")
    ap.add_argument("--report-s", type=float, default=15.0, help="seconds between progress lines")
    ap.add_argument("--workdir", type=Path, default=None, help="where the model is built and kept (default: a "
                    "temporary directory, removed at the end)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default $LLAMA_SERVER, else the "
                    "`make bench-peer-server` build)")
    ap.add_argument("--llama-cpp-src", default=None, help="llama-cpp-python sdist or llama.cpp dir (the converters)")
    ap.add_argument("--ort-memory", choices=ORT_MEMORY_MODES, default=None,
                    help="ours: the device config's ort_memory (runtime.engine.backends.onnxruntime.ORT_MEMORY_MODES; "
                    "default: the server's)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="ours: the device config's prefill_chunk "
                    f"(tokens per prefill forward; default: the server's, {DEFAULT_PREFILL_CHUNK})")
    ap.add_argument("--kv-cache", choices=("quantized_pages", "float"), default="quantized_pages",
                    help="ours: engine.kv_cache of the serving engine (4-bit quantized pages, the served cache, or the "
                         "float cache; each world built in its own folder under --workdir)")
    ap.add_argument("--out", type=Path, default=RESULTS / "device_memory_bench.json")
    args = ap.parse_args(argv)
    servers = args.servers.split(",")
    if unknown := sorted(set(servers) - set(SERVERS)):
        ap.error(f"unknown server(s) {unknown}; known: {', '.join(SERVERS)}")
    loads = parse_loads(args.loads)
    if too_short := [c for contexts in loads.values() for c in contexts if c <= args.max_tokens]:
        ap.error(f"contexts {too_short} leave no prompt beside --max-tokens {args.max_tokens}")
    before = os.getloadavg()[0]

    def report(result: dict) -> dict:
        return {"loadavg_1m_before": before, **result, "loadavg_1m_after": os.getloadavg()[0]} | judge(result)

    with tempfile.TemporaryDirectory(prefix="device-memory-") as tmp:
        work = args.workdir or Path(tmp)
        root = work / f"{args.shape}-{args.kv_cache}"
        world = build_int4_world(args.shape, root, args.threads, args.kv_cache)
        result = report(measure(world, loads, servers, args, root,
                                lambda partial: write_report(args.out, report(partial))))
    print_results(result)
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
