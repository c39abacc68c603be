"""Verification of a release: what a device accepts, and every refusal with its own reason and exit code."""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from release_testkit import copy_release, resign, world

from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import greedy_generate
from runtime.engine.interface import read_interface
from runtime.engine.tokenizer import DeviceTokenizer
from runtime.release.contract import parse_time
from runtime.release.signing import generate_key
from runtime.release.verify import (
    EXIT_CODES,
    BackboneMismatch,
    ChecksumMismatch,
    ExpiredRelease,
    InterfaceMismatch,
    KVScalesRefused,
    MonthMismatch,
    RollbackRefused,
    SignatureRefused,
    SizeLimitExceeded,
    TokenizerMismatch,
    UnlistedFile,
    UnsafePath,
    bind_release,
    load_trusted_keys,
    verify_path,
    verify_release,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    from bench.lib.worlds import make_tiny_base
    from tasks.stages.compile import compile_engine

    w = world(tmp_path_factory)
    w["keys"] = load_trusted_keys([w["trusted_key"]])
    w["iface"] = read_interface(w["engine"])
    # Engines a release must not run on: another backbone, and the same backbone with another interface.
    other = make_tiny_base(w["root"] / "other-base", seed=7)
    compile_engine(other, w["root"] / "other-engine", max_rank=8, ort_threads=1)
    compile_engine(w["tokenizer"], w["root"] / "rank16-engine", max_rank=16, ort_threads=1)
    return w


def verify(w, path, **kw):
    return verify_release(path, w["keys"], w["iface"], **kw)


def test_peft_loads_the_package_and_its_greedy_outputs_match_the_engine(w):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tok = DeviceTokenizer(w["tokenizer"])
    prompt = tok.encode("inspect board=PCB-1201 line=L2 part=C7 temp_c=244 defect=lifted lift_um=40 verdict:")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(w["tokenizer"], dtype=torch.float32), w["b"])
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                    eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    peft_tokens = out[0, len(prompt):].tolist()

    engine = OrtEngine(w["engine"], threads=1)
    bind_release(engine, verify(w, w["b"]))
    engine_tokens = greedy_generate(engine, [prompt], 10, [tok.eos_id], tok.pad_id)[0]

    assert len(engine_tokens) == 10 and engine_tokens == [t for t in peft_tokens if t != tok.eos_id]


def test_a_release_verifies_and_its_manifest_binds_everything(w):
    verified = verify(w, w["b"], tokenizer_sha256=DeviceTokenizer(w["tokenizer"]).sha256)
    m = verified.manifest
    raw = (w["b"] / "manifest.json").read_text()
    assert raw == json.dumps(m, indent=2, sort_keys=True) + "\n"  # sorted keys, canonical bytes
    assert m["month"] == "2026-11" and m["release_id"].startswith("2026-11+")
    assert m["base_model_hash"] == w["iface"].backbone_hash
    assert m["engine"]["interface_hash"] == w["iface"].lora_contract_hash  # the float engine's: every form of it binds the release
    assert m["kv_format"] is None and m["adapter"] == {"lora_alpha": 16.0, "r": 8,
                                                               "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"]}
    assert m["gates"]["passed"] is True and m["gates"]["verdicts"]["accuracy_new"]["threshold"] == 0.95
    assert m["metrics"]["adapter"]["accuracy_new"] == 0.96 and "per_rule" not in m["metrics"]["base"]
    assert sorted(m["files"]) == ["adapter_config.json", "adapter_model.safetensors", "provenance.json"]
    assert parse_time(m["expires_at"]) - parse_time(m["created_at"]) == dt.timedelta(days=120)
    assert len(m["pipeline"]["git_revision"]) == 40
    assert verified.lora["lora_A.0.q_proj+k_proj+v_proj"].shape == (24, 64)


