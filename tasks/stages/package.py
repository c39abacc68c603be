"""The package stage: the signed, adapter-only release a device installs.

Only a candidate whose gates passed is packaged (``gates/gates.json`` missing or failed:
refused, exit 2). The stage writes ``artifacts/<month>/package/``:

  release/          the release directory (format: ``runtime/release/contract.py``): the PEFT files
                    unchanged, provenance, ``manifest.json`` (sorted keys) and
                    ``manifest.sig`` (Ed25519 over the manifest bytes)
  release.tar.gz    the same files, reproducible archive
  check.json        post-package checks for the gates: size against the base, the device's own
                    verification, and one generation through the device's verify + load path
                    (with how many of the manifest's probes it passes, run as a device runs them)

The manifest carries health probes (``runtime.serve.health``): the first PROBE_COUNT test rows of the
evaluation's ``predictions.jsonl`` that the serving engine answered right, each with the test
split's answer as the expected one; a device runs them after each swap and reverts on a mismatch.

The signing key is ``publish.signing_key`` (PEM) or the file named by the environment variable
``RELEASE_SIGNING_KEY``; when neither exists the key is created at ``publish.signing_key``
(mode 0600) with its public half beside it (``.pub``, PEM), the file devices are given to trust.

    python -m tasks.stages.package --params params.yaml
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from runtime.engine.adapter_config import ADAPTER_FILES, PROVENANCE, read_adapter_config
from runtime.engine.hashing import sha256_file
from runtime.engine.tokenizer import ChatPrompt, DeviceTokenizer
from runtime.release.contract import DEFAULT_PRODUCT
from tasks.artifacts import atomic_output_dir, write_json
from tasks.cli import stage_main
from tasks.config import ReleaseConfig, StageError
from tasks.layout import CHECK_FILE, PREDICTIONS_FILE, RELEASE_DIR
from tasks.provenance import git_revision
from tasks.records import DataError, is_chat, parse_row

SIGNING_KEY_ENV = "RELEASE_SIGNING_KEY"
TARBALL = "release.tar.gz"
FALLBACK_PROMPT = "inspect board=PCB-1000 line=L1 part=R1 temp_c=240 defect=bridge bridge_um=10 verdict:"
PROBE_COUNT = 4  # a few seconds of greedy decode on a device, enough to catch a release that is not itself there


class PackageRefused(StageError):
    """A candidate that must not be packaged (gates missing or failed, inputs missing or stale)."""


# ---------------------------------------------------------------- inputs

def read_gates(path: Path) -> dict:
    """The gate report; refuse a missing, malformed or failed one, naming the failed gates."""
    path = Path(path)
    if not path.exists():
        raise PackageRefused(f"{path} is missing: the gates stage must pass before a release is packaged")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PackageRefused(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(report, dict) or not isinstance(report.get("passed"), bool) or not isinstance(report.get("gates"), list):
        raise PackageRefused(f"{path}: expected {{\"passed\": bool, \"gates\": [...]}}")
    for i, gate in enumerate(report["gates"]):
        if not isinstance(gate, dict) or not isinstance(gate.get("name"), str) or not isinstance(gate.get("passed"), bool):
            raise PackageRefused(f"{path}: gates[{i}] needs a string name and a boolean passed")
    failed = [g for g in report["gates"] if not g["passed"]]
    if not report["passed"] or failed:
        detail = ", ".join(f"{g['name']} ({g.get('value')} {g.get('op', '')} {g.get('threshold')})" for g in failed)
        raise PackageRefused(f"{path}: gates did not pass{': ' + detail if detail else ''}; nothing is packaged")
    return report


def select_probes(predictions: Path, max_tokens: int, count: int = PROBE_COUNT) -> list[dict]:
    """The manifest's probes: the first ``count`` test rows whose answer on the serving engine
    (``adapter_on_engine``) was the test split's (whitespace-trimmed), so a device reproduces it."""
    predictions = Path(predictions)
    if not predictions.exists():
        raise PackageRefused(f"{predictions} is missing: run python -m tasks.stages.evaluate first")
    probes = []
    with open(predictions) as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                ex = parse_row(predictions, lineno, line)
                on_engine = json.loads(line).get("adapter_on_engine")
            except DataError as err:
                raise PackageRefused(f"not a prediction row: {err}") from None
            if isinstance(on_engine, str) and on_engine.strip() == ex.completion.strip():
                # a chat row's probe is its chat, rendered on the device as /v1/chat/completions renders it
                prompt = {"messages": list(ex.prompt.messages)} if is_chat(ex) else {"prompt": ex.prompt}
                probes.append({**prompt, "expected": ex.completion, "max_tokens": max_tokens})
            if len(probes) == count:
                break
    return probes


