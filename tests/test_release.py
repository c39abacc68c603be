"""End to end: the monthly flow on the embedded default, in a fresh copy of the project, as `make release` runs it.

One project copy (a new git repository holding the tracked files) lives for the module, and the
runs build on each other like months in production:

1. 2026-11: the whole flow from scratch, as `make release` runs it: the test run's published project
   (tests/project_testkit.py: built once for the run, or CI's own `make release` just before the tests),
   copied; everything it recorded is checked, the update channel read by python-tuf's own ngclient over
   loopback HTTP among it.
2. 2026-11 again: nothing recomputed, nothing published twice.
3. 2026-12 with an impossible threshold: Failed with the reason; no release; champion unchanged.
4. 2026-12: publishes, reusing the engine (engine_builds 0); champion moves.
5. A real Prefect server serves the deployment; a run triggered through its API completes.
"""

import datetime as dt
import json
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from project_testkit import ENV, MODEL, REPO, copy_published, git, published_state
from service_testkit import free_port, run_in_group, start_service
from tuf_testkit import http_server_process, ngclient_then_tampered

pytestmark = pytest.mark.slow  # the real monthly flow, end to end: minutes per test


@pytest.fixture(scope="module")
def project(tmp_path_factory, published):
    """A copy of the published project (2026-11 published from scratch): the later months run in it, and
    nothing of theirs reaches the published project, which other tests may be reading."""
    before = published_state(published)
    root = copy_published(published, tmp_path_factory.mktemp("release") / "project")
    home = tmp_path_factory.mktemp("prefect-home")
    yield {"root": root, "env": ENV | {"PREFECT_HOME": str(home)}, "seconds": {}}
    assert published_state(published) == before, f"the published project changed ({published.source})"


def run_flow(project, name: str, **overrides) -> subprocess.CompletedProcess:
    root = project["root"]
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for key, value in overrides.items():
        section, field = key.split("__")
        raw[section][field] = value
    params = root.parent / f"params-{name}.yaml"
    params.write_text(yaml.safe_dump(raw))
    start = time.perf_counter()
    done = run_in_group([sys.executable, "-m", "flows.monthly_release", "--params", str(params)], timeout=1500, cwd=root,
                        env=project["env"])
    project["seconds"][name] = time.perf_counter() - start
    print(f"{name}: rc {done.returncode} in {project['seconds'][name]:.1f} s")
    return done


def mlflow_client(root):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def parent_runs(client, month):
    exp = client.get_experiment_by_name("monthly-adapter-release")
    runs = client.search_runs([exp.experiment_id], f"tags.month = '{month}'", order_by=["attributes.start_time ASC"])
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags]


def record_again(root, parent):
    """What a retry of the flow's `record` task does, for the flow run that recorded ``parent``."""
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from tasks.config import load_config\n"
        "from tasks.release.stage_runner import StageRun, stage_names\n"
        "from tasks.release.steps import full_gate_report, record_in_mlflow\n"
        "cfg = load_config('params.yaml')\n"
        "runs = [StageRun(name, True, 1.0, 0.0, 1.0) for name in stage_names(Path.cwd())]\n"
        "recorded = record_in_mlflow(cfg, Path.cwd(), runs, full_gate_report(cfg), sys.argv[1])\n"
        "print(json.dumps([recorded.run_id, recorded.version]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, parent.data.tags["prefect_flow_run_id"]], cwd=root, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [parent.info.run_id, "1"]


