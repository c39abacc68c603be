"""Release test kit: a tiny world of signed releases, re-signing, and a real git + DVC registry.

``world(tmp_path_factory)`` builds (about 12 s on 2 cores) a random Qwen2 with a trained
tokenizer, its compiled engine, a signing key and two packaged releases, A (2026-10, r=4) and
B (2026-11, r=8), with the same code the benchmark uses (``bench.serving.hotswap_bench``).
``make_registry`` writes what the publish stage publishes: git + DVC, ``releases/<month>``
tracked by DVC and pushed to a local remote, tagged ``release/<month>``, ``channels.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.lib.worlds import build_tiny_world
from runtime.engine.hashing import sha256_file
from runtime.release.contract import (
    MANIFEST,
    REGISTRY_CHANNELS,
    SIGNATURE,
    manifest_bytes,
    registry_release_path,
    release_tag,
)
from runtime.release.signing import key_id, load_private_key, sign

DVC = str(Path(sys.executable).parent / "dvc")
ENV = os.environ | {"DVC_NO_ANALYTICS": "1", "GIT_TERMINAL_PROMPT": "0"}


def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("world")
    w = build_tiny_world(root)
    w["root"] = root
    w["key"] = root / "keys" / "release_signing.key"
    w["a"], w["b"] = w["releases"]
    return w


def copy_release(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def resign(release: Path, key: Path, **overrides) -> dict:
    """Recompute the file list of ``release``, apply manifest overrides, sign with ``key``: what a
    pipeline (bug) holding the trusted key would publish."""
    manifest = json.loads((release / MANIFEST).read_text())
    manifest["files"] = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                         for p in sorted(release.iterdir()) if p.name not in (MANIFEST, SIGNATURE)}
    private = load_private_key(key)
    manifest["signing_key_id"] = key_id(private.public_key())
    manifest.update(overrides)
    data = manifest_bytes(manifest)
    (release / MANIFEST).write_bytes(data)
    (release / SIGNATURE).write_bytes(sign(private, data))
    return manifest


def run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr[-2000:]}"
    return done.stdout


def make_registry(root: Path, releases: dict[str, Path], channels: dict[str, str]) -> Path:
    """A release registry as the publish stage writes it, with a real git repository and DVC remote."""
    registry, remote = root / "registry", root / "dvc-remote"
    registry.mkdir(parents=True)
    run(["git", "init", "-q", "-b", "main"], registry)
    run(["git", "config", "user.name", "release-bot"], registry)
    run(["git", "config", "user.email", "release-bot@example.invalid"], registry)
    run([DVC, "init", "-q"], registry)
    run([DVC, "config", "core.analytics", "false"], registry)
    run([DVC, "remote", "add", "-d", "origin", str(remote.absolute())], registry)
    run(["git", "add", "-A"], registry)
    run(["git", "commit", "-q", "-m", "registry"], registry)
    for month, release in sorted(releases.items()):
        shutil.copytree(release, registry / registry_release_path(month))
        run([DVC, "add", "-q", registry_release_path(month)], registry)
        run(["git", "add", f"{registry_release_path(month)}.dvc", "releases/.gitignore"], registry)
        run(["git", "commit", "-q", "-m", f"release {month}"], registry)
        run(["git", "tag", release_tag(month)], registry)
        run([DVC, "push", "-q"], registry)
    (registry / REGISTRY_CHANNELS).write_text(json.dumps(channels, indent=2, sort_keys=True) + "\n")
    run(["git", "add", REGISTRY_CHANNELS], registry)
    run(["git", "commit", "-q", "-m", "channels"], registry)
    return registry
