"""``engine.kv_cache: quantized_pages``: the config that selects the paged cache with quantized pages, what it refuses
before a month's training, and the compile stage's own function building the serving engine with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import greedy_generate
from runtime.engine.interface import QUANTIZED_PAGES_INTERFACE_VERSION, read_interface
from tasks.config import ConfigError, parse_config
from tasks.models import load_tokenizer
from tasks.stages.compile import compile_profile_engines, serving_form

PAGES = {"engine": {"kv_cache": "quantized_pages"}}


def test_quantized_pages_are_selected_by_the_engine_section_and_take_their_widths_from_the_kv_section():
    cfg = parse_config(PAGES | {"kv": {"k_bits": 8, "v_bits": 2, "v_group_size": 16}})
    assert cfg.layout.serving_engine_dir == Path("engine/kvpages-paged16-stacked")
    assert serving_form(cfg.engine, cfg.kv) == {"kv_spec": None, "kv_attention": "standard", "kv_block_size": 16,
                                                "stacked": True, "kv_pages": {"k_bits": 8, "v_bits": 2, "v_group_size": 16}}
    assert parse_config({}).layout.serving_engine_dir == Path("engine/kv-paged16-stacked")  # the default is unchanged
    assert serving_form(parse_config({}).engine, parse_config({}).kv)["kv_pages"] is None


def test_quantized_pages_a_page_cannot_hold_are_refused_naming_every_key():
    with pytest.raises(ConfigError, match=r"engine.kv_cache quantized_pages: kv.k_bits 5 \(pages store 2, 3, 4, 8 bits\); "
                                          r"engine.kv_block_size 0 \(a page is a block of the paged cache\)"):
        parse_config({"engine": {"kv_cache": "quantized_pages", "kv_block_size": 0}, "kv": {"k_bits": 5}})
    with pytest.raises(ConfigError, match=r"kv.v_group_size=48 does not divide head_dim=64"):
        parse_config(PAGES | {"kv": {"v_group_size": 48}})
    with pytest.raises(ConfigError, match=r"backend tensorrt runs neither .*: set engine.kv_cache: float"):
        parse_config({"engine": {"backend": "tensorrt", "kv_cache": "quantized_pages", "kv_block_size": 0,
                                 "mixed_adapters": False}})


def test_the_compile_stage_builds_the_serving_engine_with_quantized_pages(tiny_llama_dir, tmp_path):
    cfg = parse_config({"base_model": {"source": "local", "path": str(tiny_llama_dir)}, "kv": {"v_group_size": 8},
                        "engine": {"dir": str(tmp_path / "engine"), "threads": 1, "kv_cache": "quantized_pages"}})

    metrics = compile_profile_engines(cfg)

    serving = cfg.layout.serving_engine_dir
    iface = read_interface(serving)
    assert serving == cfg.layout.engine_dir / "kvpages-paged16-stacked" and metrics["engine_builds"] == 2  # float + pages
    assert iface.version == QUANTIZED_PAGES_INTERFACE_VERSION and iface.stacked and iface.kv_block_size == 16
    assert iface.kv_pages == metrics["serving_engine"]["kv_pages"] == {"k_bits": 4, "v_bits": 4, "v_group_size": 8}
    assert not cfg.layout.kv_engine_dir.exists()  # no static-scale engine: pages need no release scales
    assert compile_profile_engines(cfg)["engine_builds"] == 0  # the cache key holds the scheme

    engine = OrtEngine(serving, threads=1)
    engine.set_adapter(None)
    prompt = "inspect board=PCB-0042 line=L3 part=P7 defect=void size=12 and a longer tail of words to fill two pages verdict:"
    ids = load_tokenizer(tiny_llama_dir).encode(prompt)
    assert len(ids) > 32  # page 1 is sealed by the prefill and read quantized by every decode step
    assert len(greedy_generate(engine, [ids], max_new_tokens=8)[0]) == 8
    assert engine.pool.used_bytes == 0
