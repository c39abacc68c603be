"""``engine.kv_cache: quantized_pages``: the config that selects the paged cache with quantized pages, what it refuses
before a month's training, the compile stage's own function building the serving engine with it, and the evaluate
stage measuring what the pages cost a release, in PyTorch and on that engine, for the KV gates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_testkit import make_adapter

from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import greedy_generate
from runtime.engine.interface import QUANTIZED_PAGES_INTERFACE_VERSION, read_interface
from tasks.config import ConfigError, WeightAccuracyDrop, parse_config
from tasks.gate_rules import evaluation_gates
from tasks.models import load_tokenizer
from tasks.stages.compile import compile_profile_engines, serving_form
from tasks.stages.evaluate import evaluate

PAGES = {"engine": {"kv_cache": "quantized_pages"}}


def test_quantized_pages_are_the_default_and_take_their_widths_from_the_kv_section():
    cfg = parse_config({"kv": {"k_bits": 8, "v_bits": 2, "v_group_size": 16}})
    assert cfg.engine.kv_cache == "quantized_pages" and cfg.layout.serving_engine_dir == Path("engine/kvpages-paged16-stacked")
    assert serving_form(cfg.engine, cfg.kv, 64) == {"kv_block_size": 16, "stacked": True,
                                                    "kv_pages": {"k_bits": 8, "v_bits": 2, "v_group_size": 16}}
    # A head narrower than the value group is one group (the default 64 on a 16-channel head); a wider one keeps it
    assert serving_form(parse_config({}).engine, parse_config({}).kv, 16)["kv_pages"]["v_group_size"] == 16
    assert serving_form(parse_config({}).engine, parse_config({}).kv, 128)["kv_pages"]["v_group_size"] == 64
    float_cache = parse_config({"engine": {"kv_cache": "float"}})
    assert float_cache.layout.serving_engine_dir == Path("engine/paged16-stacked")
    assert serving_form(float_cache.engine, float_cache.kv, 64)["kv_pages"] is None


def test_quantized_pages_a_page_cannot_hold_are_refused_naming_every_key():
    with pytest.raises(ConfigError, match=r"kv \(the quantized pages\): kv.k_bits 5 \(pages store 2, 3, 4, 8 bits\); "
                                          r"engine.kv_block_size 0 \(a page is a block of the paged cache\)"):
        parse_config({"engine": {"kv_cache": "quantized_pages", "kv_block_size": 0}, "kv": {"k_bits": 5}})
    with pytest.raises(ConfigError, match=r"kv.v_group_size=48 does not divide head_dim=64"):
        parse_config(PAGES | {"kv": {"v_group_size": 48}})
    with pytest.raises(ConfigError, match=r"backend tensorrt runs neither .*: set engine.kv_cache: float"):
        parse_config({"engine": {"backend": "tensorrt", "kv_cache": "quantized_pages", "kv_block_size": 0,
                                 "mixed_adapters": False}})


@pytest.fixture(scope="module")
def pages_profile(tiny_llama_dir, tmp_path_factory):
    """(the profile, what its first compile reported): a local Llama serving 4-bit pages of 16 tokens."""
    root = tmp_path_factory.mktemp("pages-profile")
    cfg = parse_config({"base_model": {"source": "local", "path": str(tiny_llama_dir)}, "kv": {"v_group_size": 8},
                        "engine": {"dir": str(root / "engine"), "threads": 1, "kv_cache": "quantized_pages"}})
    return cfg, compile_profile_engines(cfg)


def test_quantized_pages_need_the_kv_gates():
    with pytest.raises(ConfigError, match="engine.kv_cache quantized_pages needs kv.enabled: the KV gates measure"):
        parse_config(PAGES | {"kv": {"enabled": False}})
    # a float cache with the KV gates measures the same pages in PyTorch; without them it measures nothing
    assert parse_config({"engine": {"kv_cache": "float"}, "kv": {"k_bits": 3}}).kv.page_spec(64).k_bits == 3
    assert not parse_config({"engine": {"kv_cache": "float"}, "kv": {"enabled": False, "k_bits": 5}}).kv.enabled


def test_the_compile_stage_builds_the_serving_engine_with_quantized_pages(pages_profile, tiny_llama_dir):
    cfg, metrics = pages_profile

    serving = cfg.layout.serving_engine_dir
    iface = read_interface(serving)
    assert serving == cfg.layout.engine_dir / "kvpages-paged16-stacked" and metrics["engine_builds"] == 2  # float + pages
    assert iface.version == QUANTIZED_PAGES_INTERFACE_VERSION and iface.stacked and iface.kv_block_size == 16
    assert iface.kv_pages == metrics["serving_engine"]["kv_pages"] == {"k_bits": 4, "v_bits": 4, "v_group_size": 8}
    assert sorted(p.name for p in cfg.layout.engine_dir.iterdir() if p.is_dir()) == ["kvpages-paged16-stacked"]
    assert compile_profile_engines(cfg)["engine_builds"] == 0  # the cache key holds the scheme

    engine = OrtEngine(serving, threads=1)
    engine.set_adapter(None)
    prompt = "inspect board=PCB-0042 line=L3 part=P7 defect=void size=12 and a longer tail of words to fill two pages verdict:"
    ids = load_tokenizer(tiny_llama_dir).encode(prompt)
    assert len(ids) > 32  # page 1 is sealed by the prefill and read quantized by every decode step
    assert len(greedy_generate(engine, [ids], max_new_tokens=8)[0]) == 8
    assert engine.pool.used_bytes == 0


def test_the_evaluate_stage_measures_what_the_pages_cost_in_pytorch_and_on_the_engine(pages_profile, tiny_llama_dir,
                                                                                      tmp_path):
    cfg, _ = pages_profile
    data = tmp_path / "data"
    data.mkdir()
    tail = "and a longer tail of words to fill the pages " * 4  # prompts of 3+ pages: the prefill seals pages 1, 2
    rows = [{"prompt": f"inspect board=PCB-00{i} line=L{i} part=P{i} defect=void size={i} {tail}verdict:",
             "completion": " ok"} for i in range(10, 16)]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words = "the inspection of each board on the line records its part its defect and the size of that defect"
    (data / "heldout.txt").write_text("".join(f"{words} {i} {words} {words}\n" for i in range(4)))  # ~70 tokens each
    adapter = make_adapter(tiny_llama_dir, tmp_path / "adapter")

    out = evaluate(tiny_llama_dir, adapter, data, tmp_path / "eval", cfg.eval.model_copy(update={"max_new_tokens": 3}),
                   "2026-11", cfg.engine, pages=cfg.kv.page_spec(8), max_weight_accuracy_drop=WeightAccuracyDrop())

    metrics = json.loads(out.read_text())
    kv = metrics["kv_cache"]
    assert kv["scheme"] == "quantized_pages" and kv["spec"] == {"k_bits": 4, "v_bits": 4, "v_group_size": 8}
    assert kv["heldout_documents"] == 4 and kv["tokens"] > 100 and kv["kl_mean"] > 0.0
    assert [row["bits"] for row in kv["grid"]] == [8, 4, 3, 2] and kv["grid"][1]["config"].startswith("release")
    # the engine decoded the same documents through the pages its runtime sealed: the same perplexities as the
    # one-forward measure in PyTorch, up to float32 (an isolated code on a rounding boundary moves them by less)
    on_engine = kv["on_engine"]
    assert on_engine["tokens"] == kv["tokens"]
    assert on_engine["perplexity_float_cache"] == pytest.approx(kv["perplexity_float_cache"], rel=1e-4)
    assert on_engine["ppl_increase_pct"] == pytest.approx(kv["ppl_increase_pct"], abs=0.05)
    parity = metrics["engine_parity"]
    assert parity["kv_cache"] == "quantized_pages" and parity["pages_sealed"] >= 12
    assert parity["pages_sealer_bytes_differing"] == 0 and parity["kv_bytes_compared"] > 0
    assert parity["kv_code_mismatch"] < 1e-3  # sealing PyTorch's own K/V: float rounding only, reported
    gates = {g.name: g for g in evaluation_gates(metrics, cfg.gates, None, cfg.engine, True)}
    assert gates["pages_sealer_parity"].passed and gates["engine_parity"].passed
    assert "kv_code_mismatch" not in gates  # reported, not gated: pages are held to the exact sealer parity above
    assert gates["kv_ppl_increase_pct"].value == on_engine["ppl_increase_pct"]
    assert gates["kv_accuracy_drop"].value == on_engine["accuracy_drop"]
    # the answers' drop is the engine's own with a float cache less with its pages: its weights count in neither
    assert on_engine["accuracy_drop"] == on_engine["accuracy_float_pages"] - metrics["adapter_on_engine"]["accuracy"]
    assert 0 <= on_engine["answers_differing"] <= len(rows)
    assert (tmp_path / "eval" / "kv_bits.png").is_file()


def test_a_device_that_seals_one_code_otherwise_than_the_reference_is_refused(pages_profile, tiny_llama_dir,
                                                                               tmp_path, monkeypatch):
    """The parity gate seals again the K/V the engine handed its cache: one code byte off in one page of one layer
    is a difference (a planted defect: the runtime's sealer, wrapped to change it, clearly named)."""
    from runtime.engine import kv_pages
    from runtime.engine.adapter import load_adapter
    from tasks.checks.engine_parity import pages_parity
    from tasks.models import load_release_backbone

    cfg, _ = pages_profile
    adapter = make_adapter(tiny_llama_dir, tmp_path / "adapter")
    engine = OrtEngine(cfg.layout.serving_engine_dir, threads=1)
    engine.set_adapter(load_adapter(adapter, engine.interface))
    backbone, _, _ = load_release_backbone(tiny_llama_dir, adapter, cfg.layout.serving_engine_dir)
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompt = "inspect board=PCB-0042 line=L3 part=P7 defect=void size=12 " + "and a longer tail of words " * 4
    assert pages_parity(engine, backbone, tokenizer, [prompt])["pages_sealer_bytes_differing"] == 0

    right_sealer = kv_pages.seal_pages

    def sealer_one_code_off(k, v, spec):
        pages = right_sealer(k, v, spec)
        pages["key_codes"][0, 0, 0, 0] ^= 1  # the first page's first key code, low bit flipped
        return pages

    monkeypatch.setattr(kv_pages, "seal_pages", sealer_one_code_off)
    report = pages_parity(engine, backbone, tokenizer, [prompt])
    assert report["pages_sealer_bytes_differing"] >= 1 and report["pages_sealed"] >= 2


def test_weight_quantization_rewrites_the_projections_and_nothing_of_the_pages_read(pages_profile, tiny_llama_dir,
                                                                                     tmp_path):
    """The int4 copy of the serving engine quantizes the layers' projections only: a constant matrix in the pages'
    read (an unmixing product of a page's scores, once) would be taken for a projection and rounded to 4 bits."""
    from runtime.engine.model import read_config
    from tasks.weights.engines import quantize_engine_dir

    cfg, _ = pages_profile
    record = quantize_engine_dir(cfg.layout.serving_engine_dir, tmp_path / "int4", "int4", block_size=32)
    backbone = read_config(tiny_llama_dir)
    inner = [int(line.split(" K=")[1].split()[0]) for line in record["quantized"] if " K=" in line]
    assert len(inner) == 4 * backbone.num_layers  # q k v fused, o, gate up fused, down (the head and table kept float)
    assert set(inner) == {backbone.hidden_size, backbone.intermediate_size}
