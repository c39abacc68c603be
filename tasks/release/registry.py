"""The release registry: a git + DVC repository that devices pull published releases from.

Layout (names: ``runtime/release/contract.py``; the device side, ``runtime/release/pull.py``, reads exactly this):

- ``releases/<month>/`` the release directory, tracked by DVC as ``releases/<month>.dvc``; its
  files live in the DVC remote;
- ``releases/index.json`` month -> release id, adapter sha256, headline metrics, MLflow version;
- ``channels.json`` alias -> month, e.g. ``{"champion": "2026-11"}``;
- ``releases/<month>.RELEASE_NOTES.md`` what the release changed and measured (``tasks/release/notes.py``);
- a tag ``release/<month>`` on the commit that published the month.

That is the default product's; another product's (``data.product``) are the same under
``products/<product>/`` with the tag ``release/<product>/<month>`` (``runtime.release.contract.product_path``).

``.dvc/config`` in the registry names the remote, so ``dvc get <registry> releases/<month>``
works on any machine that can reach both. Publishing is one commit plus one tag plus one push;
``rollback`` returns the registry to the commit before, so a failure half way leaves no
visible half release.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime.release.contract import (
    DEFAULT_PRODUCT,
    REGISTRY_CHANNELS,
    REGISTRY_INDEX,
    REGISTRY_RELEASES,
    RELEASE_NOTES,
    channels_bytes,
    parse_channels,
    product_path,
    registry_release_path,
    release_tag,
)
from tasks.artifacts import write_json
from tasks.config import StageError
from tasks.release.stage_runner import DVC_ENV, REMOTE_NAME, remote_url

GIT_IDENTITY = {"user.name": "adapter-release", "user.email": "adapter-release@localhost"}


class PublishError(StageError):
    """A release that cannot be published (already published differently, or a registry problem)."""


@dataclass(frozen=True)
class Published:
    month: str
    release_id: str
    commit: str
    tag: str
    previous_head: str  # where ``rollback`` returns the registry
    previous_tag: str | None  # the commit the month's tag named before (a forced republish), if any
    already: bool  # True: this exact release was already published; nothing was done
    product: str = DEFAULT_PRODUCT


def _run(cwd: Path, *cmd: str) -> str:
    done = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, env={**os.environ, **DVC_ENV})
    if done.returncode != 0:
        raise PublishError(f"`{' '.join(cmd)}` failed in {cwd}: {(done.stderr or done.stdout).strip()[-2000:]}")
    return done.stdout.strip()


def _git(registry: Path, *args: str) -> str:
    return _run(registry, "git", *args)


def _dvc(registry: Path, *args: str) -> str:
    return _run(registry, os.sys.executable, "-m", "dvc", *args)


FAULT_ENV = "RELEASE_FAULT_POINT"


def fault_point(name: str) -> None:
    """Die here, as a power cut would, when ``RELEASE_FAULT_POINT`` names this point (fault-injection tests)."""
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def ensure_registry(registry_dir: Path, remote_dir: str) -> Path:
    """Create the registry (git, DVC, remote, empty channels and index) if it does not exist.

    ``remote_dir`` is a folder (relative to the working directory) or a URL such as ``s3://bucket/releases``.
    """
    registry = Path(registry_dir).resolve()
    remote = remote_url(Path.cwd(), remote_dir)
    if not (registry / ".git").exists():
        registry.mkdir(parents=True, exist_ok=True)
        _git(registry, "init", "-q", "-b", "main")
        for key, value in GIT_IDENTITY.items():
            _git(registry, "config", key, value)
    if not (registry / ".dvc").exists():
        _dvc(registry, "init", "-q")
        _dvc(registry, "config", "core.analytics", "false")
    _dvc(registry, "remote", "add", "-d", "-f", REMOTE_NAME, remote)
    if not (registry / REGISTRY_CHANNELS).exists():
        (registry / REGISTRY_CHANNELS).write_bytes(channels_bytes({}))
    if not (registry / REGISTRY_INDEX).exists():
        (registry / REGISTRY_INDEX).parent.mkdir(parents=True, exist_ok=True)
        write_json(registry / REGISTRY_INDEX, {})
    _git(registry, "add", "-A")
    if _git(registry, "status", "--porcelain"):
        _git(registry, "commit", "-q", "-m", f"registry: DVC remote {remote}")
    return registry


@contextlib.contextmanager
def registry_lock(registry_dir: Path, timeout: float = 600.0) -> Iterator[None]:
    """One publisher at a time. An OS lock (flock) dies with its process: a killed run leaves none behind."""
    path = Path(registry_dir).resolve() / ".git" / "publish.lock"
    deadline = time.monotonic() + timeout
    with open(path, "w") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PublishError(f"{path}: another run has been publishing for over {timeout:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def push_release(registry_dir: Path, month: str, product: str = DEFAULT_PRODUCT) -> None:
    """Push the month's files to the remote again (idempotent): repairs a run killed after its commit."""
    _dvc(Path(registry_dir).resolve(), "push", "-q", f"{registry_release_path(month, product)}.dvc")


def read_index(registry: Path, product: str = DEFAULT_PRODUCT) -> dict:
    path = Path(registry) / product_path(REGISTRY_INDEX, product)
    return json.loads(path.read_text()) if path.exists() else {}


