"""The update channel: a TUF repository of the published releases, written with python-tuf's Metadata API.

Plain static files (names: ``runtime/release/contract.py``) that any HTTP server, object store or the DVC
remote can serve, e.g. ``python -m http.server -d tuf 8000``; devices pull with python-tuf's
ngclient (``runtime/release/tuf_pull.py``):

- ``metadata/<n>.root.json`` every root version (a device walks them from the root it was given);
- ``metadata/<n>.targets.json``: every release tarball ``releases/<month>.tar.gz`` (custom fields
  month, release id, base model hash, engine interface hash) and ``channels.json`` (champion, the
  registry's; candidate, the newest month published): the channel pointers are signed like releases.
  That is the default product's; another product's are ``products/<product>/releases/<month>.tar.gz``
  and ``products/<product>/channels.json`` (``runtime.release.contract.product_path``), in the same
  metadata, signed by the same keys;
- ``metadata/<n>.snapshot.json``, ``metadata/timestamp.json`` (written last: the switch to a new
  state; a crash before it leaves the previous state served);
- ``targets/<dir>/<sha256>.<name>`` (consistent snapshots: a file once written never changes).

Keys (Ed25519 PEM, ``runtime.release.signing``; created if missing, never overwritten or deleted) are the
files ``<role>-<n>.key`` in ``publish.tuf_keys_dir``: root ``ROOT_KEYS`` keys with threshold
``ROOT_THRESHOLD``, one online key each for targets, snapshot and timestamp. The root keys are only
needed to create the repository and to change keys (``rotate-root``, ``revoke-key``): keep them
offline and bring them back with ``--root-key`` (docs/update-channel.md).

    python -m tasks.release.update_channel init | refresh | status [--params params.yaml]
    python -m tasks.release.update_channel rotate-root [--add-key FILE] [--remove-key KEYID] [--threshold N] [--root-key FILE]
    python -m tasks.release.update_channel revoke-key KEYID --replacement FILE [--root-key FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import functools
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from securesystemslib.signer import CryptoSigner, Signer
from tuf.api.metadata import (
    SPECIFICATION_VERSION,
    Metadata,
    MetaFile,
    Role,
    Root,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from runtime.engine.atomic_files import atomic_copy, atomic_write
from runtime.release.contract import (
    DEFAULT_PRODUCT,
    MANIFEST,
    TUF_CHANNELS_TARGET,
    TUF_METADATA_DIR,
    TUF_TARGETS_DIR,
    channels_bytes,
    manifest_product,
    product_path,
    registry_release_path,
    release_target_path,
)
from runtime.release.signing import generate_key, load_private_key
from runtime.release.verify import write_tarball
from tasks.config import PublishConfig, StageError

ROOT_KEYS, ROOT_THRESHOLD = 3, 2
ONLINE_ROLES = (Targets.type, Snapshot.type, Timestamp.type)
EXPIRY_DAYS = {Root.type: 365, Targets.type: 90, Snapshot.type: 7}  # timestamp: publish.timestamp_expiry_days
RENEW_WITHIN_DAYS = {Targets.type: 14, Snapshot.type: 2}  # refresh re-signs a role this close to its expiry
HASHES = ["sha256"]
LOCK_FILE = ".lock"
SERIALIZER = JSONSerializer(compact=False)


class UpdateChannelError(StageError):
    """The TUF repository cannot be written as asked (missing keys, a threshold not met, a bad key id)."""


@dataclass(frozen=True)
class Channel:
    """Where the repository and its keys are, and how long a timestamp lives."""

    repo: Path
    keys: Path
    timestamp_expiry_days: int = 1

    @classmethod
    def from_config(cls, publish: PublishConfig) -> "Channel":
        return cls(Path(publish.tuf_dir), Path(publish.tuf_keys_dir), publish.timestamp_expiry_days)

    @property
    def metadata(self) -> Path:
        return self.repo / TUF_METADATA_DIR

    @property
    def targets(self) -> Path:
        return self.repo / TUF_TARGETS_DIR


@dataclass
class State:
    """The repository's current metadata (the newest root, and what timestamp.json names)."""

    root: Metadata[Root]
    targets: Metadata[Targets]
    snapshot: Metadata[Snapshot]
    timestamp: Metadata[Timestamp]


def _now(now: dt.datetime | None) -> dt.datetime:
    return (now or dt.datetime.now(dt.timezone.utc)).replace(microsecond=0)


