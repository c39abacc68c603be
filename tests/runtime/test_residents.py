"""Several resident releases: ``model`` picks one by release id, month or channel; LRU unloading at the
cap; an exact canary share; promote and unload through the admin API; the metrics of each release.

Every server is the real app under uvicorn (``server_testkit.running_server``) on the tiny world's real
ONNX Runtime engine; A (2026-10) and B (2026-11) answer differently, and C (2026-12) is B's adapter
signed as a newer month."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import openai
import pytest
from release_testkit import copy_release, resign, world
from server_testkit import PROMPT, call, manifest_id, running_server, sample, scrape

from runtime.release.verify import RollbackRefused
from runtime.serve.residents import CanarySplit

LONG = 1024  # tokens: over a second of decode on the tiny world, long enough to unload its release meanwhile


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    stamp = manifest_id(w["b"]).partition("+")[2]
    w["c"] = copy_release(w["b"], w["root"] / "release-2026-12")
    resign(w["c"], w["key"], month="2026-12", release_id=f"2026-12+{stamp}")
    return w


def answer(port: int, model: str | None, max_tokens: int = 6) -> tuple[str, str]:
    """(the release it ran on, its text) of a greedy completion of PROMPT naming ``model``."""
    status, out = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
                       | ({"model": model} if model is not None else {}))
    assert status == 200, out
    return out["model"], out["choices"][0]["text"]


def load(port: int, release: Path, channel: str = "champion") -> tuple[int, dict]:
    return call(port, "POST", "/v1/adapters", {"path": str(release), "channel": channel})


def models(port: int) -> list[tuple[str, str]]:
    return [(m["id"], m["channel"]) for m in call(port, "GET", "/v1/models")[1]["data"]]


def test_model_picks_a_resident_release_by_id_month_or_channel(w):
    a, b = manifest_id(w["a"]), manifest_id(w["b"])
    with running_server(w, release_dirs=(w["root"],)) as (app, background):
        port = background.port
        assert load(port, w["a"])[0] == 200
        text_a = answer(port, None)
        status, body = load(port, w["b"], "candidate")
        assert status == 200 and (body["channel"], body["previous"]) == ("candidate", None)
        text_b = answer(port, "candidate")
        assert text_a[0] == a and text_b[0] == b and text_a[1] != text_b[1]

        for model, expected in ((a, text_a), ("2026-10", text_a), ("champion", text_a), (None, text_a),
                                (b, text_b), ("2026-11", text_b), ("candidate", text_b)):
            assert answer(port, model) == expected, model
        listed = openai.OpenAI(base_url=f"{background.url}/v1", api_key="unused", max_retries=0).models.list().data
        assert [(m.id, m.month, m.channel) for m in listed] == [(a, "2026-10", "champion"), (b, "2026-11", "candidate")]
        health = call(port, "GET", "/ready")[1]
        assert (health["release_id"], health["candidate"]["release_id"], health["resident"]) == (a, b, 2)

        status, body = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "model": "2026-09"})
        assert (status, body["error"]["code"], body["error"]["param"]) == (404, "model_not_found", "model")
        assert f"{a} (champion), {b} (candidate)" in body["error"]["message"]
        samples = scrape(port)
    assert sample(samples, "adapter_release_requests_total", release_id=a, channel="champion", product="default") == 5
    assert sample(samples, "adapter_release_requests_total", release_id=b, channel="candidate", product="default") == 4
    assert sample(samples, "adapter_release_info", release_id=b, month="2026-11", channel="candidate", product="default") == 1
    assert 0 < sample(samples, "adapter_release_expires_in_seconds", release_id=b, channel="candidate", product="default") <= 121 * 86400
    assert sample(samples, "adapter_resident_releases") == 2


def stream_text(resp: httpx.Response, lines) -> tuple[set[str], str]:
    """(the models named, the text) of a completion stream's remaining events."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return {e["model"] for e in events}, "".join(e["choices"][0]["text"] for e in events)


