"""Faults: a release killed at its worst moments, two releases at once, a corrupted remote, a full disk.

A small but complete project (few training steps, small splits, gates lowered to match) runs
the real flow in a fresh git copy; each test is a month of it. After every fault the rerun must
end with exactly one consistent release: the registry's tag, index and champion channel, the
MLflow ``champion`` alias and the DVC remote all agree, and no stale lock blocks anything.
"""

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from project_testkit import ENV, MODEL, copy_project, git
from service_testkit import free_port, kill_group_when

pytestmark = pytest.mark.slow  # the real monthly flow, end to end: minutes per test

SMALL = {
    "base_model": {"pretrain_steps": 60, "pretrain_examples": 600},
    "data": {"train_size": 320, "val_size": 40, "calib_size": 32, "test_size": 80, "heldout_lines": 40},
    "train": {"steps": 40},
    "eval": {"latency_prompts": 2, "latency_steps": 4},
    "gates": {"min_accuracy_new": 0.0, "champion_tolerance": 1.0, "min_accuracy_regression": 0.0, "max_kv_accuracy_drop": 1.0,
              "max_kv_ppl_increase_pct": 1000.0, "max_decode_step_ratio": 1e6, "max_forgetting_pct": 1e6, "max_package_pct_of_base": 100.0},
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The project copy, and one Prefect server for all its runs: a killed flow then leaves no
    temporary server of its own behind."""
    from flows.local_server import start_server, stop_server

    root = copy_project(tmp_path_factory.mktemp("faults"))
    env = ENV | {"PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home"))}
    server, api_url = start_server(free_port(), env)
    try:
        yield {"root": root, "env": env | {"PREFECT_API_URL": api_url}}
    finally:
        stop_server(server)


def params_for(project, month: str) -> Path:
    raw = yaml.safe_load((project["root"] / "params.yaml").read_text())
    for section, values in SMALL.items():
        raw[section].update(values)
    raw["data"]["month"] = month
    path = project["root"].parent / f"params-{month}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start_flow(project, month: str, log: Path | None = None, **env) -> subprocess.Popen:
    """The flow in its own process group; output to ``log`` or to a pipe the caller reads line by line."""
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "flows.monthly_release", "--params", str(params_for(project, month))],
                            cwd=project["root"], env=project["env"] | env, stdout=out,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    proc.wait(timeout=900)
    _kill_group(proc)
    return proc.returncode, log.read_text()


def run_flow(project, month: str, **env) -> tuple[int, str]:
    log = project["root"].parent / f"flow-{month}-{time.monotonic_ns()}.log"
    return finish(start_flow(project, month, log, **env), log)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_when(project, month: str, marker: str, delay: float) -> str:
    """Start a release, SIGKILL its whole process group ``delay`` s after ``marker`` appears in its output."""
    return kill_group_when(start_flow(project, month), marker, delay)


def registry_state(root: Path) -> dict:
    registry = root / "registry"
    return {
        "tags": sorted(git(registry, "tag", "--list").split()),
        "index": json.loads((registry / "releases" / "index.json").read_text()),
        "champion": json.loads((registry / "channels.json").read_text()).get("champion"),
        "clean": git(registry, "status", "--porcelain") == "",
    }


def assert_consistent(project, months: list[str]) -> dict:
    """The registry, MLflow and the remote tell the same story: ``months`` published, the last is champion."""
    from mlflow.tracking import MlflowClient

    root = project["root"]
    state = registry_state(root)
    assert state["tags"] == [f"release/{m}" for m in months] and sorted(state["index"]) == months and state["clean"]
    assert state["champion"] == months[-1]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert str(champion.version) == state["index"][months[-1]]["mlflow_version"]
    for month in months:  # every release can be fetched from the remote alone
        out = root.parent / f"get-{month}-{time.monotonic_ns()}"
        subprocess.run([sys.executable, "-m", "dvc", "get", str(root / "registry"), f"releases/{month}", "--rev",
                        f"release/{month}", "-o", str(out)], check=True, capture_output=True, env=project["env"])
        assert (out / "manifest.json").exists()
    return state


def test_killed_during_compilation_the_rerun_publishes_one_release(project):
    kill_when(project, "2026-11", "Running stage 'compile'", 3.0)
    assert not (project["root"] / "registry" / "releases" / "2026-11").exists()
    rc, out = run_flow(project, "2026-11")
    assert rc == 0, out[-4000:]
    assert_consistent(project, ["2026-11"])
    # The float-cache engine (adapters bind to it) and the quantized-pages engine the device runs, once each.
    assert json.loads((project["root"] / "artifacts" / "engine_build.json").read_text())["engine_builds"] == 2


def test_killed_during_fine_tuning_the_rerun_publishes_one_release(project):
    kill_when(project, "2026-12", "Running stage 'finetune'", 4.0)
    leftovers = list((project["root"] / "artifacts" / "2026-12").glob(".finetune.tmp-*"))
    rc, out = run_flow(project, "2026-12")
    assert rc == 0, out[-4000:]
    assert_consistent(project, ["2026-11", "2026-12"])
    # The killed writer's half-written folder was never taken for output, and is gone now.
    assert all(not p.exists() for p in leftovers)


def test_killed_right_after_the_registry_commit_the_rerun_completes_the_publication(project):
    rc, out = run_flow(project, "2027-01", RELEASE_FAULT_POINT="registry-committed")
    assert rc == -signal.SIGKILL, out[-3000:]
    # The registry names the release, but its files never reached the remote and MLflow never moved.
    assert registry_state(project["root"])["champion"] == "2027-01"
    rc, out = run_flow(project, "2027-01")
    assert rc == 0, out[-4000:]
    assert "already published" in out and "MLflow champion moved" in out
    assert_consistent(project, ["2026-11", "2026-12", "2027-01"])


def test_two_runs_of_one_month_at_once_make_one_release(project):
    logs = [project["root"].parent / f"concurrent-{i}.log" for i in (1, 2)]
    runs = [start_flow(project, "2027-02", log) for log in logs]
    results = [finish(proc, log) for proc, log in zip(runs, logs)]
    codes, outs = sorted(code for code, _ in results), [out for _, out in results]
    assert codes == [0, 2], outs
    assert any("another release run holds" in out for out in outs)
    assert_consistent(project, ["2026-11", "2026-12", "2027-01", "2027-02"])


def test_a_corrupted_release_in_the_remote_is_refused_by_the_device(project):
    root = project["root"]
    adapter = root / "registry" / "releases" / "2027-02" / "adapter_model.safetensors"
    digest = hashlib.md5(adapter.read_bytes()).hexdigest()
    # Both stored copies: the remote's, and the registry's own DVC cache, which `dvc get` on a local
    # registry reads first. A device pulling from a git URL reads the remote's.
    for store in (root / "dvc-remote", root / "registry" / ".dvc" / "cache"):
        stored = store / "files" / "md5" / digest[:2] / digest[2:]
        blob = bytearray(stored.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        stored.chmod(0o644)
        stored.write_bytes(bytes(blob))
    target = root.parent / "device-corrupt"
    pulled = subprocess.run([sys.executable, "-m", "runtime", "pull", "--registry", str(root / "registry"), "--release",
                             "2027-02", "--to", str(target), "--trusted-key", str(root / "keys" / "release_signing.pub"),
                             "--engine", str(root / "engine"), "--tokenizer", str(root / "models" / "base")],
                            cwd=root, env=project["env"], capture_output=True, text=True)
    assert pulled.returncode in (11, 30), pulled.stderr  # runtime's checksum refusal, or DVC's own check on download
    assert not target.exists()


def _full_disk():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_packaging_on_a_full_disk_fails_clearly_and_leaves_nothing(project):
    root = project["root"]
    package = root / "artifacts" / "2027-02" / "package"
    package.rename(package.with_name("package.kept"))
    before = registry_state(root)
    done = subprocess.run([sys.executable, "-m", "tasks.stages.package", "--params", str(params_for(project, "2027-02"))],
                          cwd=root, env=project["env"], capture_output=True, text=True, preexec_fn=_full_disk)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.startswith("error: ") and "File too large" in done.stderr
    assert not package.exists() and not list(package.parent.glob(".package.tmp-*"))
    assert registry_state(root) == before
