import json
import os
import subprocess
import sys

import pytest

from tasks.release.registry import (
    PublishError,
    ensure_registry,
    publish_release,
    read_channels,
    read_index,
    release_notes_path,
    rollback,
)


def package(tmp_path, name: str, payload: bytes):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(payload)
    (d / "manifest.json").write_text(json.dumps({"release_id": name}))
    return d


def git(registry, *args):
    return subprocess.run(["git", *args], cwd=registry, capture_output=True, text=True, check=True).stdout.strip()


def entry(release_id, sha):
    return {"release_id": release_id, "adapter_sha256": sha, "accuracy_new": 1.0}


@pytest.fixture
def registry(tmp_path):
    return ensure_registry(tmp_path / "registry", tmp_path / "remote")


def test_a_published_release_is_committed_tagged_indexed_and_in_the_remote(tmp_path, registry):
    pkg = package(tmp_path, "r-2026-11", b"weights-1")
    published = publish_release(registry, pkg, "2026-11", entry("r-2026-11", "aaa"), champion=True)
    assert not published.already and published.tag == "release/2026-11"
    assert git(registry, "ls-files", "releases") == "releases/.gitignore\nreleases/2026-11.dvc\nreleases/index.json"
    assert git(registry, "rev-list", "-n", "1", "release/2026-11") == published.commit
    assert read_channels(registry) == {"champion": "2026-11"}
    assert read_index(registry)["2026-11"]["release_id"] == "r-2026-11"
    assert git(registry, "status", "--porcelain") == ""
    # The remote holds the files: a fresh `dvc get` from the registry returns them.
    out = tmp_path / "pulled"
    subprocess.run([sys.executable, "-m", "dvc", "get", str(registry), "releases/2026-11", "--rev", "release/2026-11", "-o", str(out)],
                   check=True, capture_output=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert (out / "adapter_model.safetensors").read_bytes() == b"weights-1"


def test_a_second_product_publishes_beside_the_first_and_devices_pull_it_by_product(tmp_path, registry):
    from runtime.release.pull import resolve_alias

    publish_release(registry, package(tmp_path, "d-2026-11", b"weights-d"), "2026-11", entry("d-2026-11", "ddd"),
                    champion=True)
    published = publish_release(registry, package(tmp_path, "b-2026-11", b"weights-b"), "2026-11",
                                entry("b-2026-11", "bbb"), champion=True, product="beta")
    assert (published.tag, published.product) == ("release/beta/2026-11", "beta")
    assert git(registry, "rev-list", "-n", "1", "release/beta/2026-11") == published.commit
    assert git(registry, "ls-files", "products") == ("products/beta/channels.json\nproducts/beta/releases/.gitignore\n"
                                                     "products/beta/releases/2026-11.dvc\nproducts/beta/releases/index.json")
    assert read_channels(registry) == {"champion": "2026-11"} and read_index(registry)["2026-11"]["release_id"] == "d-2026-11"
    assert read_channels(registry, "beta") == {"champion": "2026-11"}
    assert read_index(registry, "beta")["2026-11"]["release_id"] == "b-2026-11"
    assert resolve_alias(str(registry), "champion", product="beta") == "2026-11"  # the device reads the same file
    out = tmp_path / "pulled"
    subprocess.run([sys.executable, "-m", "dvc", "get", str(registry), "products/beta/releases/2026-11", "--rev",
                    "release/beta/2026-11", "-o", str(out)],
                   check=True, capture_output=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert (out / "adapter_model.safetensors").read_bytes() == b"weights-b"
    assert git(registry, "status", "--porcelain") == ""


def test_publishing_the_same_release_twice_reports_the_first(tmp_path, registry):
    pkg = package(tmp_path, "r", b"weights-1")
    first = publish_release(registry, pkg, "2026-11", entry("r", "aaa"), champion=True)
    again = publish_release(registry, pkg, "2026-11", entry("r", "aaa"), champion=True)
    assert again.already and again.commit == first.commit
    assert git(registry, "rev-list", "--count", "HEAD") == "2"  # set-up, release, nothing more


def test_another_adapter_for_a_published_month_needs_force(tmp_path, registry):
    publish_release(registry, package(tmp_path, "r1", b"weights-1"), "2026-11", entry("r1", "aaa"), champion=True)
    with pytest.raises(PublishError, match="already published as r1 .*publish.force"):
        publish_release(registry, package(tmp_path, "r2", b"weights-2"), "2026-11", entry("r2", "bbb"), champion=True)
    forced = publish_release(registry, package(tmp_path, "r3", b"weights-3"), "2026-11", entry("r3", "ccc"),
                             champion=True, force=True)
    assert read_index(registry)["2026-11"]["release_id"] == "r3"
    assert git(registry, "rev-list", "-n", "1", "release/2026-11") == forced.commit


def test_rollback_leaves_no_trace_of_the_release(tmp_path, registry):
    first = publish_release(registry, package(tmp_path, "r1", b"weights-1"), "2026-11", entry("r1", "aaa"), champion=True)
    second = publish_release(registry, package(tmp_path, "r2", b"weights-2"), "2026-12", entry("r2", "bbb"), champion=True,
                             notes="# Release notes 2026-12\n")
    notes = registry / release_notes_path("2026-12")
    assert notes.read_text() == "# Release notes 2026-12\n" and git(registry, "ls-files", str(notes)) != ""
    rollback(registry, second.previous_head, "2026-12", second.previous_tag)
    assert not notes.exists()
    assert git(registry, "rev-parse", "HEAD") == first.commit
    assert git(registry, "tag", "--list") == "release/2026-11"
    assert read_channels(registry) == {"champion": "2026-11"}
    assert "2026-12" not in read_index(registry)
    assert not (registry / "releases" / "2026-12").exists()
    assert git(registry, "status", "--porcelain") == ""


def test_a_failed_forced_republish_restores_the_previous_tag_and_files(tmp_path, registry):
    first = publish_release(registry, package(tmp_path, "r1", b"weights-1"), "2026-11", entry("r1", "aaa"), champion=True)
    forced = publish_release(registry, package(tmp_path, "r2", b"weights-2"), "2026-11", entry("r2", "bbb"),
                             champion=True, force=True)
    rollback(registry, forced.previous_head, "2026-11", forced.previous_tag)
    assert git(registry, "rev-list", "-n", "1", "release/2026-11") == first.commit
    assert (registry / "releases" / "2026-11" / "adapter_model.safetensors").read_bytes() == b"weights-1"