def test_first_month_publishes_and_records_everything(project, published):
    # The month's run is the published project's, which exists only if it published: what it printed and recorded.
    root = project["root"]
    # Where the fine-tune ran reaches the flow's own log (a deployment's run page), not only the stage's console.
    assert "finetune ran on device cpu, precision fp32, processes 1" in published.output, published.source

    release = root / "artifacts" / "2026-11"
    metrics = json.loads((release / "eval" / "metrics.json").read_text())
    base, on_engine = metrics["base"], metrics["adapter_on_engine"]
    assert metrics["changed_rules"] == ["crack", "tombstone"]
    assert base["accuracy_new"] <= 0.60  # the base learned last month's rule book
    assert on_engine["accuracy_new"] >= 0.95 and on_engine["accuracy_regression"] >= 0.95
    assert on_engine["accuracy_new"] == metrics["adapter"]["accuracy_new"]
    # The device's engine keeps its KV cache in 4-bit pages: parity with PyTorch, and every page the device sealed
    # (one per test row: its second page; the first and the open one stay float) is the reference's byte for byte.
    parity = metrics["engine_parity"]
    assert parity["kv_cache"] == "quantized_pages" and parity["max_abs_logit_diff"] <= 1e-4 and parity["passed"]
    assert parity["max_logit_error"] <= parity["max_logit_error_limit"] and parity["max_kl"] <= parity["max_kl_limit"]
    assert parity["pages_sealed"] >= 600 and parity["pages_sealer_bytes_differing"] == 0
    kv = metrics["kv_cache"]
    assert kv["scheme"] == "quantized_pages" and kv["accuracy_drop"] <= 0.01 and kv["ppl_increase_pct"] <= 1.0
    assert kv["on_engine"]["accuracy_drop"] <= 0.01 and kv["on_engine"]["tokens"] > 1000
    # Rows of ~40 tokens are mostly the float sink and open pages: the bits stored say so, not a 4-bit figure.
    assert 16 < kv["stored_bits_per_value"] < 32 and [row["bits"] for row in kv["grid"]] == [8.0, 4.0, 3.0, 2.0]
    assert 0 < on_engine["decode_latency"]["p50_ms"] <= on_engine["decode_latency"]["p95_ms"]
    gates = json.loads((release / "gates" / "gates.json").read_text())
    assert gates["passed"] and gates["champion"] is None

    # MLflow: a parent run with the headline metrics, a nested run per DVC stage, version 1 is champion.
    client = mlflow_client(root)
    (parent,) = parent_runs(client, "2026-11")
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["accuracy_new"] >= 0.95 and parent.data.metrics["engine_builds"] == 2.0  # float, the serving form (quantized pages, stacked)
    assert parent.data.metrics["gate.package_pct_of_base.value"] <= 2.0
    assert {"decode_p95_ms", "kv_ppl_increase_pct", "kv_bytes_per_token", "package_bytes"} <= set(parent.data.metrics)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.tags["stage"] for c in children) == sorted(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])
    assert all(c.data.metrics["reproduced"] == 1.0 for c in children)
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert str(champion.version) == "1" and champion.run_id == parent.info.run_id
    assert str(client.get_model_version_by_alias(MODEL, "candidate").version) == "1"
    # The loss as metric history, one point per logged step; stage runs span the stage's real wall time.
    finetune = next(c for c in children if c.data.tags["stage"] == "finetune")
    params = yaml.safe_load((root / "params.yaml").read_text())["train"]
    train_loss = client.get_metric_history(finetune.info.run_id, "train_loss")
    assert sorted(m.step for m in train_loss) == list(range(1, params["steps"] + 1))
    val_loss = client.get_metric_history(finetune.info.run_id, "val_loss")
    assert sorted(m.step for m in val_loss) == list(range(params["eval_every"], params["steps"] + 1, params["eval_every"]))
    assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, "train_loss")) == \
        sorted(m.step for m in train_loss)  # the same curve on the parent, where a reviewer looks first
    assert finetune.info.end_time - finetune.info.start_time == pytest.approx(1000 * finetune.data.metrics["seconds"], abs=1500)
    assert parent.info.start_time <= finetune.info.start_time and finetune.info.end_time <= parent.info.end_time
    assert any(name.startswith("system/") for name in parent.data.metrics)  # MLflow system metrics while it ran
    # Release notes beside the release in the registry: the first month has no champion to compare with.
    notes = (root / "registry" / "releases" / "2026-11.RELEASE_NOTES.md").read_text()
    assert "No champion before this one" in notes and parent.info.run_id in notes
    assert "Rules changed since the base model's rule book" in notes and "crack, tombstone" in notes

    # `record` retried (Prefect retries it) for the same flow run: the same parent run and model version.
    record_again(root, parent)
    (again,) = parent_runs(client, "2026-11")
    assert again.info.run_id == parent.info.run_id
    assert [str(v.version) for v in client.search_model_versions(f"name = '{MODEL}'")] == ["1"]
    assert len(client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")) == \
        len(children)
    assert len(client.get_metric_history(finetune.info.run_id, "train_loss")) == params["steps"]

    # The registry names it champion; the DVC remote holds it; DVC says the pipeline is up to date.
    registry = root / "registry"
    assert json.loads((registry / "channels.json").read_text()) == {"champion": "2026-11"}
    assert git(registry, "tag", "--list") == "release/2026-11"
    pulled = root.parent / "pulled-2026-11"
    subprocess.run([sys.executable, "-m", "dvc", "get", str(registry), "releases/2026-11", "--rev", "release/2026-11",
                    "-o", str(pulled)], check=True, capture_output=True, env=project["env"])
    assert (pulled / "adapter_model.safetensors").read_bytes() == \
        (release / "package" / "release" / "adapter_model.safetensors").read_bytes()
    check_update_channel(root, release / "package" / "release")
    # Every stage is up to date except the two that always run (they read the user's folders, which DVC
    # cannot list as dependencies when unset); nothing else is stale.
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, env=project["env"],
                            capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout) == {"data": ["always changed"], "base_model": ["always changed"]}, status.stdout
    assert "metrics.json" in subprocess.run([sys.executable, "-m", "dvc", "metrics", "show"], cwd=root, env=project["env"],
                                            capture_output=True, text=True, check=True).stdout


