"""Pull a release from the release registry with the ``dvc`` command, verify it, install it.

The registry (written by the pipeline's publish stage) is a git repository with DVC, whose
default remote holds the release files:

  releases/<month>.dvc   DVC pointer of the directory releases/<month>/ (a release, runtime/release/verify.py)
  channels.json          git-tracked aliases: {"champion": "2026-11", ...}
  tag release/<month>    the commit that published <month>

(the default product's; another product's are under ``products/<product>/``, tagged
``release/<product>/<month>``: ``runtime.release.contract.product_path``).

``pull`` runs ``dvc get <registry> releases/<month> --rev release/<month>`` (for an alias it
first gets ``channels.json`` at the registry's default branch, or ``--rev``) into a hidden
temporary sibling of the target, verifies it there (signature, checksums, expiry, rollback
against the release already installed in the target, and the engine checks when an engine is
given), and only then renames it into place (``runtime.release.device_state.install_folder``: fsynced first,
as the device state installs its copies). A refused release leaves the target untouched.
The machine needs the runtime's dependencies and DVC (as a command, never imported here).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from runtime.engine.errors import RefusedInput
from runtime.release.contract import (
    DEFAULT_PRODUCT,
    MANIFEST,
    MONTH,
    REGISTRY_CHANNELS,
    parse_channels,
    product_path,
    registry_release_path,
    release_order,
    release_tag,
)
from runtime.release.device_state import install_folder
from runtime.release.verify import PackageError, VerifiedRelease, verify_release

ALIAS = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


class PullError(RefusedInput):
    """The registry could not give the release asked for (unknown alias or month, dvc failure)."""

    reason, exit_code = "pull", 30


def dvc_command() -> list[str]:
    """The ``dvc`` executable: on PATH, or beside this Python (a virtual environment's bin/)."""
    found = shutil.which("dvc") or shutil.which("dvc", path=str(Path(sys.executable).parent))
    if found is None:
        raise PullError("the dvc command is not installed (pip install dvc); pull fetches releases with `dvc get`")
    return [found]


def dvc_get(registry: str, path: str, out: Path, rev: str | None) -> None:
    cmd = dvc_command() + ["get", str(registry), path, "-o", str(out)] + (["--rev", rev] if rev else [])
    env = os.environ | {"DVC_NO_ANALYTICS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise PullError(f"`dvc {' '.join(cmd[1:])}` failed: {' '.join(detail[-3:]) if detail else 'exit ' + str(done.returncode)}")


def resolve_alias(registry: str, alias: str, rev: str | None = None, product: str = DEFAULT_PRODUCT) -> str:
    """The month an alias of ``product``'s ``channels.json`` names, at ``rev`` (default: the registry's default branch)."""
    if not ALIAS.match(alias):
        raise PullError(f"alias {alias!r} is not a channel name")
    path = product_path(REGISTRY_CHANNELS, product)
    with tempfile.TemporaryDirectory(prefix="channels-") as tmp:
        out = Path(tmp) / REGISTRY_CHANNELS
        dvc_get(registry, path, out, rev)
        try:
            channels = parse_channels(out.read_bytes(), f"{registry}: {path}")
        except ValueError as err:
            raise PullError(str(err)) from None
    month = channels.get(alias)
    if month is None:
        raise PullError(f"{registry}: {path} has no alias {alias!r} naming a month (aliases: {', '.join(sorted(channels)) or 'none'})")
    return month


def installed_release_id(target: Path) -> str | None:
    """Release id of what ``target`` holds now (verified when it was installed), for rollback checks."""
    manifest = Path(target) / MANIFEST
    if not manifest.is_file():
        return None
    try:
        release_id = json.loads(manifest.read_text()).get("release_id")
        release_order(release_id)
        return release_id
    except (OSError, ValueError, AttributeError):  # not a release we installed: nothing to protect
        return None


def pull(
    registry: str,
    target: str | Path,
    trusted_keys: dict,
    month: str | None = None,
    alias: str | None = None,
    rev: str | None = None,
    iface=None,
    allow_rollback: bool = False,
    product: str = DEFAULT_PRODUCT,
    **verify_options,
) -> VerifiedRelease:
    """Fetch ``month`` (or the month ``alias`` names) of ``product`` from ``registry`` into ``target``, verified.

    ``target`` is replaced as a whole, and only after verification passed; its previous release
    is the active one for rollback protection. Raises PullError or a PackageError subclass.
    """
    if (month is None) == (alias is None):
        raise PullError("give exactly one of a release month or an alias")
    if alias is not None:
        month = resolve_alias(registry, alias, rev, product)
    if not MONTH.match(month):
        raise PullError(f"release {month!r} is not a month YYYY-MM")
    path = registry_release_path(month, product)
    fetch = functools.partial(dvc_get, registry, path, rev=release_tag(month, product))
    return install(fetch, f"{registry}: {path}", month, target, trusted_keys, iface, allow_rollback, product=product,
                   **verify_options)


def install(fetch: Callable[[Path], None], source: str, month: str, target: str | Path, trusted_keys: dict, iface=None,
            allow_rollback: bool = False, **verify_options) -> VerifiedRelease:
    """``fetch(dir)`` a release of ``month`` into a hidden staging sibling of ``target``, verify it
    (``verify_release``, rollback against what ``target`` holds), then install it there (``install_folder``).
    ``source`` names where it came from in a refusal."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.pull-", dir=target.parent))
    try:
        fetched = staging / "release"
        fetch(fetched)
        try:
            verified = verify_release(fetched, trusted_keys, iface, active_release=installed_release_id(target),
                                      allow_rollback=allow_rollback, month=month, **verify_options)
        except PackageError as err:  # it names the staging folder, gone on return: say where the release came from
            raise type(err)(f"{source}: {err}") from None
        install_folder(fetched, target, replaced=staging / "previous")
        verified.path = target
        return verified
    finally:
        shutil.rmtree(staging, ignore_errors=True)
