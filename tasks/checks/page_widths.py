"""Per-layer widths of the quantized pages, chosen on real text (``kv.layer_kl_budget``; issue 39 item 2).

At one width for every layer, a few layers hold most of what the cache costs: on SmolLM2-135M at K2/V2, layers
18, 20, 23 and 17 hold half of the KL to the float cache (docs/kv-cache-real-weights.md). Calibration reads each
layer's keys, and separately its values, from pages alone (every other layer and role in float:
``tasks.checks.page_quality.page_read_logits``) on windows of real prose and code, and takes the KL of the
next-token distributions against the float cache per scored token as what that layer and role cost. Measured on
SmolLM2 the costs alone add up to the cost of all at once (0.174 against 0.177 at K2/V2), so the budget on the total
splits into equal shares: a role whose KL exceeds ``budget / (2 x layers)`` gets the next width (2 -> 3 -> 4 -> 8)
and is measured again, until every role is within its share or at 8 bits.

The widths shape the engine's page pools and its graph, so they are chosen once per backbone, never per month:
``ensure_layer_widths`` caches the choice beside the engines, keyed by the backbone's hash, the scheme, the budget
and the calibration windows, and the compile stage builds the serving engine with them
(``PageQuantSpec.layer_bits``). The record (widths, the KL of every role at every width measured) reaches the
release notes and MLflow through the evaluate stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from kernels.kv_spec import PAGE_BITS, PageQuantSpec
from tasks.artifacts import write_json
from tasks.checks.page_quality import PAGED_ROLES, page_read_logits
from tasks.scoring import kl_sum

log = logging.getLogger(__name__)

LAYER_WIDTHS_FILE = "kv_layer_widths.json"  # in engine.dir: the calibration's record, read by compile and evaluate
# Windows of calibration text: each window's first half is prefilled, its second half decoded and scored, so every
# scored token reads up to a window's half of sealed pages behind it.
CALIBRATION_WINDOW = 1024
WIDER = {b: PAGE_BITS[PAGE_BITS.index(b) + 1] for b in PAGE_BITS[:-1]}  # the next width: 2 -> 3 -> 4 -> 8


def scored(length: int, prefill: int) -> torch.Tensor:
    """(1, K): the positions whose logits predict a window's decoded tokens (each token from the position before)."""
    return torch.arange(prefill - 1, length - 1)[None]


@torch.no_grad()
def _float_runs(backbone, windows: list[list[int]], block_size: int) -> list[tuple]:
    """Per window: its ids (1, T), prefill, each layer's float input and the float cache's log-probabilities of the
    scored positions (the window's second half)."""
    runs = []
    for ids in windows:
        x, prefill = torch.tensor([ids]), len(ids) // 2
        inputs: list = []
        logits = page_read_logits(backbone, x, None, block_size, prefill, inputs=inputs,
                                  logit_positions=scored(len(ids), prefill))[0]
        runs.append((x, prefill, inputs, torch.log_softmax(logits.double(), -1)))
    return runs


def role_kl(backbone, runs: list[tuple], spec: PageQuantSpec, block_size: int, layer: int, role: str,
            bits: int) -> float:
    """Mean KL(float || pages) per scored token when only ``layer``'s ``role`` (keys or values) is read from pages at
    ``bits``, everything else in float."""
    pages = PageQuantSpec(k_bits=bits, v_bits=bits, v_group_size=spec.v_group_size)
    total, tokens = 0.0, 0
    for x, prefill, inputs, float_logp in runs:
        logits = page_read_logits(backbone, x, pages, block_size, prefill, paged={layer: (role,)},
                                  start=(layer, inputs[layer]), logit_positions=scored(x.shape[1], prefill))[0]
        logp = torch.log_softmax(logits.double(), -1)
        total += kl_sum(float_logp, logp)
        tokens += len(logp)
    return total / tokens


