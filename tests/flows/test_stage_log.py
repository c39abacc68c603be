"""The flow's output says each thing once: DVC's messages are not printed a second time through
Prefect's console, DVC's git advice is not shown, each stage ends in one line with its name, wall time
and what it wrote, and DVC's "Running stage" line and warnings still reach the output."""

from __future__ import annotations

import re
import subprocess
import sys

import yaml
from project_testkit import ENV, TIMESTAMPS, repeated_lines

FLOW = '''
import logging
from pathlib import Path

from prefect import flow

from flows.monthly_release import reproduce
from tasks.release.stage_runner import ensure_dvc_repo, stage_names


@flow
def stages():
    for name in stage_names(Path.cwd()):
        reproduce(name)
    logging.getLogger("dvc.repo").warning("a warning from DVC")


ensure_dvc_repo(Path.cwd(), "../remote")
stages()
'''


def test_a_flow_running_dvc_stages_prints_each_line_once_without_git_advice(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"], ["git", "config", "user.name", "t"]):
        subprocess.run(cmd, cwd=repo, check=True)
    (repo / "params.yaml").write_text("greeting: hello\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "make": {"cmd": "python -c \"print('making'); open('out.txt', 'w').write('hello')\"",
                 "params": ["greeting"], "outs": ["out.txt"]},
        "shout": {"cmd": "python -c \"open('loud.txt', 'w').write(open('out.txt').read().upper()); "
                         "open('m.json', 'w').write('{}')\"",
                  "deps": ["out.txt"], "outs": ["loud.txt"], "metrics": [{"m.json": {"cache": False}}]},
    }}, sort_keys=False))
    env = ENV | {"PREFECT_HOME": str(tmp_path / "prefect-home")}  # with flows/__init__.py's start-up deadline
    done = subprocess.run([sys.executable, "-c", FLOW], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert (repo / "loud.txt").read_text() == "HELLO"

    assert repeated_lines(output) == {}, output[-4000:]
    lines = [TIMESTAMPS.sub("", line).strip() for line in output.splitlines()]
    assert "git add" not in output and "autostage" not in output and "auto staging" not in output, output[-4000:]
    summaries = [line.split(" - ", 1)[1] for line in lines if re.search(r" - (make|shout): ", line)]
    assert [re.sub(r"\d+\.\d s", "N s", s) for s in summaries] == [
        "make: ran in N s, wrote out.txt", "shout: ran in N s, wrote loud.txt, m.json"], output[-4000:]
    assert lines.count("making") == 1  # the stage's own output, once
    assert sum(line.endswith("dvc.stage.run - Running stage 'make':") for line in lines) == 1  # where it began
    assert sum("a warning from DVC" in line for line in lines) == 1, output[-4000:]
