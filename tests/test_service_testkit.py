"""The test harness stops what a test started, also when the test fails or times out."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from service_testkit import live, run_in_group

SPAWNS_A_CHILD = ("import subprocess, sys, time\n"
                  "child = subprocess.Popen(['sleep', '300'])\n"
                  "open(sys.argv[1], 'w').write(str(child.pid))\n"
                  "time.sleep(300)\n")


def test_a_command_that_times_out_leaves_none_of_its_children_running(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_group([sys.executable, "-c", SPAWNS_A_CHILD, str(pid_file)], timeout=20)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while live([child]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live([child]) == []


def test_a_command_that_ends_gives_its_output_and_exit_code():
    done = run_in_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                        timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
