"""Update-channel test kit: a TUF repository served over loopback HTTP, and what an attacker does to it.

``serve(folder)`` is ``python -m http.server -d folder`` in a thread (the README's way to serve the
channel); ``mirror(folder)`` is the same server whose folder can be switched at once, as a compromised
mirror switches what it serves to a running device. The helpers below change the served files as a
man in the middle or a compromised mirror would, with python-tuf's own Metadata API; each takes the
served copy of a repository written by ``tasks.release.update_channel`` and the channel (its keys folder).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from securesystemslib.signer import CryptoSigner
from service_testkit import free_port
from tuf.api.metadata import Metadata, TargetFile, Targets
from tuf.api.serialization.json import JSONSerializer
from tuf.ngclient import Updater

from runtime.release.contract import (
    DEFAULT_PRODUCT,
    TUF_CHANNELS_TARGET,
    TUF_METADATA_DIR,
    product_path,
    release_target_path,
)
from runtime.release.verify import write_tarball
from tasks.release.update_channel import Channel, _add_target, _resign, load_state, refresh, release_target, signers

REPO = Path(__file__).resolve().parents[1]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """The base URL of ``folder`` served by the standard library's HTTP server on a free loopback port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class Mirror:
    """What ``mirror`` serves: ``show(folder)`` switches it at once (a symlink replaced by rename)."""

    def __init__(self, workdir: Path):
        self.link = Path(workdir) / "served"
        self.url = ""

    def show(self, folder: Path) -> None:
        tmp = self.link.with_name(f".{self.link.name}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(folder).resolve(), target_is_directory=True)
        os.replace(tmp, self.link)


@contextlib.contextmanager
def mirror(workdir: Path, folder: Path) -> Iterator[Mirror]:
    """A loopback HTTP server showing ``folder`` until ``Mirror.show`` switches it."""
    shown = Mirror(workdir)
    shown.show(folder)
    with serve(shown.link) as url:
        shown.url = url
        yield shown


def updater(url: str, first_root: Path, metadata_dir: Path) -> Updater:
    """python-tuf's ngclient on ``url``, trusting ``first_root`` (the device's out-of-band root)."""
    metadata_dir.mkdir(parents=True, exist_ok=True)
    return Updater(str(metadata_dir), f"{url}/metadata/", target_base_url=f"{url}/targets/",
                   bootstrap=first_root.read_bytes())


def resign_metadata(repo: Path, name: str, signer: CryptoSigner, **changes) -> None:
    """``metadata/<name>`` with ``changes`` set on its signed part, signed by ``signer`` alone."""
    path = repo / TUF_METADATA_DIR / name
    md = Metadata.from_bytes(path.read_bytes())
    for field, value in changes.items():
        setattr(md.signed, field, value)
    md.sign(signer)
    path.write_bytes(md.to_bytes(JSONSerializer(compact=False)))


def same_length_change(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (as long) in the file: only a hash can tell."""
    data = path.read_bytes()
    assert old in data and len(old) == len(new)
    path.write_bytes(data.replace(old, new, 1))


def target_file(repo: Path, channel: Channel, path: str) -> Path:
    """The served file of target ``path`` (consistent snapshots: ``targets/<dir>/<sha256>.<name>``)."""
    sha = load_state(Channel(repo, channel.keys)).targets.signed.targets[path].hashes["sha256"]
    folder, _, name = path.rpartition("/")
    return repo / "targets" / folder / f"{sha}.{name}"


def zero_tarball(repo: Path, channel: Channel, month: str = "2026-11") -> None:
    """Arbitrary package: the served bytes of a release change (same length), its signed hash does not."""
    path = target_file(repo, channel, release_target_path(month))
    path.write_bytes(bytes(path.stat().st_size))


def misnamed_release(repo: Path, channel: Channel, release_dir: Path, month: str, product: str = DEFAULT_PRODUCT) -> None:
    """Champion ``month`` of ``product`` whose signed target holds ``release_dir``, a release of another month (or
    product): the steps of ``publish_release`` without its month and product checks, as a mislabelling publisher
    or a holder of the online keys signs it. Length, hashes and signatures are genuine; only the signed manifest
    inside says its month and product."""
    served = Channel(repo, channel.keys)
    state = load_state(served)
    with tempfile.TemporaryDirectory(prefix="misnamed-") as tmp:
        tarball = write_tarball(release_dir, Path(tmp) / f"{month}.tar.gz")
        _add_target(served, state, release_target(release_dir, tarball, month, product), tarball)
        pointer = Path(tmp) / TUF_CHANNELS_TARGET
        pointer.write_text(json.dumps({"champion": month, "candidate": month}))
        _add_target(served, state, TargetFile.from_file(product_path(TUF_CHANNELS_TARGET, product), str(pointer),
                                                        ["sha256"]), pointer)
    _resign(served, state, {Targets.type}, signers(served), dt.datetime.now(dt.timezone.utc))


def endless_tarball(repo: Path, channel: Channel, month: str = "2026-11") -> None:
    """Endless data: a release tarball served with a MiB more than its signed length."""
    with open(target_file(repo, channel, release_target_path(month)), "ab") as fh:
        fh.write(bytes(1 << 20))


def endless_timestamp(repo: Path, channel: Channel) -> None:
    """Endless data: a timestamp of a MiB (ngclient reads at most 16 KiB of it)."""
    with open(repo / TUF_METADATA_DIR / "timestamp.json", "ab") as fh:
        fh.write(b" " * (1 << 20))


def expire_timestamp(repo: Path, channel: Channel) -> None:
    """Indefinite freeze: a timestamp, newer and validly signed, that expired yesterday."""
    refresh(Channel(repo, channel.keys), now=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2))


def mix_and_match(repo: Path, channel: Channel) -> None:
    """Targets from another snapshot: the previous targets version served as the current one."""
    version = load_state(Channel(repo, channel.keys)).targets.signed.version
    metadata = repo / TUF_METADATA_DIR
    (metadata / f"{version}.targets.json").write_bytes((metadata / f"{version - 1}.targets.json").read_bytes())


def wrong_key(repo: Path, channel: Channel) -> None:
    """A newer timestamp signed by a key the root does not name."""
    version = load_state(Channel(repo, channel.keys)).timestamp.signed.version
    resign_metadata(repo, "timestamp.json", CryptoSigner.generate_ed25519(), version=version + 1)


def fast_forward(repo: Path, channel: Channel) -> None:
    """A timestamp whose version jumps to 2**31, signed by a key the root does not name: accepted, it would
    make every later real timestamp look like a rollback."""
    resign_metadata(repo, "timestamp.json", CryptoSigner.generate_ed25519(), version=2**31)


# python-tuf's ngclient in an environment of its own (a fresh venv holding only tuf and what it
# needs, run with -I), as a device with only tuf installed would run it: the script first proves
# that nothing of this project can be imported there.
NGCLIENT_SCRIPT = """
import importlib.util, json, sys
assert all(importlib.util.find_spec(m) is None for m in ("runtime", "tasks", "onnxruntime")), "not a tuf-only environment"
from tuf.ngclient import Updater
url, first_root, metadata_dir, target, out = sys.argv[1:]
updater = Updater(metadata_dir, url + "/metadata/", target_base_url=url + "/targets/",
                  bootstrap=open(first_root, "rb").read())
updater.refresh()
info = updater.get_targetinfo(target)
updater.download_target(info, out)
expires = json.load(open(metadata_dir + "/timestamp.json"))["signed"]["expires"]
print(json.dumps({"custom": info.custom, "sha256": info.hashes["sha256"], "timestamp_expires": expires}))
"""


@contextlib.contextmanager
def http_server_process(folder: Path, port: int) -> Iterator[str]:
    """``python -m http.server`` serving ``folder`` (the README's one line), until the block ends."""
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "-d", str(folder), str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/metadata/1.root.json", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def ngclient_then_tampered(served: Path, first_root: Path, target: str, workdir: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """``served`` under ``python -m http.server``: what ngclient (in a tuf-only venv of its own, ``tuf_only_python``) fetched of ``target``
    (custom fields, sha256, the timestamp's expiry; the file is ``workdir/ngclient/target``), then how a
    second fresh client fares once the served target's bytes are zeroed (the file is changed in place)."""
    python = tuf_only_python(workdir / "tuf-venv")
    with http_server_process(served, free_port()) as url:
        got = ngclient_fetch(python, url, first_root, target, workdir / "ngclient")
        assert got.returncode == 0, got.stderr[-3000:]
        fetched = json.loads(got.stdout)
        folder, _, name = target.rpartition("/")
        path = served / "targets" / folder / f"{fetched['sha256']}.{name}"
        path.write_bytes(bytes(path.stat().st_size))
        return fetched, ngclient_fetch(python, url, first_root, target, workdir / "ngclient-tampered")


def tuf_only_python(venv: Path) -> Path:
    """The interpreter of a new virtual environment at ``venv`` with only python-tuf installed (at the
    version ``constraints.txt`` pins, from the package registry)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                "-c", str(REPO / "constraints.txt"), "tuf"], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, f"pip install tuf into {venv}: {installed.stderr[-3000:]}"
    return python


def ngclient_fetch(python: Path, url: str, first_root: Path, target: str, workdir: Path):
    """Run NGCLIENT_SCRIPT with ``python``: refresh from ``first_root`` and download ``target`` into ``workdir``."""
    (workdir / "metadata").mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(python), "-I", "-c", NGCLIENT_SCRIPT, url, str(first_root), str(workdir / "metadata"),
                           target, str(workdir / "target")], cwd=workdir, capture_output=True, text=True, timeout=120)
