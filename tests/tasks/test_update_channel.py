"""The update channel's TUF repository as the publish step writes it, read by python-tuf's ngclient over HTTP.

Releases here are small stand-in directories (a manifest with the identity fields and one file):
the repository signs bytes, whatever they are; the device-side tests (tests/runtime/test_tuf_pull.py)
pull real signed releases through ``verify_release``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from securesystemslib.signer import CryptoSigner
from tuf.api import exceptions
from tuf.api.metadata import Metadata
from tuf_testkit import resign_metadata, same_length_change, serve, updater

from runtime.release.contract import TUF_CHANNELS_TARGET, product_path, release_target_path
from runtime.release.signing import load_private_key
from runtime.release.verify import write_tarball
from tasks.config import ConfigError, PublishConfig, parse_config
from tasks.release.update_channel import (
    ROOT_THRESHOLD,
    Channel,
    UpdateChannelError,
    ensure_repository,
    key_file,
    load_state,
    publish_release,
    refresh,
    rotate_root,
    status,
)

REPO = Path(__file__).resolve().parents[2]


def fake_release(folder: Path, month: str, product: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(hashlib.sha256(f"{product}{month}".encode()).digest() * 64)
    manifest = {"month": month, "release_id": f"{month}+20261101T000000Z", "base_model_hash": "b" * 64,
                "engine": {"interface_hash": "e" * 64}} | ({"product": product} if product else {})
    (folder / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
    return folder


@pytest.fixture
def channel(tmp_path) -> Channel:
    return Channel(tmp_path / "tuf", tmp_path / "keys")


def first_root(channel: Channel) -> Path:
    return channel.metadata / "1.root.json"


def device_metadata(metadata_dir: Path, role: str):
    """What ngclient verified and keeps in the device's metadata folder (root.json: the newest root)."""
    return Metadata.from_bytes((metadata_dir / f"{role}.json").read_bytes()).signed


def served_target(channel: Channel, path: str) -> Path:
    sha = load_state(channel).targets.signed.targets[path].hashes["sha256"]
    folder, _, name = path.rpartition("/")
    return channel.targets / folder / f"{sha}.{name}"


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)  # read per test: a module-level time is stale by the time a late test runs


def test_a_published_release_refreshes_from_the_first_root_and_downloads(channel, tmp_path):
    started = utc_now()
    release = fake_release(tmp_path / "r", "2026-11")
    assert publish_release(channel, release, "2026-11", "2026-11") == ["targets", "snapshot", "timestamp"]
    with serve(channel.repo) as url:
        client = updater(url, first_root(channel), tmp_path / "device")
        client.refresh()
        info = client.get_targetinfo(release_target_path("2026-11"))
        assert info.custom == {"month": "2026-11", "release_id": "2026-11+20261101T000000Z",
                               "base_model_hash": "b" * 64, "engine_interface_hash": "e" * 64}
        got = Path(client.download_target(info, str(tmp_path / "got.tar.gz")))
        channels = json.loads(Path(client.download_target(client.get_targetinfo(TUF_CHANNELS_TARGET),
                                                          str(tmp_path / "channels.json"))).read_text())
    assert got.read_bytes() == write_tarball(release, tmp_path / "expected.tar.gz").read_bytes()
    assert channels == {"champion": "2026-11", "candidate": "2026-11"}
    expires = device_metadata(tmp_path / "device", "timestamp").expires  # what the client verified and kept
    assert started < expires <= utc_now() + dt.timedelta(days=1)
    root = Metadata.from_bytes(first_root(channel).read_bytes()).signed
    assert root.roles["root"].threshold == ROOT_THRESHOLD < len(root.roles["root"].keyids)
    assert root.consistent_snapshot


def test_the_same_release_again_writes_nothing_and_keys_are_never_replaced(channel, tmp_path):
    release = fake_release(tmp_path / "r", "2026-11")
    publish_release(channel, release, "2026-11", "2026-11")
    keys = {p.name: p.read_bytes() for p in channel.keys.iterdir()}
    before = sorted(p.name for p in channel.metadata.iterdir())
    assert publish_release(channel, release, "2026-11", "2026-11") == []
    assert sorted(p.name for p in channel.metadata.iterdir()) == before
    shutil.rmtree(channel.repo)  # a lost repository is made again with the same keys
    ensure_repository(channel)
    assert {p.name: p.read_bytes() for p in channel.keys.iterdir()} == keys