def _expiry(channel: Channel, role: str, now: dt.datetime) -> dt.datetime:
    days = channel.timestamp_expiry_days if role == Timestamp.type else EXPIRY_DAYS[role]
    return now + dt.timedelta(days=days)


# ---------------------------------------------------------------- keys

def _signer(path: Path) -> CryptoSigner:
    return CryptoSigner(load_private_key(path))


def key_file(channel: Channel, role: str, n: int = 1) -> Path:
    return channel.keys / f"{role}-{n}.key"


def ensure_key(path: Path) -> CryptoSigner:
    """The signer of the key at ``path``, created (mode 0600, with its .pub) if the file does not exist."""
    path = Path(path)
    if not path.exists():
        generate_key(path)
    return _signer(path)


def signers(channel: Channel, extra: list[Path] = ()) -> dict[str, Signer]:
    """key id -> signer of every private key in the keys folder and of ``extra`` (offline root keys)."""
    files = sorted(channel.keys.glob("*.key")) if channel.keys.is_dir() else []
    out = {}
    for path in [*files, *map(Path, extra)]:
        signer = _signer(path)
        out[signer.public_key.keyid] = signer
    return out


def _sign(md: Metadata, role: Role, available: dict[str, Signer], what: str) -> None:
    """Sign ``md`` with every available key of ``role``; refuse below its threshold."""
    md.signatures.clear()
    used = [available[k] for k in role.keyids if k in available]
    if len(used) < role.threshold:
        missing = [k[:12] for k in role.keyids if k not in available]
        raise UpdateChannelError(f"{what}: {len(used)} of the keys needed (threshold {role.threshold}) are available; "
                                 f"missing key ids {missing} (bring offline root keys with --root-key FILE)")
    for signer in used:
        md.sign(signer, append=True)


# ---------------------------------------------------------------- files

