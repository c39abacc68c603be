"""Release packages on the device side: safe packing and unpacking, and verification.

A release is a flat directory (or a ``.tar.gz`` of its files) holding only data; its files and
their formats are ``runtime/release/contract.py``'s (the PEFT files unchanged, provenance,
``manifest.json`` with sorted keys, ``manifest.sig`` the raw 64-byte Ed25519
signature of manifest.json).

``verify_release`` runs every check before anything reaches an engine, and each failure is
its own ``PackageError`` subclass with a ``reason`` and a process exit code (``EXIT_CODES``).
Nothing is executed or unpickled: JSON is parsed with ``json``, tensors with safetensors, and
the only files accepted are the ``.json`` / ``.safetensors`` ones the signed manifest lists.

Order of the checks, cheapest and most fundamental first, one function per phase: layout
(``_listing``: regular files only, no links) -> signature over the manifest bytes (``_check_signature``:
nothing in the manifest is trusted before this) -> manifest fields (``_signed_manifest``) -> files
(``_check_files``: size limits, no unlisted names, sha256 of every file) -> freshness (``_check_freshness``:
expiry, the month and product it was fetched as, rollback) -> engine (``_check_engine``: backbone and interface
hashes against the local engine, tokenizer) -> adapter rank, modules, shapes, finite values (``_adapter_inputs``,
``runtime.engine.adapter.load_adapter``) -> no KV scales (``_no_kv_scales``).

Rollback protection: a candidate whose release id sorts before the active release's
(``runtime.release.contract.release_order``) is refused unless rollback is explicitly allowed; the same
release again is accepted. A serving device with a state directory passes the higher of its
champion and its high-water mark (``runtime.release.device_state``).

Health probes: ``probes`` in the manifest (covered by the signature) lists up to MAX_PROBES test
prompts with the answer the evaluated engine gave, ``{"prompt" or "messages", "expected", "max_tokens"}``
(a chat row's probe is its messages, rendered by the chat template as a chat request's are);
``release_probes`` reads them. A manifest without the field (releases packaged before probes
existed) has none, and a device then commits it on its error window alone (``runtime.serve.health``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.engine.adapter import load_adapter
from runtime.engine.adapter_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PROVENANCE, AdapterError, read_adapter_config
from runtime.engine.atomic_files import atomic_write
from runtime.engine.errors import RefusedInput
from runtime.engine.hashing import sha256_file
from runtime.engine.interface import EngineInterface
from runtime.release.contract import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MONTH,
    PRODUCT,
    RELEASE_ID,
    SIGNATURE,
    STAMP_FORMAT,
    TIME_FORMAT,
    format_time,
    manifest_product,
    parse_time,
    release_order,
)

DATA_SUFFIXES = (".json", ".safetensors")  # data formats only: no pickle, no code, no native libraries
# A LoRA release of a 0.5B backbone at r=8 is ~4.3 MB and of the tiny default ~0.2 MB; a
# package hundreds of times larger is a mistake or an attack, refused before it is hashed.
DEFAULT_MAX_PACKAGE_BYTES = 256 << 20
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILES = 16
MAX_PROBES, MAX_PROBE_TOKENS = 16, 256  # a health check of a few greedy answers, not a second evaluation
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# ---------------------------------------------------------------- refusals

class PackageError(RefusedInput):
    """A release the device refuses. ``reason`` names the check, ``exit_code`` is what the CLI returns."""

    reason = "refused"
    exit_code = 3

    def __init__(self, message: str):
        super().__init__(message)


class MalformedPackage(PackageError):
    reason, exit_code = "malformed", 10


class ChecksumMismatch(PackageError):
    reason, exit_code = "checksum", 11


class UnlistedFile(PackageError):
    reason, exit_code = "unlisted_file", 12


class SignatureRefused(PackageError):
    reason, exit_code = "signature", 13


class BackboneMismatch(PackageError):
    reason, exit_code = "backbone_mismatch", 14


class InterfaceMismatch(PackageError):
    reason, exit_code = "interface_mismatch", 15


class AdapterRefused(PackageError):
    reason, exit_code = "adapter", 16


class KVScalesRefused(PackageError):
    reason, exit_code = "kv_scales", 17


class SizeLimitExceeded(PackageError):
    reason, exit_code = "size_limit", 18


class UnsafePath(PackageError):
    reason, exit_code = "unsafe_path", 19


class RollbackRefused(PackageError):
    reason, exit_code = "rollback", 20


class ExpiredRelease(PackageError):
    reason, exit_code = "expired", 21


class TokenizerMismatch(PackageError):
    reason, exit_code = "tokenizer_mismatch", 22


class RevertedRelease(PackageError):
    """A release this device reverted after its health check failed (``runtime.release.device_state``)."""

    reason, exit_code = "reverted", 23


class MonthMismatch(PackageError):
    """A release fetched by one month's name (``releases/<month>`` of a registry or an update channel) whose
    signed manifest is another month's."""

    reason, exit_code = "month_mismatch", 24


