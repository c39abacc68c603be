"""Pull a release from the update channel with python-tuf's ngclient, verify it, install it.

The update channel (``tasks/release/update_channel.py``) is a TUF repository of static files at a URL:
``<url>/metadata/`` and ``<url>/targets/`` (``runtime/release/contract.py``). The device is given its
first root out of band (``--trusted-root FILE``, device config ``trusted_root``) and keeps what
ngclient has verified in ``--metadata-dir`` (newer roots after a rotation, the last timestamp,
snapshot and targets: metadata never goes back in version). ``refresh`` walks the root chain,
then timestamp -> snapshot -> targets, checking signatures against thresholds, versions,
lengths, hashes and expiry; metadata it cannot get fresh is never used: the pull is refused
(``UpdateRefused``, with a reason and an exit code) and the installed release stays.

The release target is ``releases/<month>.tar.gz``; by channel (``champion``, ``candidate``) the
month comes from the signed target ``channels.json`` (the default product's; another product's are
``products/<product>/releases/<month>.tar.gz`` and ``products/<product>/channels.json``). The tarball,
its length and sha256 checked by ngclient, is unpacked (``extract_tarball``) and goes through ``verify_release`` unchanged
(``runtime.release.pull.install``: manifest signature, files, rollback against the installed release,
engine checks), then is renamed into place. Torch-free, no DVC, git or Prefect.

A serving device that watches the channel (``runtime.serve.channel_watch``) takes the same steps
(``refreshed``, ``signed_channels``, ``channel_month``, ``target_info``, ``release_tarball``) and
loads the tarball through ``AdapterServer.load`` instead of ``install``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path, PurePosixPath

from tuf.api import exceptions
from tuf.api.metadata import TargetFile
from tuf.ngclient import Updater, UpdaterConfig

from runtime.engine.errors import RefusedInput
from runtime.release.contract import (
    DEFAULT_PRODUCT,
    MONTH,
    TUF_CHANNELS,
    TUF_CHANNELS_TARGET,
    TUF_METADATA_DIR,
    TUF_TARGETS_DIR,
    parse_channels,
    product_path,
    release_target_path,
)
from runtime.release.pull import install
from runtime.release.verify import DEFAULT_MAX_PACKAGE_BYTES, SizeLimitExceeded, VerifiedRelease, extract_tarball

# reason -> exit code of ``python -m runtime pull --tuf-url`` (30 is the registry's PullError)
EXIT_CODES = {"stale_metadata": 31, "untrusted_metadata": 32, "metadata_rollback": 33, "hash_mismatch": 34,
              "too_large": 35, "unreachable": 36, "unknown_target": 37, "repository": 38}
MAX_CHANNELS_BYTES = 1 << 16
# ngclient's errors, most specific first: the reason a refusal reports.
REASONS = (
    (exceptions.ExpiredMetadataError, "stale_metadata"),
    (exceptions.UnsignedMetadataError, "untrusted_metadata"),
    (exceptions.BadVersionNumberError, "metadata_rollback"),
    (exceptions.LengthOrHashMismatchError, "hash_mismatch"),
    (exceptions.DownloadLengthMismatchError, "too_large"),
    (exceptions.DownloadError, "unreachable"),
    (exceptions.RepositoryError, "repository"),
)


class UpdateRefused(RefusedInput):
    """The update channel gave nothing this device may install; ``reason`` is a key of EXIT_CODES."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"refused ({reason}): {message}")
        self.reason, self.exit_code = reason, EXIT_CODES[reason]


def refusal(err: Exception, url: str) -> UpdateRefused:
    """The UpdateRefused of one of ngclient's errors (RepositoryError or DownloadError)."""
    reason = next(reason for cls, reason in REASONS if isinstance(err, cls))
    return UpdateRefused(reason, f"update channel {url}: {type(err).__name__}: {err}; nothing was installed")


def open_updater(url: str, trusted_root: str | Path, metadata_dir: str | Path) -> Updater:
    """An ngclient Updater on ``url`` whose trust starts at the out-of-band ``trusted_root``."""
    try:
        root = Path(trusted_root).read_bytes()
    except OSError as err:
        raise UpdateRefused("untrusted_metadata", f"trusted root {trusted_root}: {err.strerror}") from None
    Path(metadata_dir).mkdir(parents=True, exist_ok=True)
    base = url.rstrip("/")
    try:
        # UpdaterConfig's per-role length limits (timestamp 16 KiB, root 512 kB, ...) bound endless data.
        return Updater(str(metadata_dir), f"{base}/{TUF_METADATA_DIR}/", target_base_url=f"{base}/{TUF_TARGETS_DIR}/",
                       config=UpdaterConfig(), bootstrap=root)
    except (exceptions.RepositoryError, ValueError) as err:
        raise UpdateRefused("untrusted_metadata", f"trusted root {trusted_root}: {err}") from None


