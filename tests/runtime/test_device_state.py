"""Device state across restarts and health-gated commit: atomic state writes, resume without --package,
the high-water mark, signed probes that commit or revert, and a damaged state that is named, never reset.

Servers are the real app under uvicorn (``server_testkit.running_server``) or ``python -m runtime serve`` in a
subprocess, on the tiny world's ONNX Runtime engine. GOOD is B's adapter signed as 2026-12 with a probe whose
expected answer is B's real greedy answer; BAD is A's adapter signed as 2027-01 with a probe it cannot pass."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from release_testkit import copy_release, resign, world
from server_testkit import ADMIN_TOKEN, PROMPT, call, complete, manifest_id, running_server, sample, scrape

from runtime.__main__ import main
from runtime.engine.atomic_files import atomic_copy, atomic_write
from runtime.engine.tokenizer import DeviceTokenizer
from runtime.release.contract import MANIFEST
from runtime.release.device_state import STATE_FILE, DeviceState, StateError
from runtime.release.verify import (
    DEFAULT_MAX_PACKAGE_BYTES,
    MalformedPackage,
    load_trusted_keys,
    release_probes,
    verify_release,
)
from runtime.serve.server import Watcher

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    stamp = manifest_id(w["b"]).partition("+")[2]
    with running_server(w) as (app, background):
        app.load(w["b"])
        w["text_b"] = complete(background.port)["text"]
    w["good"] = copy_release(w["b"], w["root"] / "release-2026-12")
    resign(w["good"], w["key"], month="2026-12", release_id=f"2026-12+{stamp}",
           probes=[{"prompt": PROMPT, "expected": w["text_b"], "max_tokens": 6}])
    w["bad"] = copy_release(w["a"], w["root"] / "release-2027-01")
    resign(w["bad"], w["key"], month="2027-01", release_id="2027-01+" + manifest_id(w["a"]).partition("+")[2],
           probes=[{"prompt": PROMPT, "expected": w["text_b"] + " and more", "max_tokens": 6}])
    return w


def load(port: int, release: Path) -> tuple[int, dict]:
    return call(port, "POST", "/v1/adapters", {"path": str(release)})


def device_state(port: int) -> dict:
    return call(port, "GET", "/healthz")[1]["device_state"]


def until(condition, what: str, timeout: float = 30.0) -> float:
    """Poll ``condition`` every 20 ms until it holds; the seconds it took. Fails naming ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


class Clients:
    """Two clients sending small requests without a model until ``stop_after``; each answer is kept with the
    client and the moment it was sent. A request sent before a revert may be answered by the release it
    reverted however late it ends (on a busy machine, seconds), so what a test checks is the answers sent
    after a moment, never the last ones to arrive."""

    def __init__(self, port: int):
        self.answers: list[tuple[int, float, int, dict]] = []  # (client, when sent, status, body)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(port, i), daemon=True) for i in range(2)]
        for t in self._threads:
            t.start()

    def _send(self, port: int, client: int) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            self.answers.append((client, sent, *call(port, "POST", "/v1/completions",
                                                     {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})))

    def stop_after(self, moment: float) -> None:
        """Stop once each client has been answered on a request sent after ``moment``."""
        until(lambda: {c for c, sent, _, _ in list(self.answers) if sent > moment} == {0, 1}, "answers after it")
        self._stop.set()
        for t in self._threads:
            t.join()

    def statuses(self) -> set[int]:
        return {status for _, _, status, _ in self.answers}

    def answered_after(self, moment: float) -> set[tuple[str, str]]:
        """(model, text) of every answer to a request sent after ``moment``."""
        return {(b["model"], b["choices"][0]["text"]) for _, sent, _, b in self.answers if sent > moment}


# ---------------------------------------------------------------- the state file

