"""The two-pass measurement of bench/quality/kv_schemes.py, on a tiny random Qwen2 (seconds)."""

import pytest
import torch
from engine_testkit import tiny_qwen  # noqa: F401  (fixture)

from bench.quality.kv_schemes import grid, inject_key_outliers, measure, two_pass_logits
from kernels.kv_spec import KVQuantSpec
from runtime.engine.model import load_backbone
from tasks.kv_stats import collect_kv_stats, key_outlier_ratio, scales_from_stats


@pytest.fixture(scope="module")
def backbone(tiny_qwen):
    torch.manual_seed(0)
    return load_backbone(tiny_qwen)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0))


def _stats(backbone, ids):
    return {pre: collect_kv_stats(backbone, [(ids, torch.ones_like(ids))], pre, progress=False) for pre in (True, False)}


def test_two_pass_with_a_float_cache_equals_one_pass(backbone, ids):
    B, T = ids.shape
    full, _ = backbone(ids, torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.long), backbone.empty_past(B))
    suffix, cache, _ = two_pass_logits(backbone, ids, 20, None, None)
    assert cache is None
    assert torch.allclose(suffix, full[:, 20:], atol=1e-4)


def test_the_suffix_reads_the_quantized_prefix(backbone, ids):
    # given a 2-bit cache, the suffix logits are those computed from the dequantized prefix K/V,
    # not from the float ones: the measurement cannot hide the error of reading the cache
    spec = KVQuantSpec(k_bits=2, v_bits=2, k_granularity="token", v_granularity="token")
    logits, cache, past = two_pass_logits(backbone, ids, 20, spec, None)
    float_logits, _, float_past = two_pass_logits(backbone, ids, 20, None, None)
    assert len(cache) == 20
    assert not torch.allclose(logits, float_logits, atol=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(past, cache.past()))
    assert any(not torch.equal(a, b) for a, b in zip(past, float_past))


def test_measure_reports_every_metric_and_honest_bytes(backbone, ids):
    stats = _stats(backbone, ids)
    configs = {k: v for k, v in grid().items() if k in ("float", "int8", "K4/V4 chosen", "K2/V2 sym per-token")}
    res = measure(backbone, ids, 16, configs,
                  lambda s: None if s is None else scales_from_stats(stats[s.pre_rope_keys], s), 2048)
    assert res["float"]["ppl_increase_pct"] == 0.0 and res["float"]["top1_agreement"] == 1.0
    assert res["float"]["attn_rel_error"] == [0.0, 0.0]
    assert res["int8"]["kl_vs_float"] < res["K2/V2 sym per-token"]["kl_vs_float"]
    assert res["int8"]["attn_rel_error"][0] < res["K4/V4 chosen"]["attn_rel_error"][0] < res["K2/V2 sym per-token"]["attn_rel_error"][0]
    for name in ("int8", "K4/V4 chosen"):
        assert res[name]["stored_bytes_per_token_at_prefix"] == pytest.approx(res[name]["formula_bytes_per_token_at_prefix"])
    assert res["K4/V4 chosen"]["compression_vs_fp16"] > 3.0  # head_dim 16 here: scales weigh more than at 64


def test_injected_outliers_keep_the_float_function_and_show_in_the_statistics(backbone, ids):
    spiked = inject_key_outliers(backbone, pairs=(1, 5))
    B, T = ids.shape
    args = (ids, torch.arange(T).expand(B, T), torch.ones(B, T, dtype=torch.long), backbone.empty_past(B))
    assert torch.allclose(spiked(*args)[0], backbone(*args)[0], atol=1e-3)
    before = key_outlier_ratio(_stats(backbone, ids)[True]["k_channel_amax"])
    after = key_outlier_ratio(_stats(spiked, ids)[True]["k_channel_amax"])
    assert min(after) > 5 * max(before)


def test_decode_like_scoring_puts_the_suffix_in_the_cache_too(backbone, ids):
    from bench.quality.kv_schemes import chunked_logits

    float_two_pass, _, _ = two_pass_logits(backbone, ids, 16, None, None)
    assert torch.allclose(chunked_logits(backbone, ids, 16, None, None, chunk=4), float_two_pass, atol=1e-4)
    spec = KVQuantSpec(k_granularity="token", v_granularity="token", k_symmetric=False, v_symmetric=False)
    quant_two_pass, _, _ = two_pass_logits(backbone, ids, 16, spec, None)
    quant_chunked = chunked_logits(backbone, ids, 16, spec, None, chunk=4)
    assert torch.allclose(quant_chunked[:, :4], quant_two_pass[:, :4], atol=1e-4)  # first chunk: same cache
    assert not torch.allclose(quant_chunked[:, 4:], quant_two_pass[:, 4:], atol=1e-4)  # later chunks read quantized suffix


def test_the_gqa_engine_row_is_scored_through_the_engines_own_module(backbone, ids):
    from bench.quality.kv_schemes import GQA_ROW, gqa_engine_exact

    stats = _stats(backbone, ids)
    spec = grid()[GQA_ROW]
    scales = scales_from_stats(stats[False], spec)
    res = measure(backbone, ids, 16, {"float": None, GQA_ROW: spec}, lambda s: None if s is None else scales, 2048, chunk=4)
    exact = gqa_engine_exact(backbone, ids, 16, scales, res["float"], chunk=4)
    # The same quantizer, read differently: the engine's prompt and suffix also read themselves quantized.
    assert exact["perplexity"] != pytest.approx(res[GQA_ROW]["perplexity"], rel=1e-6)
    assert abs(exact["ppl_increase_pct"] - res[GQA_ROW]["ppl_increase_pct"]) < 5.0
    assert exact["ppl_increase_pct"] != 0.0
    # Every token is appended before attention reads the cache, so how the suffix is chunked changes nothing.
    assert exact["ppl_increase_pct_decode_like"] == pytest.approx(exact["ppl_increase_pct"], abs=1e-6)


def test_one_command_writes_json_table_and_plot(tmp_path):
    import json

    from bench.quality.kv_schemes import main

    out = tmp_path / "kv_schemes.json"
    assert main(["--quick", "--out", str(out), "--cache", str(tmp_path / "models")]) == 0
    report = json.loads(out.read_text())
    text = report["text"]
    assert set(text["results"]) == set(grid())
    assert text["results"]["K4/V4 chosen"]["bytes_per_token"] < 2048 / 3.5  # at the stated context of 2048
    assert len(text["key_outlier_ratio"]["pre_rope"]) == 4
    assert min(text["outlier_case"]["key_outlier_ratio"]["pre_rope"]) > 5
    assert set(report["acceptance"]) >= {"k4v4_ppl_increase_le_0.5pct", "outlier_per_channel_le_half_of_per_token",
                                         "gqa_engine_ppl_increase_le_0.5pct", "gqa_outlier_le_half_of_per_token"}
    assert "exactly as the GQA engine computes it" in out.with_suffix(".md").read_text()
    assert "| K4/V4 chosen |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 10_000
