"""What a fine-tune costs the base, knob by knob (issue 40, item 2): held-out perplexity of base + adapter over the
base's (the forgetting gate's measure, ``tasks.gate_rules.forgetting_pct``) beside test accuracy, for the profile's
own settings and for one change at a time.

    python -m bench.quality.forgetting_knobs --params examples/smollm2.yaml
        [--knobs "profile;train.lr=0.001;train.steps=8;lora.dropout=0.1;train.rehearsal_share=0.25"] [--work DIR]
        [--out bench/results/forgetting_knobs.json]

A knob is the profile as it is (``profile``) or dotted settings of it joined by ``,`` (``train.lr=0.001,train.steps=8``;
values read as YAML), checked like ``params.yaml``. Each is trained with the finetune stage's own function on the
profile's month as its data stage wrote it (``layout.data_dir``: run the flow, or its data stage, first) into
``--work``/<knob>, then scored in PyTorch in fp32 as the evaluate stage scores it (``tasks.stages.evaluate.perplexity``
on the held-out text, greedy exact-match accuracy on the test rows). The base is scored once. Not in CI nor in
``make bench``: each knob is a fine-tune (about 1.5 min on 2 cores for the real-model profile). Rehearsal
(``train.rehearsal_share``) draws on the month's copy of the profile's ``data.rehearsal_text``: the data stage must
have run with it set.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from bench.lib.report import RESULTS, Figure, progress, write_report
from bench.lib.tables import table
from tasks.config import ReleaseConfig, load_config, with_settings
from tasks.records import HELDOUT_TEXT, read_jsonl, read_text_corpus

PROFILE = "profile"


def parse_knob(knob: str) -> dict:
    """``train.lr=0.001,lora.dropout=0.1`` -> {"train.lr": 0.001, "lora.dropout": 0.1}; ``profile`` -> {}."""
    if knob == PROFILE:
        return {}
    settings = {}
    for part in knob.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--knobs: {part!r} is not KEY=VALUE (e.g. train.lr=0.001)")
        settings[key.strip()] = yaml.safe_load(value)
    return settings


def score(model, tokenizer, test, texts, cfg: ReleaseConfig) -> dict:
    from tasks.scoring import accuracy_report, greedy_completions
    from tasks.stages.evaluate import perplexity

    predictions = greedy_completions(model, tokenizer, [ex.prompt for ex in test], cfg.eval.max_new_tokens,
                                     cfg.eval.batch_size, desc="greedy decode")
    return {"accuracy": accuracy_report(test, predictions)["accuracy"],
            "perplexity": perplexity(model, tokenizer, texts, cfg.eval.batch_size)}


def run(cfg: ReleaseConfig, knobs: list[str], work: Path) -> dict:
    import torch
    from peft import PeftModel

    from tasks.gate_rules import forgetting_pct
    from tasks.models import load_base_model
    from tasks.stages.finetune import finetune

    data_dir = cfg.layout.data_dir
    if not (data_dir / "train.jsonl").is_file():
        raise SystemExit(f"{data_dir}: no train.jsonl: run the profile's flow (or its data stage) first")
    test = read_jsonl(data_dir / "test.jsonl")
    texts = read_text_corpus(data_dir / HELDOUT_TEXT)
    base_dir = Path(cfg.base_model.path)
    model, tokenizer = load_base_model(base_dir)
    with torch.no_grad():
        base = score(model, tokenizer, test, texts, cfg)
    progress(f"base: accuracy {base['accuracy']:.3f}, held-out perplexity {base['perplexity']:.3f}")
    rows = []
    for knob in knobs:
        knob_cfg = with_settings(cfg, parse_knob(knob), f"--knobs {knob}")
        progress(f"[{knob}] fine-tune: {knob_cfg.train.steps} steps, lr {knob_cfg.train.lr}, "
                 f"dropout {knob_cfg.lora.dropout}, rehearsal {knob_cfg.train.rehearsal_rows} of "
                 f"{knob_cfg.train.batch_size} rows ...")
        out = work / knob.replace("/", "_").replace(",", "+")
        adapter = finetune(base_dir, data_dir, out, knob_cfg.lora, knob_cfg.train, "forgetting-knobs")
        adapted = PeftModel.from_pretrained(model, adapter)
        adapted.eval()
        with torch.no_grad():
            scored = score(adapted, tokenizer, test, texts, knob_cfg)
        model = adapted.unload()  # the base again, for the next knob
        forgetting = forgetting_pct({"base": base, "adapter": scored})
        rows.append({"knob": knob, "settings": parse_knob(knob), **scored, "forgetting_pct": forgetting,
                     "gate_passes": forgetting <= cfg.gates.max_forgetting_pct})
        progress(f"[{knob}] accuracy {scored['accuracy']:.3f}, held-out perplexity {scored['perplexity']:.3f} "
                 f"({forgetting:+.2f}%)")
    return {"base": base, "rows": rows, "max_forgetting_pct": cfg.gates.max_forgetting_pct,
            "heldout_documents": len(texts), "test_rows": len(test)}


def figures(payload: dict) -> list[Figure]:
    """Per knob: the held-out perplexity increase over the base, with the test accuracy beside it."""
    return [Figure(f"forgetting, {row['knob']}: held-out perplexity of base + adapter over the base's",
                   row["forgetting_pct"], f"{row['forgetting_pct']:+.2f}% (accuracy {row['accuracy']:.3f})")
            for row in payload["results"]["rows"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="held-out perplexity and accuracy of the profile's fine-tune, knob by knob")
    ap.add_argument("--params", type=Path, required=True, help="the profile (its month already written by its flow)")
    ap.add_argument("--knobs", default=f"{PROFILE};train.lr=0.001;train.steps=8;lora.dropout=0.1;train.rehearsal_share=0.25",
                    help="';'-separated knobs: 'profile', or KEY=VALUE[,KEY=VALUE...] overrides of the profile")
    ap.add_argument("--work", type=Path, default=Path("forgetting-knobs"), help="where each knob's adapter is written")
    ap.add_argument("--out", type=Path, default=RESULTS / "forgetting_knobs.json")
    args = ap.parse_args(argv)
    cfg = load_config(args.params)
    knobs = [k.strip() for k in args.knobs.split(";") if k.strip()]
    for knob in knobs:
        with_settings(cfg, parse_knob(knob), f"--knobs {knob}")  # every knob checked before the first fine-tune
    load_before = os.getloadavg()[0]
    results = run(cfg, knobs, args.work)
    base = results["base"]
    print(f"\nbase: accuracy {base['accuracy']:.3f}, held-out perplexity {base['perplexity']:.3f} "
          f"({results['heldout_documents']} documents, {results['test_rows']} test rows)")
    print(table(["knob", "accuracy", "held-out ppl", "vs base", f"gate <= {results['max_forgetting_pct']}%"],
                ([r["knob"], f"{r['accuracy']:.3f}", f"{r['perplexity']:.3f}", f"{r['forgetting_pct']:+.2f}%",
                  "pass" if r["gate_passes"] else "REFUSED"] for r in results["rows"])))
    write_report(args.out, {"params": str(args.params), "loadavg_1m_before": load_before, "results": results,
                            "loadavg_1m_after": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