def check_update_channel(root, package):
    """python-tuf's ngclient, in a process of its own, refreshes from the channel's first root over
    ``python -m http.server`` and downloads the release target; altered bytes on the server are refused."""
    from runtime.release.verify import write_tarball

    served = shutil.copytree(root / "tuf", root.parent / "tuf-served")  # the tampering must not touch the project's
    fetched, tampered = ngclient_then_tampered(served, root / "tuf" / "metadata" / "1.root.json",
                                               "releases/2026-11.tar.gz", root.parent)
    manifest = json.loads((package / "manifest.json").read_text())
    assert fetched["custom"] == {"month": "2026-11", "release_id": manifest["release_id"],
                                 "base_model_hash": manifest["base_model_hash"],
                                 "engine_interface_hash": manifest["engine"]["interface_hash"]}
    assert (root.parent / "ngclient" / "target").read_bytes() == write_tarball(package, root.parent / "p.tar.gz").read_bytes()
    expires = dt.datetime.fromisoformat(fetched["timestamp_expires"].replace("Z", "+00:00"))
    assert expires <= dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=7)
    assert tampered.returncode != 0 and "LengthOrHashMismatchError" in tampered.stderr, tampered.stderr[-2000:]


def test_second_run_with_nothing_changed_recomputes_and_publishes_nothing(project):
    root = project["root"]
    metrics_file = root / "artifacts" / "2026-11" / "eval" / "metrics.json"
    before = metrics_file.stat().st_mtime_ns
    commits = git(root / "registry", "rev-list", "--count", "HEAD")
    done = run_flow(project, "second")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "already published" in done.stdout
    assert metrics_file.stat().st_mtime_ns == before
    # The second run was visible in MLflow while it ran, and says it found the release published; no new version.
    client = mlflow_client(root)
    first, second = parent_runs(client, "2026-11")
    assert second.info.status == "FINISHED" and second.data.tags["outcome"].startswith("already published")
    assert [str(v.version) for v in client.search_model_versions(f"name = '{MODEL}'")] == ["1"]
    # Set-up, one release, the copy's own remote (project_testkit.relocate); the rerun committed nothing.
    assert git(root / "registry", "rev-list", "--count", "HEAD") == commits == "3"
    # The release's own span in MLflow (its parent run, stages to outcome), the first run's against this one's.
    seconds = [(run.info.end_time - run.info.start_time) / 1000 for run in (first, second)]
    assert seconds[1] <= 0.25 * seconds[0], seconds


def test_an_impossible_threshold_fails_the_flow_and_publishes_nothing(project):
    root = project["root"]
    done = run_flow(project, "impossible", data__month="2026-12", gates__min_accuracy_new=1.01)
    assert done.returncode == 2
    assert "release 2026-12 not published: accuracy_new" in done.stderr and "needs >= 1.01" in done.stderr
    registry = root / "registry"
    assert json.loads((registry / "channels.json").read_text()) == {"champion": "2026-11"}
    assert git(registry, "tag", "--list") == "release/2026-11"
    assert not (root / "artifacts" / "2026-12" / "package").exists()
    client = mlflow_client(root)
    (failed,) = parent_runs(client, "2026-12")
    assert failed.info.status == "FAILED" and failed.data.metrics["gate.accuracy_new.passed"] == 0.0
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "1"


