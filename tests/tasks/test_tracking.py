from tasks.config import PublishConfig, ReleaseConfig
from tasks.release.tracking import (
    CANDIDATE,
    CHAMPION,
    alias_version,
    client_for,
    flatten_numbers,
    log_stage_run,
    move_champion,
    register_candidate,
    restore_champion,
    start_release_run,
)


def test_numeric_leaves_become_dotted_metric_names():
    assert flatten_numbers({"a": 1, "b": {"c": 2.5, "d": "x", "e": [1]}, "f": True}) == {"a": 1.0, "b.c": 2.5, "f": 1.0}


def test_parent_and_nested_runs_versions_and_aliases_on_sqlite(tmp_path):
    publish = PublishConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifacts_dir=str(tmp_path / "mlruns"))
    client, experiment = client_for(publish, tmp_path)
    parent = start_release_run(client, experiment, ReleaseConfig(), "abc123", None)
    report = tmp_path / "report.md"
    report.write_text("# ok\n")
    child = log_stage_run(client, experiment, parent, "evaluate", True, 12.5, {"accuracy_new": 1.0}, [report])
    run = client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.metrics == {"accuracy_new": 1.0, "seconds": 12.5, "reproduced": 1.0}
    assert [a.path for a in client.list_artifacts(child)] == ["report.md"]
    assert client.get_run(parent).data.params["data.month"] == "2026-11"
    assert str(tmp_path / "mlruns") in client.get_run(parent).info.artifact_uri

    v1 = register_candidate(client, "adapter", parent, "file:///nowhere", {"month": "2026-11"})
    next_month = start_release_run(client, experiment, ReleaseConfig(), "abc123", None)
    v2 = register_candidate(client, "adapter", next_month, "file:///nowhere", {"month": "2026-12"})
    assert (v1, v2) == ("1", "2") and alias_version(client, "adapter", CANDIDATE) == "2"
    assert alias_version(client, "adapter", CHAMPION) is None
    assert move_champion(client, "adapter", v1) is None
    assert move_champion(client, "adapter", v2) == "1"
    restore_champion(client, "adapter", "1", v2)
    assert alias_version(client, "adapter", CHAMPION) == "1"
    assert "published" not in client.get_model_version("adapter", v2).tags


def test_a_retried_record_finds_its_parent_run_stage_runs_and_model_version_again(tmp_path):
    from tasks.release.tracking import log_history

    publish = PublishConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifacts_dir=str(tmp_path / "mlruns"))
    client, experiment = client_for(publish, tmp_path)
    loss = [(step, 1.0 / step) for step in range(1, 31)]
    recorded = []
    for _attempt in range(2):
        parent = start_release_run(client, experiment, ReleaseConfig(), "abc123", "flow-run-1")
        child = log_stage_run(client, experiment, parent, "finetune", True, 3.0, {"final_loss": 0.1}, [],
                              {"train_loss": loss}, started=1_700_000_000.0, ended=1_700_000_003.5)
        recorded.append((parent, child, register_candidate(client, "adapter", parent, "file:///nowhere", {})))
    assert recorded[0] == recorded[1]
    parent, child, version = recorded[0]
    assert sorted(r.info.run_id for r in client.search_runs([experiment])) == sorted([child, parent])
    assert [str(v.version) for v in client.search_model_versions("name = 'adapter'")] == ["1"] and version == "1"
    history = client.get_metric_history(child, "train_loss")
    assert sorted((m.step, m.value) for m in history) == loss  # one point per step, not two
    run = client.get_run(child)
    assert (run.info.start_time, run.info.end_time) == (1_700_000_000_000, 1_700_000_003_500)
    # Another flow run opens another parent; a half-logged stage run is replaced, not kept beside the new one.
    other = start_release_run(client, experiment, ReleaseConfig(), "abc123", "flow-run-2")
    assert other != parent
    half = client.create_run(experiment, run_name="finetune", tags={"mlflow.parentRunId": other, "stage": "finetune"}).info.run_id
    log_history(client, half, "train_loss", loss[:3])
    replaced = log_stage_run(client, experiment, other, "finetune", True, 3.0, {}, [], {"train_loss": loss})
    assert replaced != half and client.get_run(half).info.lifecycle_stage == "deleted"
