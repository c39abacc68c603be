"""The KV tiers bench on the tiny shape: prefix sharing off against on and swap against refusal, each through
``python -m runtime serve`` and the openai SDK, read back from the servers' own metrics."""

import json

from bench.serving import kv_tiers_bench as bench


def test_the_bench_measures_prefix_sharing_with_and_without_a_budget_and_swap_on_the_tiny_world_rows_paired(tmp_path):
    out = tmp_path / "kv_tiers.json"
    assert bench.main(["--shape", "tiny", "--workdir", str(tmp_path), "--rounds", "1", "--clients", "3",
                       "--system-tokens", "64", "--question-tokens", "16", "--answer-tokens", "4",
                       "--prefill-chunk", "16", "--swap-clients", "4", "--swap-context", "120", "--swap-answer", "8",
                       "--swap-fits", "2", "--sample-s", "0.005", "--batch-invariant", "--out", str(out)]) == 0
    # (the gauge is sampled every 5 ms: the tiny world's rounds last a few hundred ms, and at the default 50 ms a quiet
    # machine once finished the round without sharing between two samples, leaving its peak unsampled)
    p = json.loads(out.read_text())
    for key in ("prefix_ttft_speedup", "prefix_kv_ratio", "swap_refused", "swap_failed", "swap_tokens_per_s_ratio",
                "outputs_identical"):
        assert key in p, key
    on, off = p["prefix_counters"]["on"], p["prefix_counters"]["off"]
    assert off["hit_tokens_total"] == 0 and on["hit_tokens_total"] >= 3 * 48  # each client read whole chunks of the turn
    assert p["prefix_kv_ratio"] < 1 and p["outputs_identical_alone"] is True
    assert p["batch_invariant"] is True and p["outputs_identical"] is True  # every server paired its rows
    assert (p["swap_refused"], p["swap_failed"]) == (0, 0) and p["swap_runs"]["unbudgeted"]["refused"] == 0
    assert p["swap_budget_mb"] > 0 and p["errors"] == {"off": 0, "on": 0}
    budgeted = p["prefix_budgeted"]  # a KV budget that holds two whole worst cases
    assert budgeted["prefix_budget_mb"] > 0 and budgeted["errors"] == {"off": 0, "on": 0}
    assert budgeted["rows_per_step"]["off"] <= 2  # never more rows than the budget holds whole without sharing

