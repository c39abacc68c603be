"""What a device remembers across restarts: its releases and its rollback protection, in ``--state-dir``.

    DIR/state.json             the record below, replaced atomically
    DIR/lock                   held (flock) by the one process using the directory, with its pid
    DIR/releases/<release id>/ verified copies of the active, the previous and the candidate release
                               (and of other resident ones), so a restart needs no network and no --package
    DIR/products/<product>/    another product's state, laid out as DIR is (``for_product``)

``DIR`` itself is the default product's state (``runtime.release.contract.DEFAULT_PRODUCT``): a state
directory written before products existed is that product's as it stands. Each product has its own
champion, candidate, trial and high-water mark: a product's releases never roll another's back.

``state.json`` (sorted keys)::

    {"format_version": 1,
     "active": "2026-11+20261130T120000Z",   the champion (null before the first release)
     "status": "committed",                  "trial" while its health check runs, then "committed";
                                             "failed" when its check failed with nothing to revert to
     "previous": "2026-10+...",              the last committed champion before it: the revert target
     "candidate": "2026-12+...",             the candidate channel's release (null without one), resumed with it
     "high_water": "2026-11+...",            the highest release ever committed: nothing older is accepted
     "reverted": {"2026-12+...": {"reason": "probe_mismatch", "detail": "...", "at": "2026-12-01T10:00:00Z"}},
     "last_check": {"release_id", "result": "committed" | "reverted" | "failed", "reason", "detail", "at"},
     "updated_at": "..."}

A release raises the high-water mark once its health check commits it (``runtime.serve.health``), so a
release that was reverted never lifted the floor above the one the device went back to. A reverted
release id is never loaded again as champion (``RevertedRelease``): a fixed build has a new id.

Every write goes through ``atomic_write``: a temporary file in the same folder, fsync, rename over the
old file, fsync of the folder. A power cut at any point leaves the old record or the new one, never a
mix: a stray temporary file is ignored and removed at the next start. A release copy is complete,
verified again from its copied bytes and fsynced before the record names it (``install_folder``, which
``runtime.release.pull`` installs its releases with too). Temporary names start with a dot, so a static HTTP
server or a folder watcher passes over them. A record that cannot be read or does not hold these fields
is an error naming the file, never silently reset: rebuilding trust from nothing is an operator's act
(``python -m runtime rollback``, or removing the folder).
"""

from __future__ import annotations

import ctypes
import datetime as dt
import errno
import fcntl
import functools
import json
import os
import shutil
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from runtime.engine.atomic_files import TEMP_PREFIX, atomic_write, fsync_dir
from runtime.engine.errors import RefusedInput
from runtime.release.contract import DEFAULT_PRODUCT, RELEASE_ID, check_product, format_time, release_order

STATE_FILE = "state.json"
STATE_LOCK = "lock"
STATE_RELEASES = "releases"
STATE_PRODUCTS = "products"
STATE_FORMAT_VERSION = 1
TRIAL, COMMITTED, FAILED = "trial", "committed", "failed"
STATUSES = (TRIAL, COMMITTED, FAILED)
CHAMPION_STATES = ("none",) + STATUSES  # the champion_state gauge's labels: "none" without a release
# Why a health check reverted a champion: a probe answered otherwise, a probe could not run, or a request
# on the new champion failed (500) within the window.
REVERT_REASONS = ("probe_mismatch", "probe_error", "generation_errors")


class StateError(RefusedInput):
    """A state directory this device cannot trust or use; the CLI exits 2 (device configuration)."""

    exit_code = 2