def gate_verdicts(report: dict) -> dict:
    verdicts = {}
    for gate in report["gates"]:
        name = gate["name"]
        while name in verdicts:  # a repeated gate name keeps every verdict
            name += "_"
        verdicts[name] = {k: gate.get(k) for k in ("passed", "value", "threshold", "op")}
    return {"passed": report["passed"], "verdicts": verdicts}


def key_metrics(metrics: dict) -> dict:
    """The numbers worth carrying to a device: every numeric scalar at the top level and one level
    down (accuracy, accuracy_new, accuracy_regression, perplexity per model); per-rule tables stay out."""
    def scalar(v):  # NaN/inf are left out: the manifest is strict JSON
        return isinstance(v, (int, float, bool)) and v == v and v not in (float("inf"), float("-inf"))

    out = {}
    for key, value in sorted(metrics.items()):
        if scalar(value):
            out[key] = value
        elif isinstance(value, dict):
            inner = {k: v for k, v in sorted(value.items()) if scalar(v)}
            if inner:
                out[key] = inner
    return out


def resolve_signing_key(setting: str | Path):
    """(private key, path of its public key). ``RELEASE_SIGNING_KEY`` wins over the setting; a
    missing key at the setting's path is created. A ``.pub`` that is not this key's is refused."""
    from runtime.release.signing import generate_key, load_private_key, public_key_path, public_pem

    env = os.environ.get(SIGNING_KEY_ENV)
    path = Path(env) if env else Path(setting)
    if env and not path.exists():
        raise PackageRefused(f"{SIGNING_KEY_ENV}={env}: no such key file")
    if path.exists():
        key = load_private_key(path)
    else:
        key = generate_key(path)
        print(f"created signing key {path} (public key {public_key_path(path)}: give it to the devices)", file=sys.stderr)
    pub_path, pem = public_key_path(path), public_pem(key.public_key())
    if pub_path.exists() and pub_path.read_bytes() != pem:
        raise PackageRefused(f"{pub_path} is not the public half of {path}; remove it or restore the matching key")
    if not pub_path.exists():
        pub_path.write_bytes(pem)
    return key, pub_path


# ---------------------------------------------------------------- the package

def build_manifest(release_dir: Path, month: str, created: dt.datetime, expiry_days: int, iface, metrics: dict,
                   gates: dict, key_id: str, tokenizer, pipeline: dict, probes: list[dict],
                   product: str = DEFAULT_PRODUCT) -> dict:
    from runtime.release.contract import FORMAT, FORMAT_VERSION, format_time, make_release_id

    provenance = json.loads((release_dir / PROVENANCE).read_text())
    acfg = read_adapter_config(release_dir)
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(release_dir.iterdir())}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "release_id": make_release_id(month, created),
        "month": month,
        "product": product,
        "created_at": format_time(created),
        "expires_at": format_time(created + dt.timedelta(days=expiry_days)),
        "base_model_hash": provenance["base_model_hash"],
        # The LoRA contract: the float engine's hash, which the paged, stacked and quantized-pages engines of the
        # same backbone also accept (their float_interface_hash).
        "engine": {
            "interface_hash": iface.lora_contract_hash,
            "interface_version": iface.version,
            "max_rank": iface.max_rank,
            "target_modules": list(iface.target_modules),
        },
        "adapter": {"r": acfg.r, "lora_alpha": acfg.lora_alpha, "target_modules": list(acfg.target_modules)},
        "kv_format": None,  # no KV scales: quantized pages seal their own on the device (runtime.release.verify)
        "tokenizer_sha256": tokenizer.sha256,
        "stop_token_ids": list(tokenizer.stop_ids),
        "metrics": metrics,
        "gates": gates,
        "files": files,
        "pipeline": pipeline | {"params_hash": provenance.get("params_hash")},
        "probes": probes,
        "signing_key_id": key_id,
    }


