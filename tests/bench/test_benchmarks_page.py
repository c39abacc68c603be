"""docs/benchmarks.md is written from the benchmarks' JSON: every figure with the command, date and load
the benchmark stamped into its JSON (bench.lib.report), the newest run of each benchmark, nothing unstamped, and
the figures each benchmark states, whether its command names its module as bench/ has it now or as it had it
before its kinds (``bench.<name>``)."""

from __future__ import annotations

import json
import subprocess
import sys

from project_testkit import ENV, REPO

from bench.benchmarks_page import render_page


def stamp(command: str, finished: str, start: list[float], end: list[float]) -> dict:
    return {"command": command, "started_at": finished, "finished_at": finished, "loadavg_start": start,
            "loadavg_end": end, "cpus": 2, "machine": "x86_64", "python": "3.11.7"}


def paged_kv_payload(ratio: float) -> dict:
    rows = {f"float32 {layout}": {"kv_allocated_over_needed": ratio * f} for layout, f in (("padded", 2.0), ("paged", 1.0))}
    return {"results": {"rows": rows, "ratios": {"float32": {"paged_over_padded_tokens_per_s": 1.1}}}}


def test_a_benchmark_writes_its_command_dates_and_load_into_its_json(tmp_path):
    script = ("import sys; from bench.lib.report import write_report\n"
              "sys.argv = ['/x/bench/engine/engine_bench.py', '--iters', '3']\n"
              f"write_report({str(tmp_path / 'e.json')!r}, {{'results': {{}}}})\n")
    subprocess.run([sys.executable, "-c", script], check=True, env=ENV, cwd=REPO, capture_output=True)
    recorded = json.loads((tmp_path / "e.json").read_text())["recorded"]
    assert recorded["command"] == "python -m bench.engine.engine_bench --iters 3"
    assert recorded["started_at"] <= recorded["finished_at"] and recorded["finished_at"].endswith("Z")
    assert len(recorded["loadavg_start"]) == len(recorded["loadavg_end"]) == 3 and recorded["cpus"] >= 1


def test_every_figure_names_its_command_date_and_load_from_the_newest_stamped_run(tmp_path):
    (tmp_path / "latest").mkdir()
    older = paged_kv_payload(9.0) | {"recorded": stamp("python -m bench.paged_kv_bench", "2026-11-01T10:00:00Z",
                                                       [0.5, 0.4, 0.3], [0.7, 0.5, 0.3])}
    newer = paged_kv_payload(1.0) | {"recorded": stamp("python -m bench.engine.paged_kv_bench --out $RESULTS/paged_kv_bench.json",
                                                       "2026-12-01T10:00:00Z", [1.25, 1.0, 0.9], [2.5, 1.5, 1.1])}
    (tmp_path / "paged_kv_bench.json").write_text(json.dumps(older))
    (tmp_path / "latest" / "paged_kv_bench.json").write_text(json.dumps(newer))
    # a benchmark that states no figures: the numbers of its JSON by key
    (tmp_path / "weight_quant_quality.json").write_text(json.dumps({"quantized": {"calib_kl": 2959.0}, "recorded": stamp(
        "python -m bench.quality.weight_quant_quality", "2026-12-01T11:00:00Z", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])}))
    (tmp_path / "scale_bench.json").write_text(json.dumps({"flow_seconds": 1350.0}))  # before the stamp existed
    (tmp_path / "latest.json").write_text(json.dumps({"benches": []}))  # run_all's summary, not a benchmark

    page = render_page(tmp_path)
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert "| KV bytes allocated / needed, 8 rows of 128-1024 tokens, float32 paged | 1.000 | `python -m " \
           "bench.engine.paged_kv_bench --out $RESULTS/paged_kv_bench.json` | 2026-12-01T10:00:00Z | 1.25 → 2.50 (1 min; " \
           "15 min 1.10), 2 CPUs |" in rows
    assert "9.000" not in page  # the older run of the same benchmark
    assert "| quantized.calib_kl | 2,959 | `python -m bench.quality.weight_quant_quality` | 2026-12-01T11:00:00Z |" in page
    assert all(row.count(" | ") == 4 and "CPUs |" in row for row in rows)  # every number: command, date, load
    assert "Not quoted (written before benchmarks stamped their command, date and load): `scale_bench.json`" in page
    assert "latest.json" not in page