def test_a_device_tokenizer_that_stops_or_tokenizes_otherwise_is_refused(w, tmp_path):
    import shutil

    tok = DeviceTokenizer(w["tokenizer"])
    assert json.loads((w["b"] / "manifest.json").read_text())["stop_token_ids"] == list(tok.stop_ids)
    other = shutil.copytree(w["tokenizer"], tmp_path / "tokenizer")
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, 3]}))
    stops = DeviceTokenizer(other).stop_ids
    with pytest.raises(TokenizerMismatch, match=r"evaluated stopping at token ids \[\d+\], the device's tokenizer stops at"):
        verify(w, w["b"], tokenizer_sha256=tok.sha256, stop_token_ids=stops)
    with pytest.raises(TokenizerMismatch, match="release was trained with tokenizer"):
        verify(w, w["b"], tokenizer_sha256="0" * 64, stop_token_ids=tok.stop_ids)
    assert verify(w, w["b"], tokenizer_sha256=tok.sha256, stop_token_ids=tok.stop_ids).manifest["month"] == "2026-11"


@pytest.mark.parametrize("name,reason", [
    ("adapter_config.json", "checksum"), ("adapter_model.safetensors", "checksum"), ("provenance.json", "checksum"),
    ("manifest.json", "signature"), ("manifest.sig", "signature"),
])
def test_a_flipped_byte_in_any_file_is_refused(w, tmp_path, name, reason):
    release = copy_release(w["b"], tmp_path / "r")
    data = bytearray((release / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (release / name).write_bytes(bytes(data))
    with pytest.raises((ChecksumMismatch, SignatureRefused)) as err:
        verify(w, release)
    assert err.value.reason == reason and err.value.exit_code == EXIT_CODES[reason]
    assert name in str(err.value)


def test_an_unlisted_file_is_refused(w, tmp_path):
    release = copy_release(w["b"], tmp_path / "r")
    (release / "extra.json").write_text("{}")
    with pytest.raises(UnlistedFile, match="extra.json not listed in the signed manifest"):
        verify(w, release)


def test_a_package_signed_by_another_key_is_refused(w, tmp_path):
    release = copy_release(w["b"], tmp_path / "r")
    other = tmp_path / "other.key"
    generate_key(other)
    resign(release, other)
    with pytest.raises(SignatureRefused, match="which this device does not trust"):
        verify(w, release)
    assert verify_release(release, load_trusted_keys([other.with_suffix(".pub")]), w["iface"]).key_id != next(iter(w["keys"]))


def test_a_package_for_another_backbone_is_refused(w):
    other = read_interface(w["root"] / "other-engine")
    with pytest.raises(BackboneMismatch, match="the local engine runs backbone") as err:
        verify_release(w["b"], w["keys"], other)
    assert err.value.exit_code == 14


def test_a_package_for_another_engine_interface_is_refused(w):
    rank16 = read_interface(w["root"] / "rank16-engine")
    assert rank16.backbone_hash == w["iface"].backbone_hash
    with pytest.raises(InterfaceMismatch, match="release is for engine interface") as err:
        verify_release(w["b"], w["keys"], rank16)
    assert err.value.exit_code == 15


def _tarball(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


@pytest.mark.parametrize("member,message", [
    ("../evil.json", "climbs out of the archive"),
    ("/etc/evil.json", "absolute path"),
    ("sub/evil.json", "not a plain file name"),
    ("link", "is a link"),
])
def test_a_path_traversal_or_link_in_a_tarball_is_refused(w, tmp_path, member, message):
    files = [(tarfile.TarInfo(p.name), p.read_bytes()) for p in sorted(w["b"].iterdir())]
    bad = tarfile.TarInfo(member)
    if member == "link":
        bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
    tar = _tarball(tmp_path / "evil.tar.gz", files + [(bad, b"{}" if member != "link" else b"")])
    with pytest.raises(UnsafePath, match=message) as err:
        verify_path(tar, w["keys"], iface=w["iface"])
    assert err.value.exit_code == 19
    assert not (tmp_path.parent / "evil.json").exists()


def test_the_release_tarball_verifies_like_the_directory(w):
    verified = verify_path(w["b"].parent / "release.tar.gz", w["keys"], iface=w["iface"])
    assert verified.release_id == json.loads((w["b"] / "manifest.json").read_text())["release_id"]


def test_an_older_release_replayed_is_refused_unless_rollback_is_allowed(w):
    newer = verify(w, w["b"]).release_id
    with pytest.raises(RollbackRefused, match=re.escape(f"older than the active release {newer}")) as err:
        verify(w, w["a"], active_release=newer)
    assert err.value.exit_code == 20
    assert verify(w, w["a"], active_release=newer, allow_rollback=True).manifest["month"] == "2026-10"
    assert verify(w, w["b"], active_release=newer).release_id == newer  # the same release again is fine
    with pytest.raises(RollbackRefused):
        verify(w, w["a"], active_release="2026-11")  # a bare month works as the active release too


def test_a_release_fetched_by_another_months_name_is_refused(w):
    with pytest.raises(MonthMismatch, match="fetched as the release of 2026-12, but its signed manifest is release "
                       f"{re.escape(verify(w, w['b']).release_id)} of 2026-11") as err:
        verify(w, w["b"], month="2026-12")
    assert (err.value.exit_code, EXIT_CODES["month_mismatch"]) == (24, 24)
    assert "month: 2026-11, as fetched" in verify(w, w["b"], month="2026-11").checks


def test_an_expired_manifest_is_refused(w):
    expires = parse_time(verify(w, w["b"]).manifest["expires_at"])
    with pytest.raises(ExpiredRelease, match="expired at") as err:
        verify(w, w["b"], now=expires + dt.timedelta(seconds=1))
    assert err.value.exit_code == 21


def test_a_signed_release_that_brings_static_kv_scales_is_refused(w, tmp_path):
    # A release of the static quantized cache (removed): its adapter was gated on a cache this runtime does not have.
    release = copy_release(w["b"], tmp_path / "r")
    resign(release, w["key"], kv_format={"name": "K4cs/V4cs post s0 w0", "k_bits": 4, "v_bits": 4})
    with pytest.raises(KVScalesRefused, match="brings static KV scales .*which this runtime no longer reads") as err:
        verify(w, release)
    assert err.value.exit_code == 17


def test_a_package_over_the_size_limit_is_refused(w):
    with pytest.raises(SizeLimitExceeded, match="the device limit is 10000 bytes"):
        verify(w, w["b"], max_bytes=10_000)


def test_verify_command_exit_codes(w, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "runtime", "verify", *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    ok = cli(w["b"], "--trusted-key", w["trusted_key"], "--engine", w["engine"], "--tokenizer", w["tokenizer"])
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    release = copy_release(w["b"], tmp_path / "r")
    (release / "adapter_model.safetensors").write_bytes(b"\0" + (release / "adapter_model.safetensors").read_bytes()[1:])
    bad = cli(release, "--trusted-key", w["trusted_key"], "--engine", w["engine"])
    assert bad.returncode == 11 and "refused (checksum)" in bad.stderr
    old = cli(w["a"], "--trusted-key", w["trusted_key"], "--active-release", "2026-11")
    assert old.returncode == 20 and "refused (rollback)" in old.stderr
    nokey = cli(w["b"])
    assert nokey.returncode == 13 and "no trusted public key configured" in nokey.stderr
    device = w["root"] / "device.json"  # paths relative to the config file
    device.write_text(json.dumps({"trusted_keys": ["keys/release_signing.pub"], "engine": "engine", "tokenizer": "base"}))
    configured = cli(w["b"], "--device-config", device)
    assert configured.returncode == 0, configured.stderr
    assert any(c.startswith("adapter: r=8") for c in json.loads(configured.stdout)["checks"])