def _write(path: Path, data: bytes) -> None:
    """Atomic and durable: a reader (the HTTP server) sees the old file or the new one, never part of one
    (the temporary file is a dot-file, which the device passes over)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)


def _metadata_file(channel: Channel, role: str, version: int) -> Path:
    name = f"{role}.json" if role == Timestamp.type else f"{version}.{role}.json"
    return channel.metadata / name


def _target_file(channel: Channel, path: str, sha256: str) -> Path:
    folder, _, name = path.rpartition("/")
    return channel.targets / folder / f"{sha256}.{name}"


def _load(path: Path) -> Metadata:
    try:
        return Metadata.from_bytes(path.read_bytes())
    except OSError as err:
        raise UpdateChannelError(f"{path}: cannot read TUF metadata ({err.strerror}); is {path.parent.parent} "
                                 "an update channel (python -m tasks.release.update_channel init)?") from None


def root_versions(channel: Channel) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in channel.metadata.glob("*.root.json"))


def load_state(channel: Channel) -> State:
    versions = root_versions(channel)
    if not versions:
        raise UpdateChannelError(f"{channel.metadata}: no root metadata; create the repository first "
                                 "(python -m tasks.release.update_channel init)")
    root = _load(_metadata_file(channel, Root.type, versions[-1]))
    timestamp = _load(_metadata_file(channel, Timestamp.type, 0))
    snapshot = _load(_metadata_file(channel, Snapshot.type, timestamp.signed.snapshot_meta.version))
    targets = _load(_metadata_file(channel, Targets.type, snapshot.signed.meta[f"{Targets.type}.json"].version))
    return State(root, targets, snapshot, timestamp)


def _save(channel: Channel, md: Metadata) -> bytes:
    """Write signed metadata where its role and version put it; return its bytes."""
    data = md.to_bytes(SERIALIZER)
    _write(_metadata_file(channel, md.signed.type, md.signed.version), data)
    return data


def _resign(channel: Channel, state: State, roles: set[str], available: dict[str, Signer], now: dt.datetime) -> list[str]:
    """New versions of ``roles`` and of every role that names them (targets -> snapshot -> timestamp),
    signed and written in that order; timestamp.json last. Returns the roles written."""
    written = []
    root = state.root.signed
    if Targets.type in roles:
        state.targets.signed.version += 1
        state.targets.signed.expires = _expiry(channel, Targets.type, now)
        _sign(state.targets, root.get_delegated_role(Targets.type), available, Targets.type)
        data = _save(channel, state.targets)
        state.snapshot.signed.meta[f"{Targets.type}.json"] = MetaFile.from_data(state.targets.signed.version, data, HASHES)
        written.append(Targets.type)
    if written or Snapshot.type in roles:
        state.snapshot.signed.version += 1
        state.snapshot.signed.expires = _expiry(channel, Snapshot.type, now)
        _sign(state.snapshot, root.get_delegated_role(Snapshot.type), available, Snapshot.type)
        data = _save(channel, state.snapshot)
        state.timestamp.signed.snapshot_meta = MetaFile.from_data(state.snapshot.signed.version, data, HASHES)
        written.append(Snapshot.type)
    state.timestamp.signed.version += 1
    state.timestamp.signed.expires = _expiry(channel, Timestamp.type, now)
    _sign(state.timestamp, root.get_delegated_role(Timestamp.type), available, Timestamp.type)
    _save(channel, state.timestamp)
    return written + [Timestamp.type]


# ---------------------------------------------------------------- repository life cycle

_held: set[Path] = set()  # the repositories this process holds the lock of (a locked call may call another)


def _one_writer(write):
    """One writer of a repository at a time: the flow's publish, the refresh deployment and a person's
    command would otherwise each sign version n+1 from the same state, and one of them would be lost."""

    @functools.wraps(write)
    def locked(channel: Channel, *args, **kwargs):
        path = (channel.repo / LOCK_FILE).absolute()
        if path in _held:
            return write(channel, *args, **kwargs)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # an OS lock: it dies with a killed writer
            _held.add(path)
            try:
                return write(channel, *args, **kwargs)
            finally:
                _held.discard(path)
                fcntl.flock(fh, fcntl.LOCK_UN)

    return locked


@_one_writer
def ensure_repository(channel: Channel, now: dt.datetime | None = None) -> State:
    """Create the repository (keys if missing, root v1, empty targets, snapshot, timestamp) unless it exists.
    A creation killed before its timestamp was never served: it is made again."""
    if _metadata_file(channel, Timestamp.type, 0).exists():
        return load_state(channel)
    now = _now(now)
    root_signers = [ensure_key(key_file(channel, Root.type, n)) for n in range(1, ROOT_KEYS + 1)]
    online = {role: ensure_key(key_file(channel, role)) for role in ONLINE_ROLES}
    root = Root(expires=_expiry(channel, Root.type, now), consistent_snapshot=True)
    for signer in root_signers:
        root.add_key(signer.public_key, Root.type)
    root.roles[Root.type].threshold = ROOT_THRESHOLD
    for role, signer in online.items():
        root.add_key(signer.public_key, role)
    available = {s.public_key.keyid: s for s in [*root_signers, *online.values()]}
    state = State(Metadata(root), Metadata(Targets()), Metadata(Snapshot()), Metadata(Timestamp()))
    for md in (state.targets, state.snapshot, state.timestamp):
        md.signed.version = 0  # _resign below writes each as version 1
    _sign(state.root, root.roles[Root.type], available, "root")
    _save(channel, state.root)
    _resign(channel, state, {Targets.type}, available, now)
    return state


def release_target(release_dir: Path, tarball: Path, month: str, product: str = DEFAULT_PRODUCT) -> TargetFile:
    """The target of a release tarball, with the manifest's identity as custom fields."""
    manifest = json.loads((Path(release_dir) / MANIFEST).read_text())
    custom = {"month": month, "release_id": manifest["release_id"], "base_model_hash": manifest["base_model_hash"],
              "engine_interface_hash": manifest["engine"]["interface_hash"]}
    target = TargetFile.from_file(release_target_path(month, product), str(tarball), HASHES)
    target.unrecognized_fields["custom"] = custom
    return target


def _add_target(channel: Channel, state: State, target: TargetFile, source: Path) -> bool:
    """Copy ``source`` to its content-addressed place and list it; False if already listed as is."""
    if state.targets.signed.targets.get(target.path) == target:
        return False
    dest = _target_file(channel, target.path, target.hashes["sha256"])
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        atomic_copy(source, dest)
    state.targets.signed.targets[target.path] = target
    return True