def test_the_real_model_tables_are_figures_with_their_increase_and_speed_ratio(tmp_path):
    from bench.engine import real_model_speed as speed
    from bench.quality import real_model_quality as rq

    ref = rq.quality_row("ours", "fp32", "float (fp32)", nll=2.0 * 64, kl=0.0, n=64, ref_ppl=None, kv_read="engine")
    q4 = rq.quality_row("llama.cpp", "Q4_0", "q4_0", nll=2.1 * 64, kl=3.2, n=64, ref_ppl=ref["ppl"], kv_read="engine")
    quality = {"documents": ["topic:a", "stdlib:b.py"], "scored_per_document": 32, "context": 1024, "rows": [ref, q4],
               "not_measured": ["ours fp32 K2 (reference)"],
               "recorded": stamp("python -m bench.quality.real_model_quality --docs 2", "2026-12-02T03:00:00Z", [1.0] * 3,
                                 [2.0] * 3)}
    case = lambda ms: {"decode_512": {"median": ms, "p10": ms / 2, "p95": ms * 2}}  # noqa: E731
    rows = {"ours_int4_kv4": case(12.0), "llama_q4_0_kv_q4_0": case(8.0)}
    speed_payload = {"pasts": [512], "rows": rows, "comparisons": speed.compare(rows, ["decode_512"]),
                     "recorded": stamp("python -m bench.engine.real_model_speed", "2026-12-02T04:00:00Z", [3.0] * 3, [4.0] * 3)}
    (tmp_path / "real_model_quality.json").write_text(json.dumps(quality))
    (tmp_path / "real_model_speed.json").write_text(json.dumps(speed_payload))
    page = render_page(tmp_path)
    assert "llama.cpp Q4_0 weights, q4_0 KV (engine): Δ perplexity vs ours fp32 float cache | +10.52 % (ppl 8.166, KL 5.00e-02)" in page
    assert "rows not measured (time budget spent) | ours fp32 K2 (reference)" in page
    assert "ours_int4_kv4 decode ms/token, past 512, batch 1 | 12.0 ms (p10 6.000 ms, p95 24.0 ms)" in page
    assert "ours_int4_kv4 / llama_q4_0_kv_q4_0 decode after 512 median time | 1.50x (slower)" in page
    assert "**not readable**" not in page


def test_a_benchmark_not_run_again_keeps_the_section_the_page_had(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    kv = paged_kv_payload(2.0) | {"recorded": stamp("python -m bench.paged_kv_bench", "2026-11-01T10:00:00Z", [0.5] * 3, [0.5] * 3)}
    (first / "paged_kv_bench.json").write_text(json.dumps(kv))
    (first / "weight_quant_quality.json").write_text(json.dumps({"float_ppl": 100.0, "recorded": stamp(
        "python -m bench.weight_quant_quality", "2026-11-01T11:00:00Z", [1.0] * 3, [1.0] * 3)}))
    (second / "weight_quant_quality.json").write_text(json.dumps({"float_ppl": 250.0, "recorded": stamp(
        "python -m bench.quality.weight_quant_quality", "2026-12-01T11:00:00Z", [1.0] * 3, [1.0] * 3)}))
    (second / "scale_bench.json").write_text(json.dumps({"flow_seconds": 1350.0}))  # unstamped: named at the end
    before = render_page(first)

    page = render_page(second, before)

    kv_section = before[before.index("## paged_kv_bench"):before.index("## weight_quant_quality")]
    assert kv_section in page and "2.000" in kv_section  # kept as it was: bench/results/ is not in git
    assert "| float_ppl | 250 |" in page and "| float_ppl | 100 |" not in page  # the new run replaces the old
    assert page.index("## paged_kv_bench") < page.index("## weight_quant_quality") < page.index("Not quoted")
    assert render_page(second, page) == page  # rewriting it again changes nothing


def test_device_memory_figures_give_each_servers_peak_and_kv_bytes(tmp_path):
    run = {"ready_rss_bytes": 1.0e9, "peak_rss_bytes": 4.5e9, "end_rss_bytes": 4.0e9, "errors": 0,
           "over_rss_limit_at_s": None, "kv_allocated_bytes": 50.0e6, "kv_needed_bytes": 25.0e6,
           "kv_allocated_over_needed": 2.0}
    payload = {"shape": "0.5b", "dims": {"num_hidden_layers": 24, "hidden_size": 896, "vocab_size": 151936},
               "arrival": "staggered", "max_tokens": 64, "rss_limit_gb": 12.0,
               "loads": {"mixed": {"ours": run, "llama": run | {"peak_rss_bytes": 0.9e9}}}, "not_run": ["8x2048 llama"], "failed": {},
               "kv_allocated_over_needed": 2.0, "rss_vs_llama_server": None, "rss_vs_llama_server_note": "no llama",
               "mixed_adapters_vs_one": None, "mixed_adapters_vs_one_note": "mixed-adapter batches not built yet",
               "recorded": stamp("python -m bench.serving.device_memory_bench", "2026-12-02T07:00:00Z", [2.0] * 3, [2.0] * 3)}
    (tmp_path / "device_memory_bench.json").write_text(json.dumps(payload))
    page = render_page(tmp_path)
    assert "mixed (staggered arrival, 64 tokens each): ours (int4, 4-bit KV) peak resident set | 4.50 GB (ready 1.00 GB, " \
           "at the end 4.00 GB; 0 errors)" in page
    assert "llama-server (Q4_0, q4_0 KV) peak resident set | 0.90 GB" in page
    assert "ours (int4, 4-bit KV) KV bytes allocated / needed | 2.00x (50.0 MB / 25.0 MB)" in page
    assert "| mixed_adapters_vs_one | not measured: mixed-adapter batches not built yet |" in page
    assert "| loads not measured (the run cut short, or the server absent) | 8x2048 llama |" in page
    assert "**not readable**" not in page
