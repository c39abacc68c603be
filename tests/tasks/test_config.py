from pathlib import Path

import pytest
import yaml

from tasks.config import ConfigError, ReleaseConfig, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def write_params(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_repository_params_file_states_the_defaults():
    assert load_config(REPO / "params.yaml") == ReleaseConfig()


def test_unknown_key_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"lora\.rank: Extra inputs are not permitted"):
        load_config(write_params(tmp_path, {"lora": {"rank": 8}}))


def test_unknown_section_is_an_error_naming_the_section(tmp_path):
    with pytest.raises(ConfigError, match=r"^.*\n  gatez: Extra inputs"):
        load_config(write_params(tmp_path, {"gatez": {}}))


def test_wrong_type_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps: Input should be a valid integer"):
        load_config(write_params(tmp_path, {"train": {"steps": "many"}}))


def test_out_of_range_value_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"lora\.dropout: Input should be less than 1"):
        load_config(write_params(tmp_path, {"lora": {"dropout": 1.5}}))


def test_a_weights_accuracy_drop_out_of_range_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"gates\.max_weight_accuracy_drop\.int8: Input should be less than or equal to 1"):
        load_config(write_params(tmp_path, {"gates": {"max_weight_accuracy_drop": {"int8": 1.5}}}))


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write_params(tmp_path, {"data": {"month": "2026-13"}, "lora": {"r": 0}}))
    message = str(err.value)
    assert "2 invalid setting(s)" in message
    assert "data.month: Value error, must be a month written YYYY-MM, got '2026-13'" in message
    assert "lora.r: Input should be greater than or equal to 1" in message


def test_weight_block_size_must_be_a_power_of_two_for_matmulnbits():
    with pytest.raises(ConfigError, match=r"engine\.weight_block_size: Value error, must be a power of two \(MatMulNBits\), got 96"):
        parse_config({"engine": {"weight_block_size": 96}})
    assert parse_config({"engine": {"weight_block_size": 32}}).engine.weight_block_size == 32


def test_each_weight_width_takes_its_own_block_unless_one_is_set():
    # int8's error is its activations' rounding per block, so it defaults to 32; int4 keeps 128
    engine = parse_config({"engine": {"weights": "int8"}}).engine
    assert engine.weight_block_size is None and engine.weight_block() == 32 and engine.weight_block("int4") == 128
    assert parse_config({"engine": {"weights": "int4"}}).engine.weight_block() == 128
    pinned = parse_config({"engine": {"weights": "int8", "weight_block_size": 64}}).engine
    assert pinned.weight_block() == pinned.weight_block("int4") == 64


def test_kv_block_size_is_zero_or_a_power_of_two_in_range_naming_the_key():
    assert ReleaseConfig().engine.kv_block_size == 16  # the paged cache is the default
    assert ReleaseConfig().layout.serving_engine_dir == Path("engine/kvpages-paged16-stacked")
    padded = {"kv_cache": "float", "kv_block_size": 0}
    assert parse_config({"engine": padded}).layout.serving_engine_dir == Path("engine/stacked")
    for bad in (12, 4, 512):
        with pytest.raises(ConfigError, match=rf"engine\.kv_block_size: Value error, must be 0 \(the padded cache\) or a "
                                              rf"power of two from 8 to 256 .*, got {bad}"):
            parse_config({"engine": {"kv_block_size": bad}})
    with pytest.raises(ConfigError, match=r"engine\.kv_block_size: Input should be greater than or equal to 0"):
        parse_config({"engine": {"kv_block_size": -16}})


def test_a_paged_cache_needs_onnxruntime_and_quantized_pages_a_paged_cache():
    with pytest.raises(ConfigError, match=r"backend tensorrt runs neither .* \(onnxruntime only\): set engine.kv_block_size: 0$"):
        parse_config({"engine": {"backend": "tensorrt", "kv_cache": "float", "kv_block_size": 16, "mixed_adapters": False}})
    with pytest.raises(ConfigError, match=r"kv \(the quantized pages\): engine\.kv_block_size 0 \(a page is a block"):
        parse_config({"engine": {"kv_block_size": 0}})
    # A float cache measures the pages in PyTorch for the KV gates: padded or paged, any block size
    assert parse_config({"engine": {"kv_cache": "float", "kv_block_size": 0}, "kv": {"k_bits": 2}}).kv.k_bits == 2


def test_base_month_must_precede_release_month():
    with pytest.raises(ConfigError, match=r"trained_through \(2026-11\) must be before data\.month \(2026-11\)"):
        parse_config({"base_model": {"trained_through": "2026-11"}})


