"""A DVC stage's progress reaches the Prefect run: progress artifacts and log lines, through the flow's `reproduce` task.

Given a DVC repository whose one stage runs a 12-step loop reporting through ``tasks.progress.Progress``,
when the monthly flow's ``reproduce`` task runs it inside a flow on a real (test harness) Prefect server,
then the task run has a progress artifact at 100% naming the last step and loss, its log has a line with
step and loss, and the progress file is gone; the same stage run by ``dvc repro`` alone reports nothing
beyond its terminal bar.
"""

import subprocess
import sys
import time

import pytest
import yaml
from project_testkit import REPO

from tasks.progress import PROGRESS_ENV

STAGE = (
    "import time\n"
    "from tasks.progress import Progress\n"
    "with Progress('train toy', 12) as bar:\n"
    "    for step in range(12):\n"
    "        time.sleep(0.05)\n"
    "        bar.advance(loss=1.0 / (step + 1))\n"
    "open('done.txt', 'w').write('ok')\n"
)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    from tasks.release.stage_runner import ensure_dvc_repo

    root = tmp_path / "repo"
    root.mkdir()
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"], ["git", "config", "user.name", "t"]):
        subprocess.run(cmd, cwd=root, check=True)
    (root / "stage.py").write_text(STAGE)
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"toy": {"cmd": f"{sys.executable} stage.py",
                                                                       "deps": ["stage.py"], "outs": ["done.txt"]}}}))
    ensure_dvc_repo(root, tmp_path / "remote")
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the stage imports this checkout's tasks.progress
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.chdir(root)
    return root


def test_stage_progress_reaches_the_prefect_task_run_as_artifact_and_log_lines(repo):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler
    from prefect.testing.utilities import prefect_test_harness

    from flows.monthly_release import reproduce

    @flow
    def one_stage():
        from prefect.runtime import flow_run

        return reproduce("toy"), flow_run.id

    last = "train toy: step 12/12 (100%), loss 0.0833"
    with prefect_test_harness(server_startup_timeout=None):  # None: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        run, flow_run_id = one_stage()
        APILogHandler().flush()  # logs reach the server in background batches
        with get_client(sync_client=True) as client:
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])))
            deadline = time.monotonic() + 30  # the flush waits 5 s at most: on loaded cores a batch can take longer
            while True:
                logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
                lines = [log.message for log in logs if log.message.startswith("train toy: step")]
                if last in lines or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    assert run.reproduced and (repo / "done.txt").read_text() == "ok"
    (artifact,) = artifacts  # one bar, one artifact, updated in place
    assert artifact.data == 100.0 and str(artifact.flow_run_id) == str(flow_run_id)
    assert artifact.description == f"toy: {last}"
    assert lines[0].startswith("train toy: step 1/12 (8%), loss 1.0000") and lines[-1] == last
    assert not list((repo / ".dvc" / "tmp" / "progress").iterdir())


def test_without_a_progress_file_a_stage_only_draws_its_bar(repo):
    done = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "train toy" in done.stderr and (repo / "done.txt").read_text() == "ok"
    assert not (repo / ".dvc" / "tmp" / "progress").exists()