def test_next_month_reuses_the_engine_and_becomes_champion(project):
    root = project["root"]
    done = run_flow(project, "next", data__month="2026-12")
    assert done.returncode == 0, done.stderr[-4000:]
    client = mlflow_client(root)
    latest = parent_runs(client, "2026-12")[-1]
    assert latest.info.status == "FINISHED"
    assert latest.data.metrics["engine_builds"] == 0.0
    assert client.get_model_version_by_alias(MODEL, "champion").run_id == latest.info.run_id
    assert json.loads((root / "registry" / "channels.json").read_text()) == {"champion": "2026-12"}
    assert sorted(git(root / "registry", "tag", "--list").split()) == ["release/2026-11", "release/2026-12"]
    # A device pulls `champion` through DVC, verifies it against its engine and key, and gets 2026-12.
    device = root.parent / "device-release"
    pulled = subprocess.run([sys.executable, "-m", "runtime", "pull", "--registry", str(root / "registry"),
                             "--alias", "champion", "--to", str(device), "--trusted-key", str(root / "keys" / "release_signing.pub"),
                             "--engine", str(root / "engine"), "--tokenizer", str(root / "models" / "base")],
                            cwd=root, env=project["env"], capture_output=True, text=True)
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    assert json.loads((device / "manifest.json").read_text())["month"] == "2026-12"
    # ... and through the update channel (TUF over HTTP), from the root it was given at set-up.
    with http_server_process(root / "tuf", free_port()) as url:
        pulled = subprocess.run([sys.executable, "-m", "runtime", "pull", "--tuf-url", url, "--trusted-root",
                                 str(root / "tuf" / "metadata" / "1.root.json"), "--metadata-dir", str(root.parent / "device-tuf"),
                                 "--alias", "champion", "--to", str(root.parent / "device-tuf-release"),
                                 "--trusted-key", str(root / "keys" / "release_signing.pub"), "--engine", str(root / "engine")],
                                cwd=root, env=project["env"], capture_output=True, text=True)
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    assert json.loads(pulled.stdout)["month"] == "2026-12"
    champion_gate = next(g for g in json.loads((root / "artifacts" / "2026-12" / "gates" / "gates.json").read_text())["gates"]
                         if g["name"] == "accuracy_new_vs_champion")
    assert champion_gate["op"] == ">=" and "2026-11" in champion_gate["detail"]
    # Its release notes compare it with the champion it replaces.
    notes = (root / "registry" / "releases" / "2026-12.RELEASE_NOTES.md").read_text()
    assert "| metric | this candidate | champion 2026-11 | change |" in notes and "| accuracy, changed rules |" in notes
    assert "- Rules changed since the champion (2026-11): " in notes
    assert latest.info.run_id in notes and "2026-12.RELEASE_NOTES.md" in git(root / "registry", "ls-files", "releases")


def test_a_real_prefect_server_runs_the_deployment_with_other_parameters(project, process_groups, tmp_path):
    from flows import startup_timeout
    from flows.local_server import start_server

    root, env = project["root"], project["env"]
    server, api_url = start_server(free_port(), env)
    process_groups.append(server)
    env = env | {"PREFECT_API_URL": api_url}
    process_groups.append(start_service([sys.executable, "-m", "flows.serve", "--params", "params.yaml"], cwd=root, env=env,
                                        log=tmp_path / "serve.log"))
    # The deployment appears once flows.serve has started and registered it: a process start, given the
    # deadline of a server start (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS).
    trigger = (
        "import json, sys, time\n"
        "from prefect.deployments import run_deployment\n"
        "from prefect.exceptions import ObjectNotFound\n"
        "deadline = time.monotonic() + float(sys.argv[1])\n"
        "while True:\n"
        "    try:\n"
        "        run = run_deployment('monthly-release/monthly-release', parameters={'month': '2026-12', 'dry_run': True},\n"
        "                             timeout=600)\n"
        "        break\n"
        "    except ObjectNotFound:\n"
        "        if time.monotonic() > deadline:\n"
        "            raise\n"
        "        time.sleep(2)\n"
        "print(json.dumps({'state': run.state.type.value, 'params': run.parameters}))\n"
    )
    done = subprocess.run([sys.executable, "-c", trigger, str(startup_timeout())], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "serve.log").read_text()[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"state": "COMPLETED",
                      "params": {"month": "2026-12", "dry_run": True, "force": False, "overrides": {}}}
    # A dry run moves nothing.
    assert json.loads((root / "registry" / "channels.json").read_text()) == {"champion": "2026-12"}