def install_folder(staged: Path, target: Path, replaced: Path | None = None) -> None:
    """Put the complete folder ``staged`` (beside ``target``, on its file system) at ``target`` by rename,
    after an fsync of every file in it and of itself, and fsync ``target``'s parent: a crash leaves no
    half-written folder at ``target``. What ``target`` held ends at ``replaced``. The two folders are
    swapped in one step (``renameat2(RENAME_EXCHANGE)``), so ``target`` is never absent; where the kernel
    or file system cannot swap, what ``target`` held is moved to ``replaced`` first (a folder cannot be
    renamed over one that has files), leaving ``target`` absent between the two renames."""
    for path in sorted(staged.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(staged)
    if replaced is not None and target.exists():
        if _exchange(staged, target):
            os.replace(staged, replaced)  # the previous contents, which the swap left at ``staged``
            fsync_dir(target.parent)
            return
        os.replace(target, replaced)
    os.replace(staged, target)
    fsync_dir(target.parent)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


@functools.cache
def _renameat2():
    """glibc's ``renameat2`` (2.28 and later), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically; False where the kernel, file system or libc cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


@dataclass(frozen=True)
class StateRecord:
    active: str | None = None
    status: str | None = None
    previous: str | None = None
    candidate: str | None = None
    high_water: str | None = None
    reverted: dict = field(default_factory=dict)
    last_check: dict | None = None
    updated_at: str | None = None
    format_version: int = STATE_FORMAT_VERSION

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes, where: Path) -> StateRecord:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise StateError(f"{where}: device state is not valid JSON ({err}); it was damaged. Restore it, or "
                             "remove the state directory to start over (rollback protection starts over too)") from None
        if not isinstance(data, dict):
            raise StateError(f"{where}: device state must be a JSON object")
        problems = []
        unknown = sorted(set(data) - {f for f in cls.__dataclass_fields__})
        if unknown:
            problems.append(f"unknown field(s) {unknown}")
        if data.get("format_version") != STATE_FORMAT_VERSION:
            problems.append(f"format_version: this runtime reads {STATE_FORMAT_VERSION} (got {data.get('format_version')!r})")
        for key in ("active", "previous", "candidate", "high_water"):
            value = data.get(key)
            if value is not None and not (isinstance(value, str) and RELEASE_ID.match(value)):
                problems.append(f"{key}: a release id or null (got {value!r:.80})")
        if data.get("status") not in (STATUSES if data.get("active") is not None else (None,)):
            problems.append(f"status: one of {', '.join(STATUSES)} with an active release, null without "
                            f"(got {data.get('status')!r:.40})")
        reverted = data.get("reverted", {})
        if not isinstance(reverted, dict) or not all(isinstance(v, dict) and isinstance(v.get("reason"), str)
                                                     for v in reverted.values()):
            problems.append("reverted: an object of release id -> {reason, detail, at}")
        if not isinstance(data.get("last_check"), (dict, type(None))):
            problems.append("last_check: an object or null")
        if problems:
            raise StateError(f"{where}: invalid device state:\n  - " + "\n  - ".join(problems))
        return cls(**{k: data.get(k, getattr(cls(), k)) for k in cls.__dataclass_fields__})


class DeviceState:
    """The state directory: its record (read once, then written through) and its release copies; thread-safe.

    ``exclusive`` (the default, for serve and rollback) holds the directory's lock until ``close`` or the
    process ends (a SIGKILL included: the kernel drops it), so two processes never write one state; a
    reader (``python -m runtime state``) passes False."""

    def __init__(self, directory: str | Path, exclusive: bool = True):
        self.directory = Path(directory)
        self.path = self.directory / STATE_FILE
        self.releases = self.directory / STATE_RELEASES
        self._lock = threading.RLock()
        self._held = None
        self._unclaimed: set[str] = set()  # new copies of loads not yet resident: no write removes them
        self._products: dict[str, DeviceState] = {}  # the other products' states opened through this one
        try:
            self.releases.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StateError(f"{self.directory}: cannot create the state directory ({err.strerror})") from None
        if exclusive:
            self._held = _hold(self.directory / STATE_LOCK)
        try:
            self.record = self._read(exclusive)
        except BaseException:
            self.close()  # a state this process cannot use is not held either
            raise

    def _read(self, exclusive: bool) -> StateRecord:
        if exclusive:
            for leftover in [*self.directory.glob(TEMP_PREFIX + "*"), *self.releases.glob(TEMP_PREFIX + "*")]:
                _remove(leftover)  # what a crash left half written; the record never names it
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return StateRecord()
        except OSError as err:
            raise StateError(f"{self.path}: cannot read the device state ({err.strerror})") from None
        record = StateRecord.parse(raw, self.path)
        for key in ("active", "previous", "candidate"):
            release_id = getattr(record, key)
            if release_id is not None and not self.copy_path(release_id).is_dir():
                raise StateError(f"{self.path}: the {key} release {release_id} has no copy at "
                                 f"{self.copy_path(release_id)}; the state directory was damaged")
        return record

    def close(self) -> None:
        """Let go of the directory's lock, and of its products' (the records stay as written)."""
        for state in self._products.values():
            state.close()
        if self._held is not None:
            self._held.close()
            self._held = None

    def for_product(self, product: str) -> DeviceState:
        """The state of ``product``: this one for the default product, else ``products/<product>/`` (created
        when missing), opened as this one was (exclusive or not) and closed with it."""
        if product == DEFAULT_PRODUCT:
            return self
        with self._lock:
            if product not in self._products:
                self._products[product] = DeviceState(self.directory / STATE_PRODUCTS / check_product(product),
                                                      exclusive=self._held is not None)
            return self._products[product]

    def other_products(self) -> list[str]:
        """The products other than the default with a state written here."""
        return sorted(p.parent.name for p in (self.directory / STATE_PRODUCTS).glob(f"*/{STATE_FILE}"))

    def copy_path(self, release_id: str) -> Path:
        return self.releases / release_id

    def floor(self) -> str | None:
        """The high-water mark: a release older than this is refused (rollback protection)."""
        return self.record.high_water

    def reverted(self, release_id: str) -> dict | None:
        return self.record.reverted.get(release_id)

    def keep(self, release_dir: Path, release_id: str, trusted_keys: dict, max_bytes: int) -> Path:
        """Copy the verified release at ``release_dir`` into the state directory (verified again from the
        copied bytes, then installed with ``install_folder``); its path."""
        from runtime.release.verify import verify_release

        target = self.copy_path(release_id)
        with self._lock:
            if target.is_dir():
                return target
            tmp = self.releases / f"{TEMP_PREFIX}{release_id}-{os.getpid()}"
            _remove(tmp)
            tmp.mkdir()
            for src in sorted(Path(release_dir).iterdir()):
                shutil.copyfile(src, tmp / src.name)
            verify_release(tmp, trusted_keys, max_bytes=max_bytes)  # the copy is what a restart will trust
            install_folder(tmp, target)
            self._unclaimed.add(release_id)
            return target

    def write(self, keep: set[str] = frozenset(), **changes) -> StateRecord:
        """Apply ``changes`` to the record and write it atomically; then remove release copies the record
        no longer names (``keep``: ids of other resident releases, whose copies stay; a copy ``keep`` made
        stays until a write names it or keeps it, as its load finishes between the two)."""
        with self._lock:
            record = replace(self.record, **changes, updated_at=format_time(dt.datetime.now(dt.timezone.utc)))
            atomic_write(self.path, record.to_bytes())
            self.record = record
            named = {record.active, record.previous, record.candidate} | set(keep)
            self._unclaimed -= named
            for copy in self.releases.iterdir():
                if copy.name not in named | self._unclaimed and not copy.name.startswith(TEMP_PREFIX):
                    _remove(copy)
            return record

    def rollback(self) -> StateRecord:
        """The operator's rollback (the server stopped): the previous release becomes the active one, the
        high-water mark comes down to it, and the release left is remembered as reverted by the operator."""
        with self._lock:
            record = self.record
            if record.previous is None:
                raise StateError(f"{self.path}: no previous release is kept (active: {record.active}); nothing "
                                 "to roll back to")
            reverted = record.reverted | {record.active: {
                "reason": "operator", "detail": "python -m runtime rollback",
                "at": format_time(dt.datetime.now(dt.timezone.utc))}}
            return self.write(active=record.previous, status=COMMITTED, previous=None, high_water=record.previous,
                              reverted=reverted)


def newer(a: str | None, b: str | None) -> str | None:
    """The later of two release ids (None counts as older than any)."""
    if a is None or b is None:
        return a or b
    return a if release_order(a) >= release_order(b) else b


def _hold(path: Path):
    """The lock file, opened and locked with our pid in it; StateError naming the holder when it is taken."""
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise StateError(f"{path}: the state directory is in use by process {holder}; one serve per state "
                         "directory, and python -m runtime rollback only with serve stopped") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