def refreshed(url: str, trusted_root: str | Path, metadata_dir: str | Path) -> Updater:
    """An Updater whose top-level metadata is refreshed: fresh, verified, never older than what
    ``metadata_dir`` saw before; UpdateRefused when it cannot be. ngclient refreshes an Updater once:
    every pull, and every poll of a watching device, makes a new one."""
    updater = open_updater(url, trusted_root, metadata_dir)
    try:
        updater.refresh()
    except (exceptions.RepositoryError, exceptions.DownloadError) as err:
        raise refusal(err, url) from None
    return updater


def target_info(updater: Updater, url: str, path: str, max_bytes: int) -> TargetFile:
    """The signed targets metadata's entry for ``path`` (its length, hashes and custom fields)."""
    try:
        info = updater.get_targetinfo(path)
    except (exceptions.RepositoryError, exceptions.DownloadError) as err:
        raise refusal(err, url) from None
    if info is None:
        raise UpdateRefused("unknown_target", f"update channel {url}: the signed targets list no {path}")
    if info.length > max_bytes:
        raise SizeLimitExceeded(f"{url}: target {path} is {info.length} bytes, the device takes at most {max_bytes}")
    return info


def download(updater: Updater, url: str, info: TargetFile, out: Path) -> Path:
    """The target ``info`` names, saved as ``out`` once its length and hashes are the signed ones."""
    try:
        return Path(updater.download_target(info, str(out)))
    except (exceptions.RepositoryError, exceptions.DownloadError) as err:
        raise refusal(err, url) from None


def signed_channels(updater: Updater, url: str, workdir: Path, product: str = DEFAULT_PRODUCT) -> dict:
    """The signed ``channels.json`` of ``product`` (downloaded into ``workdir``): channel -> month."""
    target = product_path(TUF_CHANNELS_TARGET, product)
    info = target_info(updater, url, target, MAX_CHANNELS_BYTES)
    folder = Path(workdir) / product
    folder.mkdir(parents=True, exist_ok=True)
    path = download(updater, url, info, folder / TUF_CHANNELS_TARGET)
    try:
        return parse_channels(path.read_bytes(), f"update channel {url}: the signed {target}")
    except ValueError as err:
        raise UpdateRefused("repository", str(err)) from None


def channel_month(channels: dict, url: str, channel: str) -> str:
    """The month the signed ``channels`` name for ``channel``."""
    month = channels.get(channel)
    if not isinstance(month, str) or not MONTH.match(month):
        raise UpdateRefused("unknown_target", f"update channel {url}: {TUF_CHANNELS_TARGET} names no month for "
                            f"{channel!r} (channels: {', '.join(sorted(channels)) or 'none'}; known: {', '.join(TUF_CHANNELS)})")
    return month


def release_tarball(updater: Updater, url: str, info: TargetFile, workdir: Path) -> Path:
    """The release tarball ``info`` names, downloaded into ``workdir`` (ngclient checks its length and hash)."""
    return download(updater, url, info, Path(workdir) / PurePosixPath(info.path).name)


def tuf_pull(
    url: str,
    trusted_root: str | Path,
    metadata_dir: str | Path,
    target: str | Path,
    trusted_keys: dict,
    month: str | None = None,
    channel: str | None = None,
    iface=None,
    allow_rollback: bool = False,
    max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES,
    product: str = DEFAULT_PRODUCT,
    **verify_options,
) -> VerifiedRelease:
    """Install ``month`` (or the month ``channel`` names) of ``product`` from the update channel at ``url`` into ``target``.

    Raises UpdateRefused (stale, unsigned, rolled-back, altered or oversized metadata or target),
    or what ``runtime.release.pull.install`` raises (a PackageError subclass, PullError)."""
    if (month is None) == (channel is None):
        raise UpdateRefused("unknown_target", "give exactly one of a release month or a channel")
    if month is not None and not MONTH.match(month):
        raise UpdateRefused("unknown_target", f"release {month!r} is not a month YYYY-MM")

    updater = refreshed(url, trusted_root, metadata_dir)
    if channel is not None:
        with tempfile.TemporaryDirectory(prefix="tuf-channels-") as tmp:
            month = channel_month(signed_channels(updater, url, Path(tmp), product), url, channel)
    path = release_target_path(month, product)
    info = target_info(updater, url, path, max_bytes)

    def fetch(out: Path) -> None:
        extract_tarball(release_tarball(updater, url, info, out.parent), out, max_bytes)

    return install(fetch, f"update channel {url}: {path}", month, target, trusted_keys, iface, allow_rollback,
                   max_bytes=max_bytes, product=product, **verify_options)
