"""The decode-latency gate judges the release, not the machine's load: it reads the serving engine's decode step
over the float engine's, timed beside it (``tasks.stages.evaluate.decode_latency``). A good release passes beside
two CPU-bound processes; an engine whose step takes twice as long is refused, on a quiet machine and beside them."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext

import pytest
from engine_testkit import make_adapter

from tasks.config import EngineConfig, GatesConfig, parse_config
from tasks.gate_rules import evaluation_gates
from tasks.models import load_tokenizer
from tasks.stages.evaluate import decode_latency

PROMPTS = ["inspect board=PCB-0042 line=L3 part=P7 defect=void size=12 verdict:",
           "inspect board=PCB-0107 line=L1 part=P2 defect=crack size=3 verdict:",
           "inspect board=PCB-0555 line=L2 part=P9 defect=bridge size=40 verdict:",
           "inspect board=PCB-0901 line=L4 part=P1 defect=scratch size=7 verdict:"]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tmp_path_factory):
    """(the serving engine with an adapter bound, the float engine with nothing bound): the default profile's
    serving form (paged, adapters stacked) with a float cache, at one thread as the release times them
    (eval.latency_threads). (This 2-layer, 32-wide backbone's quantized-pages step is 3.5x its float step: fixed
    costs of the pages beside almost no arithmetic; the embedded default's is 1.6-1.8x.)"""
    from runtime.engine.adapter import load_adapter
    from runtime.engine.engine import open_engine
    from tasks.stages.compile import compile_profile_engines

    root = tmp_path_factory.mktemp("latency-gate")
    cfg = parse_config({"base_model": {"source": "local", "path": str(tiny_llama_dir)}, "kv": {"enabled": False},
                        "engine": {"dir": str(root / "engine"), "threads": 1, "kv_cache": "float"}})
    compile_profile_engines(cfg)
    serving = open_engine(cfg.layout.serving_engine_dir, threads=1)
    serving.set_adapter(load_adapter(make_adapter(tiny_llama_dir, root / "adapter"), serving.interface))
    reference = open_engine(cfg.engine.dir, threads=1)
    reference.set_adapter(None)
    assert cfg.layout.serving_engine_dir != cfg.engine.dir  # two engines: the paged, stacked one and the float one
    return serving, reference, load_tokenizer(tiny_llama_dir)


class TwiceAsSlowEngine:
    """A test double of a release's engine whose decode step takes twice as long: each forward of the real engine
    is followed by as long again of busy work (CPU-bound, as a slower graph would be)."""

    def __init__(self, engine):
        self.engine = engine

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.engine.forward(*args, **kwargs)
        spent = time.perf_counter() - start
        until = time.perf_counter() + spent
        while time.perf_counter() < until:
            pass
        return out


@contextmanager
def two_cpu_bound_processes():
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)  # both spinning before the first step is timed
        yield
    finally:
        for p in burners:
            p.kill()
            p.wait()


def latency_gate(summary: dict):
    metrics = {"adapter_on_engine": {"decode_latency": summary}, "engine_parity": {"weights": "int8"}}
    return next(g for g in evaluation_gates(metrics, GatesConfig(), None, EngineConfig(), False) if g.name == "decode_step_ratio")


@pytest.mark.parametrize("beside", ["quiet", "two CPU-bound processes"])
def test_a_good_release_passes_and_one_twice_as_slow_is_refused(engines, beside):
    serving, reference, tokenizer = engines
    with two_cpu_bound_processes() if beside != "quiet" else nullcontext():
        good, _ = decode_latency(serving, reference, tokenizer, PROMPTS, steps=16)
        slow, _ = decode_latency(TwiceAsSlowEngine(serving), reference, tokenizer, PROMPTS, steps=16)

    assert latency_gate(good).passed, good
    assert not latency_gate(slow).passed, slow
    # The ratio sees the 2x. Quiet, within 35%; beside the two processes good and slow are timed one after the other,
    # so the load each meets differs: CI read 2 x 2.09 as 6.69 (3.2x) there, so only the lower side is held under load.
    if beside == "quiet":
        assert slow["step_ratio"] == pytest.approx(2 * good["step_ratio"], rel=0.35)
    else:
        assert slow["step_ratio"] > 1.5 * good["step_ratio"], (good, slow)
    assert good["steps"] == slow["steps"] == 64
