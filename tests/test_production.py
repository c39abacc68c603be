"""Production mode, for real: a Prefect server, an MLflow tracking server and a process worker on loopback.

In a fresh copy of the project, as `make prefect-server`, `make mlflow-server`, `make worker` and
`make deploy` set it up: `flows.deploy` registers `monthly-release` on the work pool with its monthly
schedule and a params file as its defaults; a run is triggered through the API with only
`{"month": "2026-12"}` (what `prefect deployment run monthly-release/monthly-release -p month=2026-12`
sends); the worker, started elsewhere, runs it in the project copy with the deployment's other
settings; the release lands in the MLflow server (parent run, nested stage runs, registered version
and aliases), the registry and the shared DVC remote. A second run, a dry run whose `overrides` raise
a gate out of reach, fails with the gate, its value and threshold in the flow run's state message.
Every service is then stopped with its process group and nothing is left running.

The run is a small release (short training, small splits) with gates its short-trained candidate
passes: it exercises the machinery, not the accuracy targets (tests/test_release.py checks those).
"""

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from project_testkit import ENV, MODEL, copy_project, git
from service_testkit import free_port, kill_pids, processes_in, start_service, stop_group

from flows.local_server import wait_http
from tasks.release.steps import SUMMARY_KEY

pytestmark = pytest.mark.slow  # the real monthly flow, end to end: minutes per test

POOL = "adapter-release-test"
MONTH = "2026-12"
# The deployment's defaults (params.yaml with these changes): a smaller backbone, short training, small splits,
# one thread per process (the machine's 2 cores are shared), gates a short-trained candidate passes.
FAST = {
    "data": {"train_size": 200, "val_size": 32, "calib_size": 16, "test_size": 48, "heldout_lines": 32},
    "base_model": {"num_layers": 2, "hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256,
                   "pretrain_examples": 300, "pretrain_steps": 30, "pretrain_batch_size": 16},
    "train": {"steps": 30, "batch_size": 16, "warmup_steps": 3, "threads": 1},
    "engine": {"threads": 1},
    "eval": {"latency_prompts": 2, "latency_steps": 4},
    "gates": {"min_accuracy_new": 0.0, "min_accuracy_regression": 0.0, "max_kv_accuracy_drop": 1.0,
              "max_kv_ppl_increase_pct": 1000.0, "max_decode_step_ratio": 1e6, "max_forgetting_pct": 1e6, "max_package_pct_of_base": 100.0},
}
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# The run takes about 80 s on 2 cores at load 3-4, over 7 min at load 15 (other jobs running): it may take as long
# as it keeps writing to the worker's log, and fails after RUN_STALL_S without a line (a hang), or at RUN_LIMIT_S.
RUN_STALL_S = 240
RUN_LIMIT_S = 1800


# Prefect's server answers 503 for errors it rolled back and calls retryable (SQLite "database is
# locked" while the worker writes); its own client retries 429/503 with backoff, and so does this one.
RETRYABLE_HTTP = (429, 503)


def api(url: str, payload: dict | None = None, attempts: int = 5) -> dict:
    """One Prefect REST call, as the UI makes it (GET, or POST with a JSON body)."""
    data = None if payload is None else json.dumps(payload).encode()
    for attempt in range(attempts):
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                         method="GET" if data is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            if err.code not in RETRYABLE_HTTP or attempt == attempts - 1:
                raise
            time.sleep(2**attempt)


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_to_the_end(api_url: str, deployment_id: str, parameters: dict, worker, log: Path) -> dict:
    """A flow run of the deployment created through the API with ``parameters``, once the worker has finished it."""
    flow_run = api(f"{api_url}/deployments/{deployment_id}/create_flow_run", {"parameters": parameters})
    limit = time.monotonic() + RUN_LIMIT_S
    written, stall = log.stat().st_size, time.monotonic() + RUN_STALL_S
    while flow_run["state"]["type"] not in FINAL and time.monotonic() < min(stall, limit):
        assert worker.poll() is None, tail(log)
        time.sleep(3)
        flow_run = api(f"{api_url}/flow_runs/{flow_run['id']}")
        if log.stat().st_size > written:
            written, stall = log.stat().st_size, time.monotonic() + RUN_STALL_S
    return flow_run


