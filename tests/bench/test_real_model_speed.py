"""bench/engine/real_model_speed.py: its like-for-like comparison (milliseconds), its interleaving with one
llama.cpp context held at a time (milliseconds), and, where the `peer` extra is installed, that rounds
of llama.cpp contexts loaded and closed one at a time decode (about 20 s)."""

from contextlib import contextmanager

import numpy as np

from bench.engine import real_model_speed as speed
from bench.lib.timing import PerRound, interleaved


def test_each_precision_is_judged_against_its_llama_cpp_counterpart_and_each_of_its_kv_caches():
    case = lambda ms: {"decode_512": {"median": ms, "p10": ms, "p95": ms}}  # noqa: E731
    rows = {"ours_fp32_kv4": case(30.0), "ours_int4_kv4": case(9.0),
            "llama_f16_kv_q4_0": case(20.0), "llama_f16_kv_f16": case(40.0), "llama_q4_0_kv_q4_0": case(10.0)}
    got = {(c["ours"], c["peer"]): (c["ratio"], c["pass"]) for c in speed.compare(rows, ["decode_512"])}
    assert got == {("ours_fp32_kv4", "llama_f16_kv_q4_0"): (1.5, False), ("ours_fp32_kv4", "llama_f16_kv_f16"): (0.75, True),
                   ("ours_int4_kv4", "llama_q4_0_kv_q4_0"): (0.9, True)}  # int8 and q4_0/f16 absent: not compared


def test_prefill_is_a_case_of_its_own_compared_like_the_decode_steps():
    keys = speed.case_keys([512, 2048], 256)
    assert keys == ["decode_512", "decode_2048", "prefill_256"] and speed.case_keys([512], 0) == ["decode_512"]
    stats = lambda ms: {"median": ms, "p10": ms, "p95": ms}  # noqa: E731
    rows = {"ours_int8_kv4": {"decode_512": stats(8.0), "prefill_256": stats(300.0)},
            "llama_q8_0_kv_q4_0": {"decode_512": stats(10.0), "prefill_256": stats(200.0)}}
    got = {c["case"]: (c["ratio"], c["pass"]) for c in speed.compare(rows, speed.case_keys([512], 256))}
    assert got == {"decode_512": (0.8, True), "prefill_256": (1.5, False)}
    figures = {f.name: f.text for f in speed.figures({"rows": rows, "comparisons": speed.compare(rows, ["prefill_256"])})}
    assert figures["real model: ours_int8_kv4 prefill of 256 tokens, tokens/s (the last position's logits)"] == \
        "853 tokens/s (300.0 ms)"
    assert figures["real model: ours_int8_kv4 / llama_q8_0_kv_q4_0 prefill of 256 median time"] == "1.50x (slower)"


def test_interleaving_holds_one_per_round_step_open_at_a_time_and_opens_it_for_each_of_its_rounds():
    # given two steps that hold a resource (as a llama.cpp context) and one plain step, in 4 rounds
    held, events = set(), []

    def resource(name):
        @contextmanager
        def opened():
            held.add(name)
            events.append(("open", name))
            try:
                yield lambda: events.append(("call", name, frozenset(held)))
            finally:
                held.discard(name)

        return PerRound(opened)

    steps = {"a": resource("a"), "plain": lambda: events.append(("call", "plain", frozenset(held))), "b": resource("b")}
    stats = interleaved(steps, iters=8, rounds=4, warmup=3, settle=1)
    # then every call of a held step ran with only its own resource open, the plain step with none,
    # each resource was opened once per round, in the order A plain B, and nothing is left open
    calls = [e for e in events if e[0] == "call"]
    assert all(e[2] == ({e[1]} if e[1] != "plain" else set()) for e in calls)
    assert [e[1] for e in events if e[0] == "open"] == ["a", "b"] * 4
    assert sum(e[1] == "a" for e in calls) == 4 * (1 + 2)  # settle + timed per round, no warm-up outside a round
    assert sum(e[1] == "plain" for e in calls) == 3 + 4 * (1 + 2)  # the plain step keeps its warm-up
    assert not held and set(stats) == {"a", "plain", "b"} and all(s["median"] >= 0.0 for s in stats.values())


def test_llama_cpp_cases_load_one_context_per_round_and_decode_the_same_token_each_time(tmp_path, llama_peer):
    # given the tiny backbone as an F32 GGUF with a q4_0 and an f16 KV cache, each a llama_case at past 16
    from bench.lib import llama_cpp_peer as peer
    from bench.lib.backbones import SHAPES, embedded_tokenizer_dir, make_backbone_and_adapter

    llama_cpp, llama_dir = llama_peer

    model_dir, _ = make_backbone_and_adapter(tmp_path, SHAPES["tiny"])
    src = peer.gguf_source_dir(model_dir, embedded_tokenizer_dir(tmp_path), tmp_path / "gguf_src")
    gguf = peer.convert_to_gguf(llama_dir, src, tmp_path / "model-f32.gguf", "f32")
    cases = {kv: speed.llama_case(llama_cpp, gguf, kv, 2, 512, 16, 0) for kv in ("q4_0", "f16")}
    # when each is opened twice, one at a time, and its step called twice per opening
    logits = {kv: [] for kv in cases}
    for _ in range(2):
        for kv, case in cases.items():
            with case.open() as step:
                for _ in range(2):
                    logits[kv].append(np.array(step()))
    # then each call decoded the token after the same past, evaluated in the first opening and restored
    # from its saved KV cells in the second: the same logits every time, and
    # the 4-bit cache moves them off the f16 cache's
    for kv, rows in logits.items():
        assert np.abs(rows[0]).max() > 0.1
        for row in rows[1:]:
            np.testing.assert_allclose(row, rows[0], atol=1e-5, err_msg=kv)
    assert np.abs(logits["q4_0"][0] - logits["f16"][0]).max() > 1e-4