def test_candidate_is_the_newest_month_and_champion_what_the_registry_names(channel, tmp_path):
    publish_release(channel, fake_release(tmp_path / "b", "2026-11"), "2026-11", "2026-11")
    publish_release(channel, fake_release(tmp_path / "a", "2026-10"), "2026-10", "2026-10")  # an older month, later
    pointer = json.loads(served_target(channel, TUF_CHANNELS_TARGET).read_text())
    assert pointer == {"candidate": "2026-11", "champion": "2026-10"}
    assert sorted(status(channel)["targets"]) == [TUF_CHANNELS_TARGET, release_target_path("2026-10"),
                                                  release_target_path("2026-11")]


def test_each_product_has_its_own_channels_and_candidate_in_one_repository(channel, tmp_path):
    publish_release(channel, fake_release(tmp_path / "d", "2026-11"), "2026-11", "2026-11")  # the default product
    publish_release(channel, fake_release(tmp_path / "b10", "2026-10", "beta"), "2026-10", "2026-10", product="beta")
    publish_release(channel, fake_release(tmp_path / "b12", "2026-12", "beta"), "2026-12", "2026-10", product="beta")
    beta_channels = product_path(TUF_CHANNELS_TARGET, "beta")
    assert beta_channels == "products/beta/channels.json"
    # beta's newer month is beta's candidate only: the default product's pointer is as a single product left it
    assert json.loads(served_target(channel, TUF_CHANNELS_TARGET).read_text()) == {"candidate": "2026-11",
                                                                                  "champion": "2026-11"}
    assert json.loads(served_target(channel, beta_channels).read_text()) == {"candidate": "2026-12", "champion": "2026-10"}
    assert sorted(status(channel)["targets"]) == [TUF_CHANNELS_TARGET, beta_channels,
                                                  "products/beta/releases/2026-10.tar.gz",
                                                  "products/beta/releases/2026-12.tar.gz", release_target_path("2026-11")]
    with serve(channel.repo) as url:  # python-tuf's ngclient reads both products' signed pointers
        client = updater(url, first_root(channel), tmp_path / "device")
        client.refresh()
        info = client.get_targetinfo(release_target_path("2026-12", "beta"))
        assert info.custom["release_id"] == "2026-12+20261101T000000Z"
    with pytest.raises(UpdateChannelError, match="a release of product beta, not default"):
        publish_release(channel, fake_release(tmp_path / "b11", "2026-11", "beta"), "2026-11", None)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace (to see the file system calls) is not installed")
def test_every_published_file_is_fsynced_then_renamed_into_place_then_its_folder_fsynced(channel, tmp_path):
    """A power cut must leave a served file whole or absent: the system calls of a real publish, as strace saw them."""
    release, trace = fake_release(tmp_path / "r", "2026-11"), tmp_path / "trace"
    code = ("import sys; from pathlib import Path; from tasks.release.update_channel import Channel, publish_release; "
            "publish_release(Channel(Path(sys.argv[1]), Path(sys.argv[2])), Path(sys.argv[3]), '2026-11', '2026-11')")
    subprocess.run(["strace", "-f", "-y", "-qq", "-e", "trace=fsync,rename,renameat,renameat2", "-o", str(trace),
                    sys.executable, "-c", code, str(channel.repo), str(channel.keys), str(release)],
                   cwd=REPO, check=True, timeout=120)
    calls = [re.search(r'(fsync)\(\d+<([^>]*)>\)|(rename\w*)\(.*?"([^"]*)", .*?"([^"]*)"\)', line)
             for line in trace.read_text().splitlines() if " = 0" in line]
    fsynced = [(i, m.group(2)) for i, m in enumerate(calls) if m and m.group(1)]
    renamed = {m.group(5): (i, m.group(4)) for i, m in enumerate(calls) if m and m.group(3)}
    published = sorted(p for folder in (channel.metadata, channel.targets) for p in folder.rglob("*") if p.is_file())
    assert len(published) >= 8 and not [p for p in published if p.name.startswith(".")]  # no temporary is left
    for path in published:  # targets (copied from the tarball) and metadata (written)
        at, temporary = renamed[str(path)]
        assert Path(temporary).name.startswith("."), temporary  # a static server never serves a half-written file
        assert any(i < at and p == temporary for i, p in fsynced), f"{path}: renamed in before its bytes were on disk"
        assert any(i > at and p == str(path.parent) for i, p in fsynced), f"{path}: its folder's entry not fsynced"