def test_a_worker_runs_the_deployment_triggered_through_the_api_and_records_in_the_mlflow_server(tmp_path):
    from flows.local_server import start_server, stop_server

    started = time.monotonic()
    root = copy_project(tmp_path / "project")
    shared = tmp_path / "shared"  # what production keeps outside the checkout (make PROD_DIR=...)
    (shared / "mlflow").mkdir(parents=True)
    logs = tmp_path / "logs"
    logs.mkdir()
    env = ENV | {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    prefect_port, mlflow_port = free_port(), free_port()
    tracking = f"http://127.0.0.1:{mlflow_port}"
    services, prefect_server = [], None
    try:
        prefect_server, api_url = start_server(prefect_port, env)
        env |= {"PREFECT_API_URL": api_url}
        mlflow_server = start_service(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{shared / 'mlflow' / 'mlflow.db'}",
             "--artifacts-destination", str(shared / "mlflow" / "artifacts"), "--host", "127.0.0.1",
             "--port", str(mlflow_port), "--workers", "1"],
            cwd=shared / "mlflow", env=env, log=logs / "mlflow.log")
        services.append(mlflow_server)
        registered = tmp_path / "deploy-params.yaml"  # params.yaml as the deployment is registered with it
        registered.write_text(yaml.safe_dump(merged(yaml.safe_load((root / "params.yaml").read_text()), FAST)))
        deployed = subprocess.run([sys.executable, "-m", "flows.deploy", "--params", str(registered), "--work-pool", POOL,
                                   "--set", f"publish.tracking_uri={tracking}",
                                   "--set", f"publish.remote_dir={shared / 'dvc-remote'}"],
                                  cwd=root, env=env, capture_output=True, text=True, timeout=180)
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        # The worker starts elsewhere: the deployment's pull step makes the project copy the run's directory.
        worker = start_service([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process",
                                "--limit", "1", "--install-policy", "never"], cwd=tmp_path, env=env, log=logs / "worker.log")
        services.append(worker)
        wait_http(f"{tracking}/health", 120, mlflow_server, "mlflow server")

        deployment = api(f"{api_url}/deployments/name/monthly-release/monthly-release")
        (schedule,) = deployment["schedules"]
        assert (schedule["schedule"]["cron"], schedule["schedule"]["timezone"], schedule["active"]) == \
            ("0 6 1 * *", "Europe/Berlin", True)
        assert deployment["work_pool_name"] == POOL
        assert deployment["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(root)}}]
        assert deployment["parameters"] == {"month": "2026-11", "dry_run": False, "force": False, "overrides": {}}
        defaults = api(f"{api_url}/variables/name/monthly-release-defaults")["value"]
        assert defaults["publish"]["tracking_uri"] == tracking and defaults["train"]["steps"] == 30

        # The month alone, as `prefect deployment run ... -p month=2026-12` sends it: Prefect fills the rest of
        # the parameters from the deployment's, the flow every other setting from the deployment's defaults.
        flow_run = run_to_the_end(api_url, deployment["id"], {"month": MONTH}, worker, logs / "worker.log")
        run_seconds = time.monotonic() - started
        print(f"flow run {flow_run['id']}: {flow_run['state']['type']} after {run_seconds:.0f} s since the test began")
        assert flow_run["state"]["type"] == "COMPLETED", (flow_run["state"], tail(logs / "worker.log", 8000))
        assert flow_run["work_pool_name"] == POOL
        assert flow_run["parameters"] == {"month": MONTH, "dry_run": False, "force": False, "overrides": {}}
        # The summary artifact states the settings the run resolved.
        (summary,) = api(f"{api_url}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]},
                                                                       "key": {"any_": [SUMMARY_KEY]}}})
        settings = yaml.safe_load(summary["data"].split("## Settings", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0])
        assert settings == merged(defaults, {"data": {"month": MONTH}})

        # MLflow server: the parent run of the month, a nested run per DVC stage, version 1 champion.
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking)
        experiment = client.get_experiment_by_name(defaults["publish"]["experiment"])
        runs = client.search_runs([experiment.experiment_id], f"tags.month = '{MONTH}'")
        (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        assert parent.info.status == "FINISHED"
        assert parent.data.tags["prefect_flow_run_id"] == flow_run["id"]
        assert parent.data.params["train.steps"] == "30" and parent.data.params["publish.tracking_uri"] == tracking
        assert parent.data.metrics["gates_passed"] == 1.0 and parent.data.metrics["engine_builds"] == 2.0  # float, the serving form (quantized pages, stacked)
        assert parent.info.artifact_uri.startswith("mlflow-artifacts:")  # the server chose where artifacts go
        children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(c.data.tags["stage"] for c in children) == sorted(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])
        assert all(c.info.status == "FINISHED" and c.data.metrics["reproduced"] == 1.0 for c in children)
        champion = client.get_model_version_by_alias(MODEL, "champion")
        assert str(champion.version) == "1" and champion.run_id == parent.info.run_id
        assert str(client.get_model_version_by_alias(MODEL, "candidate").version) == "1"
        assert "package/manifest.json" in {f.path for f in client.list_artifacts(parent.info.run_id, "package")}
        assert list((shared / "mlflow" / "artifacts").rglob("manifest.json"))  # proxied to --artifacts-destination

        # A failed gate stays obvious on the parameterised path: the state message names it, its value, its threshold.
        refused = run_to_the_end(api_url, deployment["id"], {"month": MONTH, "dry_run": True,
                                                             "overrides": {"gates.min_accuracy_new": 1.01}},
                                 worker, logs / "worker.log")
        assert refused["state"]["type"] == "FAILED", (refused["state"], tail(logs / "worker.log", 8000))
        assert re.search(r"release 2026-12 not published: accuracy_new = [0-9.]+ \(needs >= 1\.01", refused["state"]["message"]), \
            refused["state"]["message"]
        assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "1"
    finally:
        for service in reversed(services):
            stop_group(service)
        if prefect_server is not None:
            stop_server(prefect_server)
            stop_group(prefect_server)
        left = processes_in(tmp_path)
        kill_pids(left)  # a flow run this test started, if the run outlived the worker (a timeout)
    assert left == [], f"processes left running in {tmp_path}: {left}"
    assert all(service.returncode is not None for service in [*services, prefect_server])

    # The registry in the project copy names the release; the shared DVC remote holds its files.
    registry = root / "registry"
    assert git(registry, "tag", "--list") == f"release/{MONTH}"
    assert json.loads((registry / "channels.json").read_text()) == {"champion": MONTH}
    assert any(p.is_file() for p in (shared / "dvc-remote").rglob("*"))
    assert (root / "artifacts" / MONTH / "package" / "release.tar.gz").is_file()
    # The run stated its parameters in params.yaml only while it lasted.
    assert git(root, "status", "--porcelain", "params.yaml") == ""
    print(f"production-mode test: {time.monotonic() - started:.0f} s")