def _check_inputs(adapter_dir: Path, iface) -> None:
    problems = [f"{adapter_dir / n} is missing" for n in ADAPTER_FILES if not (adapter_dir / n).exists()]
    if problems:
        raise PackageRefused("; ".join(problems))
    prov = json.loads((adapter_dir / PROVENANCE).read_text())
    if prov.get("base_model_hash") != iface.backbone_hash:
        raise PackageRefused(f"{adapter_dir}: adapter is for backbone {str(prov.get('base_model_hash'))[:12]}, the "
                             f"engine runs {iface.backbone_hash[:12]}; recompile or fine-tune again")


def load_and_query(release_dir: Path, pub_path: Path, engine_dir: Path, backend: str, threads: int,
                   tokenizer_dir: Path, prompt: str | ChatPrompt, max_new_tokens: int) -> dict:
    """Open the serving engine and answer one prompt (a chat through the template, as
    /v1/chat/completions would) through the device's verify + load path."""
    from runtime.engine.engine import open_engine
    from runtime.engine.generate import greedy_generate
    from runtime.release.verify import bind_release, load_trusted_keys, release_probes, verify_release

    start = time.perf_counter()
    engine = open_engine(engine_dir, backend, threads=threads)
    tok = DeviceTokenizer(tokenizer_dir)
    verified = verify_release(release_dir, load_trusted_keys([pub_path]), engine.interface, tokenizer_sha256=tok.sha256,
                              stop_token_ids=tok.stop_ids)
    bind_release(engine, verified)
    chat = isinstance(prompt, ChatPrompt)
    prompt_ids = tok.encode_chat(list(prompt.messages)) if chat else tok.encode(prompt)
    ids = greedy_generate(engine, [prompt_ids], max_new_tokens, tok.stop_ids, tok.pad_id)[0]
    probes = release_probes(verified.manifest)  # one at a time, as a device runs them after a swap
    passed = sum(tok.decode(greedy_generate(engine, [p.encode(tok)], p.max_tokens, tok.stop_ids, tok.pad_id)[0])
                 .strip() == p.expected.strip() for p in probes)
    return {"ok": True, "prompt": list(prompt.messages) if chat else prompt, "output": tok.decode(ids),
            "release_id": verified.release_id,
            "backend": backend, "probes": len(probes), "probes_passed": passed,
            "seconds": round(time.perf_counter() - start, 3)}