def calibrate_layer_widths(backbone, windows: list[list[int]], spec: PageQuantSpec, block_size: int,
                           budget: float) -> dict:
    """The record of the module's docstring: {"layer_bits": [[k, v] per layer], "layers": [{"layer", "k_bits",
    "v_bits", "key_kl": {bits: KL}, "value_kl": {bits: KL}}], "share", "budget", "tokens", "kl_sum"}. ``spec``'s
    widths are where every layer starts."""
    from tasks.progress import Progress

    layers = backbone.cfg.num_layers
    share = budget / (len(PAGED_ROLES) * layers)
    runs = _float_runs(backbone, windows, block_size)
    start = {"keys": spec.k_bits, "values": spec.v_bits}
    width = {(i, role): start[role] for i in range(layers) for role in PAGED_ROLES}
    kl: dict[tuple[int, str], dict[int, float]] = {key: {} for key in width}
    pending = list(width)
    while pending:
        with Progress(f"KV widths per layer (share {share:.2e})", len(pending), unit="role") as bar:
            for i, role in pending:
                kl[i, role][width[i, role]] = role_kl(backbone, runs, spec, block_size, i, role, width[i, role])
                bar.advance()
        pending = [key for key in pending if kl[key][width[key]] > share and width[key] in WIDER]
        for key in pending:
            width[key] = WIDER[width[key]]
    layer_bits = [[width[i, "keys"], width[i, "values"]] for i in range(layers)]
    return {
        "layer_bits": layer_bits, "budget": budget, "share": share, "base": [spec.k_bits, spec.v_bits],
        "tokens": sum(len(r[3]) for r in runs), "windows": len(windows),
        "kl_sum": sum(kl[key][width[key]] for key in width),  # the chosen widths' costs alone, summed
        "layers": [{"layer": i, "k_bits": width[i, "keys"], "v_bits": width[i, "values"],
                    "key_kl": {str(b): v for b, v in kl[i, "keys"].items()},
                    "value_kl": {str(b): v for b, v in kl[i, "values"].items()}} for i in range(layers)],
    }


def widths_key(backbone_hash: str, spec: PageQuantSpec, block_size: int, budget: float,
               windows: list[list[int]]) -> str:
    """What a cached record was chosen from: the backbone, the scheme it starts at, the budget and the text."""
    text = hashlib.sha256(json.dumps(windows).encode()).hexdigest()
    payload = {"backbone": backbone_hash, "spec": spec.to_dict(), "block_size": block_size, "budget": budget,
               "windows": text}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def ensure_layer_widths(model_dir: Path, cache_dir: Path, spec: PageQuantSpec, block_size: int, budget: float,
                        windows: list[list[int]]) -> tuple[PageQuantSpec, dict]:
    """``spec`` with the per-layer widths calibration chooses for ``model_dir``'s backbone under ``budget``, and the
    record; calibrated on ``windows`` (token ids of real text: ``tasks.real_model.text.calibration_windows``), or read from ``cache_dir /
    LAYER_WIDTHS_FILE`` where the same key was calibrated before."""
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.model import load_backbone

    key = widths_key(backbone_hash(model_dir), spec, block_size, budget, windows)
    path = Path(cache_dir) / LAYER_WIDTHS_FILE
    if path.exists() and (record := json.loads(path.read_text())).get("key") == key:
        log.info("KV widths per layer: calibrated before (%s)", path)
    else:
        record = calibrate_layer_widths(load_backbone(model_dir).eval(), windows, spec, block_size, budget) | {"key": key}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_json(tmp, record)
        tmp.replace(path)
    return spec.with_layer_bits(record["layer_bits"]), record


def served_pages(cfg) -> PageQuantSpec:
    """The quantized pages of a profile (a ``tasks.config.ReleaseConfig``): its serving engine's own where it serves
    pages (with the per-layer widths the engine was compiled with), else the ``kv`` section's."""
    from runtime.engine.interface import read_interface
    from runtime.engine.model import read_config

    if cfg.engine.kv_cache == "quantized_pages" and cfg.engine.kv_block_size:
        return PageQuantSpec.from_dict(read_interface(cfg.engine.cache_engine_dir).kv_pages)
    return cfg.kv.page_spec(read_config(cfg.base_model.path).head_dim)


def widths_summary(engine_root: Path, pages: PageQuantSpec) -> dict | None:
    """For the metrics, the release notes and MLflow: the calibration that chose ``pages``' per-layer widths
    (``LAYER_WIDTHS_FILE`` under ``engine_root``), each layer's widths and what its keys and values
    cost alone at them; None for one width everywhere."""
    path = Path(engine_root) / LAYER_WIDTHS_FILE
    if not pages.layer_bits or not path.exists():
        return None
    record = json.loads(path.read_text())
    if [tuple(pair) for pair in record["layer_bits"]] != list(pages.layer_bits):
        return None
    return {"budget": record["budget"], "share": record["share"], "kl_sum": record["kl_sum"], "tokens": record["tokens"],
            "layers": {str(row["layer"]): {"k_bits": row["k_bits"], "v_bits": row["v_bits"],
                                           "key_kl": row["key_kl"][str(row["k_bits"])],
                                           "value_kl": row["value_kl"][str(row["v_bits"])]} for row in record["layers"]}}