def test_at_the_cap_the_least_recently_used_standby_release_is_unloaded_and_its_requests_finish(w):
    a, b, c = (manifest_id(w[k]) for k in "abc")
    with running_server(w, release_dirs=(w["root"],), max_resident=2, max_tokens=LONG) as (app, background):
        port = background.port
        assert load(port, w["a"])[0] == 200
        long_a = answer(port, a, LONG)[1]
        assert load(port, w["b"])[0] == 200  # A goes to standby: named by id, it still answers
        assert models(port) == [(b, "champion"), (a, "standby")]
        with httpx.stream("POST", f"{background.url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "model": a, "max_tokens": LONG, "temperature": 0, "stream": True}) as resp:
            lines = resp.iter_lines()
            first = next(lines)  # the decode on A runs
            answer(port, b)  # B is used after A: A is the least recently used
            status, body = load(port, w["c"])
            in_flight = sample(scrape(port), "adapter_generations_in_flight")
            named, rest = stream_text(resp, lines)
        assert status == 200 and body["unloaded"] == [a] and body["previous"] == b
        assert in_flight == 1  # A was unloaded while its request decoded
        assert named == {a} and json.loads(first[6:])["choices"][0]["text"] + rest == long_a  # wholly on A
        assert models(port) == [(c, "champion"), (b, "standby")]
        status, body = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "model": a})
        assert (status, body["error"]["code"]) == (404, "model_not_found") and f"{c} (champion), {b} (standby)" in \
            body["error"]["message"]
        samples = scrape(port)
    assert sample(samples, "adapter_unloads_total", reason="lru") == 1
    assert sample(samples, "adapter_unloads_total", reason="admin") == 0
    assert {dict(labels)["release_id"] for (name, labels) in samples if name == "adapter_release_info"} == {b, c}
    assert sample(samples, "adapter_release_requests_total", release_id=a, channel="standby", product="default") == 1


def test_a_canary_share_sends_exactly_that_fraction_of_requests_without_model_to_the_candidate(w):
    a, b = manifest_id(w["a"]), manifest_id(w["b"])
    with running_server(w, release_dirs=(w["root"],), canary_share=0.25) as (app, background):
        port = background.port
        assert load(port, w["a"])[0] == 200
        assert [answer(port, None)[0] for _ in range(3)] == [a] * 3  # no candidate: all to the champion
        assert load(port, w["b"], "candidate")[0] == 200
        texts = {a: answer(port, a)[1], b: answer(port, b)[1]}
        got = [answer(port, None) for _ in range(40)]
        assert call(port, "GET", "/healthz")[1]["canary_share"] == 0.25
        samples = scrape(port)
    assert [i for i, (model, _) in enumerate(got) if model == b] == list(range(3, 40, 4))  # every 4th: 10 of 40
    assert all(text == texts[model] for model, text in got)
    assert sample(samples, "adapter_release_requests_total", release_id=b, channel="candidate", product="default") == 10 + 1
    assert sample(samples, "adapter_release_requests_total", release_id=a, channel="champion", product="default") == 30 + 3 + 1


@pytest.mark.parametrize("share,n", [(0.1, 1000), (0.3, 77), (1.0, 9), (0.0, 9), (2 / 3, 301)])
def test_the_canary_split_is_exact_and_even_over_any_window(share, n):
    split = CanarySplit(share)
    sent = [split.to_candidate("2026-11+x") for _ in range(n)]
    expected = int(n * split.share)
    assert sum(sent) == expected and split.share == pytest.approx(share)
    for k in (7, 10, 50):  # any k consecutive requests hold floor(k * share) or one more
        counts = {sum(sent[i:i + k]) for i in range(n - k + 1)}
        assert counts <= {int(k * split.share), int(k * split.share) + 1}, (k, counts)
    assert split.to_candidate("2026-12+y") == (share == 1.0)  # a new candidate starts a new window


def test_a_candidate_older_than_the_champion_is_refused_and_the_champion_keeps_answering(w):
    b = manifest_id(w["b"])
    with running_server(w, release_dirs=(w["root"],)) as (app, background):
        port = background.port
        status, body = load(port, w["b"], "candidate")
        assert (status, body["error"]["code"]) == (409, "no_champion") and models(port) == []
        assert load(port, w["b"])[0] == 200
        before = answer(port, None)
        status, body = load(port, w["a"], "candidate")
        assert (status, body["reason"], body["active_release"]) == (409, "rollback", b)
        status, body = load(port, w["b"], "candidate")
        assert (status, body["error"]["code"]) == (409, "is_champion")
        status, body = call(port, "POST", "/v1/adapters", {"path": str(w["a"]), "channel": "candidate",
                                                           "allow_rollback": True})
        assert (status, body["error"]["code"]) == (403, "rollback_is_local")
        assert answer(port, None) == before and models(port) == [(b, "champion")]
        assert call(port, "GET", "/healthz")[1]["candidate"] is None
        assert sample(scrape(port), "adapter_refusals_total", reason="rollback") == 1


