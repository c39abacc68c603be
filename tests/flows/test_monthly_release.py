"""The monthly flow's parameters: four fields a person types, set onto the deployment's defaults.

Given the flow ``monthly-release``,
then Prefect's form (built from its signature) has exactly month, dry_run, force and overrides;
a run's parameters are set onto its defaults key by key and every key is validated, a bad one named;
and on a real (test-harness) Prefect server a run of the registered deployment starts from the
settings it was registered with, and one whose overrides name an unknown key fails before any stage.
"""

import pytest

from flows.monthly_release import flow_parameters, monthly_release, resolve_config
from tasks.config import ConfigError, ReleaseConfig, with_settings

DEFAULTS = ReleaseConfig.model_validate({"publish": {"tracking_uri": "http://127.0.0.1:5999"},
                                         "train": {"steps": 30}, "gates": {"min_accuracy_new": 0.5}})


def test_the_form_has_four_fields():
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(monthly_release)
    assert list(schema.properties) == ["month", "dry_run", "force", "overrides"]
    assert schema.required == [] and all(field["default"] is None for field in schema.properties.values())
    # The form's help text is the docstring's.
    assert schema.properties["month"]["description"].startswith("The release month, YYYY-MM")
    assert "gates.min_accuracy_new" in schema.properties["overrides"]["description"]


def test_a_month_alone_keeps_every_other_default():
    config = resolve_config(DEFAULTS, "2026-12", None, None, None)
    assert config.data.month == "2026-12"
    assert config.model_dump(exclude={"data"}) == DEFAULTS.model_dump(exclude={"data"})
    assert config.data.model_dump(exclude={"month"}) == DEFAULTS.data.model_dump(exclude={"month"})


def test_overrides_set_dotted_keys_at_any_depth():
    config = resolve_config(DEFAULTS, None, True, None, {"gates.min_accuracy_new": 0.97, "lora.target_modules": ["q_proj"],
                                                         "gates.max_weight_accuracy_drop.int4": 0.05})
    assert (config.gates.min_accuracy_new, config.lora.target_modules, config.gates.max_weight_accuracy_drop.int4) == \
        (0.97, ("q_proj",), 0.05)
    assert config.publish.dry_run is True and config.publish.tracking_uri == DEFAULTS.publish.tracking_uri
    assert config.data.month == DEFAULTS.data.month


def test_an_unknown_key_is_named_with_the_nearest_setting():
    with pytest.raises(ConfigError, match=r"gates\.min_acuracy_new: not a setting of params\.yaml \(did you mean "
                                          r"gates\.min_accuracy_new\?\)"):
        resolve_config(DEFAULTS, None, None, None, {"gates.min_acuracy_new": 0.97})
    with pytest.raises(ConfigError, match=r"  gates: not a setting"):  # a section is not a setting: its keys are
        resolve_config(DEFAULTS, None, None, None, {"gates": {"min_accuracy_new": 0.97}})


def test_a_bad_value_is_named_by_its_key():
    with pytest.raises(ConfigError, match=r"gates\.min_accuracy_new: Input should be less than or equal to 1\.01"):
        resolve_config(DEFAULTS, None, None, None, {"gates.min_accuracy_new": 2})
    with pytest.raises(ConfigError, match=r"data\.month: Value error, must be a month written YYYY-MM, got '2026-13'"):
        resolve_config(DEFAULTS, "2026-13", None, None, None)


def test_a_setting_with_a_parameter_of_its_own_is_not_an_override():
    with pytest.raises(ConfigError, match=r"data\.month has a parameter of its own: set month"):
        resolve_config(DEFAULTS, None, None, None, {"data.month": "2026-12"})


def test_flow_parameters_resolve_back_to_the_config():
    config = with_settings(DEFAULTS, {"data.month": "2026-12", "publish.force": True, "kv.k_bits": 8, "kv.v_bits": 8},
                           source="test")
    parameters = flow_parameters(config, DEFAULTS)
    assert parameters == {"month": "2026-12", "dry_run": False, "force": True, "overrides": {"kv.k_bits": 8, "kv.v_bits": 8}}
    assert resolve_config(DEFAULTS, **parameters) == config


@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=None):  # None: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        yield


def run_of_deployment(parameters: dict, defaults: ReleaseConfig):
    """A flow run of the registered deployment with ``parameters``, run in this process; its final state."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from flows.monthly_release import register_defaults
    from flows.serve import DEPLOYMENT

    deployment_id = monthly_release.to_deployment(name=DEPLOYMENT, parameters=register_defaults(defaults)).apply()
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
        state = run_flow(monthly_release, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")
        return state, client.read_flow_run(flow_run.id), client.read_task_runs()


def test_a_deployment_run_starts_from_the_registered_settings(prefect_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # lora.r 8 fits the code's default engine (max_rank 8), not the registered one (max_rank 4).
    registered = with_settings(DEFAULTS, {"lora.r": 4, "engine.max_rank": 4}, source="test")
    state, flow_run, _ = run_of_deployment({"month": "2026-12", "overrides": {"lora.r": 8}}, registered)
    assert flow_run.parameters == {"month": "2026-12", "dry_run": False, "force": False, "overrides": {"lora.r": 8}}
    assert state.is_failed() and "lora.r (8) exceeds engine.max_rank (4)" in state.message


def test_an_unknown_override_fails_the_run_before_any_stage(prefect_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state, flow_run, task_runs = run_of_deployment({"overrides": {"gates.min_acuracy_new": 0.97}}, DEFAULTS)
    assert state.is_failed() and "gates.min_acuracy_new: not a setting of params.yaml" in state.message
    assert [t for t in task_runs if t.flow_run_id == flow_run.id] == []
    assert list(tmp_path.iterdir()) == []  # no DVC set-up, no lock, no params.yaml written
