"""Load test: N concurrent clients against the server while releases are swapped in and out.

    .venv/bin/python -m bench.hotswap_bench [--clients 8] [--before 5] [--during 15] [--after 5] [--swap-every 2]

Uses two packaged releases under ``artifacts/*/package/release`` when there are at least two
(with the engine, tokenizer and public key of ``params.yaml``); otherwise builds a tiny world in a
temporary directory: a random Qwen2 with a trained tokenizer, its compiled engine, two signed
releases (months 2026-10 and 2026-11, different adapters and KV scales).

The server runs in this process (the device's app under uvicorn on a free port, its default
limits: 2 generations decoding, the rest queued); clients are threads with keep-alive connections
sending greedy ``/v1/completions``. Phases: ``before`` (release A only), ``during`` (A and B
swapped every ``swap_every`` s, rollback explicitly allowed: A is older), ``after`` (no swaps).
Swaps are ``AdapterServer.load`` calls in this process, since a rollback is a local act the
network never gets. Reported: swap latency p50/p99 (server side: verify + bind + activate, and the
activation alone; and as the swapping caller saw it, the swap lock included), failed requests,
throughput per phase, and per response whether the
release it names is consistent with what was active when it began: its activation number is not
older than the last swap completed before it was sent, maps to the release it names, and its
text is exactly that release's answer to the prompt (so no step ran on another adapter).
Writes ``bench/results/hotswap_bench.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from bench.report import write_report
from runtime.contract import MANIFEST

RESULTS = Path(__file__).parent / "results" / "hotswap_bench.json"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPTS = [
    "inspect board=PCB-1201 line=L2 part=C7 temp_c=244 defect=lifted lift_um=40 verdict:",
    "inspect board=PCB-3310 line=L1 part=R12 temp_c=251 defect=void void_pct=18 verdict:",
    "inspect board=PCB-0042 line=L3 part=U3 temp_c=239 defect=bridge bridge_um=55 verdict:",
    "inspect board=PCB-7781 line=L1 part=C26 temp_c=258 defect=tombstone tilt_deg=12 verdict:",
]


# ---------------------------------------------------------------- a tiny world (also used by the tests)

def make_tiny_base(out: Path, seed: int = 0, **overrides) -> Path:
    """A random Qwen2 with a byte-level BPE tokenizer trained on inspection rows: a base model
    directory like models/base, small enough to export in seconds."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tasks.base_model import train_tokenizer
    from tasks.data import rulebook, sample_examples

    out = Path(out)
    examples = sample_examples(rulebook("2026-10", 1234, 2), 64, random.Random(0))
    tokenizer = train_tokenizer([ex.prompt + ex.completion for ex in examples], 300, out)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**(TINY | {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                                                   "pad_token_id": tokenizer.pad_token_id} | overrides)))
    with torch.no_grad():  # spread logits so greedy choices are not near-ties
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.08) if p.ndim == 2 or name.endswith("bias") else p.normal_(1.0, 0.1)
    model.save_pretrained(out)
    return out