@_one_writer
def publish_release(channel: Channel, release_dir: Path, month: str, champion: str | None,
                    now: dt.datetime | None = None, product: str = DEFAULT_PRODUCT) -> list[str]:
    """Make ``month``'s release a target of ``product``, that product's channels ``champion`` (as given) and
    ``candidate`` (the newest month of its targets: a rerun of an older month never moves it back) a signed
    target, and sign new targets, snapshot and timestamp. Idempotent: the same release and channels again write
    nothing (returns the roles written, [] then). A release of another month or product is refused: devices
    refuse it."""
    manifest = json.loads((Path(release_dir) / MANIFEST).read_text())
    if manifest["month"] != month:
        raise UpdateChannelError(f"{release_dir}: a release of {manifest['month']}, not {month}; not published")
    if manifest_product(manifest) != product:
        raise UpdateChannelError(f"{release_dir}: a release of product {manifest_product(manifest)}, not {product}; "
                                 "not published")
    state = ensure_repository(channel, now)
    with tempfile.TemporaryDirectory(prefix="tuf-target-") as tmp:
        tarball = write_tarball(Path(release_dir), Path(tmp) / f"{month}.tar.gz")
        changed = _add_target(channel, state, release_target(release_dir, tarball, month, product), tarball)
        newest = max(t.custom["month"] for t in state.targets.signed.targets.values()
                     if t.custom and t.path == release_target_path(t.custom["month"], product))
        channels = {"candidate": newest} | ({"champion": champion} if champion else {})
        pointer = Path(tmp) / TUF_CHANNELS_TARGET
        pointer.write_bytes(channels_bytes(channels))
        changed |= _add_target(channel, state, TargetFile.from_file(product_path(TUF_CHANNELS_TARGET, product),
                                                                    str(pointer), HASHES), pointer)
    if not changed:
        return []
    return _resign(channel, state, {Targets.type}, signers(channel), _now(now))


def publish_from_registry(publish: PublishConfig, month: str, now: dt.datetime | None = None,
                          product: str = DEFAULT_PRODUCT) -> list[str]:
    """Sign the registry's ``month`` of ``product`` (as ``releases/<month>`` holds it) and the product's champion
    into the update channel. The flow runs it once the registry has committed; a rerun
    (``tasks.release.steps.reconcile_published``) finishes it after a crash. Returns the roles written ([]: the
    channel already said so)."""
    from tasks.release.registry import read_channels

    registry = Path(publish.registry_dir)
    champion = read_channels(registry, product).get("champion")
    return publish_release(Channel.from_config(publish), registry / registry_release_path(month, product), month,
                           champion, now, product)


@_one_writer
def refresh(channel: Channel, now: dt.datetime | None = None) -> list[str]:
    """A new timestamp (and snapshot or targets close to their expiry) without a release: the daily run."""
    now = _now(now)
    state = load_state(channel)
    due = {role for role, days in RENEW_WITHIN_DAYS.items()
           if getattr(state, role).signed.expires <= now + dt.timedelta(days=days)}
    return _resign(channel, state, due, signers(channel), now)


def _new_root(channel: Channel, state: State, change, available: dict[str, Signer], now: dt.datetime) -> Metadata[Root]:
    """Root version n+1 changed by ``change(root)``, signed by the threshold of root n and of n+1."""
    old = state.root
    new = Metadata.from_bytes(old.to_bytes())
    change(new.signed)
    new.signed.version += 1
    new.signed.expires = _expiry(channel, Root.type, now)
    new.signatures.clear()
    for keyid in dict.fromkeys(old.signed.roles[Root.type].keyids + new.signed.roles[Root.type].keyids):
        if keyid in available:
            new.sign(available[keyid], append=True)
    for name, trusted in (("the current root", old.signed), ("the new root", new.signed)):
        result = trusted.get_verification_result(Root.type, new.signed_bytes, new.signatures)
        if not result.verified:
            raise UpdateChannelError(
                f"root v{new.signed.version} must be signed by the threshold of {name} "
                f"({trusted.roles[Root.type].threshold}); signed by {len(result.signed)}, missing key ids "
                f"{sorted(k[:12] for k in result.unsigned)} (bring offline root keys with --root-key FILE)")
    _save(channel, new)
    state.root = new
    return new


@_one_writer
def rotate_root(channel: Channel, add_keys: list[Path] = (), remove_keyids: list[str] = (), threshold: int | None = None,
                root_keys: list[Path] = (), now: dt.datetime | None = None) -> int:
    """A new root with root keys added (created if missing) or removed and/or a new threshold; returns its version."""
    state = load_state(channel)
    new_signers = [ensure_key(Path(p)) for p in add_keys]
    added = [signer.public_key for signer in new_signers]

    def change(root: Root) -> None:
        for key in added:
            root.add_key(key, Root.type)
        for keyid in remove_keyids:
            root.revoke_key(_full_keyid(root, keyid, Root.type), Root.type)
        if threshold is not None:
            root.roles[Root.type].threshold = threshold
        if root.roles[Root.type].threshold > len(root.roles[Root.type].keyids):
            raise UpdateChannelError(f"root threshold {root.roles[Root.type].threshold} exceeds its "
                                     f"{len(root.roles[Root.type].keyids)} keys")

    available = signers(channel, root_keys) | {s.public_key.keyid: s for s in new_signers}
    return _new_root(channel, state, change, available, _now(now)).signed.version


