"""Release notes: what a person reads about one month's candidate, published or refused.

A published release's notes lie in the registry beside it (``releases/<month>.RELEASE_NOTES.md``,
``tasks/release/registry.py``) and in the flow's summary artifact; a refused candidate's are in the summary.
Everything comes from the stage outputs, the gate report and the run's provenance; nothing is measured here.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from runtime.release.contract import MANIFEST
from tasks.config import ReleaseConfig
from tasks.gate_rules import failed_reason, forgetting_pct, kv_size_vs_fp16, scored_metrics
from tasks.inspection import RULEBOOK

COMPARED = (("accuracy_new", "accuracy, changed rules"), ("accuracy_regression", "accuracy, unchanged rules"),
            ("accuracy", "accuracy, all"))


def describe_trigger(flow_run, ui_url: str | None) -> dict:
    """Who or what started the flow run (a ``prefect.client.schemas.objects.FlowRun``), and where to see it."""
    if flow_run is None:
        return {"by": "no Prefect flow run", "flow_run": None, "url": None}
    if flow_run.auto_scheduled:
        by = "the deployment's schedule"
    elif flow_run.created_by is not None:
        by = f"{flow_run.created_by.display_value} ({flow_run.created_by.type.lower()}), by hand"
    elif flow_run.deployment_id is not None:
        by = "a person: a run of the deployment created in the Prefect UI or through its API"
    else:
        by = "a person: `make release` / `python -m flows.monthly_release`"
    # Without a UI (ephemeral Prefect: `make release`) Prefect builds the URL from an unset base: "None/flow-runs/...".
    url = ui_url if ui_url and ui_url.startswith(("http://", "https://")) else None
    return {"by": by, "flow_run": f"{flow_run.name} ({flow_run.id})", "url": url}


def _data_hash(root: Path) -> str | None:
    lock = Path(root) / "dvc.lock"
    if not lock.exists():
        return None
    outs = (yaml.safe_load(lock.read_text()).get("stages", {}).get("data") or {}).get("outs") or []
    return outs[0].get("md5") if outs else None


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def rule_changes(this_month: Path, champion_month: Path) -> list[str] | None:
    """What each rule changed between two months' ``rulebook.json`` (``tasks/stages/data.py``), e.g.
    ``shift: threshold 40 -> 55``; None when either month has no rule book (a user's own rows)."""
    books = [Path(d) / RULEBOOK for d in (champion_month, this_month)]
    if not all(b.exists() for b in books):
        return None
    before, after = (json.loads(b.read_text())["rules"] for b in books)
    changes = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name, {}), after.get(name, {})
        fields = [f"{k} {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if fields:
            changes.append(f"{name}: {', '.join(fields)}")
    return changes


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _lost(drop: float) -> str:
    """An accuracy drop (fraction) as signed points gained; + 0.0 turns -0.0 into 0.0."""
    return f"{-100 * drop + 0.0:+.2f} points"


def champion_table(scored: dict, champion: dict | None) -> list[str]:
    if champion is None:
        return ["No champion before this one: it is the first release, compared with no earlier month."]
    lines = [f"| metric | this candidate | champion {champion['month']} | change |", "|---|---|---|---|"]
    for key, label in COMPARED:
        ours, theirs = scored.get(key), champion.get(key)
        change = "n/a" if ours is None or theirs is None else f"{100 * (ours - theirs) + 0.0:+.1f} points"
        lines.append(f"| {label} | {_pct(ours)} | {_pct(theirs)} | {change} |")
    return lines


def render_release_notes(cfg: ReleaseConfig, root: Path, report: dict, outcome: str, trigger: dict,
                         mlflow_run: str | None, git_revision: str) -> str:
    """The notes of this month's candidate; ``outcome`` says what became of it (published, refused, dry run)."""
    layout = cfg.layout
    metrics = _read(layout.metrics_file)
    scored = scored_metrics(metrics)
    manifest_id = _read(layout.package_release_dir / MANIFEST).get("release_id")
    title = f"# Release notes {cfg.data.month}" + (f": {manifest_id}" if manifest_id else "")
    lines = [title, "", f"**{outcome}**", ""]
    if not report["passed"]:
        lines += [f"Refused by the gates: {failed_reason(report)}.", ""]

    lines += ["## What changed", ""]
    changed = metrics.get("changed_rules")
    if changed:
        lines.append(f"- Rules changed since the base model's rule book ({cfg.base_model.trained_through}): "
                     f"{', '.join(changed)}.")
    elif changed is not None:
        lines.append("- No rule is marked changed in the test rows: accuracy is gated overall.")
    champion = report.get("champion")
    if champion is not None:
        changes = rule_changes(layout.data_dir, layout.data_dir.parent / champion["month"])
        if changes is not None:
            lines.append(f"- Rules changed since the champion ({champion['month']}): "
                         + ("; ".join(changes) if changes else "none") + ".")
    source = f"your rows from `{cfg.data.jsonl_dir}`" if cfg.data.jsonl_dir else f"the embedded generator (seed {cfg.data.seed})"
    data_hash = _data_hash(root)
    lines.append(f"- Data: {source}, {metrics.get('adapter', {}).get('count', 'n/a')} test rows"
                 + (f"; `{layout.data_dir}` md5 {data_hash} (dvc.lock)." if data_hash else "."))

    lines += ["", "## Against the champion", ""] + champion_table(scored, champion)
    forgetting = forgetting_pct(metrics)
    if forgetting is not None:
        lines += ["", "## What the adapter costs the base", "",
                  f"Held-out perplexity {metrics['base']['perplexity']:.3f} for the base, "
                  f"{metrics['adapter']['perplexity']:.3f} with the adapter: {forgetting:+.2f}% "
                  f"(gate: <= {cfg.gates.max_forgetting_pct:+.1f}%)."]

    lines += ["", "## Quantization", ""]
    kv = metrics.get("kv_cache")
    if kv:
        on_engine = kv.get("on_engine", {})
        spec = next(row["config"] for row in kv["grid"] if row["config"].startswith("release"))
        lines.append(f"- KV cache, {spec}: accuracy {_lost(kv['accuracy_drop'])}, "
                     f"held-out perplexity {kv['ppl_increase_pct']:+.2f}% against the float cache"
                     + (f" (on the engine: {_lost(on_engine['accuracy_drop'])}, {on_engine['ppl_increase_pct']:+.2f}%)"
                        if on_engine else "")
                     + f"; {kv['bytes_per_token']:,.0f} bytes per token, {kv_size_vs_fp16(kv)}.")
        widths = kv.get("layer_widths")
        if widths:
            wider = [f"{i} K{w['k_bits']}/V{w['v_bits']}" for i, w in widths["layers"].items()
                     if [w["k_bits"], w["v_bits"]] != [kv["spec"]["k_bits"], kv["spec"]["v_bits"]]]
            lines.append(f"  Widths per layer calibrated on {widths['tokens']:,} tokens of real text, KL budget "
                         f"{widths['budget']:.2e} (each layer's keys and values {widths['share']:.2e} alone; summed "
                         f"{widths['kl_sum']:.2e}): wider in layers {', '.join(wider) or 'none'}.")
    else:
        lines.append("- KV cache: float (not quantized).")
    weights = metrics.get("weights_gate")
    if weights:
        drops = ", ".join(f"{k} {_lost(v)}" for k, v in weights["drops"].items())
        lines.append(f"- Weights {weights['weights']}: {drops} against the float adapter (limit {100 * weights['max_drop']:.2f})"
                     + (f"; perplexity x{weights['perplexity_ratio']:.4f}." if weights.get("perplexity_ratio") else "."))
        if weights.get("mixed"):
            mix = weights["mixed"]
            parts = ", ".join(f"{n} {option}" for option, n in mix["options"].items() if n)
            lines.append(f"  Stored at {mix['bits_per_weight']:.2f} bits per weight (budget {mix['budget_bits']}): "
                         f"parts {parts}.")
    else:
        lines.append(f"- Weights: {cfg.engine.weights} (not quantized).")

    latency = scored.get("decode_latency")
    if latency:
        lines += ["", "## Decode latency", "",
                  f"One decode step on the {cfg.engine.backend} engine, batch 1, adapter bound, "
                  f"{latency['threads']} thread(s): p50 {latency['p50_ms']:.2f} ms, "
                  f"p95 {latency['p95_ms']:.2f} ms over {latency['steps']} steps (1-minute load average "
                  f"{latency['loadavg_1m'][0]:.1f} -> {latency['loadavg_1m'][1]:.1f}); "
                  f"10th percentiles {latency['p10_ms']:.2f} ms against {latency['reference_p10_ms']:.2f} ms for the float "
                  f"engine's step timed beside it, {latency['step_ratio']:.2f}x "
                  f"(gate: <= {cfg.gates.max_decode_step_ratio}x)."]
    check = _read(layout.package_check_file)
    if check:
        lines += ["", "## Package", "",
                  f"{check['package_bytes']:,} bytes, {check['pct_of_base']}% of the base model's {check['base_bytes']:,} bytes."]

    lines += ["", "## Provenance", "", f"- Triggered by {trigger['by']}"
              + (f"; flow run {trigger['flow_run']}" if trigger.get("flow_run") else "")
              + (f": {trigger['url']}" if trigger.get("url") else "") + "."]
    lines.append(f"- MLflow run `{mlflow_run}` in `{cfg.publish.tracking_uri}`." if mlflow_run else "- MLflow: not recorded.")
    lines.append(f"- Pipeline git revision `{git_revision}`.")
    return "\n".join(lines) + "\n"