def build_release(
    adapter_dir: Path,
    metrics_path: Path,
    gates_path: Path,
    engine_dir: Path,
    base_dir: Path,
    out_dir: Path,
    signing_key: str | Path,
    month: str,
    expiry_days: int = 120,
    backend: str = "onnxruntime",
    threads: int = 2,
    prompt: str | ChatPrompt = FALLBACK_PROMPT,
    max_new_tokens: int = 8,
    now: dt.datetime | None = None,
    repo_dir: Path | None = None,
    probes: Sequence[dict] = (),
    product: str = DEFAULT_PRODUCT,
) -> Path:
    """Package, sign, archive and check one release into ``out_dir`` (replaced as a whole); return it."""
    from runtime.engine.interface import read_interface
    from runtime.release.contract import MANIFEST, SIGNATURE, manifest_bytes
    from runtime.release.signing import key_id, sign
    from runtime.release.verify import load_trusted_keys, verify_release, write_tarball

    adapter_dir, base_dir, engine_dir = Path(adapter_dir), Path(base_dir), Path(engine_dir)
    gates = gate_verdicts(read_gates(gates_path))
    if not Path(metrics_path).exists():
        raise PackageRefused(f"{metrics_path} is missing: run python -m tasks.stages.evaluate first")
    metrics = key_metrics(json.loads(Path(metrics_path).read_text()))
    iface = read_interface(engine_dir)
    _check_inputs(adapter_dir, iface)
    private, pub_path = resolve_signing_key(signing_key)
    tokenizer = DeviceTokenizer(base_dir)  # what the device will tokenize and stop with
    created = (now or dt.datetime.now(dt.timezone.utc)).replace(microsecond=0)

    with atomic_output_dir(Path(out_dir)) as tmp:
        release = tmp / RELEASE_DIR
        release.mkdir()
        for name in ADAPTER_FILES:  # byte for byte: PEFT's files must stay loadable by PeftModel.from_pretrained
            shutil.copyfile(adapter_dir / name, release / name)
        manifest = build_manifest(release, month, created, expiry_days, iface, metrics, gates,
                                  key_id(private.public_key()), tokenizer, git_revision(repo_dir), list(probes), product)
        data = manifest_bytes(manifest)
        (release / MANIFEST).write_bytes(data)
        (release / SIGNATURE).write_bytes(sign(private, data))
        write_tarball(release, tmp / TARBALL)

        package_bytes = sum(p.stat().st_size for p in release.iterdir())
        base_bytes = sum(p.stat().st_size for p in base_dir.glob("*.safetensors"))
        check = {
            "release_id": manifest["release_id"],
            "package_bytes": package_bytes,
            "tarball_bytes": (tmp / TARBALL).stat().st_size,
            "base_bytes": base_bytes,
            "pct_of_base": round(100.0 * package_bytes / base_bytes, 4) if base_bytes else None,
        }
        try:
            verified = verify_release(release, load_trusted_keys([pub_path]), iface)
            check["verify"] = verified.summary()
        except Exception as err:  # recorded for the gate, which blocks publishing
            check["verify"] = {"ok": False, "reason": getattr(err, "reason", type(err).__name__), "error": str(err)}
        try:
            check["load_and_query"] = load_and_query(release, pub_path, engine_dir, backend, threads, base_dir,
                                                     prompt, max_new_tokens)
        except Exception as err:
            check["load_and_query"] = {"ok": False, "prompt": prompt, "output": None, "seconds": None,
                                       "error": f"{type(err).__name__}: {err}"}
        write_json(tmp / CHECK_FILE, check)
    return Path(out_dir)


def _first_test_prompt(data_dir: Path) -> str | ChatPrompt:
    test = Path(data_dir) / "test.jsonl"
    if test.exists():
        with open(test) as fh:
            line = fh.readline()
        if line.strip():
            return parse_row(test, 1, line).prompt
    return FALLBACK_PROMPT


def run_stage(cfg: ReleaseConfig) -> Path:
    layout = cfg.layout
    return build_release(
        adapter_dir=layout.adapter_dir,
        metrics_path=layout.metrics_file,
        gates_path=layout.gates_file,
        engine_dir=layout.serving_engine_dir,
        base_dir=Path(cfg.base_model.path),
        out_dir=layout.package_dir,
        signing_key=cfg.publish.signing_key,
        month=cfg.data.month,
        product=cfg.data.product,
        expiry_days=cfg.publish.expiry_days,
        backend=cfg.engine.backend,
        threads=cfg.engine.threads,
        prompt=_first_test_prompt(layout.data_dir),
        max_new_tokens=cfg.eval.max_new_tokens,
        probes=select_probes(layout.eval_dir / PREDICTIONS_FILE, cfg.eval.max_new_tokens),
    )


def _summary(out: Path) -> str:
    check = json.loads((out / CHECK_FILE).read_text())
    return (f"release {check['release_id']} packaged at {out / RELEASE_DIR} ({check['package_bytes']} bytes, "
            f"{check['pct_of_base']}% of the base); verify ok={check['verify']['ok']}, "
            f"load and query ok={check['load_and_query']['ok']}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("Package, sign and check this month's adapter release.", lambda cfg: _summary(run_stage(cfg)), argv)


if __name__ == "__main__":
    sys.exit(main())
