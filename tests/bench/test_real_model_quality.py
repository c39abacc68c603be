"""bench/quality/real_model_quality.py: its perplexity and KL arithmetic, its rows and its decode loops, on tiny
arrays and a tiny model (seconds; the bench itself runs on the real checkpoint, not in CI)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.lib.real_checkpoint import real_documents
from bench.quality import real_model_quality as rq


def test_score_logits_gives_the_nll_of_the_targets_and_zero_kl_against_itself():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    nll, kl, n = rq.score_logits(rq.log_softmax(logits), logits, np.array([0, 2]))
    p0 = math.exp(2.0) / (math.exp(2.0) + 2.0)
    assert n == 2
    assert nll == pytest.approx(-math.log(p0) + math.log(3.0))
    assert kl == pytest.approx(0.0, abs=1e-12)


def test_score_logits_kl_is_the_reference_weighted_log_ratio():
    ref, cand = np.array([[math.log(0.75), math.log(0.25)]]), np.array([[0.0, 0.0]])
    _, kl, _ = rq.score_logits(rq.log_softmax(ref), cand, np.array([0]))
    assert kl == pytest.approx(0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5))  # 0.1308 nats
    _, kl_back, _ = rq.score_logits(rq.log_softmax(cand), ref, np.array([0]))
    assert kl_back != pytest.approx(kl)  # KL(ref || row), not symmetric


def test_a_row_has_the_issue_schema_and_its_increase_over_the_reference():
    ref = rq.quality_row("ours", "fp32", "float (fp32)", nll=2.0 * 10, kl=0.0, n=10, ref_ppl=None)
    row = rq.quality_row("llama.cpp", "Q4_0", "q4_0", nll=2.1 * 10, kl=0.5, n=10, ref_ppl=ref["ppl"], kv_bits=4.5)
    assert set(rq.ROW_KEYS) <= set(row) and set(rq.ROW_KEYS) <= set(ref)
    assert ref["ppl"] == pytest.approx(math.exp(2.0)) and ref["ppl_increase_pct"] == 0.0
    assert row["ppl_increase_pct"] == pytest.approx(100.0 * (math.exp(0.1) - 1.0))  # +10.52%
    assert row["kl_mean"] == pytest.approx(0.05) and row["tokens"] == 10 and row["kv_bits"] == 4.5
    assert "Q4_0" in rq.format_table([ref, row]).splitlines()[2]


def test_calib_and_eval_documents_never_share_a_name():
    calib = {n for docs in real_documents("calib") for n, _ in docs}
    eval_ = {n for docs in real_documents("eval") for n, _ in docs}
    assert calib and eval_ and not calib & eval_
    assert any(n.startswith("topic:") for n in eval_) and any(n.startswith("stdlib:") for n in eval_)


def test_decoding_token_by_token_gives_the_full_forward_logits(tiny_llama_dir):
    """The float cache filled by a prefill and then one token per call predicts what one pass over
    the whole row does on the engine path; the pages' reference path reads the same until a token reads a sealed
    page (8-bit pages stay close)."""
    from kernels.kv_spec import PageQuantSpec
    from runtime.engine.backends.torch_eager import TorchEngine
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import build_interface
    from runtime.engine.model import load_backbone, read_config

    torch.manual_seed(0)
    ids = torch.randint(0, 300, (12,)).tolist()
    backbone = load_backbone(tiny_llama_dir)
    with torch.no_grad():
        full, _ = backbone(torch.tensor([ids]), torch.arange(12)[None], torch.ones(1, 12, dtype=torch.long),
                           backbone.empty_past(1))
    want = full[0, 7:11].numpy()  # rows predicting ids[8:12]
    iface = build_interface(read_config(tiny_llama_dir), backbone_hash(tiny_llama_dir), 4, ())
    got = rq.engine_decode_logits(TorchEngine(tiny_llama_dir, iface), ids, prefix=8)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4)
    # in calls ending on multiples of 3 (8 -> 9, 9 -> 11): the same rows
    np.testing.assert_allclose(rq.engine_decode_logits(TorchEngine(tiny_llama_dir, iface), ids, prefix=8, chunk=3), want,
                               atol=1e-4)

    # pages of 4 tokens (the tiny head has 8 channels: one value group): from position 8 on, a token reads page 1
    # (tokens 4-7) sealed; position 7, the prefill's last, reads every page in float
    spec = PageQuantSpec(k_bits=8, v_bits=8, v_group_size=8)
    pages = rq.page_reference_logits(rq.BaseModel(tiny_llama_dir), spec, 8, 4)(ids)
    assert pages.shape == want.shape
    np.testing.assert_allclose(pages[0], want[0], atol=1e-4)
    assert 0 < np.abs(pages[1:] - want[1:]).max() < 0.05


def test_the_bootstrap_interval_resamples_documents_and_holds_the_increase():
    ref, tokens = [200.0, 300.0, 250.0, 220.0], [100, 100, 100, 100]
    assert rq.bootstrap_ppl_increase(ref, ref, tokens) == [0.0, 0.0]
    uniform = [x + 1.0 for x in ref]  # every document 0.01 nats per token worse: the same +1.005% in every draw
    assert rq.bootstrap_ppl_increase(uniform, ref, tokens) == pytest.approx([100 * math.expm1(0.01)] * 2)
    lo, hi = rq.bootstrap_ppl_increase([ref[0] + 8.0] + ref[1:], ref, tokens)  # one document carries it all
    assert lo == pytest.approx(0.0) and hi > 100 * math.expm1(8.0 / 400)  # draws holding it twice or more exceed the mean


def test_a_weight_engine_is_built_when_its_row_asks_and_not_once_the_time_budget_is_spent(tmp_path):
    # given two engines not built yet, each a builder that writes its directory's cache key
    builds = []

    def build(out):
        builds.append(out.name)
        out.mkdir()
        (out / rq.CACHE_KEY_FILE).write_text('{"key": "k"}')

    engines = rq.WeightEngines(tmp_path / "float")
    for name in ("a", "b"):
        engines.add(name, tmp_path / name, lambda name=name: build(tmp_path / name))
    # when nothing asked: nothing is built; asking twice builds once
    assert builds == [] and list(engines) == ["fp32", "a", "b"] and engines.directory("b") == tmp_path / "b"
    assert engines["a"] == tmp_path / "a" and engines["a"] == tmp_path / "a" and builds == ["a"]
    # and past the deadline a row whose engine is not on disk is listed, not built
    run = rq.QualityRun([("doc", [1, 2])], 1, tmp_path, deadline=0.0, backbone_cfg=None, block_size=16)
    run.rows.append({"ppl": 1.0})  # the reference is measured
    rq.weight_row(run, engines, "b", threads=1)
    assert builds == ["a"] and run.not_measured == ["ours b (engine not built: the time budget was spent)"]
