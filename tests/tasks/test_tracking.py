from tasks.config import PublishConfig, ReleaseConfig
from tasks.tracking import (CANDIDATE, CHAMPION, alias_version, client_for, flatten_numbers, log_stage_run,
                            move_champion, register_candidate, restore_champion, start_release_run)


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
    v2 = register_candidate(client, "adapter", parent, "file:///nowhere", {"month": "2026-12"})
    assert (v1, v2) == ("1", "2") and alias_version(client, "adapter", CANDIDATE) == "2"
    assert alias_version(client, "adapter", CHAMPION) is None
    assert move_champion(client, "adapter", v1) is None
    assert move_champion(client, "adapter", v2) == "1"
    restore_champion(client, "adapter", "1", v2)
    assert alias_version(client, "adapter", CHAMPION) == "1"
    assert "published" not in client.get_model_version("adapter", v2).tags