@_one_writer
def revoke_key(channel: Channel, keyid: str, replacement: Path, root_keys: list[Path] = (),
               now: dt.datetime | None = None) -> list[str]:
    """Replace ``keyid`` by the key at ``replacement`` (created if missing) in every role that trusts it:
    a new root, then the online roles re-signed with their new keys. Returns the roles it was revoked from."""
    now = _now(now)
    state = load_state(channel)
    full = _full_keyid(state.root.signed, keyid, None)
    new_signer = ensure_key(Path(replacement))
    new_key = new_signer.public_key
    roles = [name for name, role in state.root.signed.roles.items() if full in role.keyids]

    def change(root: Root) -> None:
        for role in roles:
            root.revoke_key(full, role)
            root.add_key(new_key, role)

    available = signers(channel, root_keys)
    available.pop(full, None)  # a revoked key signs nothing more, the new root included
    available[new_key.keyid] = new_signer
    _new_root(channel, state, change, available, now)
    _resign(channel, state, {role for role in roles if role in ONLINE_ROLES}, available, now)
    return roles


def _full_keyid(root: Root, given: str, role: str | None) -> str:
    """The key id ``given`` (or a unique prefix of it) among the root's keys (of ``role``)."""
    pool = root.roles[role].keyids if role else list(root.keys)
    found = [k for k in pool if k.startswith(given.lower())]
    if len(found) != 1:
        raise UpdateChannelError(f"key id {given!r} names {len(found)} keys of {role or 'the root'}; "
                                 f"known: {sorted(k[:12] for k in pool)}")
    return found[0]


def status(channel: Channel) -> dict:
    state = load_state(channel)
    return {
        "repository": str(channel.repo.resolve()),
        "spec_version": SPECIFICATION_VERSION,
        "roles": {role: {"version": getattr(state, role).signed.version,
                         "expires": getattr(state, role).signed.expires.isoformat(),
                         "threshold": state.root.signed.roles[role].threshold,
                         "keyids": state.root.signed.roles[role].keyids}
                  for role in (Root.type, *ONLINE_ROLES)},
        "targets": {path: t.custom for path, t in sorted(state.targets.signed.targets.items())},
    }


def main(argv: list[str] | None = None) -> int:
    from tasks.config import load_config

    parser = argparse.ArgumentParser(prog="python -m tasks.release.update_channel", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="publish.tuf_dir, tuf_keys_dir, timestamp_expiry_days")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("init", "refresh", "status"):
        sub.add_parser(name)
    rot = sub.add_parser("rotate-root", help="a new root version: root keys added or removed, a new threshold")
    rot.add_argument("--add-key", action="append", default=[], type=Path, metavar="FILE", help="created if missing")
    rot.add_argument("--remove-key", action="append", default=[], metavar="KEYID")
    rot.add_argument("--threshold", type=int)
    rev = sub.add_parser("revoke-key", help="replace a key in every role that trusts it")
    rev.add_argument("keyid", metavar="KEYID", help="key id or a unique prefix of it (see status)")
    rev.add_argument("--replacement", required=True, type=Path, metavar="FILE", help="the new key; created if missing")
    for p in (rot, rev):
        p.add_argument("--root-key", action="append", default=[], type=Path, metavar="FILE",
                       help="an offline root private key (PEM) to sign the new root with; repeatable")
    args = parser.parse_args(argv)
    try:
        channel = Channel.from_config(load_config(args.params).publish)
        if args.command == "init":
            ensure_repository(channel)
            out = status(channel)
        elif args.command == "refresh":
            out = {"written": refresh(channel)}
        elif args.command == "status":
            out = status(channel)
        elif args.command == "rotate-root":
            out = {"root_version": rotate_root(channel, args.add_key, args.remove_key, args.threshold, args.root_key)}
        else:
            out = {"revoked_from": revoke_key(channel, args.keyid, args.replacement, args.root_key)}
    except (StageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
