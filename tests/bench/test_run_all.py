"""The `make bench` report: the figures each benchmark states of its JSON, with the command that produced them.

Sample payloads have the shape each benchmark writes (trimmed to what its figures read); nothing heavy runs.
"""

import json

import pytest

from bench import run_all
from bench.run_all import Bench, build_report, command_text, machine_info, render_markdown, run_bench


def flow_payload():
    runs = [
        {"name": "first", "month": "2026-11", "seconds": 241.5, "returncode": 0, "engine_builds": 1,
         "engine_builds_mlflow": 1, "engine_builds_agree": True, "stages_ran": ["compile", "data", "finetune"]},
        {"name": "rerun", "month": "2026-11", "seconds": 21.0, "returncode": 0, "engine_builds": 0,
         "engine_builds_mlflow": None, "engine_builds_agree": True},
        {"name": "next", "month": "2026-12", "seconds": 180.2, "returncode": 0, "engine_builds": 0,
         "engine_builds_mlflow": 0, "engine_builds_agree": True, "stages_ran": ["data", "finetune"]},
    ]
    return {"runs": runs, "rerun_over_first": 21.0 / 241.5, "engine_builds_per_month": {"2026-11": 1, "2026-12": 0}}


def engine_payload():
    rows = {b: {"decode_128_ms": t, "decode_512_ms": 2 * t, "prefill_128_ms": 10 * t}
            for b, t in (("eager_torch_lora", 1.5), ("eager_hf_peft", 2.0), ("ort_lora_inputs", 0.5), ("ort_merged", 0.45))}
    ratios = {"eager_over_engine_decode_512": 3.0, "hf_over_engine_decode_512": 4.0}
    for k in ("decode_128", "decode_512", "prefill_128"):
        ratios[f"lora_overhead_{k}"], ratios[f"lora_overhead_{k}_p10"] = 0.111, 0.05
    return {"results": {"tiny": {"rows": rows, "ratios": ratios}}}


def paged_kv_payload():
    rows = {f"float32 {layout}": {"kv_allocated_over_needed": ratio} for layout, ratio in (("padded", 2.0), ("paged", 1.0234))}
    return {"results": {"rows": rows, "ratios": {"float32": {"paged_over_padded_tokens_per_s": 1.1}}}}


@pytest.fixture
def records():
    plan = {b.name: b for b in run_all.plan(flow_ready=True)}

    def rec(name, status, payload=None, **extra):
        b = plan[name]
        return {"name": name, "module": b.module, "title": b.title, "command": command_text(b), "mode": b.mode, "seconds": 1.0,
                "json": f"/nonexistent/{name}.json", "status": status, **({"payload": payload} if payload else {}), **extra}

    return [
        rec("flow_bench", "ok", flow_payload()),
        rec("engine_bench", "ok", engine_payload()),
        rec("paged_kv_bench", "ok", paged_kv_payload()),
        rec("hotswap_bench", "failed", reason="exit 1: ConnectionRefusedError"),
        rec("gpu_check", "skipped", reason="gpu_check: cannot run here: TensorRT is not installed"),
    ]


def test_every_figure_row_states_the_command_that_produced_it(records):
    report = build_report(records, {"$RESULTS": "bench/results/latest"}, 600.0, machine_info(0.5))
    rows = {(r["bench"], r["figure"]): r for r in report["figures"]}

    first = rows[("flow_bench", "monthly flow wall time, first run 2026-11")]
    assert first["value"] == 241.5 and first["text"] == "241.5 s"
    assert first["command"] == "python -m bench.flow.flow_bench --workdir $WORK/flow --out $RESULTS/flow_bench.json"
    assert rows[("flow_bench", "engine builds, next month 2026-12")]["value"] == 0
    assert rows[("flow_bench", "unchanged rerun / first run wall time")]["text"] == "8.7 %"
    overhead = rows[("engine_bench", "tiny: LoRA-as-input overhead vs merged, decode past 512 (median; p10)")]
    assert overhead["text"] == "+11.1 % (+5.0 %)" and overhead["command"].startswith("python -m bench.engine.engine_bench ")
    assert rows[("paged_kv_bench", "KV bytes allocated / needed, 8 rows of 128-1024 tokens, float32 paged")]["text"] == "1.023"
    assert rows[("paged_kv_bench", "paged / padded decode tokens/s, 8 rows, float32")]["value"] == 1.1
    assert all(r["command"].startswith(("python -m bench.", "cd $FLOW_PROJECT && python -m bench.")) for r in report["figures"])


def test_a_failed_benchmark_is_a_failed_row_and_fails_the_report_a_skipped_one_does_not(records):
    report = build_report(records, {"$RESULTS": "r"}, 1.0, machine_info(0.5))
    failed = [r for r in report["figures"] if r["bench"] == "hotswap_bench"]
    assert len(failed) == 1 and failed[0]["text"].startswith("**FAILED**: exit 1: ConnectionRefusedError")
    assert failed[0]["command"] == "cd $FLOW_PROJECT && python -m bench.serving.hotswap_bench --out $RESULTS/hotswap_bench.json"
    skipped = [r for r in report["figures"] if r["bench"] == "gpu_check"]
    assert len(skipped) == 1 and "SKIPPED" in skipped[0]["text"]
    assert report["ok"] is False

    without_failure = build_report([r for r in records if r["status"] != "failed"], {"$RESULTS": "r"}, 1.0, machine_info(0.5))
    assert without_failure["ok"] is True


def test_a_payload_without_its_figures_fails_the_benchmark_instead_of_dropping_it(records):
    del records[1]["payload"]["results"]["tiny"]["ratios"]["hf_over_engine_decode_512"]
    report = build_report(records, {"$RESULTS": "r"}, 1.0, machine_info(0.5))
    engine = [r for r in report["figures"] if r["bench"] == "engine_bench"]
    assert len(engine) == 1 and "FAILED" in engine[0]["text"] and "hf_over_engine_decode_512" in engine[0]["text"]
    assert report["ok"] is False


def test_markdown_and_json_hold_every_benchmark_and_the_wall_time(records):
    report = build_report(records, {"$RESULTS": "bench/results/latest"}, 754.0, machine_info(0.5))
    report["plots"] = [("monthly flow wall time and engine builds", "latest_flow.png")]
    md = render_markdown(report)
    assert "12.6 min wall time" in md
    for rec in records:
        assert f"| {rec['name']} | {rec['status']} |" in md
    assert "| flow_bench | monthly flow wall time, unchanged rerun (same month) 2026-11 | 21.0 s | " \
           "`python -m bench.flow.flow_bench --workdir $WORK/flow --out $RESULTS/flow_bench.json` |" in md
    assert "![monthly flow wall time and engine builds](latest_flow.png)" in md
    assert json.loads(json.dumps(report))["figures"] == report["figures"]  # latest.json is plain JSON


def test_a_benchmark_process_that_fails_is_recorded_with_its_exit_code_and_error(tmp_path):
    bench = Bench("bench.engine.no_such_bench", "missing", ("--out", "$RESULTS/missing.json"), "full", 60)
    rec = run_bench(bench, {"$RESULTS": str(tmp_path)})
    assert rec["status"] == "failed" and rec["returncode"] == 1
    assert "No module named bench.engine.no_such_bench" in rec["reason"]
    assert rec["command"] == "python -m bench.engine.no_such_bench --out $RESULTS/missing.json" and "payload" not in rec