def test_heads_must_group_evenly():
    with pytest.raises(ConfigError, match=r"base_model: Value error, num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        parse_config({"base_model": {"num_kv_heads": 3}})


def test_config_is_frozen():
    cfg = ReleaseConfig()
    with pytest.raises(Exception, match="frozen"):
        cfg.lora.r = 4


def test_missing_params_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: params file not found"):
        load_config(tmp_path / "nope.yaml")


def test_params_hash_changes_with_any_setting():
    a = ReleaseConfig()
    b = parse_config({"train": {"lr": 0.001}})
    assert a.params_hash() == ReleaseConfig().params_hash()
    assert a.params_hash() != b.params_hash()


def test_quantized_pages_need_onnxruntime_and_the_kv_gates_and_the_static_scheme_is_gone():
    with pytest.raises(ConfigError, match="set engine.kv_cache: float and engine.kv_block_size: 0 and engine.mixed_adapters: false"):
        parse_config({"engine": {"backend": "tensorrt"}})  # every onnxruntime-only default named in one error
    with pytest.raises(ConfigError, match="engine.kv_cache quantized_pages needs kv.enabled"):
        parse_config({"kv": {"enabled": False}})
    assert parse_config({"engine": {"backend": "tensorrt", "kv_cache": "float", "kv_block_size": 0, "mixed_adapters": False},
                         "kv": {"enabled": False}}).layout.serving_engine_dir == Path("engine")
    with pytest.raises(ConfigError, match=r"engine\.kv_cache: Value error, the static quantized cache was removed .*"
                                          r"set quantized_pages"):
        parse_config({"engine": {"kv_cache": "quantized"}})
    with pytest.raises(ConfigError, match=r"kv\.pre_rope_keys: Extra inputs are not permitted"):
        parse_config({"kv": {"pre_rope_keys": True}})


def test_a_users_model_or_data_inside_a_pipeline_output_is_refused():
    with pytest.raises(ConfigError, match=r"base_model.path: 'models/base' overlaps the base_model stage's output"):
        parse_config({"base_model": {"source": "local", "path": "models/base"}})
    with pytest.raises(ConfigError, match=r"data.jsonl_dir: 'data/2026-11' overlaps data.dir"):
        parse_config({"data": {"jsonl_dir": "data/2026-11"}})
    with pytest.raises(ConfigError, match=r"data.heldout_text: 'artifacts/text.txt' overlaps train.output_dir"):
        parse_config({"data": {"heldout_text": "artifacts/text.txt"}})
    with pytest.raises(ConfigError, match=r"base_model.path: '.' overlaps"):  # the project itself holds outputs
        parse_config({"base_model": {"source": "local", "path": "."}})
    ok = parse_config({"base_model": {"source": "local", "path": "/srv/models/qwen2"}, "data": {"jsonl_dir": "/srv/month"}})
    assert ok.base_model.path == "/srv/models/qwen2"


def test_the_embedded_default_is_built_only_where_the_base_model_stage_writes():
    with pytest.raises(ConfigError, match=r"base_model: Value error, path: the embedded default is built at models/base"):
        parse_config({"base_model": {"path": "elsewhere"}})


def test_the_own_model_example_params_file_is_valid():
    cfg = load_config(REPO / "examples" / "own-model.yaml")
    assert cfg.base_model.source == "local" and cfg.data.jsonl_dir is not None and cfg.gates.min_accuracy == 0.95


def test_command_line_assignments_are_dotted_settings_with_yaml_values():
    from tasks.config import parse_assignments, with_settings

    settings = parse_assignments(["publish.tracking_uri=http://127.0.0.1:5000", "lora.target_modules=[q_proj, v_proj]",
                                  "gates.max_weight_accuracy_drop.int8=0.01", "publish.dry_run=true"], source="--set")
    config = with_settings(ReleaseConfig(), settings, source="--set")
    assert (config.publish.tracking_uri, config.lora.target_modules, config.gates.max_weight_accuracy_drop.int8,
            config.publish.dry_run) == ("http://127.0.0.1:5000", ("q_proj", "v_proj"), 0.01, True)
    with pytest.raises(ConfigError, match=r"--set 'publish\.dry_run': expected section\.key=value"):
        parse_assignments(["publish.dry_run"], source="--set")
    with pytest.raises(ConfigError, match=r"--set: 1 unknown setting\(s\)\n  publish\.trackinguri: not a setting of "
                                          r"params\.yaml \(did you mean publish\.tracking_uri\?\)"):
        with_settings(ReleaseConfig(), parse_assignments(["publish.trackinguri=x"], source="--set"), source="--set")


def test_the_product_defaults_to_the_one_of_releases_before_products_and_is_checked():
    from runtime.release.contract import DEFAULT_PRODUCT

    assert parse_config({}).data.product == DEFAULT_PRODUCT == "default"
    assert parse_config({"data": {"product": "pcb-solder"}}).data.product == "pcb-solder"
    for bad in ("PCB", "beta:candidate", "2026-11", "candidate"):
        with pytest.raises(ConfigError, match=r"data\.product: Value error, product"):
            parse_config({"data": {"product": bad}})