def make_tiny_adapter(base: Path, out: Path, engine_dir: Path | None = None, r: int = 4, seed: int = 1,
                      targets: tuple[str, ...] = TARGETS) -> Path:
    """A PEFT LoRA adapter with random non-zero weights and the provenance the fine-tune stage writes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from runtime.contract import PROVENANCE
    from runtime.hashing import backbone_hash
    from runtime.interface import read_interface

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2.0 * r, target_modules=list(targets),
                                                  init_lora_weights=False, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.15)
    peft_model.save_pretrained(out)
    prov = {"base_model_hash": backbone_hash(base), "base_model_path": str(base), "params_hash": f"bench-{seed}"}
    if engine_dir is not None:
        prov["engine_interface_hash"] = read_interface(engine_dir).interface_hash
    (Path(out) / PROVENANCE).write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    return Path(out)


def make_tiny_release(root: Path, base: Path, engine_dir: Path, adapter: Path, month: str, signing_key: Path,
                      now: dt.datetime | None = None, gates_passed: bool = True, expiry_days: int = 120) -> Path:
    """Calibrate KV scales for ``adapter``, write eval metrics and a gate report, and package it with
    ``tasks.package.build_release`` into ``root/package``; return the release directory."""
    from kernels.kv_spec import PRE_ROPE_SCHEME
    from tasks.calibrate import calibrate_kv_scales
    from tasks.data import rulebook, sample_examples, write_jsonl
    from tasks.layout import RELEASE_DIR
    from tasks.package import build_release

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    calib = root / "calib.jsonl"
    write_jsonl(calib, sample_examples(rulebook(month, 1234, 2), 16, random.Random(0)))
    calibrate_kv_scales(base, adapter, calib, root / "kv", PRE_ROPE_SCHEME, batch_size=8, engine_dir=engine_dir)
    (root / "metrics.json").write_text(json.dumps({
        "month": month, "base": {"accuracy": 0.5, "accuracy_new": 0.1, "per_rule": {"lifted": 0.5}},
        "adapter": {"accuracy": 0.97, "accuracy_new": 0.96, "accuracy_regression": 0.98, "perplexity": 3.2}}))
    (root / "gates.json").write_text(json.dumps({"passed": gates_passed, "gates": [
        {"name": "accuracy_new", "value": 0.96, "threshold": 0.95, "op": ">=", "passed": gates_passed, "detail": ""}]}))
    out = build_release(adapter, root / "kv", root / "metrics.json", root / "gates.json", engine_dir, base,
                        root / "package", signing_key, month, expiry_days=expiry_days, threads=1, prompt=PROMPTS[0],
                        max_new_tokens=4, now=now)
    return out / RELEASE_DIR


def build_tiny_world(root: Path) -> dict:
    from tasks.compile import compile_engine

    root = Path(root)
    base = make_tiny_base(root / "base")
    engine = root / "engine"
    compile_engine(base, engine, max_rank=8, target_modules=TARGETS, ort_threads=1)
    key = root / "keys" / "release_signing.key"
    t = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    releases = []
    for i, month in enumerate(("2026-10", "2026-11")):
        adapter = make_tiny_adapter(base, root / f"adapter-{month}", engine, r=4 + 4 * i, seed=11 + i)
        releases.append(make_tiny_release(root / f"release-{month}", base, engine, adapter, month, key,
                                          now=t - dt.timedelta(days=1 - i)))
    return {"engine": engine, "tokenizer": base, "trusted_key": key.with_suffix(".pub"), "releases": releases,
            "source": "tiny world built by bench.hotswap_bench"}


def existing_world() -> dict | None:
    """Two packaged releases of the pipeline, if ``make release`` ran for two months."""
    from runtime.signing import public_key_path
    from tasks.config import load_config
    from tasks.layout import PACKAGE, RELEASE_DIR

    if not Path("params.yaml").exists():
        return None
    cfg = load_config("params.yaml")
    found = sorted(cfg.layout.output_dir.glob(f"*/{PACKAGE}/{RELEASE_DIR}/manifest.json"))
    pub = public_key_path(cfg.publish.signing_key)
    if len(found) < 2 or not pub.exists() or not cfg.layout.serving_engine_dir.exists():
        return None
    return {"engine": cfg.layout.serving_engine_dir, "tokenizer": Path(cfg.base_model.path), "trusted_key": pub,
            "releases": [p.parent for p in found[-2:]], "source": "artifacts/*/package/release"}


# ---------------------------------------------------------------- the load test

class Client(threading.Thread):
    def __init__(self, port: int, stop: threading.Event, known: list, max_new_tokens: int, seed: int):
        super().__init__(daemon=True)
        self.port, self.stop, self.known, self.n, self.rng = port, stop, known, max_new_tokens, random.Random(seed)
        self.records: list[dict] = []

    def run(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            prompt = self.rng.choice(PROMPTS)
            known = self.known[0]  # activation of the last swap completed before this request was sent
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": self.n,
                                                                    "temperature": 0}),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                status, body = resp.status, answer(json.loads(resp.read()))
            except Exception as err:  # counted as a failed request
                status, body = 0, {"error": f"{type(err).__name__}: {err}"}
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            self.records.append({"t0": t0, "t1": time.perf_counter(), "status": status, "prompt": prompt,
                                 "known_activation": known, **body})
        conn.close()


def answer(body: dict) -> dict:
    """The release, activation and text of a /v1/completions answer; an error answer as it is."""
    if "choices" not in body:
        return body
    return {"release_id": body["model"], "activation": body["activation"], "text": body["choices"][0]["text"]}


def post(port: int, path: str, payload: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, answer(json.loads(resp.read()))
    conn.close()
    return out


def run_load_test(world: dict, clients: int, before: float, during: float, after: float, swap_every: float,
                  max_new_tokens: int, threads: int) -> dict:
    from runtime.backends.onnxruntime import OrtEngine
    from runtime.latency import percentile
    from runtime.package import PackageError, load_trusted_keys
    from runtime.http_server import BackgroundServer
    from runtime.server import AdapterServer
    from runtime.tokenizer import DeviceTokenizer

    engine = OrtEngine(world["engine"], threads=threads)
    app = AdapterServer(engine, DeviceTokenizer(world["tokenizer"]), load_trusted_keys([world["trusted_key"]]))
    server = BackgroundServer(app).start()
    port = server.port
    release_a, release_b = (str(p) for p in world["releases"])

    # Each release's answer to every prompt, from the same server with only that release active.
    expected, activation_release = {}, {}
    for path in (release_b, release_a):  # ends on A (older), the release the load starts with
        swap = app.load(path, allow_rollback=True)
        activation_release[swap["activation"]] = swap["release_id"]
        for prompt in PROMPTS:
            status, out = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": max_new_tokens,
                                                         "temperature": 0})
            assert status == 200, out
            expected[(swap["release_id"], prompt)] = out["text"]
    distinct = len({v for v in expected.values()})
    known = [app.active.activation]

    stop = threading.Event()
    workers = [Client(port, stop, known, max_new_tokens, seed=i) for i in range(clients)]
    t_start = time.perf_counter()
    for w in workers:
        w.start()
    time.sleep(before)
    t_during = time.perf_counter()
    swaps, targets = [], [release_b, release_a]
    while time.perf_counter() - t_during < during:
        path = targets[len(swaps) % 2]
        t0 = time.perf_counter()
        try:
            status, swap = 200, app.load(path, allow_rollback=True)
        except PackageError as err:
            status, swap = 422, {"reason": err.reason, "error": str(err)}
        client_ms = (time.perf_counter() - t0) * 1e3
        if status == 200:
            activation_release[swap["activation"]] = swap["release_id"]
            known[0] = swap["activation"]
        swaps.append({"status": status, "client_ms": client_ms, **swap})
        time.sleep(max(0.0, swap_every - client_ms / 1e3))
    t_after = time.perf_counter()
    time.sleep(after)
    stop.set()
    for w in workers:
        w.join()
    t_end = time.perf_counter()
    metrics = {"requests_by_release": app.metrics.requests_by_release(),
               "swaps": app.metrics.value("adapter_swaps_total")}
    server.stop()

    records = [r for w in workers for r in w.records]
    ok = [r for r in records if r["status"] == 200]
    failed = [r for r in records if r["status"] != 200]

    def consistent(r):
        return (activation_release.get(r["activation"]) == r["release_id"] and r["activation"] >= r["known_activation"]
                and expected.get((r["release_id"], r["prompt"])) == r["text"])

    def phase(lo, hi):
        done = [r for r in ok if lo <= r["t1"] < hi]
        return {"requests": len(done), "seconds": round(hi - lo, 2), "requests_per_s": round(len(done) / (hi - lo), 2),
                "p50_latency_ms": percentile([(r["t1"] - r["t0"]) * 1e3 for r in done], 50)}

    accepted = [s for s in swaps if s["status"] == 200]
    server_ms = [s["swap_ms"] for s in accepted]
    return {
        "source": world["source"], "clients": clients, "max_new_tokens": max_new_tokens, "ort_threads": threads,
        "swap_every_s": swap_every, "releases": [Path(p).parent.parent.name + "/" + json.loads(
            (Path(p) / MANIFEST).read_text())["release_id"] for p in (release_a, release_b)],
        "distinct_answers": distinct,
        "swaps": {"count": len(swaps), "accepted": len(accepted),
                  "server_ms_p50": percentile(server_ms, 50), "server_ms_p99": percentile(server_ms, 99),
                  "server_ms_max": max(server_ms) if server_ms else None,
                  "activate_ms_p99": percentile([s["activate_ms"] for s in accepted], 99),
                  "client_ms_p50": percentile([s["client_ms"] for s in accepted], 50),
                  "client_ms_p99": percentile([s["client_ms"] for s in accepted], 99)},
        "requests": {"total": len(records), "ok": len(ok), "failed": len(failed),
                     "failed_examples": [r.get("error") for r in failed[:5]],
                     "release_consistent": sum(consistent(r) for r in ok),
                     "release_inconsistent": sum(not consistent(r) for r in ok),
                     "raced_a_swap": sum(r["activation"] > r["known_activation"] for r in ok),
                     "by_release": metrics["requests_by_release"]},
        "throughput": {"before": phase(t_start, t_during), "during": phase(t_during, t_after), "after": phase(t_after, t_end)},
        "server_metrics": metrics,
        "acceptance": {"swap_p99_le_50ms": bool(server_ms) and percentile(server_ms, 99) <= 50.0,
                       "zero_failed_requests": not failed, "clients_ge_8": clients >= 8,
                       "every_response_on_its_release": all(consistent(r) for r in ok), "no_restart": True},
    }


def print_table(r: dict) -> None:
    s, q, t = r["swaps"], r["requests"], r["throughput"]
    rows = [
        ("source", r["source"]),
        ("clients / swaps accepted", f"{r['clients']} / {s['accepted']} of {s['count']}"),
        ("swap ms p50 / p99 / max (verify+bind+activate)", f"{s['server_ms_p50']:.2f} / {s['server_ms_p99']:.2f} / {s['server_ms_max']:.2f}"),
        ("activation alone ms p99", f"{s['activate_ms_p99']:.4f}"),
        ("swap ms as the swapping caller saw it p50 / p99", f"{s['client_ms_p50']:.2f} / {s['client_ms_p99']:.2f}"),
        ("requests ok / failed", f"{q['ok']} / {q['failed']}"),
        ("responses on the release active at start", f"{q['release_consistent']} of {q['ok']} ({q['raced_a_swap']} raced a swap)"),
        *((f"throughput {k} (req/s, p50 ms)", f"{v['requests_per_s']}, {v['p50_latency_ms']:.1f}") for k, v in t.items()),
        ("acceptance", ", ".join(f"{k}={v}" for k, v in r["acceptance"].items())),
    ]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--before", type=float, default=5.0)
    parser.add_argument("--during", type=float, default=15.0)
    parser.add_argument("--after", type=float, default=5.0)
    parser.add_argument("--swap-every", type=float, default=2.0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads of the shared session")
    parser.add_argument("--tiny", action="store_true", help="build the tiny world even if packaged releases exist")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    world = None if args.tiny else existing_world()
    with tempfile.TemporaryDirectory(prefix="hotswap-") as tmp:
        if world is None:
            print("building a tiny world (base, engine, two signed releases)...", flush=True)
            world = build_tiny_world(Path(tmp))
        result = run_load_test(world, args.clients, args.before, args.during, args.after, args.swap_every,
                               args.max_new_tokens, args.threads)
    print_table(result)
    write_report(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
