"""Per-layer widths of the quantized pages (``kv.layer_kl_budget``, ``tasks.checks.page_widths``): calibration widens exactly
the layers' keys and values that cost more than their share of the budget, the compile stage builds the serving
engine with the widths it chose and reuses them, and the evaluate stage measures the pages the engine serves."""

from __future__ import annotations

import json

import pytest
import torch
from engine_testkit import tiny_qwen  # noqa: F401  (fixture)

from kernels.kv_spec import PageQuantSpec, key_code_shape
from runtime.engine.interface import read_interface
from runtime.engine.model import load_backbone
from tasks.checks import page_widths
from tasks.checks.page_widths import (
    LAYER_WIDTHS_FILE,
    WIDER,
    calibrate_layer_widths,
    role_kl,
    served_pages,
    widths_summary,
)
from tasks.config import parse_config
from tasks.stages.compile import compile_profile_engines

BLOCK = 16


@pytest.fixture(scope="module")
def backbone(tiny_qwen):
    return load_backbone(tiny_qwen).eval()


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 96, (3, 96), generator=torch.Generator().manual_seed(0)).tolist()  # 3 pages sealed each


def test_calibration_widens_exactly_the_roles_over_their_share_until_they_fit(backbone, windows):
    spec = PageQuantSpec(k_bits=2, v_bits=2, v_group_size=8)
    # Given what each layer's keys and values cost alone at 2 bits
    loose = calibrate_layer_widths(backbone, windows, spec, BLOCK, budget=1e3)
    base = {(row["layer"], role): row[f"{role}_kl"]["2"] for row in loose["layers"] for role in ("key", "value")}
    assert loose["layer_bits"] == [[2, 2], [2, 2]] and all(kl > 0 for kl in base.values())
    # When the budget's share (budget / 4 roles) lies between the cheapest and the dearest role's cost
    budget = 4 * sorted(base.values())[1] * 1.01
    record = calibrate_layer_widths(backbone, windows, spec, BLOCK, budget)
    # Then exactly the roles over the share were widened, each to the first width within it (or 8 bits)
    share = record["share"]
    assert share == pytest.approx(budget / 4)
    for row in record["layers"]:
        for role, width in (("key", row["k_bits"]), ("value", row["v_bits"])):
            measured = {int(b): kl for b, kl in row[f"{role}_kl"].items()}
            assert (width > 2) == (base[row["layer"], role] > share)
            assert measured[width] <= share or width == 8
            assert all(measured[b] > share for b in measured if b < width)
            assert list(measured) == [b for b in (2, *WIDER.values()) if b <= width]
    assert sum(w != [2, 2] for w in record["layer_bits"]) >= 1
    assert record["kl_sum"] == pytest.approx(sum(row[f"{role}_kl"][str(row[f"{role[0]}_bits"])]
                                                 for row in record["layers"] for role in ("key", "value")))


def test_a_roles_cost_alone_is_zero_in_float_and_shrinks_with_its_width(backbone, windows):
    runs = page_widths._float_runs(backbone, windows, BLOCK)
    spec = PageQuantSpec(v_group_size=8)
    costs = [role_kl(backbone, runs, spec, BLOCK, 1, "keys", bits) for bits in (2, 4, 8)]
    assert costs == sorted(costs, reverse=True) and costs[2] < 1e-3 * costs[0]
    # a prefill reads its own chunk in float: windows of one page past the sink have nothing sealed to read
    short = page_widths._float_runs(backbone, [w[:2 * BLOCK] for w in windows], BLOCK)
    assert role_kl(backbone, short, spec, BLOCK, 0, "values", 2) == pytest.approx(0.0, abs=1e-9)


@pytest.fixture(scope="module")
def widths_profile(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("widths-profile")
    cfg = parse_config({"base_model": {"source": "local", "path": str(tiny_llama_dir)},
                        "kv": {"v_group_size": 8, "k_bits": 2, "v_bits": 2, "layer_kl_budget": 1e-6,
                               "layer_calibration_tokens": 512},
                        "engine": {"dir": str(root / "engine"), "threads": 1, "kv_cache": "quantized_pages"}})
    return cfg, compile_profile_engines(cfg)


def test_the_compile_stage_serves_the_widths_calibration_chose_and_reuses_them(widths_profile, monkeypatch):
    cfg, metrics = widths_profile
    record = json.loads((cfg.layout.engine_dir / LAYER_WIDTHS_FILE).read_text())
    iface = read_interface(cfg.layout.serving_engine_dir)
    # a budget this small widens every role of the random backbone: the engine's pools and graph carry the widths
    assert iface.kv_pages["layer_bits"] == record["layer_bits"] == metrics["kv_layer_widths"]["layer_bits"]
    assert any(w != [2, 2] for w in record["layer_bits"]) and record["tokens"] > 0
    pools = {t.name: tuple(t.shape[-2:]) for t in iface.inputs if t.name.startswith("pool_key_codes.")}
    assert pools == {f"pool_key_codes.{i}": key_code_shape(k, iface.kv_block_size, iface.head_dim)
                     for i, (k, _) in enumerate(record["layer_bits"])}
    assert served_pages(cfg) == PageQuantSpec.from_dict(iface.kv_pages)
    # what the evaluate stage puts in the metrics (and so in MLflow and the release notes): each layer's widths and
    # what its keys and values cost alone at them
    summary = widths_summary(cfg.engine.dir, served_pages(cfg))
    assert [[w["k_bits"], w["v_bits"]] for w in summary["layers"].values()] == record["layer_bits"]
    assert summary["layers"]["0"]["key_kl"] == record["layers"][0]["key_kl"][str(record["layer_bits"][0][0])]
    assert widths_summary(cfg.engine.dir, PageQuantSpec(k_bits=2, v_bits=2, v_group_size=8)) is None

    # a second compile finds the calibration and the engine under their keys: nothing is measured or built again
    monkeypatch.setattr(page_widths, "calibrate_layer_widths", lambda *a, **k: pytest.fail("calibrated again"))
    assert compile_profile_engines(cfg)["engine_builds"] == 0