def test_promote_and_unload_through_the_admin_api(w):
    a, b, c = (manifest_id(w[k]) for k in "abc")
    with running_server(w, release_dirs=(w["root"],)) as (app, background):
        port = background.port
        status, body = call(port, "POST", "/v1/adapters/promote", {})
        assert (status, body["error"]["code"]) == (409, "no_candidate")
        assert load(port, w["a"])[0] == 200 and load(port, w["b"], "candidate")[0] == 200
        text_b = answer(port, "candidate")

        status, body = call(port, "POST", "/v1/adapters/promote", {})
        assert (status, body["champion"], body["previous"]) == (200, b, a)
        assert answer(port, None) == text_b and models(port) == [(b, "champion"), (a, "standby")]
        status, body = call(port, "POST", "/v1/adapters/promote", {})
        assert (status, body["error"]["code"]) == (409, "no_candidate")

        assert load(port, w["c"], "candidate")[0] == 200
        status, body = call(port, "POST", "/v1/adapters/unload", {"model": "champion"})
        assert (status, body["error"]["code"]) == (409, "champion")
        status, body = call(port, "POST", "/v1/adapters/unload", {"model": "2026-10"})
        assert status == 200 and body["unloaded"] == a
        assert body["resident"] == [{"release_id": b, "product": "default", "channel": "champion"},
                                    {"release_id": c, "product": "default", "channel": "candidate"}]
        assert call(port, "POST", "/v1/completions", {"prompt": PROMPT, "model": a})[0] == 404
        assert call(port, "POST", "/v1/adapters/unload", {"model": a})[0] == 404
        assert call(port, "POST", "/v1/adapters/unload", {"model": "candidate"})[1]["unloaded"] == c
        assert call(port, "GET", "/healthz")[1]["candidate"] is None and models(port) == [(b, "champion")]
        assert call(port, "POST", "/v1/adapters/unload", {"model": b, "force": True})[1]["error"]["code"] == "unknown_field"

        assert load(port, w["a"], "candidate")[0] == 409  # A is older than the champion B now
        assert load(port, w["c"], "candidate")[0] == 200
        assert load(port, w["b"])[0] == 200  # B again, as champion: C, newer, stays the candidate
        assert models(port)[:2] == [(b, "champion"), (c, "candidate")]
        samples = scrape(port)
    assert sample(samples, "adapter_promotions_total") == 1
    assert sample(samples, "adapter_unloads_total", reason="admin") == 2


def test_a_newer_champion_takes_the_channel_of_an_older_candidate(w):
    b, c = manifest_id(w["b"]), manifest_id(w["c"])
    with running_server(w, release_dirs=(w["root"],)) as (app, background):
        app.load(w["a"])
        app.load(w["b"], channel="candidate")
        app.load(w["c"])  # the watch mode's way: newer, as champion
        assert models(background.port)[:2] == [(c, "champion"), (b, "standby")]
        assert app.residents.candidate is None


def test_every_admin_route_needs_the_token_and_is_off_without_one(w):
    routes = [("/v1/adapters", {"path": str(w["b"])}), ("/v1/adapters/promote", {}),
              ("/v1/adapters/unload", {"model": "candidate"})]
    with running_server(w, release_dirs=(w["root"],)) as (app, background):
        app.load(w["a"])
        app.load(w["b"], channel="candidate")
        for path, payload in routes:
            for token in (None, "not-the-admin-token-0123456789"):
                status, body = call(background.port, "POST", path, payload, token=token)
                assert (status, body["error"]["code"]) == (401, "invalid_admin_token"), (path, token)
        assert models(background.port) == [(manifest_id(w["a"]), "champion"), (manifest_id(w["b"]), "candidate")]
    with running_server(w, admin_token=None) as (app, background):
        for path, payload in routes:
            status, body = call(background.port, "POST", path, payload)
            assert (status, body["error"]["code"]) == (404, "admin_api_off"), path


def test_concurrent_loads_end_on_the_newest_champion_within_the_cap(w):
    outcomes = []

    def load_champion(release):
        try:
            outcomes.append(app.load(release)["release_id"])
        except RollbackRefused as err:  # B verified against A, then C won the race: checked again under the lock
            outcomes.append(err.reason)

    with running_server(w, max_resident=2) as (app, background):
        app.load(w["a"])
        threads = [threading.Thread(target=load_champion, args=(w[k],)) for k in "bcbc"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        listing = models(background.port)
    assert set(outcomes) <= {manifest_id(w["b"]), manifest_id(w["c"]), "rollback"} and len(outcomes) == 4
    assert listing[0] == (manifest_id(w["c"]), "champion") and len(listing) == 2
