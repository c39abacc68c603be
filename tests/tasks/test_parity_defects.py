"""Engine parity (tasks/checks/engine_parity.py) judges the function the engine computes, on the embedded default's
published release: its compiled float engine and adapter pass, and each of four planted defects
(tests/parity_testkit.py) is refused. The real-model profile's counterpart is in tests/tasks/test_real_model.py."""

from __future__ import annotations

import pytest
from parity_testkit import DecodePositionsOneOn, adapter_with_scale, adapter_without_module, checkpoint_with_layer_from

from tasks.config import load_config

PROMPTS = 40  # test rows of the published month, each a prefill of ~20-30 positions and a greedy answer


@pytest.fixture(scope="module")
def release(published):
    """The published release's base, adapter, float engine and test prompts, and PyTorch + merged PEFT."""
    from peft import PeftModel

    from tasks.models import load_base_model
    from tasks.records import read_jsonl

    root = published.root
    cfg = load_config(root / "params.yaml")
    layout = cfg.layout
    model, tokenizer = load_base_model(root / layout.base_model_dir)
    merged = PeftModel.from_pretrained(model, root / layout.adapter_dir).merge_and_unload().eval()
    prompts = [ex.prompt for ex in read_jsonl(root / layout.data_dir / "test.jsonl")][:PROMPTS]
    return {"root": root, "cfg": cfg, "layout": layout, "merged": merged, "tokenizer": tokenizer, "prompts": prompts}


def parity_of(release, engine, adapter_dir) -> dict:
    from runtime.engine.adapter import load_adapter
    from tasks.checks.engine_parity import check_parity

    engine.set_adapter(load_adapter(adapter_dir, engine.interface, require_provenance=False))
    engine_cfg = release["cfg"].engine
    return check_parity(engine, release["merged"], release["tokenizer"], release["prompts"],
                        release["cfg"].eval.max_new_tokens, 16, engine_cfg.parity_max_logit_error, engine_cfg.parity_max_kl)


@pytest.fixture(scope="module")
def float_engine(release):
    from runtime.engine.backends.onnxruntime import OrtEngine

    return OrtEngine(release["root"] / release["layout"].engine_dir)


def test_the_published_engine_passes_parity_on_its_own_test_rows(release, float_engine):
    report = parity_of(release, float_engine, release["root"] / release["layout"].adapter_dir)
    assert report["passed"], report
    assert report["positions_compared"] > 10 * PROMPTS and report["greedy_identical"]
    assert report["max_logit_error"] <= release["cfg"].engine.parity_max_logit_error / 4  # headroom on this model


@pytest.mark.parametrize("defect", ["module_left_out", "scale_x2", "decode_position_one_on"])
def test_parity_refuses_a_planted_adapter_or_position_defect(release, float_engine, defect, tmp_path):
    adapter = release["root"] / release["layout"].adapter_dir
    engine = float_engine
    if defect == "module_left_out":
        adapter = adapter_without_module(adapter, tmp_path / "adapter", layer=1, module="v_proj")
    elif defect == "scale_x2":
        adapter = adapter_with_scale(adapter, tmp_path / "adapter", 2.0)
    else:
        engine = DecodePositionsOneOn(float_engine)
    report = parity_of(release, engine, adapter)
    assert not report["passed"], report
    limits = release["cfg"].engine
    assert report["max_logit_error"] > limits.parity_max_logit_error and report["max_kl"] > limits.parity_max_kl
    if defect == "scale_x2":  # it changes answers, each a clear choice of the reference, no near-tie
        assert report["greedy_mismatches"] and report["greedy_mismatches_beyond_ties"] == report["greedy_mismatches"]


def test_parity_refuses_an_engine_with_one_layer_from_another_checkpoint(release, tmp_path):
    """The other checkpoint: the base with the month's adapter merged (a derivative of the same base, as a user who
    exported last month's merged model holds); its layer 2 in an engine compiled like the release's, which also applies
    the adapter."""
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.stages.compile import compile_engine

    engine_cfg = release["cfg"].engine
    spliced = checkpoint_with_layer_from(release["root"] / release["layout"].base_model_dir,
                                         release["merged"].state_dict(), 2, tmp_path / "spliced")
    compile_engine(spliced, tmp_path / "engine", engine_cfg.max_rank, engine_cfg.target_modules, engine_cfg.opset)
    report = parity_of(release, OrtEngine(tmp_path / "engine"), release["root"] / release["layout"].adapter_dir)
    assert not report["passed"], report
    assert report["max_logit_error"] > engine_cfg.parity_max_logit_error