def test_a_release_of_another_month_is_not_published(channel, tmp_path):
    with pytest.raises(UpdateChannelError, match=r"a release of 2026-11, not 2026-12; not published"):
        publish_release(channel, fake_release(tmp_path / "r", "2026-11"), "2026-12", "2026-12")
    assert not channel.metadata.exists() and not channel.targets.exists()  # refused before anything is written


def test_timestamp_expiry_is_at_most_seven_days():
    assert PublishConfig().timestamp_expiry_days == 1
    assert parse_config({"publish": {"timestamp_expiry_days": 7}}).publish.timestamp_expiry_days == 7
    with pytest.raises(ConfigError, match="timestamp_expiry_days"):
        parse_config({"publish": {"timestamp_expiry_days": 8}})


def test_changed_target_bytes_and_an_edited_channel_pointer_are_refused(channel, tmp_path):
    publish_release(channel, fake_release(tmp_path / "a", "2026-10"), "2026-10", "2026-10")
    publish_release(channel, fake_release(tmp_path / "b", "2026-11"), "2026-11", "2026-10")
    tarball = served_target(channel, release_target_path("2026-11"))
    tarball.write_bytes(bytes(len(tarball.read_bytes())))  # same length, other bytes
    same_length_change(served_target(channel, TUF_CHANNELS_TARGET), b'"champion": "2026-10"', b'"champion": "2026-11"')
    with serve(channel.repo) as url:
        client = updater(url, first_root(channel), tmp_path / "device")
        client.refresh()
        for path in (release_target_path("2026-11"), TUF_CHANNELS_TARGET):
            with pytest.raises(exceptions.LengthOrHashMismatchError):
                client.download_target(client.get_targetinfo(path), str(tmp_path / "out"))


def test_a_stale_timestamp_is_refused_until_the_daily_refresh(channel, tmp_path):
    week_ago = utc_now() - dt.timedelta(days=6)
    publish_release(channel, fake_release(tmp_path / "r", "2026-11"), "2026-11", "2026-11", now=week_ago)
    with serve(channel.repo) as url:
        with pytest.raises(exceptions.ExpiredMetadataError, match="timestamp"):
            updater(url, first_root(channel), tmp_path / "device").refresh()
        # snapshot (7 days) is within 2 days of its expiry: re-signed with the timestamp; targets is not
        assert refresh(channel) == ["snapshot", "timestamp"]
        assert refresh(channel) == ["timestamp"]
        client = updater(url, first_root(channel), tmp_path / "device")
        client.refresh()
        assert client.get_targetinfo(release_target_path("2026-11")) is not None


def test_targets_from_another_snapshot_and_endless_metadata_are_refused(channel, tmp_path):
    publish_release(channel, fake_release(tmp_path / "a", "2026-10"), "2026-10", "2026-10")
    publish_release(channel, fake_release(tmp_path / "b", "2026-11"), "2026-11", "2026-11")
    served = channel.metadata
    saved = {p.name: p.read_bytes() for p in served.iterdir()}
    shutil.copyfile(served / "2.targets.json", served / "3.targets.json")  # mix and match
    with serve(channel.repo) as url:
        with pytest.raises(exceptions.LengthOrHashMismatchError, match="does not match expected length"):
            updater(url, first_root(channel), tmp_path / "d1").refresh()
        (served / "3.targets.json").write_bytes(saved["3.targets.json"])
        (served / "timestamp.json").write_bytes(saved["timestamp.json"] + b" " * 20000)  # endless data
        with pytest.raises(exceptions.DownloadLengthMismatchError):
            updater(url, first_root(channel), tmp_path / "d2").refresh()


