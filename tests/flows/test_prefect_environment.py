"""The Prefect environment every entry point gets from flows/__init__.py: a start-up deadline that holds
on a busy machine, and an error that names the setting when even that is not enough; the stages it starts
spin only briefly while they wait for their OpenMP threads."""

from __future__ import annotations

import os
import subprocess
import sys

from flows import ENV_DEFAULTS, OPENMP_SPIN_ROUNDS, STARTUP_TIMEOUT_SETTING

READ_SETTING = ("import flows.monthly_release\n"
                "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as setting\n"
                "print(setting.value())\n")


def clean_env(**extra: str) -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | extra


def test_prefect_reads_the_projects_start_up_deadline_unless_the_user_set_one():
    def prefect_sees(env: dict) -> int:
        done = subprocess.run([sys.executable, "-c", READ_SETTING], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return int(done.stdout.strip().splitlines()[-1])

    assert prefect_sees(clean_env()) == int(ENV_DEFAULTS[STARTUP_TIMEOUT_SETTING]) == 180  # Prefect's own: 20
    assert prefect_sees(clean_env(**{STARTUP_TIMEOUT_SETTING: "7"})) == 7


# What a stage started from the flow's process (as DVC starts it) finds in its environment.
STAGE_WAIT_POLICY = ("import subprocess, sys\n"
                     "import flows.monthly_release\n"
                     "stage = 'import os; print(os.environ.get(\"OMP_WAIT_POLICY\"), os.environ.get(\"GOMP_SPINCOUNT\"))'\n"
                     "subprocess.run([sys.executable, '-c', stage], check=True)\n")


def test_the_flows_stages_spin_briefly_for_their_threads_unless_the_user_set_a_policy_or_spin_count():
    def stage_sees(env: dict) -> str:
        done = subprocess.run([sys.executable, "-c", STAGE_WAIT_POLICY], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    unset = {k: v for k, v in clean_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert stage_sees(unset) == f"None {OPENMP_SPIN_ROUNDS}" == "None 10000"
    assert stage_sees(unset | {"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE None"
    assert stage_sees(unset | {"GOMP_SPINCOUNT": "5"}) == "None 5"


def test_an_ephemeral_server_slower_than_the_deadline_fails_the_release_naming_the_setting(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("data:\n  month: 2026-11\n")
    # 1 s: no ephemeral server answers that fast (it imports Prefect and migrates its database first).
    env = clean_env(**{STARTUP_TIMEOUT_SETTING: "1", "PREFECT_HOME": str(tmp_path / "prefect-home")})
    done = subprocess.run([sys.executable, "-m", "flows.monthly_release", "--params", str(params)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: Prefect's ephemeral API server did not answer within 1 s ({STARTUP_TIMEOUT_SETTING}); "
                      f"on a busy machine set it higher, e.g. {STARTUP_TIMEOUT_SETTING}=2"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / ".dvc").exists()  # no stage ran