class ProductMismatch(PackageError):
    """A release fetched as one product's (its registry or update-channel paths, or loaded for a product's
    channel) whose signed manifest is another product's (``runtime.release.contract.manifest_product``)."""

    reason, exit_code = "product_mismatch", 25


EXIT_CODES = {cls.reason: cls.exit_code for cls in PackageError.__subclasses__()}


# ---------------------------------------------------------------- packing

def write_tarball(release_dir: Path, out: Path) -> Path:
    """A reproducible ``.tar.gz`` of the release's files at the archive root (sorted names, no
    timestamps, owners or modes beyond 0644): the same directory gives the same bytes."""
    import gzip

    release_dir, out = Path(release_dir), Path(out)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(release_dir.iterdir()):
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    packed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0) as gz:
        gz.write(buf.getvalue())
    atomic_write(out, packed.getvalue())
    return out


# ---------------------------------------------------------------- unpacking

def extract_tarball(tar_path: Path, dest: Path, max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES) -> Path:
    """Unpack a release tarball into the empty directory ``dest`` without trusting any member.

    Refused (``UnsafePath``): absolute names, ``..``, names with a directory part, links,
    devices, FIFOs, duplicates, names that are not plain file names. Refused
    (``SizeLimitExceeded``): more than MAX_FILES members or more than ``max_bytes`` in all.
    Members are copied byte by byte; tarfile's own extraction (and its metadata) is never used.
    """
    tar_path, dest = Path(tar_path), Path(dest)
    try:
        tar = tarfile.open(tar_path, "r:*")
    except (tarfile.TarError, OSError) as err:
        raise MalformedPackage(f"{tar_path}: not a readable tar archive ({err})") from None
    with tar:
        members, total = [], 0
        for member in tar:
            name = member.name
            parts = name.replace("\\", "/").split("/")
            if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
                raise UnsafePath(f"{tar_path}: member {name!r} has an absolute path")
            if ".." in parts:
                raise UnsafePath(f"{tar_path}: member {name!r} climbs out of the archive with '..'")
            if member.issym() or member.islnk():
                raise UnsafePath(f"{tar_path}: member {name!r} is a link (to {member.linkname!r}); links are refused")
            clean = "/".join(p for p in parts if p not in ("", "."))
            if member.isdir() and clean == "":
                continue  # the "./" entry of `tar -C dir .`
            if not member.isfile():
                raise UnsafePath(f"{tar_path}: member {name!r} is not a regular file")
            if "/" in clean or not _SAFE_NAME.match(clean):
                raise UnsafePath(f"{tar_path}: member {name!r} is not a plain file name at the archive root")
            if clean in {m[0] for m in members}:
                raise UnsafePath(f"{tar_path}: member {clean!r} appears twice")
            members.append((clean, member))
            total += member.size
            if len(members) > MAX_FILES or total > max_bytes:
                raise SizeLimitExceeded(f"{tar_path}: more than {MAX_FILES} members or {max_bytes} bytes")
        dest.mkdir(parents=True, exist_ok=True)
        for clean, member in members:
            src = tar.extractfile(member)
            fd = os.open(dest / clean, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as out, src:
                shutil.copyfileobj(src, out)
    return dest


@contextlib.contextmanager
def unpacked_release(path: str | Path, max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES) -> Iterator[Path]:
    """A release directory as given, or a tarball unpacked into a temporary one (removed after)."""
    path = Path(path)
    if path.is_dir():
        yield path
        return
    if not path.exists():
        raise MalformedPackage(f"{path}: no such release directory or tarball")
    with tempfile.TemporaryDirectory(prefix="release-") as tmp:
        yield extract_tarball(path, Path(tmp) / "release", max_bytes)


# ---------------------------------------------------------------- verification

@dataclass
class VerifiedRelease:
    """A release that passed every check. ``lora`` is the engine's input, set when an engine interface was given;
    the arrays are owned here, so the files may go away."""

    path: Path
    manifest: dict
    key_id: str
    lora: dict[str, np.ndarray] | None = None
    checks: list[str] = field(default_factory=list)

    @property
    def release_id(self) -> str:
        return self.manifest["release_id"]

    @property
    def order(self) -> tuple[str, str]:
        return release_order(self.release_id)

    def summary(self) -> dict:
        return {"ok": True, "release_id": self.release_id, "month": self.manifest["month"],
                "product": manifest_product(self.manifest),
                "key_id": self.key_id, "expires_at": self.manifest["expires_at"], "checks": list(self.checks)}


def _listing(release_dir: Path) -> dict[str, int]:
    """name -> size of every entry; anything but a regular file is refused (links, dirs, devices)."""
    if not release_dir.is_dir():
        raise MalformedPackage(f"{release_dir}: not a directory")
    sizes = {}
    for entry in sorted(os.scandir(release_dir), key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePath(f"{release_dir / entry.name}: is a link; a release holds regular files only")
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{release_dir / entry.name}: is not a regular file; a release is flat")
        sizes[entry.name] = st.st_size
    return sizes


def _check_manifest_fields(m: dict, where: Path) -> None:
    problems = []

    def need(key, kind, check=None, text=""):
        value = m.get(key)
        if not isinstance(value, kind) or (check is not None and not check(value)):
            problems.append(f"{key}: {text or 'missing or of the wrong type'} (got {value!r:.80})")

    need("format", str, lambda v: v == FORMAT, f"must be {FORMAT!r}")
    need("format_version", int, lambda v: v == FORMAT_VERSION, f"this runtime reads version {FORMAT_VERSION}")
    need("month", str, lambda v: MONTH.match(v) is not None, "must be YYYY-MM")
    if "product" in m:  # absent: packaged before products existed, the default product's
        need("product", str, lambda v: PRODUCT.match(v) is not None, "must be a product name")
    need("release_id", str, lambda v: RELEASE_ID.match(v) is not None, "must be YYYY-MM+YYYYMMDDTHHMMSSZ")
    for key in ("created_at", "expires_at"):
        need(key, str, lambda v: _parses(v), f"must be a UTC time {TIME_FORMAT}")
    need("base_model_hash", str, lambda v: _HEX64.match(v) is not None, "must be a sha256 hex digest")
    need("engine", dict, lambda v: isinstance(v.get("interface_hash"), str), "must hold interface_hash")
    need("adapter", dict, lambda v: isinstance(v.get("r"), int) and isinstance(v.get("target_modules"), list),
         "must hold r and target_modules")
    need("files", dict)
    need("metrics", dict)
    need("gates", dict)
    need("signing_key_id", str)
    # Written null by every release since the static KV cache went (``_no_kv_scales``), and still required: a device
    # on an earlier runtime refuses a manifest without it.
    if "kv_format" not in m or not (m["kv_format"] is None or isinstance(m["kv_format"], dict)):
        problems.append("kv_format: must be null (or the KV spec object of a release with static KV scales)")
    problems += _probe_problems(m.get("probes", []))
    if not problems:
        if not m["release_id"].startswith(m["month"] + "+"):
            problems.append(f"release_id {m['release_id']} is not of month {m['month']}")
        elif release_order(m["release_id"])[1] != parse_time(m["created_at"]).strftime(STAMP_FORMAT):
            problems.append(f"release_id {m['release_id']} does not carry created_at {m['created_at']}")
        for name, entry in m["files"].items():
            if name in (MANIFEST, SIGNATURE) or not _SAFE_NAME.match(name) or not name.endswith(DATA_SUFFIXES):
                problems.append(f"files: {name!r} is not an allowed data file name ({', '.join(DATA_SUFFIXES)})")
            elif not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _HEX64.match(entry["sha256"])
                      and isinstance(entry.get("bytes"), int) and entry["bytes"] >= 0):
                problems.append(f"files.{name}: needs sha256 (hex) and bytes (int)")
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            if name not in m["files"]:
                problems.append(f"files: {name} is required but not listed")
    if problems:
        raise MalformedPackage(f"{where}: invalid manifest:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class Probe:
    """A signed health probe: greedy ``max_tokens`` on ``prompt`` (a text, or the ``messages`` of a chat
    the tokenizer's template renders) must give ``expected`` (whitespace-trimmed, the exact match of the
    evaluate stage)."""

    expected: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None

    def encode(self, tokenizer) -> list[int]:
        """The probe's prompt ids on a ``runtime.tokenizer.DeviceTokenizer``, as a request's would be."""
        return tokenizer.encode(self.prompt) if self.messages is None else tokenizer.encode_chat(list(self.messages))

    @property
    def shown(self) -> str:
        return self.prompt if self.messages is None else self.messages[-1]["content"]


def _chat_messages(value) -> bool:
    return (isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
        for m in value))


def _probe_problems(probes) -> list[str]:
    if not isinstance(probes, list) or len(probes) > MAX_PROBES:
        return [f"probes: a list of at most {MAX_PROBES} probe objects (got {probes!r:.80})"]
    problems = []
    for i, probe in enumerate(probes):
        keys = set(probe) if isinstance(probe, dict) else set()
        prompt_ok = (keys == {"prompt", "expected", "max_tokens"} and isinstance(probe["prompt"], str)
                     and bool(probe["prompt"]))
        chat_ok = keys == {"messages", "expected", "max_tokens"} and _chat_messages(probe["messages"])
        if not ((prompt_ok or chat_ok) and isinstance(probe["expected"], str)
                and type(probe["max_tokens"]) is int and 1 <= probe["max_tokens"] <= MAX_PROBE_TOKENS):
            problems.append(f"probes[{i}]: needs exactly prompt (non-empty) or messages (a list of role/content "
                            f"objects), expected (string) and max_tokens (1 to {MAX_PROBE_TOKENS}) (got {probe!r:.80})")
    return problems


def release_probes(manifest: dict) -> tuple[Probe, ...]:
    """The probes of a verified manifest; none for a manifest without the field."""
    return tuple(Probe(**{**p, "messages": tuple(p["messages"])} if "messages" in p else p)
                 for p in manifest.get("probes", []))


def _parses(text: str) -> bool:
    try:
        parse_time(text)
        return True
    except ValueError:
        return False


def load_trusted_keys(paths) -> dict:
    """{key id: public key} of every trusted key file; refuses an empty trust list."""
    from runtime.release.signing import key_id, load_public_key

    keys = {}
    for p in paths or ():
        k = load_public_key(p)
        keys[key_id(k)] = k
    if not keys:
        raise SignatureRefused("no trusted public key configured (--trusted-key PATH or trusted_keys in the "
                               "device config): a device never loads an unsigned or unverifiable release")
    return keys


def verify_release(
    path: str | Path,
    trusted_keys: dict,
    iface: EngineInterface | None = None,
    active_release: str | None = None,
    allow_rollback: bool = False,
    now: dt.datetime | None = None,
    max_bytes: int = DEFAULT_MAX_PACKAGE_BYTES,
    tokenizer_sha256: str | None = None,
    stop_token_ids: tuple[int, ...] | None = None,
    month: str | None = None,
    product: str | None = None,
) -> VerifiedRelease:
    """Verify the release directory ``path`` (tarballs: use ``unpacked_release`` first) and return it
    with its engine inputs; raise the ``PackageError`` subclass of the first failed check.

    ``trusted_keys``: ``load_trusted_keys`` output. ``iface``: the local engine's interface; None
    skips the engine-bound checks (and leaves ``lora`` unset). ``active_release``: the release id
    (or bare month) the device runs now, for rollback protection. ``month``: the month the release was
    fetched as (a registry's or an update channel's ``releases/<month>``), which its manifest must say.
    ``product``: the product it was fetched or loaded as, which its manifest must say (absent: the default).
    """
    path = Path(path)
    now = now or dt.datetime.now(dt.timezone.utc)
    sizes = _listing(path)
    raw, kid = _check_signature(path, sizes, trusted_keys)
    checks = [f"signature: ed25519 key {kid}"]
    manifest = _signed_manifest(raw, path / MANIFEST)
    checks.append(_check_files(path, sizes, manifest["files"], max_bytes))
    checks += _check_freshness(path, manifest, now, month, product, active_release, allow_rollback)
    verified = VerifiedRelease(path, manifest, kid, checks=checks)
    if iface is None:
        checks.append("engine: skipped (no engine given): backbone, interface, adapter and KV bindings unchecked")
        return verified
    checks.append(_check_engine(path, manifest, iface, tokenizer_sha256, stop_token_ids))
    verified.lora, adapter_check = _adapter_inputs(path, manifest, iface)
    checks.append(adapter_check)
    _no_kv_scales(path, manifest)
    return verified


def _check_signature(path: Path, sizes: dict[str, int], trusted_keys: dict) -> tuple[bytes, str]:
    """(manifest bytes, id of the trusted key that signed them). Refuses a directory without a manifest (not a
    release), one without a signature (an unsigned release is never loaded), a manifest over MAX_MANIFEST_BYTES
    (refused before it is read), and a signature that no trusted key verifies over those exact bytes, naming
    the key the manifest claims when this device does not trust it. Nothing in the manifest is trusted before."""
    from cryptography.exceptions import InvalidSignature

    from runtime.release.signing import verify_detached

    if MANIFEST not in sizes:
        raise MalformedPackage(f"{path}: {MANIFEST} is missing; not a release")
    if SIGNATURE not in sizes:
        raise SignatureRefused(f"{path}: {SIGNATURE} is missing; unsigned releases are never loaded")
    if sizes[MANIFEST] > MAX_MANIFEST_BYTES:
        raise SizeLimitExceeded(f"{path / MANIFEST}: {sizes[MANIFEST]} bytes, the limit is {MAX_MANIFEST_BYTES}")
    raw = (path / MANIFEST).read_bytes()
    signature = (path / SIGNATURE).read_bytes()[:128]
    try:  # only to learn which key claims to have signed; nothing is trusted before the signature
        claimed = json.loads(raw).get("signing_key_id")
    except (ValueError, AttributeError):
        claimed = None
    try:
        return raw, verify_detached(trusted_keys, raw, signature, claimed if isinstance(claimed, str) else None)
    except InvalidSignature as err:
        if isinstance(claimed, str) and claimed not in trusted_keys:
            raise SignatureRefused(f"{path / SIGNATURE}: manifest says it was signed by key {claimed}, which this "
                                   f"device does not trust (trusted: {', '.join(sorted(trusted_keys))})") from None
        raise SignatureRefused(f"{path / SIGNATURE}: signature does not verify against {path / MANIFEST} "
                               f"with any trusted key ({err}); the manifest or its signature was altered") from None


def _signed_manifest(raw: bytes, where: Path) -> dict:
    """The signed manifest, parsed. Refuses bytes that are not a JSON object and any field every later check
    reads (``_check_manifest_fields``): a signature proves who wrote a manifest, not that this runtime reads it."""
    try:
        manifest = json.loads(raw)
    except ValueError as err:
        raise MalformedPackage(f"{where}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise MalformedPackage(f"{where}: top level must be an object")
    _check_manifest_fields(manifest, where)
    return manifest


def _check_files(path: Path, sizes: dict[str, int], listed: dict, max_bytes: int) -> str:
    """What the manifest says of the files is what the directory holds; the check passed. Refuses a release whose
    declared size or file count is over the device's limit (before anything is hashed), a file the signed manifest
    does not list (nothing unsigned reaches a reader), and a listed file that is missing, of another size, or of
    another sha256 (altered or corrupted after signing)."""
    declared = sum(e["bytes"] for e in listed.values()) + sizes[MANIFEST] + sizes[SIGNATURE]
    if declared > max_bytes or len(listed) > MAX_FILES:
        raise SizeLimitExceeded(f"{path}: {declared} bytes in {len(listed)} files, the device limit is "
                                f"{max_bytes} bytes and {MAX_FILES} files")
    unlisted = sorted(set(sizes) - set(listed) - {MANIFEST, SIGNATURE})
    if unlisted:
        raise UnlistedFile(f"{path}: {', '.join(unlisted)} not listed in the signed manifest; refused")
    for name, entry in sorted(listed.items()):
        if name not in sizes:
            raise ChecksumMismatch(f"{path / name}: listed in the manifest but missing")
        if sizes[name] != entry["bytes"]:
            raise ChecksumMismatch(f"{path / name}: {sizes[name]} bytes, the manifest says {entry['bytes']}")
        digest = sha256_file(path / name)
        if digest != entry["sha256"]:
            raise ChecksumMismatch(f"{path / name}: sha256 {digest[:12]} does not match the manifest's "
                                   f"{entry['sha256'][:12]}; the file was altered or corrupted")
    return f"checksums: {len(listed)} files, {declared} bytes"


def _check_freshness(path: Path, manifest: dict, now: dt.datetime, month: str | None, product: str | None,
                     active_release: str | None, allow_rollback: bool) -> list[str]:
    """The checks passed that a validly signed release is the one this device should take now. Refuses an expired
    release (a frozen or replayed one), one whose signed month or product is not what it was fetched as (another
    release served under this name), and, unless ``allow_rollback``, one older than ``active_release`` (a
    rollback is a local act, never one a package can ask for)."""
    expires = parse_time(manifest["expires_at"])
    if now >= expires:
        raise ExpiredRelease(f"{path / MANIFEST}: release {manifest['release_id']} expired at "
                             f"{manifest['expires_at']} (now {format_time(now)}); publish a fresh release")
    checks = [f"expiry: valid until {manifest['expires_at']}"]
    if month is not None:
        if manifest["month"] != month:
            raise MonthMismatch(f"{path}: fetched as the release of {month}, but its signed manifest is release "
                                f"{manifest['release_id']} of {manifest['month']}; refused")
        checks.append(f"month: {month}, as fetched")
    if product is not None:
        if manifest_product(manifest) != product:
            raise ProductMismatch(f"{path}: fetched as a release of product {product}, but its signed manifest is "
                                  f"release {manifest['release_id']} of product {manifest_product(manifest)}; refused")
        checks.append(f"product: {product}, as fetched")
    if active_release is not None:
        if release_order(manifest["release_id"]) < release_order(active_release):
            if not allow_rollback:
                raise RollbackRefused(f"{path}: release {manifest['release_id']} is older than the active "
                                      f"release {active_release}; refused (rollback needs --allow-rollback)")
            checks.append(f"rollback: allowed explicitly, from {active_release}")
        else:
            checks.append(f"rollback: not older than active {active_release}")
    return checks


def _check_engine(path: Path, manifest: dict, iface: EngineInterface, tokenizer_sha256: str | None,
                  stop_token_ids: tuple[int, ...] | None) -> str:
    """The release was made for this device's engine and tokenizer; the check passed. Refuses another backbone,
    an engine interface the local engine does not accept (its inputs would mean something else), and a tokenizer
    or stop ids other than the ones the release was evaluated with (the same ids would be other text)."""
    if manifest["base_model_hash"] != iface.backbone_hash:
        raise BackboneMismatch(f"{path}: release is for backbone {manifest['base_model_hash'][:12]}, "
                               f"the local engine runs backbone {iface.backbone_hash[:12]}")
    if manifest["engine"]["interface_hash"] not in iface.accepted_hashes:
        raise InterfaceMismatch(f"{path}: release is for engine interface {manifest['engine']['interface_hash'][:12]}, "
                                f"the local engine has {iface.interface_hash[:12]}")
    if tokenizer_sha256 is not None and manifest.get("tokenizer_sha256") not in (None, tokenizer_sha256):
        raise TokenizerMismatch(f"{path}: release was trained with tokenizer {manifest['tokenizer_sha256'][:12]}, "
                                f"the device has {tokenizer_sha256[:12]}")
    # The stop ids come from tokenizer_config.json and generation_config.json beside tokenizer.json:
    # a device whose copies differ would end answers elsewhere than the evaluated engine did.
    expected_stops = manifest.get("stop_token_ids")
    if stop_token_ids is not None and expected_stops is not None and list(stop_token_ids) != expected_stops:
        raise TokenizerMismatch(f"{path}: release was evaluated stopping at token ids {expected_stops}, the device's "
                                f"tokenizer stops at {list(stop_token_ids)} (its tokenizer_config.json or "
                                "generation_config.json differ from the base model's)")
    return f"engine: backbone {iface.backbone_hash[:12]}, interface {manifest['engine']['interface_hash'][:12]}"


def _adapter_inputs(path: Path, manifest: dict, iface: EngineInterface) -> tuple[dict[str, np.ndarray], str]:
    """(the LoRA inputs of ``iface``, the check passed). Refuses an adapter_config.json whose rank or modules
    disagree with the signed manifest, and an adapter the engine cannot take (``load_adapter``: rank over the
    engine's, unknown modules, wrong shapes, values that are not finite)."""
    try:
        acfg = read_adapter_config(path)
        if acfg.r != manifest["adapter"]["r"] or list(acfg.target_modules) != sorted(manifest["adapter"]["target_modules"]):
            raise MalformedPackage(f"{path / ADAPTER_CONFIG}: r={acfg.r} modules={list(acfg.target_modules)} disagree "
                                   "with the manifest")
        lora = load_adapter(path, iface, require_provenance=PROVENANCE in manifest["files"])
    except AdapterError as err:
        raise AdapterRefused(str(err)) from None
    return lora, f"adapter: r={acfg.r} on {list(acfg.target_modules)}, within max rank {iface.max_rank}"


def _no_kv_scales(path: Path, manifest: dict) -> None:
    """Refuses a release that brings static KV scales (``kv_format`` set): made for the static quantized cache,
    which this runtime no longer has (quantized pages seal each page's scales on the device); its adapter alone
    would run on a cache it was not gated on."""
    if manifest["kv_format"] is not None:
        raise KVScalesRefused(f"{path}: the release brings static KV scales ({manifest['kv_format'].get('name', 'a KV spec')}) "
                              "for the static quantized cache, which this runtime no longer reads; package it again "
                              "for an engine with quantized pages or a float cache")


def verify_path(path: str | Path, trusted_keys: dict, **kwargs) -> VerifiedRelease:
    """``verify_release`` of a directory or a tarball (unpacked to a temporary directory)."""
    with unpacked_release(path, kwargs.get("max_bytes", DEFAULT_MAX_PACKAGE_BYTES)) as d:
        return verify_release(d, trusted_keys, **kwargs)


def bind_release(engine, verified: VerifiedRelease) -> None:
    """Give an engine the verified release's LoRA inputs."""
    if verified.lora is None:
        raise ValueError("release was verified without an engine interface; verify it against this engine first")
    engine.set_adapter(verified.lora)