def params_file(tmp_path: Path, channel: Channel) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"publish": {"tuf_dir": str(channel.repo), "tuf_keys_dir": str(channel.keys)}}))
    return path


def cli(params: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tasks.release.update_channel", "--params", str(params), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_rotate_root_needs_both_thresholds_and_devices_follow_the_chain(channel, tmp_path):
    publish_release(channel, fake_release(tmp_path / "r", "2026-11"), "2026-11", "2026-11")
    offline = tmp_path / "offline"
    offline.mkdir()
    for n in (2, 3):  # the root keys leave the publishing machine, as docs/update-channel.md says
        for suffix in (".key", ".pub"):
            shutil.move(key_file(channel, "root", n).with_suffix(suffix), offline / f"root-{n}{suffix}")
    old_root_1 = CryptoSigner(load_private_key(key_file(channel, "root", 1))).public_key.keyid
    new_key = tmp_path / "keys" / "root-4.key"
    with pytest.raises(UpdateChannelError, match=r"threshold of the current root \(2\); signed by 1"):
        rotate_root(channel, add_keys=[new_key], remove_keyids=[old_root_1[:10]])
    params = params_file(tmp_path, channel)
    done = cli(params, "rotate-root", "--add-key", str(new_key), "--remove-key", old_root_1[:10],
               "--root-key", str(offline / "root-2.key"), "--root-key", str(offline / "root-3.key"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"root_version": 2}  # the refused try wrote no root
    old, new = (Metadata.from_bytes((channel.metadata / f"{v}.root.json").read_bytes()) for v in (1, 2))
    old.signed.verify_delegate("root", new.signed_bytes, new.signatures)
    new.signed.verify_delegate("root", new.signed_bytes, new.signatures)
    assert old_root_1 not in new.signed.roles["root"].keyids and len(new.signed.roles["root"].keyids) == 3
    with serve(channel.repo) as url:
        updater(url, first_root(channel), tmp_path / "device").refresh()
    assert device_metadata(tmp_path / "device", "root").version == 2


def test_a_revoked_key_signs_nothing_a_device_accepts(channel, tmp_path):
    publish_release(channel, fake_release(tmp_path / "r", "2026-11"), "2026-11", "2026-11")
    old_timestamp = CryptoSigner(load_private_key(key_file(channel, "timestamp")))
    params = params_file(tmp_path, channel)
    done = cli(params, "revoke-key", old_timestamp.public_key.keyid[:12],
               "--replacement", str(key_file(channel, "timestamp", 2)))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"revoked_from": ["timestamp"]}
    shown = json.loads(cli(params, "status").stdout)["roles"]
    assert shown["root"]["version"] == 2 and old_timestamp.public_key.keyid not in shown["timestamp"]["keyids"]
    with serve(channel.repo) as url:
        updater(url, first_root(channel), tmp_path / "d1").refresh()  # the new key's timestamp is accepted
        # whoever holds the leaked key signs a newer, fresh timestamp: refused after the rotation
        version = load_state(channel).timestamp.signed.version
        resign_metadata(channel.repo, "timestamp.json", old_timestamp, version=version + 1,
                        expires=utc_now() + dt.timedelta(days=1))
        with pytest.raises(exceptions.UnsignedMetadataError, match="timestamp"):
            updater(url, first_root(channel), tmp_path / "d2").refresh()


def test_commands_name_what_is_missing(channel, tmp_path):
    params = params_file(tmp_path, channel)
    done = cli(params, "refresh")
    assert done.returncode == 2 and "no root metadata" in done.stderr and "init" in done.stderr
    assert cli(params, "init").returncode == 0
    done = cli(params, "revoke-key", "ffff", "--replacement", str(tmp_path / "k.key"))
    assert done.returncode == 2 and "key id 'ffff' names 0 keys" in done.stderr
    assert status(channel)["roles"]["timestamp"]["version"] == 1
