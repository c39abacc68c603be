"""record_in_mlflow run twice for one flow run (a Prefect retry) leaves one parent run, one run per stage, and the
loss history once: the fine-tuning curves as metric history on the finetune stage's run and on the parent; where
the fine-tune ran (device, precision, processes) as tags of its run, and as a line of the flow's log."""

from tasks.artifacts import write_json
from tasks.config import ReleaseConfig
from tasks.gate_rules import Gate, gate_report
from tasks.plots import LOSS_CSV, VAL_LOSS_CSV
from tasks.release.stage_runner import StageRun
from tasks.release.steps import live_run, placement_line, record_in_mlflow


def test_record_twice_for_one_flow_run_logs_one_run_and_each_loss_point_once(tmp_path):
    cfg = ReleaseConfig.model_validate({
        "train": {"output_dir": str(tmp_path / "artifacts")},
        "publish": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "artifacts_dir": str(tmp_path / "mlruns")},
    })
    layout = cfg.layout
    for path, payload in ((layout.gates_file, gate_report([Gate("accuracy_new", 0.98, 0.95, ">=", True, "changed rules")])),
                          (layout.metrics_file, {"adapter": {"accuracy": 0.97}}),
                          (layout.finetune_dir / "train_metrics.json",
                           {"final_loss": 0.05, "device": "cuda", "precision": "bf16", "processes": 2})):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, payload)
    (layout.finetune_dir / LOSS_CSV).write_text("step,train_loss\n" + "".join(f"{s},{1 / s:.6f}\n" for s in range(1, 41)))
    (layout.finetune_dir / VAL_LOSS_CSV).write_text("step,val_loss\n20,0.100000\n40,0.060000\n")
    runs = [StageRun("finetune", True, 2.0, 1_700_000_000.0, 1_700_000_002.0)]

    with live_run(cfg, tmp_path, "flow-run-7") as opened:
        first = record_in_mlflow(cfg, tmp_path, runs, {**gate_report([]), "packaged": False}, "flow-run-7")
        second = record_in_mlflow(cfg, tmp_path, runs, {**gate_report([]), "packaged": False}, "flow-run-7")
        from tasks.release.tracking import client_for

        client, experiment = client_for(cfg.publish, tmp_path)
        assert client.get_run(opened.run_id).info.status == "RUNNING"  # visible while the flow runs
    assert first == second and first.run_id == opened.run_id and first.version is None
    everything = client.search_runs([experiment])
    (child,) = [r for r in everything if r.info.run_id != opened.run_id]
    assert child.data.tags["mlflow.parentRunId"] == opened.run_id and child.info.start_time == 1_700_000_000_000
    assert (child.data.tags["device"], child.data.tags["precision"], child.data.tags["processes"]) == ("cuda", "bf16", "2")
    for run_id in (child.info.run_id, opened.run_id):
        assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == list(range(1, 41))
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_loss")] == [(20, 0.1), (40, 0.06)]
    assert client.get_run(opened.run_id).info.status == "FINISHED"


def test_the_flow_log_line_names_where_the_fine_tune_and_evaluation_ran(tmp_path):
    cfg = ReleaseConfig.model_validate({"train": {"output_dir": str(tmp_path / "artifacts")}})
    for path, payload in ((cfg.layout.finetune_dir / "train_metrics.json",
                           {"final_loss": 0.05, "device": "cpu", "precision": "fp32", "processes": 2}),
                          (cfg.layout.metrics_file, {"adapter": {"accuracy": 0.97}, "torch_device": "cuda"})):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, payload)
    assert placement_line(cfg, "finetune") == "finetune ran on device cpu, precision fp32, processes 2"
    assert placement_line(cfg, "evaluate") == "evaluate ran on device cuda"
    assert placement_line(cfg, "calibrate") is None  # no PyTorch placement of its own: no line
