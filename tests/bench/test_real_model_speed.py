"""bench/real_model_speed.py: its like-for-like comparison, without llama.cpp (milliseconds)."""

from bench import real_model_speed as speed


def test_each_precision_is_judged_against_its_llama_cpp_counterpart_and_each_of_its_kv_caches():
    case = lambda ms: {"decode_512": {"median": ms, "p10": ms, "p95": ms}}  # noqa: E731
    rows = {"ours_fp32_kv4": case(30.0), "ours_int4_kv4": case(9.0),
            "llama_f16_kv_q4_0": case(20.0), "llama_f16_kv_f16": case(40.0), "llama_q4_0_kv_q4_0": case(10.0)}
    got = {(c["ours"], c["peer"]): (c["ratio"], c["pass"]) for c in speed.compare(rows, [512])}
    assert got == {("ours_fp32_kv4", "llama_f16_kv_q4_0"): (1.5, False), ("ours_fp32_kv4", "llama_f16_kv_f16"): (0.75, True),
                   ("ours_int4_kv4", "llama_q4_0_kv_q4_0"): (0.9, True)}  # int8 and q4_0/f16 absent: not compared
