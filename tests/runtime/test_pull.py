"""Pull from a real release registry (git + DVC + a local DVC remote): by month, by alias, refusals."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from release_testkit import make_registry, world

from runtime.engine.interface import read_interface
from runtime.release.pull import PullError, pull
from runtime.release.verify import RollbackRefused, load_trusted_keys

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    # champion is deliberately not the newest month: the alias, not the order, decides.
    w["registry"] = make_registry(w["root"], {"2026-10": w["a"], "2026-11": w["b"]}, {"champion": "2026-10"})
    w["keys"] = load_trusted_keys([w["trusted_key"]])
    return w


def manifest(release: Path) -> dict:
    return json.loads((release / "manifest.json").read_text())


def test_pull_a_month_installs_the_verified_release(w, tmp_path):
    target = tmp_path / "device" / "active"
    verified = pull(str(w["registry"]), target, w["keys"], month="2026-11", iface=read_interface(w["engine"]))
    assert verified.release_id == manifest(w["b"])["release_id"] and verified.lora is not None
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in w["b"].iterdir())
    assert (target / "adapter_model.safetensors").read_bytes() == (w["b"] / "adapter_model.safetensors").read_bytes()
    assert [p.name for p in target.parent.iterdir()] == ["active"]  # no staging left behind


def test_pull_champion_gets_the_release_the_registry_names_and_refuses_a_rollback(w, tmp_path):
    target = tmp_path / "active"
    out = subprocess.run(
        [sys.executable, "-m", "runtime", "pull", "--registry", str(w["registry"]), "--alias", "champion",
         "--to", str(target), "--trusted-key", str(w["trusted_key"]), "--engine", str(w["engine"])],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["release_id"] == manifest(w["a"])["release_id"] == manifest(target)["release_id"]

    pull(str(w["registry"]), target, w["keys"], month="2026-11")
    with pytest.raises(RollbackRefused, match="older than the active release"):
        pull(str(w["registry"]), target, w["keys"], alias="champion")  # champion (2026-10) is older now
    assert manifest(target)["month"] == "2026-11"  # the installed release is untouched


def test_pull_of_an_unknown_alias_or_month_fails_with_its_own_exit_code(w, tmp_path):
    with pytest.raises(PullError, match="has no alias 'canary'.*aliases: champion"):
        pull(str(w["registry"]), tmp_path / "x", w["keys"], alias="canary")
    out = subprocess.run(
        [sys.executable, "-m", "runtime", "pull", "--registry", str(w["registry"]), "--release", "2026-12",
         "--to", str(tmp_path / "y"), "--trusted-key", str(w["trusted_key"])],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 30 and "dvc get" in out.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace (to see the file system calls) is not installed")
def test_replacing_an_installed_release_swaps_it_in_one_step_so_the_target_is_never_absent(tmp_path):
    """``install_folder`` over an installed release: one renameat2(RENAME_EXCHANGE) of the staged and the
    installed folder, as strace saw it, never a rename of the installed folder away (a crash between two
    renames would leave the device with no release at its path)."""
    target, staged, replaced, trace = tmp_path / "active", tmp_path / ".staged", tmp_path / ".previous", tmp_path / "trace"
    for folder, text in ((target, "old"), (staged, "new")):
        folder.mkdir()
        (folder / "manifest.json").write_text(text)
    code = ("import sys; from pathlib import Path; from runtime.release.device_state import install_folder; "
            "install_folder(*map(Path, sys.argv[1:]))")
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=rename,renameat,renameat2", "-o", str(trace),
                    sys.executable, "-c", code, str(staged), str(target), str(replaced)], cwd=REPO, check=True, timeout=60)
    renames = [line for line in trace.read_text().splitlines() if "rename" in line and line.rstrip().endswith("= 0")]
    exchanges = [line for line in renames if "RENAME_EXCHANGE" in line]
    assert len(exchanges) == 1 and f'"{staged}"' in exchanges[0] and f'"{target}"' in exchanges[0], renames
    assert not [line for line in renames if re.search(rf'rename\w*\((AT_FDCWD, )?"{re.escape(str(target))}"', line)], renames
    assert (target / "manifest.json").read_text() == "new" and (replaced / "manifest.json").read_text() == "old"
    assert not staged.exists()