def read_channels(registry: Path, product: str = DEFAULT_PRODUCT) -> dict:
    """The product's ``channels.json`` (channel -> month); {} before its first publish."""
    path = Path(registry) / product_path(REGISTRY_CHANNELS, product)
    if not path.exists():
        return {}
    try:
        return parse_channels(path.read_bytes(), str(path))
    except ValueError as err:
        raise PublishError(str(err)) from None


def _head(registry: Path) -> str:
    return _git(registry, "rev-parse", "HEAD")


def tag_exists(registry: Path, tag: str) -> bool:
    return bool(_git(registry, "tag", "--list", tag))


def release_notes_path(month: str, product: str = DEFAULT_PRODUCT) -> str:
    """The month's release notes in the registry, beside its release directory (git-tracked, not DVC)."""
    return f"{registry_release_path(month, product)}.{RELEASE_NOTES}"


def publish_release(registry_dir: Path, release_dir: Path, month: str, entry: dict, champion: bool,
                    force: bool = False, lineage: Path | None = None, notes: str | None = None,
                    product: str = DEFAULT_PRODUCT) -> Published:
    """Commit ``release_dir`` as ``releases/<month>``, tag it, push its files, and (``champion``)
    point the champion channel at it. ``entry`` must hold ``release_id`` and ``adapter_sha256``.
    ``lineage`` (the pipeline's ``dvc.lock``) is committed beside it as ``releases/<month>.dvc.lock``:
    the exact code, parameters and data hashes that produced the release. ``notes`` (markdown) are
    committed as ``release_notes_path(month)``.

    The same release published twice is reported, not repeated; a different release for a
    month already published is refused unless ``force``. ``product``: the line of releases it is published in
    (its paths, channels and index are that product's).
    """
    with registry_lock(registry_dir):
        return _publish_locked(Path(registry_dir).resolve(), Path(release_dir), month, entry, champion, force, lineage,
                               notes, product)


def _publish_locked(registry: Path, release_dir: Path, month: str, entry: dict, champion: bool, force: bool,
                    lineage: Path | None, notes: str | None, product: str) -> Published:
    tag = release_tag(month, product)
    previous = _head(registry)
    previous_tag = _git(registry, "rev-list", "-n", "1", tag) if tag_exists(registry, tag) else None
    existing = read_index(registry, product).get(month)
    if existing is not None and previous_tag is not None:
        if existing.get("adapter_sha256") == entry["adapter_sha256"] and not force:
            return Published(month, existing["release_id"], previous_tag, tag, previous, previous_tag, True, product)
        if not force:
            raise PublishError(
                f"{month} is already published as {existing['release_id']} with another adapter "
                f"(sha256 {existing['adapter_sha256'][:12]}); set publish.force: true to replace it"
            )
    target = registry / registry_release_path(month, product)
    try:
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(release_dir, target)
        _dvc(registry, "add", "-q", registry_release_path(month, product))
        if lineage is not None:
            shutil.copyfile(lineage, registry / f"{registry_release_path(month, product)}.dvc.lock")
        if notes is not None:
            (registry / release_notes_path(month, product)).write_text(notes)
        index = read_index(registry, product)
        index[month] = entry
        write_json(registry / product_path(REGISTRY_INDEX, product), index)
        channels = product_path(REGISTRY_CHANNELS, product)
        if champion:
            (registry / channels).write_bytes(channels_bytes(read_channels(registry, product) | {"champion": month}))
        _git(registry, "add", "-A", product_path(REGISTRY_RELEASES, product),
             *([channels] if (registry / channels).exists() else []))
        _git(registry, "commit", "-q", "-m", f"release {entry['release_id']} ({month})"
             + ("" if product == DEFAULT_PRODUCT else f" of {product}") + (", champion" if champion else ""))
        _git(registry, "tag", "-f", tag)
        fault_point("registry-committed")
        _dvc(registry, "push", "-q", f"{registry_release_path(month, product)}.dvc")
    except BaseException:
        rollback(registry, previous, month, previous_tag, product)
        raise
    return Published(month, entry["release_id"], _head(registry), tag, previous, previous_tag, False, product)


def rollback(registry_dir: Path, previous_head: str, month: str, previous_tag: str | None,
             product: str = DEFAULT_PRODUCT) -> None:
    """Return the registry to ``previous_head``: commit, the month's tag and its working files.

    Objects already pushed to the remote stay: they are content-addressed and nothing names them.
    """
    registry = Path(registry_dir).resolve()
    tag = release_tag(month, product)
    _git(registry, "reset", "-q", "--hard", previous_head)
    # notes (and a product's first channels and index) written but never committed
    _git(registry, "clean", "-fq", "--", release_notes_path(month, product), product_path(REGISTRY_CHANNELS, product),
         product_path(REGISTRY_INDEX, product))
    if previous_tag is not None:
        _git(registry, "tag", "-f", tag, previous_tag)
    elif tag_exists(registry, tag):
        _git(registry, "tag", "-d", tag)
    target = registry / registry_release_path(month, product)
    if (registry / f"{registry_release_path(month, product)}.dvc").exists():
        _dvc(registry, "checkout", "-q", "--force", f"{registry_release_path(month, product)}.dvc")
    elif target.exists():
        shutil.rmtree(target)
