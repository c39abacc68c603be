"""Pull real signed releases from the update channel (TUF over loopback HTTP): by channel, by month, refusals.

The repository is written by the publish step's own code (``tasks.release.update_channel``) with A
(2026-10) the champion and B (2026-11) the candidate; each refusal is made on a copy of it by
changing the served files, and must leave the installed release as it was.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from release_testkit import world
from tuf_testkit import (
    endless_timestamp,
    expire_timestamp,
    mix_and_match,
    ngclient_then_tampered,
    same_length_change,
    serve,
    target_file,
    wrong_key,
    zero_tarball,
)

from runtime.engine.adapter_config import ADAPTER_WEIGHTS
from runtime.engine.hashing import sha256_file
from runtime.engine.interface import read_interface
from runtime.release.contract import TUF_CHANNELS_TARGET, release_target_path
from runtime.release.tuf_pull import EXIT_CODES, UpdateRefused, tuf_pull
from runtime.release.verify import RollbackRefused, load_trusted_keys
from tasks.config import PublishConfig
from tasks.release import registry
from tasks.release.update_channel import Channel, publish_from_registry, publish_release

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    w["channel"] = Channel(w["root"] / "tuf", w["root"] / "tuf-keys")
    publish_release(w["channel"], w["a"], "2026-10", "2026-10")
    w["before_b"] = shutil.copytree(w["channel"].repo, w["root"] / "tuf-before-b")  # a valid, older state
    publish_release(w["channel"], w["b"], "2026-11", "2026-10")
    w["first_root"] = w["channel"].metadata / "1.root.json"
    w["keys"] = load_trusted_keys([w["trusted_key"]])
    return w


def manifest(release: Path) -> dict:
    return json.loads((release / "manifest.json").read_text())


def test_pull_by_channel_installs_the_signed_champion_and_the_existing_rollback_rule_holds(w, tmp_path):
    device = tmp_path / "device"
    device.mkdir()
    shutil.copyfile(w["first_root"], device / "1.root.json")  # given out of band
    with serve(w["channel"].repo) as url:
        (device / "device.json").write_text(json.dumps({"tuf_url": url, "trusted_root": "1.root.json",
                                                        "metadata_dir": "tuf-metadata",
                                                        "trusted_keys": [str(w["trusted_key"])]}))
        out = subprocess.run(
            [sys.executable, "-m", "runtime", "pull", "--device-config", str(device / "device.json"),
             "--alias", "champion", "--to", str(device / "active"), "--engine", str(w["engine"])],
            cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["release_id"] == manifest(w["a"])["release_id"] == manifest(device / "active")["release_id"]

        verified = tuf_pull(url, device / "1.root.json", device / "tuf-metadata", device / "active", w["keys"],
                            channel="candidate", iface=read_interface(w["engine"]))
        assert verified.release_id == manifest(w["b"])["release_id"] == manifest(device / "active")["release_id"]
        with pytest.raises(RollbackRefused, match="older than the active release"):
            tuf_pull(url, device / "1.root.json", device / "tuf-metadata", device / "active", w["keys"], channel="champion")
    assert manifest(device / "active")["month"] == "2026-11"
    assert sorted(p.name for p in device.iterdir()) == ["1.root.json", "active", "device.json", "tuf-metadata"]


def edit_champion(repo: Path, channel: Channel) -> None:
    same_length_change(target_file(repo, channel, TUF_CHANNELS_TARGET), b'"champion": "2026-10"', b'"champion": "2026-11"')


ATTACKS = {  # name: (change to the served repository, month or channel asked for, reason)
    "arbitrary package": (zero_tarball, {"month": "2026-11"}, "hash_mismatch"),
    "edited channel pointer": (edit_champion, {"channel": "champion"}, "hash_mismatch"),
    "stale timestamp (freeze)": (expire_timestamp, {"month": "2026-11"}, "stale_metadata"),
    "mix-and-match": (mix_and_match, {"month": "2026-11"}, "hash_mismatch"),
    "endless data": (endless_timestamp, {"month": "2026-11"}, "too_large"),
    "wrong key": (wrong_key, {"month": "2026-11"}, "untrusted_metadata"),
    "unknown release": (lambda repo, channel: None, {"month": "2026-12"}, "unknown_target"),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_an_attack_on_the_channel_is_refused_with_its_reason_and_the_installed_release_stays(w, tmp_path, attack):
    change, which, reason = ATTACKS[attack]
    repo = shutil.copytree(w["channel"].repo, tmp_path / "served")
    change(repo, w["channel"])
    installed = shutil.copytree(w["a"], tmp_path / "active")
    with serve(repo) as url, pytest.raises(UpdateRefused) as refused:
        tuf_pull(url, w["first_root"], tmp_path / "metadata", installed, w["keys"], **which)
    assert refused.value.reason == reason and refused.value.exit_code == EXIT_CODES[reason]
    assert str(refused.value).startswith(f"refused ({reason}): ")
    assert manifest(installed) == manifest(w["a"]) and sorted(p.name for p in tmp_path.iterdir()) == [
        "active", "metadata", "served"]


def test_older_metadata_after_newer_is_refused_and_an_unreachable_channel_installs_nothing(w, tmp_path):
    device = tmp_path / "device"
    with serve(w["channel"].repo) as url:
        tuf_pull(url, w["first_root"], device / "metadata", device / "active", w["keys"], month="2026-10")
    with serve(w["before_b"]) as url, pytest.raises(UpdateRefused, match=r"^refused \(metadata_rollback\)"):
        tuf_pull(url, w["first_root"], device / "metadata", device / "active", w["keys"], month="2026-10")
    with serve(w["channel"].repo) as url:
        pass  # the port is closed again: nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "runtime", "pull", "--tuf-url", url, "--trusted-root", str(w["first_root"]),
         "--metadata-dir", str(device / "metadata"), "--release", "2026-11", "--to", str(device / "active"),
         "--trusted-key", str(w["trusted_key"])],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == EXIT_CODES["unreachable"] and "refused (unreachable)" in out.stderr, out.stderr
    assert manifest(device / "active")["month"] == "2026-10"
    out = subprocess.run([sys.executable, "-m", "runtime", "pull", "--tuf-url", url, "--release", "2026-11",
                          "--to", str(device / "active"), "--trusted-key", str(w["trusted_key"])],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "needs --trusted-root and --metadata-dir" in out.stderr


def test_the_publish_step_signs_into_a_channel_ngclient_reads_in_its_own_process(w, tmp_path):
    """What the flow runs: tasks.release.registry into a real git + DVC registry, then the update channel from it;
    python-tuf's ngclient, in a venv holding only tuf, refreshes from the first root over `python -m http.server`."""
    cfg = PublishConfig(registry_dir=str(tmp_path / "registry"), remote_dir=str(tmp_path / "dvc-remote"),
                        tuf_dir=str(tmp_path / "tuf"), tuf_keys_dir=str(tmp_path / "keys"))
    registry.ensure_registry(Path(cfg.registry_dir), cfg.remote_dir)
    entry = {"release_id": manifest(w["b"])["release_id"], "adapter_sha256": sha256_file(w["b"] / ADAPTER_WEIGHTS)}
    registry.publish_release(Path(cfg.registry_dir), w["b"], "2026-11", entry, champion=True)
    assert publish_from_registry(cfg, "2026-11") == ["targets", "snapshot", "timestamp"]
    assert publish_from_registry(cfg, "2026-11") == []  # a rerun (reconcile) signs nothing twice
    fetched, tampered = ngclient_then_tampered(tmp_path / "tuf", tmp_path / "tuf" / "metadata" / "1.root.json",
                                               release_target_path("2026-11"), tmp_path)
    assert fetched["custom"]["release_id"] == entry["release_id"]
    expires = dt.datetime.fromisoformat(fetched["timestamp_expires"].replace("Z", "+00:00"))
    assert expires <= dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=7)
    assert tampered.returncode != 0 and "LengthOrHashMismatchError" in tampered.stderr, tampered.stderr[-2000:]
