"""Attacks on the update channel against a running device, in the style of TUF's conformance tests.

The repository is written by the publish step's own code (``tasks.release.update_channel``) in three states:
S1 (A = 2026-10 champion), SC (B = 2026-11 published as candidate) and S2 (B champion). A device,
``python -m runtime serve --tuf-url`` in a process of its own with a state directory, follows a loopback
HTTP mirror (``tuf_testkit.mirror``) that the test switches to what an attacker would serve. Each
attack must be refused with its own reason (``/ready``'s ``update_channel``, ``/metrics``) while the
release serving before answers the same greedy completion through the ``openai`` SDK. The suite's
table (attack, reason, result) is written to ``attack_table.json`` in the test's folder and printed.

The pull-level refusals of ``runtime.release.tuf_pull`` are ``test_tuf_pull.py``'s; here the watch of a serving
device (``runtime.serve.channel_watch``), the health-gated revert and the restart are what is checked.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from openai import OpenAI
from release_testkit import copy_release, resign, world
from securesystemslib.signer import CryptoSigner
from server_testkit import PROMPT, call, manifest_id, running_server, sample, scrape, serve_process
from tuf_testkit import (
    endless_tarball,
    endless_timestamp,
    expire_timestamp,
    fast_forward,
    mirror,
    misnamed_release,
    mix_and_match,
    resign_metadata,
    wrong_key,
    zero_tarball,
)

from runtime.release.signing import load_private_key
from runtime.serve.channel_watch import FRESH, REFUSED, STALE, ChannelWatcher, Outcome
from tasks.release.update_channel import Channel, key_file, load_state, publish_release, revoke_key

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.2  # the device's --tuf-interval here


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    w["channel"] = channel = Channel(w["root"] / "tuf", w["root"] / "tuf-keys")
    for name, release, month, champion in (("s1", "a", "2026-10", "2026-10"), ("sc", "b", "2026-11", "2026-10"),
                                           ("s2", "b", "2026-11", "2026-11")):
        publish_release(channel, w[release], month, champion)
        w[name] = shutil.copytree(channel.repo, w["root"] / f"tuf-{name}")
    w["first_root"] = channel.metadata / "1.root.json"
    return w


def variant(w, base: Path, folder: Path, *changes) -> Path:
    """A copy of the repository state ``base`` with ``changes`` (tuf_testkit's attacks) made to it."""
    repo = shutil.copytree(base, folder)
    for change in changes:
        change(repo, w["channel"])
    return repo


def metadata_version(metadata_dir: Path, role: str) -> int:
    """The version of ``role`` the device trusts now (what ngclient keeps in its metadata folder)."""
    return json.loads((metadata_dir / f"{role}.json").read_text())["signed"]["version"]


# ---------------------------------------------------------------- in process: the watcher itself

def test_a_watching_device_follows_champion_and_candidate_and_never_installs_from_stale_metadata(w, tmp_path, caplog):
    a, b = manifest_id(w["a"]), manifest_id(w["b"])
    stale_with_b = variant(w, w["s2"], tmp_path / "s2-expired", expire_timestamp)  # names B champion, expired
    empty = tmp_path / "empty"
    empty.mkdir()
    with mirror(tmp_path, w["sc"]) as served, running_server(w, state_dir=tmp_path / "state") as (app, background):
        port = background.port
        watcher = ChannelWatcher(app, served.url, w["first_root"], tmp_path / "metadata", interval=60)  # polled by hand
        assert call(port, "GET", "/ready")[0] == 503  # nothing loaded before the first poll
        assert watcher.poll_once() == Outcome(FRESH)
        app.gate.wait(30)
        assert [(m["id"], m["channel"]) for m in call(port, "GET", "/v1/models")[1]["data"]] == [
            (a, "champion"), (b, "candidate")]
        swaps = sample(scrape(port), "adapter_swaps_total")
        assert watcher.poll_once() == Outcome(FRESH) and sample(scrape(port), "adapter_swaps_total") == swaps == 2

        caplog.set_level(logging.INFO, logger="runtime.serve.channel_watch")
        caplog.clear()  # from here on: an earlier test may have left the logger at INFO, so the first polls were kept
        served.show(stale_with_b)
        for _ in range(2):
            outcome = watcher.poll_once()
            assert (outcome.state, outcome.reason) == (STALE, "stale_metadata")
            assert "ExpiredMetadataError" in outcome.detail
        status, ready = call(port, "GET", "/ready")
        assert status == 200 and ready["release_id"] == a  # serving on, and saying why it is not updating
        channel = ready["update_channel"]
        assert (channel["state"], channel["reason"], channel["url"], channel["polls"]) == (
            STALE, "stale_metadata", served.url, 4)
        assert channel["last_success"] is not None and call(port, "GET", "/healthz")[1]["update_channel"] == channel
        samples = scrape(port)
        assert sample(samples, "adapter_update_channel_fresh") == 0
        assert sample(samples, "adapter_update_channel_refusals_total", reason="stale_metadata") == 2
        assert sample(samples, "adapter_update_channel_last_success_timestamp_seconds") > time.time() - 60
        assert sample(samples, "adapter_swaps_total") == 2  # B is not champion: never installed from stale metadata

        served.show(empty)  # the mirror answers 404
        assert (watcher.poll_once().state, watcher.poll_once().reason) == (STALE, "unreachable")
        records = [r for r in caplog.records if r.name == "runtime.serve.channel_watch"]
        warnings = [(r.fields["state"], r.fields["reason"]) for r in records if r.levelno == logging.WARNING]
        assert warnings == [(STALE, "stale_metadata"), (STALE, "unreachable")]  # once per change, not per poll

        served.show(w["s2"])
        assert watcher.poll_once() == Outcome(FRESH)
        app.gate.wait(30)
        assert call(port, "GET", "/ready")[1]["release_id"] == b
        assert sample(scrape(port), "adapter_update_channel_fresh") == 1
        assert [r.fields["state"] for r in caplog.records if r.name == "runtime.serve.channel_watch"
                and r.levelno == logging.INFO] == [FRESH]


def test_a_target_holding_another_months_release_is_refused_once_and_never_loaded(w, tmp_path):
    a = manifest_id(w["a"])
    misnamed = variant(w, w["s1"], tmp_path / "s1-misnamed", lambda repo, channel: misnamed_release(
        repo, channel, w["b"], "2026-12"))  # B (2026-11, newer than A) signed as the target of 2026-12
    with mirror(tmp_path, w["s1"]) as served, running_server(w) as (app, background):
        watcher = ChannelWatcher(app, served.url, w["first_root"], tmp_path / "metadata", interval=60)  # polled by hand
        assert watcher.poll_once() == Outcome(FRESH) and app.active.release_id == a
        served.show(misnamed)
        refused = watcher.poll_once()
        assert (refused.state, refused.reason) == (REFUSED, "month_mismatch")
        assert f"release {manifest_id(w['b'])} of 2026-11" in refused.detail and "of 2026-12" in refused.detail
        assert watcher.poll_once() == refused  # remembered: not downloaded and verified again
        samples = scrape(background.port)
        assert [(m["id"], m["channel"]) for m in call(background.port, "GET", "/v1/models")[1]["data"]] == [
            (a, "champion")]
    assert sample(samples, "adapter_refusals_total", reason="month_mismatch") == 1
    assert sample(samples, "adapter_update_channel_refusals_total", reason="month_mismatch") == 2
    assert sample(samples, "adapter_swaps_total") == 1


def test_the_refused_targets_a_watcher_remembers_are_bounded(w, tmp_path):
    """A channel naming ever new refused targets: the watcher remembers the last ``max_rejected`` refusals."""
    repos, base = [], w["s1"]
    for month in ("2026-12", "2027-01", "2027-02", "2026-12"):  # each a newer signed state; the last names the first again
        base = variant(w, base, tmp_path / f"misnamed-{len(repos)}", lambda repo, channel, month=month: misnamed_release(
            repo, channel, w["b"], month))
        repos.append(base)
    with mirror(tmp_path, w["s1"]) as served, running_server(w) as (app, background):
        watcher = ChannelWatcher(app, served.url, w["first_root"], tmp_path / "metadata", interval=60)
        watcher.max_rejected = 2
        assert watcher.poll_once() == Outcome(FRESH)
        verified = []
        for repo in repos:
            served.show(repo)
            assert watcher.poll_once().reason == "month_mismatch"
            verified.append(sample(scrape(background.port), "adapter_refusals_total", reason="month_mismatch"))
        assert app.active.release_id == manifest_id(w["a"])
    assert verified == [1, 2, 3, 4]  # 2026-12's refusal was forgotten (two came after it): verified again


# ---------------------------------------------------------------- a running device under attack

def serve_command(w, state_dir: Path, metadata_dir: Path, url: str, interval: str = str(POLL_S)) -> list[str]:
    return [sys.executable, "-m", "runtime", "serve", "--engine", str(w["engine"]), "--tokenizer", str(w["tokenizer"]),
            "--trusted-key", str(w["trusted_key"]), "--port", "0", "--state-dir", str(state_dir), "--health-window",
            "0", "--tuf-url", url, "--trusted-root", str(w["first_root"]), "--metadata-dir", str(metadata_dir),
            "--tuf-interval", interval]


def test_serve_refuses_an_update_channel_configured_by_halves(w, tmp_path):
    command = serve_command(w, tmp_path / "state", tmp_path / "metadata", "http://127.0.0.1:9", interval="0")
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tuf_interval (--tuf-interval) 0.0: seconds, more than 0" in done.stderr
    without_metadata = command[:command.index("--metadata-dir")] + command[command.index("--tuf-interval"):]
    done = subprocess.run(without_metadata, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "serve --tuf-url needs --metadata-dir" in done.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made


ON_S2 = (  # attack: (change to a copy of S2, the device's state and reason); A serves throughout
    ("indefinite freeze (a newer champion behind an expired timestamp)", expire_timestamp, STALE, "stale_metadata"),
    ("wrong key (timestamp signed by a key the root does not name)", wrong_key, STALE, "untrusted_metadata"),
    ("fast-forward (timestamp version 2**31, wrong key)", fast_forward, STALE, "untrusted_metadata"),
    ("mix-and-match (targets of another snapshot)", mix_and_match, STALE, "hash_mismatch"),
    ("endless data (timestamp of 1 MiB)", endless_timestamp, STALE, "too_large"),
    # S2's metadata is sound from here on: the device trusts it, and refuses the release target it names
    ("endless data (release tarball 1 MiB over its signed length)", endless_tarball, REFUSED, "too_large"),
    ("arbitrary package (release bytes changed, same length)", zero_tarball, REFUSED, "hash_mismatch"),
)


def health(port: int) -> dict:
    return call(port, "GET", "/healthz")[1]


def until(port: int, done, timeout: float = 30) -> dict:
    """/healthz once ``done(it)`` holds."""
    deadline = time.monotonic() + timeout
    while not done(body := health(port)):
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    return body


def after_two_polls(port: int) -> dict:
    """/healthz once a whole poll has run after now (the one running now may have begun before a switch)."""
    polls = health(port)["update_channel"]["polls"]
    return until(port, lambda h: h["update_channel"]["polls"] >= polls + 2)


def greedy(port: int) -> tuple[str, str]:
    """(release id, text) of the champion's greedy completion of PROMPT, through the openai SDK."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="champion", prompt=PROMPT, max_tokens=6, temperature=0)
    return out.model, out.choices[0].text


def log_events(log: Path, event: str) -> list[dict]:
    lines = (json.loads(line) for line in log.read_text().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


class Suite:
    """The attacks on one running device, and their table."""

    def __init__(self, served, port: int, table: Path):
        self.served, self.port, self.table, self.rows = served, port, table, []

    def attack(self, name: str, repo: Path, state: str, reason: str, before: tuple[str, str]) -> dict:
        """Serve ``repo``; the device must end in ``state`` for ``reason``, and answer ``before`` as it did."""
        counted = sample(scrape(self.port), "adapter_update_channel_refusals_total", reason=reason)
        self.served.show(repo)
        channel = after_two_polls(self.port)["update_channel"]
        answers = greedy(self.port)
        serving = health(self.port)["release_id"]
        counted = sample(scrape(self.port), "adapter_update_channel_refusals_total", reason=reason) - counted
        kept = answers == before and serving == before[0]
        self.record(name, channel["state"], channel["reason"], f"refused ({int(counted)} polls); {serving} answering "
                    + ("as before" if kept else f"OTHERWISE: {answers}"))
        assert (channel["state"], channel["reason"]) == (state, reason), channel
        assert counted >= 1 and kept, (counted, answers, before)
        return channel

    def record(self, attack: str, state: str, reason: str | None, result: str) -> None:
        self.rows.append({"attack": attack, "state": state, "reason": reason, "result": result})
        self.table.write_text(json.dumps(self.rows, indent=2) + "\n")

    def add(self, result: str) -> None:
        """More of what the last attack's row says."""
        row = self.rows.pop()
        self.record(row["attack"], row["state"], row["reason"], row["result"] + result)


def test_attacks_on_the_channel_are_refused_by_a_running_device_whose_release_keeps_answering(w, tmp_path):
    a, b = manifest_id(w["a"]), manifest_id(w["b"])
    state_dir, metadata_dir, log = tmp_path / "state", tmp_path / "metadata", tmp_path / "serve.log"
    s2 = w["s2"]
    with mirror(tmp_path, w["s1"]) as served, serve_process(serve_command(w, state_dir, metadata_dir, served.url),
                                                            log) as (proc, port):
        suite = Suite(served, port, tmp_path / "attack_table.json")
        until(port, lambda h: h["release_id"] == a and h["device_state"]["state"] == "committed", timeout=60)
        answer_a = greedy(port)
        assert answer_a[0] == a

        genuine = load_state(Channel(s2, w["channel"].keys)).timestamp.signed.version
        for i, (name, change, state, reason) in enumerate(ON_S2):
            suite.attack(name, variant(w, s2, tmp_path / f"attack-{i}", change), state, reason, answer_a)
            # no forged timestamp was ever trusted (the fast-forward's 2**31 included): at most S2's genuine one
            assert metadata_version(metadata_dir, "timestamp") <= genuine
        assert metadata_version(metadata_dir, "timestamp") == genuine  # S2's sound metadata is trusted now
        suite.attack("rollback (the older valid metadata of S1)", w["s1"], STALE, "metadata_rollback", answer_a)

        served.show(s2)  # the real update: B, through the health-gated commit
        until(port, lambda h: h["release_id"] == b and h["device_state"]["state"] == "committed"
              and h["update_channel"]["state"] == FRESH)
        answer_b = greedy(port)
        assert answer_b[0] == b and answer_b != answer_a
        suite.record("(control) the real update S2", FRESH, None, f"installed and committed {b}")

        # a signed release whose signed probe fails on this device: installed, then reverted by the device
        bad = copy_release(w["a"], tmp_path / "release-2027-01")
        resign(bad, w["key"], month="2027-01", release_id="2027-01+" + a.partition("+")[2],
               probes=[{"prompt": PROMPT, "expected": answer_a[1] + " and more", "max_tokens": 6}])
        s3 = shutil.copytree(s2, tmp_path / "s3")
        publish_release(Channel(s3, w["channel"].keys), bad, "2027-01", "2027-01")
        answers, stop = [], threading.Event()

        def client():  # requests without model through the swap to BAD and its revert
            while not stop.is_set():
                answers.append(call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6,
                                                                      "temperature": 0}))

        clients = [threading.Thread(target=client) for _ in range(2)]
        for t in clients:
            t.start()
        switched = time.monotonic()
        served.show(s3)
        reverted = until(port, lambda h: h["device_state"]["last_check"]["result"] == "reverted")
        reverted_s = time.monotonic() - switched
        time.sleep(0.3)
        stop.set()
        for t in clients:
            t.join()
        assert reverted["device_state"]["reverted"] == [manifest_id(bad)]
        assert reverted["device_state"]["last_check"]["reason"] == "probe_mismatch"
        assert {status for status, _ in answers} == {200} and len(answers) > 4, answers  # no client saw the revert
        on_bad = sum(body["model"] == manifest_id(bad) for _, body in answers)
        trial_s = next(e["seconds"] for e in log_events(log, "release_reverted"))
        swaps = sample(scrape(port), "adapter_swaps_total")
        channel = suite.attack("probe failure (a signed release whose probe fails here)", s3, REFUSED, "reverted",
                               answer_b)
        assert sample(scrape(port), "adapter_swaps_total") == swaps  # never downloaded nor loaded again
        suite.add(f"; reverted {trial_s:.3f} s after its swap ({reverted_s:.2f} s after the mirror "
                  f"switched), {len(answers)} client requests during it ({on_bad} answered by it), all 200")
        assert channel["channels"]["champion"] == "2027-01"

        # the timestamp key is revoked (root v2); the mirror then serves a timestamp signed by the revoked key
        s3r = shutil.copytree(s3, tmp_path / "s3-revoked")
        revoked = Channel(s3r, w["channel"].keys)
        old_key = load_state(revoked).root.signed.roles["timestamp"].keyids[0]
        revoke_key(revoked, old_key, tmp_path / "timestamp-2.key")
        served.show(s3r)
        until(port, lambda h: metadata_version(metadata_dir, "root") == 2
              and h["update_channel"]["reason"] == "reverted")
        with_revoked = shutil.copytree(s3r, tmp_path / "s3-revoked-key")
        resign_metadata(with_revoked, "timestamp.json", CryptoSigner(load_private_key(key_file(revoked, "timestamp"))),
                        version=load_state(revoked).timestamp.signed.version + 1)
        suite.attack("revoked key after root rotation (timestamp signed by the revoked key)", with_revoked, STALE,
                     "untrusted_metadata", answer_b)

        events = [(e["state"], e["reason"]) for e in log_events(log, "update_channel")]
        assert all(x != y for x, y in zip(events, events[1:])) and len(events) < health(port)["update_channel"]["polls"]
        assert ("stale", "stale_metadata") in events and ("refused", "reverted") in events
        proc.kill()  # SIGKILL: no shutdown of any kind
        proc.wait()

        # restart with the same state directory; the TUF metadata folder is lost, the mirror serves S1 (A champion)
        served.show(w["s1"])
        started = time.monotonic()
        with serve_process(serve_command(w, state_dir, tmp_path / "metadata-lost", served.url), log) as (proc, port):
            answers = greedy(port)
            resumed_s = time.monotonic() - started
            suite.port = port
            suite.attack("rollback after a restart (state kept, TUF metadata lost, S1 served)", w["s1"], REFUSED,
                         "rollback", answer_b)
            assert sample(scrape(port), "adapter_swaps_total") == 1  # B resumed from the state; A never loaded
        assert answers == answer_b and resumed_s < 5, (answers, resumed_s)
        suite.add(f"; answering {resumed_s:.2f} s after the SIGKILLed device was started again")

    width = max(len(r["attack"]) for r in suite.rows)
    print("\n" + "\n".join(f"{r['attack']:<{width}}  {r['state']:<8} {r['reason'] or '-':<19} {r['result']}"
                           for r in suite.rows))
    print(f"table: {suite.table}")
