"""`make prefect` and `make prefect-server` on a port that is not Prefect's default, for real, then a stop signal.

Given a free loopback port,
when `make prefect PREFECT_PORT=<port>` runs (a Prefect server and the served deployment), or
`make prefect-server PREFECT_PORT=<port>` (the server alone),
then the UI settings the server serves send the UI's API calls to that port, the deployment
registered there has the form of four fields with params.yaml's values (and `prefect deployment run
-p month=... -p overrides=...` fills them), and SIGTERM to make (a
service manager stopping it), or SIGINT to its process group (Ctrl-C in its terminal), leaves no
process it started behind.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from project_testkit import ENV, REPO
from service_testkit import free_port, kill_pids, live

from flows import startup_timeout
from flows.local_server import descendants, wait_http

pytestmark = pytest.mark.slow  # a real Prefect server and the served deployment: about 25 s on 2 busy cores


def get_json(url: str) -> dict | None:
    """The JSON at ``url``, None while it answers 404."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        raise


@pytest.mark.parametrize("target, stop", [("prefect", "SIGTERM to make"), ("prefect-server", "SIGINT to its group")])
def test_a_server_on_a_free_port_serves_a_ui_calling_that_port_and_a_stop_signal_stops_everything(tmp_path, target, stop):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in ENV.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    log = tmp_path / "make.log"
    # -o: the venv stamp counts as made; PY: this interpreter (the checkout has no .venv of its own here).
    with open(log, "wb") as out:
        make = subprocess.Popen(["make", "-o", ".venv/.installed", target, f"PREFECT_PORT={port}", f"PY={sys.executable}",
                                 f"PREFECT_PROD_HOME={tmp_path / 'prod-prefect'}"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started = []
    try:
        wait_http(f"{base}/api/health", startup_timeout(), make, f"make {target}")  # the deadline the server itself gets
        assert get_json(f"{base}/ui-settings")["api_url"] == f"{base}/api"
        if target == "prefect":
            served_deployment_has_the_four_fields(base, make, log)
            prefect_deployment_run_takes_the_fields(base, env)
        started = descendants(make.pid)
        assert len(started) >= (3 if target == "prefect" else 2), started  # flows.local_server, prefect server, flows.serve
        if stop == "SIGTERM to make":
            os.kill(make.pid, signal.SIGTERM)
        else:
            os.killpg(make.pid, signal.SIGINT)
        make.wait(timeout=60)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        left = live(started)
        kill_pids(left)
    assert left == [], f"left running after {stop}: {left}\n{log.read_text()[-3000:]}"
    assert f"{stop.split()[0]}: stopping" in log.read_text()
    if target == "prefect-server":
        assert (tmp_path / "prod-prefect" / "prefect.db").is_file()  # PREFECT_HOME is the production one


def served_deployment_has_the_four_fields(base: str, make: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + startup_timeout()  # flows.serve starting and registering the deployment
    while (deployment := get_json(f"{base}/api/deployments/name/monthly-release/monthly-release")) is None:
        assert make.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1)
    assert list(deployment["parameter_openapi_schema"]["properties"]) == ["month", "dry_run", "force", "overrides"]
    assert deployment["parameters"] == {"month": "2026-11", "dry_run": False, "force": False, "overrides": {}}
    defaults = get_json(f"{base}/api/variables/name/monthly-release-defaults")["value"]
    assert defaults["publish"]["tracking_uri"] == "sqlite:///mlflow.db"


def prefect_deployment_run_takes_the_fields(base: str, env: dict) -> None:
    """`prefect deployment run -p ...` as docs/production.md shows it; the run starts in an hour, after this test."""
    done = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "monthly-release/monthly-release",
                           "-p", "month=2026-12", "-p", "dry_run=true", "-p", 'overrides={"gates.min_accuracy_new": 0.97}',
                           "--start-in", "1 hour"], env=env | {"PREFECT_API_URL": f"{base}/api"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{base}/api/flow_runs/filter", data=b"{}", headers={"Content-Type": "application/json"}), timeout=10).read())
    # Only monthly-release's: on a slow machine the scheduler has also had time to schedule refresh-update-channel.
    monthly = get_json(f"{base}/api/deployments/name/monthly-release/monthly-release")["id"]
    runs = [run for run in runs if run["deployment_id"] == monthly]
    (flow_run,) = [run for run in runs if not run["auto_scheduled"]]  # the others are the monthly schedule's
    assert all(run["parameters"] == {"month": "2026-11", "dry_run": False, "force": False, "overrides": {}}
               for run in runs if run["auto_scheduled"])
    assert flow_run["parameters"] == {"month": "2026-12", "dry_run": True, "force": False,
                                      "overrides": {"gates.min_accuracy_new": 0.97}}