def test_a_crash_mid_write_leaves_the_old_or_the_new_state(tmp_path):
    """A writer killed with SIGKILL at random moments: the record always parses and is one that was written.
    A temporary file a crash left behind never replaces the record and is removed at the next open."""
    writer = ("import sys\nfrom runtime.release.device_state import DeviceState\ns = DeviceState(sys.argv[1])\ni = 0\n"
              "while True:\n    i += 1\n    s.write(reverted={'2026-01': {'reason': str(i), 'detail': 'x' * 200000}})\n"
              "    if i == 1:\n        print('written', flush=True)\n")
    for delay in (0.0, 0.05, 0.1, 0.2, 0.3):
        proc = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "written\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        record = DeviceState(tmp_path).record.reverted["2026-01"]
        assert int(record["reason"]) >= 1 and record["detail"] == "x" * 200000
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # leftovers cleared
    path = tmp_path / STATE_FILE
    before = path.read_bytes()
    (tmp_path / f".tmp-{STATE_FILE}-1-1").write_text('{"active": "half wri')  # what a power cut mid-write leaves
    state = DeviceState(tmp_path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["lock", "releases", STATE_FILE]
    with pytest.raises(StateError, match=f"{tmp_path / 'lock'}: the state directory is in use by process "
                       f"{os.getpid()}"):
        DeviceState(tmp_path)  # one writer at a time
    state.close()
    atomic_write(path, b"{}")
    with pytest.raises(StateError, match=f"{path}: invalid device state"):
        DeviceState(tmp_path)


def test_a_copy_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    target, source = tmp_path / "2026-11.tar.gz", tmp_path / "source.tar.gz"
    target.write_bytes(b"old")
    source.write_bytes(b"new" * 100_000)
    with pytest.raises(IsADirectoryError):  # the temporary is open when the source fails to
        atomic_copy(tmp_path, target)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [target.name, source.name]
    atomic_copy(source, target)
    assert target.read_bytes() == source.read_bytes() and len(list(tmp_path.iterdir())) == 2


def test_a_damaged_state_is_an_error_naming_the_file_never_a_reset(w, tmp_path):
    path = tmp_path / STATE_FILE
    path.write_text("{not json")
    with pytest.raises(StateError, match=f"{path}: device state is not valid JSON"):
        DeviceState(tmp_path)
    path.write_text(json.dumps({"format_version": 1, "active": "2026-11", "status": "committed"}))
    with pytest.raises(StateError, match=r"the active release 2026-11 has no copy at .*releases/2026-11"):
        DeviceState(tmp_path)
    path.write_text(json.dumps({"format_version": 1, "active": "soon", "status": "maybe", "extra": 1}))
    with pytest.raises(StateError) as err:
        DeviceState(tmp_path)
    assert all(s in str(err.value) for s in ("unknown field(s) ['extra']", "active: a release id", "status: one of"))

    path.write_text("{not json")
    done = subprocess.run([sys.executable, "-m", "runtime", "serve", "--engine", str(w["engine"]), "--tokenizer",
                           str(w["tokenizer"]), "--trusted-key", str(w["trusted_key"]), "--state-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"error: {path}: device state is not valid JSON" in done.stderr
    assert path.read_text() == "{not json"  # left as it was for the operator


def test_a_copy_kept_for_a_load_stays_until_a_write_names_or_keeps_it(w, tmp_path):
    """A load copies its release before it is resident; a write in between (another release's trial
    committing) must not remove that copy, or the record would name a release with no copy."""
    state, a = DeviceState(tmp_path), manifest_id(w["a"])
    copy = state.keep(w["a"], a, load_trusted_keys([w["trusted_key"]]), DEFAULT_MAX_PACKAGE_BYTES)
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in w["a"].iterdir())
    state.write()
    assert copy.is_dir()
    state.write(keep={a})  # resident now: the resident set keeps it from here on
    state.write()
    assert not copy.exists()
    state.close()


# ---------------------------------------------------------------- probes in the manifest

def test_probes_are_signed_manifest_fields_and_a_manifest_without_them_loads(w, tmp_path):
    keys = load_trusted_keys([w["trusted_key"]])
    assert [p.expected for p in release_probes(verify_release(w["good"], keys).manifest)] == [w["text_b"]]
    older = copy_release(w["b"], tmp_path / "older")
    manifest = json.loads((older / MANIFEST).read_text())
    manifest.pop("probes", None)
    (older / MANIFEST).write_text(json.dumps(manifest))
    resign(older, w["key"])
    assert "probes" not in verify_release(older, keys).manifest and release_probes(manifest) == ()
    bad = copy_release(w["b"], tmp_path / "bad")
    resign(bad, w["key"], probes=[{"prompt": "", "expected": "x", "max_tokens": 0}])
    with pytest.raises(MalformedPackage, match=r"probes\[0\]: needs exactly prompt"):
        verify_release(bad, keys)


# ---------------------------------------------------------------- health-gated commit

def test_probes_that_pass_commit_and_failing_probes_revert_to_the_previous_release(w, tmp_path):
    state_dir = tmp_path / "state"
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    with running_server(w, release_dirs=(w["root"],), state_dir=state_dir, health_window=0.3) as (app, background):
        port = background.port
        assert load(port, w["a"])[0] == 200
        app.gate.wait(30)
        assert load(port, w["good"])[0] == 200
        assert device_state(port)["state"] == "trial"
        app.gate.wait(30)
        good, text_good = manifest_id(w["good"]), complete(port)["text"]
        assert text_good == w["text_b"]
        state = device_state(port)
        assert (state["state"], state["release_id"], state["previous"], state["high_water"]) == \
            ("committed", good, manifest_id(w["a"]), good)
        assert state["last_check"]["result"] == "committed"

        clients = Clients(port)  # requests without model through the swap to BAD and the revert
        time.sleep(0.3)
        swapped = time.monotonic()
        status, body = load(port, w["bad"])
        app.gate.wait(30)
        reverted_at = time.monotonic()
        clients.stop_after(reverted_at)

        assert status == 200 and body["release_id"] == manifest_id(w["bad"]), body  # verified and swapped in: then checked
        assert reverted_at - swapped < 5, reverted_at - swapped
        assert clients.statuses() == {200}  # no client saw the revert
        assert clients.answered_after(reverted_at) == {(good, text_good)}
        assert complete(port)["text"] == text_good
        state = device_state(port)
        assert (state["state"], state["release_id"], state["reverted"]) == ("committed", good, [manifest_id(w["bad"])])
        assert (state["last_check"]["result"], state["last_check"]["reason"]) == ("reverted", "probe_mismatch")
        assert "expected" in state["last_check"]["detail"]
        assert [m["id"] for m in call(port, "GET", "/v1/models")[1]["data"]] == [good, manifest_id(w["a"])]

        status, body = load(port, w["bad"])  # never installed again, through the admin API or the watch mode
        assert (status, body["reason"], body["exit_code"]) == (422, "reverted", 23)
        shutil.copytree(w["bad"], inbox / "2027-01")
        assert [r.get("refused") for r in Watcher(app, inbox).poll_once()] == ["reverted"]
        samples = scrape(port)
    assert sample(samples, "adapter_release_commits_total") == 2
    assert sample(samples, "adapter_release_reverts_total", reason="probe_mismatch") == 1
    assert sample(samples, "adapter_release_reverts_total", reason="generation_errors") == 0
    assert sample(samples, "adapter_champion_state", state="committed", product="default") == 1
    assert sample(samples, "adapter_champion_state", state="trial", product="default") == 0
    record = json.loads((state_dir / STATE_FILE).read_text())
    assert record["reverted"][manifest_id(w["bad"])]["reason"] == "probe_mismatch"
    assert sorted(p.name for p in (state_dir / "releases").iterdir()) == [manifest_id(w["a"]), good]
    print(f"\nrevert of a release whose probe fails: {reverted_at - swapped:.3f} s after its swap, "
          f"{len(clients.answers)} requests during it, all 200")


def test_the_operator_rolls_back_with_the_rollback_command(w, tmp_path, capsys):
    state_dir = tmp_path / "state"
    with running_server(w, state_dir=state_dir) as (app, background):
        for release in (w["a"], w["b"]):
            app.load(release)
            app.gate.wait(30)
    a, b = manifest_id(w["a"]), manifest_id(w["b"])
    assert main(["rollback", "--state-dir", str(state_dir)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["active"], record["high_water"], record["previous"]) == (a, a, None)
    assert record["reverted"][b]["reason"] == "operator"
    with running_server(w, release_dirs=(w["root"],), state_dir=state_dir) as (app, background):
        assert complete(background.port)["release_id"] == a
        status, body = load(background.port, w["b"])
        assert (status, body["reason"]) == (422, "reverted")
    assert main(["rollback", "--state-dir", str(state_dir)]) == 2  # nothing older is kept
    assert "no previous release is kept" in capsys.readouterr().err


@pytest.mark.parametrize("decode", ["batched", "fork"])
def test_probes_decode_in_the_servers_decode_mode(w, tmp_path, decode):
    """The probes take the path a client's request takes under ``--decode``: batched steps of the release's
    batch (counted in adapter_decode_batch_rows), or a fork of its own (no batched step at all)."""
    with running_server(w, state_dir=tmp_path / "state", decode=decode) as (app, background):
        app.load(w["good"])
        app.gate.wait(30)
        state, samples = device_state(background.port), scrape(background.port)
    assert (state["state"], state["last_check"]["result"]) == ("committed", "committed"), state["last_check"]
    steps = sample(samples, "adapter_decode_batch_rows_count")
    assert (steps > 0) if decode == "batched" else (steps == 0), steps
    assert sample(samples, "adapter_release_requests_total", release_id=manifest_id(w["good"]), channel="champion",
                  product="default") == 1


@pytest.mark.parametrize("decode", ["fork", "batched"])
def test_a_request_failing_on_a_new_champion_reverts_it(w, tmp_path, decode):
    """A generation that fails (500) on the new champion within the window reverts it. No release the
    device verifies can make a generation fail (shapes, finite weights and KV scales are checked before
    binding), so the fault is the device's: the server process's address space is capped (prlimit) while a
    client sends 16 prompts of ~4000 tokens, whose prefill ONNX Runtime cannot allocate. Only that request
    fails, in either decode mode (batched, the small requests that arrived with it are prefilled again
    without it); the clients' small requests keep answering through the revert, then on the previous release."""
    a, good = manifest_id(w["a"]), manifest_id(w["good"])
    state_dir, log, token = tmp_path / "state", tmp_path / "serve.log", tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    with running_server(w, state_dir=state_dir) as (app, background):  # A committed: the revert target
        app.load(w["a"])
        app.gate.wait(30)
    proc, port = started(serve(w, state_dir, "--health-window", "30", "--decode", decode, "--admin-token-file",
                               str(token), "--release-dir", str(w["root"])), log)
    try:
        text_a = complete(port)["text"]
        clients = Clients(port)  # requests without model through the swap, the failure and the revert
        assert load(port, w["good"])[0] == 200
        time.sleep(1.0)  # its probe (6 tokens, milliseconds) has passed: the cap below is for the big request only
        assert device_state(port)["state"] == "trial"
        tokenizer = DeviceTokenizer(w["tokenizer"])
        long_prompt = (PROMPT + " ") * ((4096 - 1) // len(tokenizer.encode(PROMPT + " ")))
        assert 3500 < len(tokenizer.encode(long_prompt)) <= 4095
        limits = resource.prlimit(proc.pid, resource.RLIMIT_AS)
        vm_bytes = int(next(line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                            if line.startswith("VmSize")).split()[1]) * 1024
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (vm_bytes + (1 << 26), limits[1]))  # 64 MiB more: chunked prefill and last-position logits fit 16 x 4,000 tokens in 1 GiB
        try:
            status, failure = call(port, "POST", "/v1/completions", {"prompt": [long_prompt] * 16, "max_tokens": 1,
                                                                     "temperature": 0})
        finally:
            resource.prlimit(proc.pid, resource.RLIMIT_AS, limits)
        reverted_after = until(lambda: device_state(port)["release_id"] == a, "revert after the 500")
        reverted_at = time.monotonic()
        clients.stop_after(reverted_at)
        state, samples, models = device_state(port), scrape(port), call(port, "GET", "/v1/models")[1]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0

    assert (status, failure["error"]["type"]) == (500, "server_error") and "alloc" in failure["error"]["message"], failure  # "Failed to allocate" or "std::bad_alloc"
    assert reverted_after < 30  # within the window
    assert clients.statuses() == {200}, [b for _, _, s, b in clients.answers if s != 200][:3]  # only the big request failed
    assert {b["model"] for _, _, _, b in clients.answers} == {a, good}  # the clients ran on the new champion, then on A again
    assert clients.answered_after(reverted_at) == {(a, text_a)}
    assert (state["state"], state["release_id"], state["previous"], state["reverted"]) == ("committed", a, None, [good])
    assert (state["last_check"]["release_id"], state["last_check"]["result"], state["last_check"]["reason"]) == \
        (good, "reverted", "generation_errors")
    assert state["last_check"]["detail"] == "1 request(s) failed (500) on it within the 30 s window"
    assert json.loads((state_dir / STATE_FILE).read_text())["reverted"][good]["reason"] == "generation_errors"
    assert sample(samples, "adapter_generation_errors_total", release_id=good, product="default") == 1
    assert sample(samples, "adapter_requests_total", endpoint="/v1/completions", status="500") == 1
    assert sample(samples, "adapter_release_reverts_total", reason="generation_errors") == 1
    assert sample(samples, "adapter_release_reverts_total", reason="probe_mismatch") == 0
    assert sample(samples, "adapter_champion_state", state="committed", product="default") == 1
    assert [m["id"] for m in models["data"]] == [a]
    # Every stderr line is JSON, ONNX Runtime's failure included: its own (C++) logger, which writes plain text, is
    # silenced, and the error reaches the log as the exception of the request that failed
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert any("alloc" in line.get("exception", "") + line.get("message", "") for line in lines), lines[-5:]
    events = [line for line in lines if line.get("event")]
    assert [(e["event"], e["release_id"], e.get("reason")) for e in events] == \
        [("release_reverted", good, "generation_errors")]
    print(f"\nrevert of a champion whose request failed (500): {reverted_after:.3f} s after the failure, "
          f"{len(clients.answers)} client requests through the swap, the failure and the revert, all 200")


# ---------------------------------------------------------------- restarts

def test_a_trial_cut_by_a_restart_runs_again_with_the_previous_release_on_standby(w, tmp_path):
    state_dir = tmp_path / "state"
    a, good = manifest_id(w["a"]), manifest_id(w["good"])
    with running_server(w, state_dir=state_dir, health_window=60) as (app, background):
        app.load(w["b"])  # on trial for 60 s: never committed, so never a revert target
        app.load(w["a"], allow_rollback=True)  # a local rollback; B's trial ends
        assert device_state(background.port)["previous"] is None
    with running_server(w, state_dir=state_dir) as (app, background):  # A's trial runs again: window 0
        app.gate.wait(30)
        assert device_state(background.port)["state"] == "committed"
    with running_server(w, state_dir=state_dir, health_window=60) as (app, background):
        app.load(w["good"])
        assert device_state(background.port)["state"] == "trial"
    record = json.loads((state_dir / STATE_FILE).read_text())
    assert (record["active"], record["status"], record["previous"], record["high_water"]) == (good, "trial", a, a)

    with running_server(w, state_dir=state_dir) as (app, background):
        assert [(r.release_id, channel) for r, channel in app.residents.listing()] == [(good, "champion"), (a, "standby")]
        app.gate.wait(30)
        assert app.load(w["good"])["release_id"] == good  # committed: loading it again checks nothing new
        state = device_state(background.port)
    assert (state["state"], state["high_water"], state["previous"]) == ("committed", good, a)


def serve(w, state_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "runtime", "serve", "--engine", str(w["engine"]), "--tokenizer", str(w["tokenizer"]),
            "--trusted-key", str(w["trusted_key"]), "--port", "0", "--state-dir", str(state_dir), *args]


def started(cmd: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    with open(log, "a") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    ready = json.loads(proc.stdout.readline())
    return proc, int(ready["listening"].rsplit(":", 1)[1])


def test_a_restart_after_sigkill_resumes_the_release_and_refuses_an_older_one(w, tmp_path):
    state_dir, release = tmp_path / "state", copy_release(w["b"], tmp_path / "2026-11")
    log = tmp_path / "serve.log"
    proc, port = started(serve(w, state_dir, "--package", str(release), "--health-window", "0"), log)
    try:
        deadline = time.monotonic() + 30
        while device_state(port)["state"] != "committed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = complete(port)
    finally:
        proc.kill()  # SIGKILL: no shutdown of any kind
        proc.wait()
    shutil.rmtree(release)  # the release folder is gone, and there is no network

    t0 = time.monotonic()
    proc, port = started(serve(w, state_dir), log)
    try:
        after = complete(port)
        resumed_s = time.monotonic() - t0
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert (after["release_id"], after["text"]) == (before["release_id"], before["text"])
    assert resumed_s < 5, resumed_s
    events = [line for line in map(json.loads, log.read_text().splitlines()) if line.get("event")]
    assert [(e["event"], e["release_id"]) for e in events] == [("release_committed", manifest_id(w["b"]))]

    older = subprocess.run(serve(w, state_dir, "--package", str(w["a"])), cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert older.returncode == 20 and f"older than the active release {manifest_id(w['b'])}" in older.stderr
    print(f"\nrestart with the same state directory: answering {resumed_s:.2f} s after the start")


def test_a_candidate_is_resumed_after_sigkill_and_dropped_from_the_state_when_unloaded_or_promoted(w, tmp_path):
    """The candidate loaded over the admin API is in the state; killed and restarted with the same state
    directory (nothing else), the device is ready within 5 s with both channels on the same releases."""
    a, good = manifest_id(w["a"]), manifest_id(w["good"])
    state_dir, log, token = tmp_path / "state", tmp_path / "serve.log", tmp_path / "admin.token"
    token.write_text(ADMIN_TOKEN)
    admin = ("--admin-token-file", str(token), "--release-dir", str(w["root"]))

    def answers(port: int) -> dict:
        return {channel: (body["model"], body["choices"][0]["text"]) for channel in ("champion", "candidate")
                for status, body in [call(port, "POST", "/v1/completions", {"model": channel, "prompt": PROMPT,
                                                                             "max_tokens": 6, "temperature": 0})]
                if status == 200}

    proc, port = started(serve(w, state_dir, "--package", str(w["a"]), "--health-window", "0", *admin), log)
    try:
        until(lambda: device_state(port)["state"] == "committed", "A committed")
        status, body = call(port, "POST", "/v1/adapters", {"path": str(w["good"]), "channel": "candidate"})
        assert (status, body["channel"]) == (200, "candidate"), body
        before = answers(port)
        assert device_state(port)["candidate"] == good
    finally:
        proc.kill()  # SIGKILL: no shutdown of any kind
        proc.wait()
    assert [before[c][0] for c in ("champion", "candidate")] == [a, good]
    assert json.loads((state_dir / STATE_FILE).read_text())["candidate"] == good

    t0 = time.monotonic()
    proc, port = started(serve(w, state_dir, "--health-window", "0", *admin), log)  # no --package, no --candidate
    try:
        until(lambda: call(port, "GET", "/ready")[0] == 200, "/ready after the restart")
        ready_s = time.monotonic() - t0
        after, health = answers(port), call(port, "GET", "/healthz")[1]
        assert (health["release_id"], health["candidate"]["release_id"]) == (a, good)

        assert call(port, "POST", "/v1/adapters/unload", {"model": "candidate"})[0] == 200
        record = json.loads((state_dir / STATE_FILE).read_text())
        assert record["candidate"] is None and not (state_dir / "releases" / good).exists()
        assert call(port, "POST", "/v1/adapters", {"path": str(w["good"]), "channel": "candidate"})[0] == 200
        assert json.loads((state_dir / STATE_FILE).read_text())["candidate"] == good
        assert call(port, "POST", "/v1/adapters/promote", {})[0] == 200
        until(lambda: device_state(port)["state"] == "committed", "the promoted candidate committed")
        record = json.loads((state_dir / STATE_FILE).read_text())
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert after == before
    assert ready_s < 5, ready_s
    assert (record["active"], record["previous"], record["candidate"], record["high_water"]) == (good, a, None, good)
    print(f"\nrestart after SIGKILL with a candidate: /ready 200 {ready_s:.2f} s after the start")
