"""The project copy the flow benchmarks (and the end-to-end tests) run the monthly flow in."""

import subprocess

from bench.lib import flow_project


def test_the_project_copy_is_what_a_clone_holds_whatever_the_checkout_has(tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    (checkout / "tasks").mkdir(parents=True)
    (checkout / "tasks" / "stage.py").write_text("committed\n")
    (checkout / "dvc.lock").write_text("this machine's runs\n")
    flow_project.git(checkout, "init", "-q")
    subprocess.run(["git", "add", "-A"], cwd=checkout, check=True)
    subprocess.run(["git", "-c", "user.email=t@localhost", "-c", "user.name=t", "commit", "-q", "-m", "x"], cwd=checkout,
                   check=True)
    (checkout / "tasks" / "stage.py").write_text("edited, not committed\n")
    (checkout / "engine-kv").mkdir()  # what a release left behind, neither tracked nor ignored
    (checkout / "engine-kv" / "model.onnx").write_text("a warm engine\n")
    monkeypatch.setattr(flow_project, "REPO", checkout)

    copy = flow_project.copy_project(tmp_path / "copy")

    assert (copy / "tasks" / "stage.py").read_text() == "edited, not committed\n"  # tracked, as the working tree has it
    assert not (copy / "engine-kv").exists()
    assert not (copy / "dvc.lock").exists()  # a clone has no lock of this machine's runs
    assert flow_project.git(copy, "status", "--short") == ""
