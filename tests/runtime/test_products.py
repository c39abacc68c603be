"""Products: several lines of releases on one backbone, served, counted and followed by one device.

Servers are the real app under uvicorn (``server_testkit.running_server``) on the tiny world's ONNX Runtime
engine, asked through the ``openai`` SDK; the update channel is written by the publish step's own code
(``tasks.release.update_channel``) and followed through python-tuf's ngclient (``runtime.serve.channel_watch``).
A (2026-10) and B (2026-11) answer differently; the products' releases are their adapters signed as:

    alpha    champion 2026-10 (A's adapter)   candidate 2026-11 (B's adapter)
    beta     champion 2026-12 (B's adapter)   candidate 2027-01 (A's adapter)

and, with no ``product`` in their manifests (releases packaged before products existed), A itself
(``legacy_a``) and B's adapter signed as 2027-02 (``legacy_late``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from release_testkit import copy_release, resign, world
from server_testkit import PROMPT, call, manifest_id, running_server, sample, scrape, serve_process, summed
from tuf_testkit import misnamed_release, serve

from runtime.release.contract import DEFAULT_PRODUCT
from runtime.release.tuf_pull import UpdateRefused, tuf_pull
from runtime.release.verify import RollbackRefused, load_trusted_keys
from runtime.serve.active_release import ActiveRelease
from runtime.serve.channel_watch import FRESH, REFUSED, ChannelWatcher, Outcome
from runtime.serve.residents import ResidencyError, ResidentSet
from tasks.release.update_channel import Channel, publish_release

REPO = Path(__file__).resolve().parents[2]
SIGNED_AS = {  # name: (release of the world, product, month)
    "alpha_champion": ("a", "alpha", "2026-10"), "alpha_candidate": ("b", "alpha", "2026-11"),
    "beta_champion": ("b", "beta", "2026-12"), "beta_candidate": ("a", "beta", "2027-01"),
}


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    w = world(tmp_path_factory)
    for name, (source, product, month) in SIGNED_AS.items():
        stamp = manifest_id(w[source]).partition("+")[2]
        w[name] = copy_release(w[source], w["root"] / name)
        resign(w[name], w["key"], product=product, month=month, release_id=f"{month}+{stamp}")
    stamp = manifest_id(w["b"]).partition("+")[2]
    w["legacy_a"] = without_product(copy_release(w["a"], w["root"] / "legacy_a"), w["key"])
    w["legacy_late"] = without_product(copy_release(w["b"], w["root"] / "legacy_late"), w["key"], month="2027-02",
                                       release_id=f"2027-02+{stamp}")
    return w


def without_product(release: Path, key: Path, **overrides) -> Path:
    """``release`` signed again with no ``product`` in its manifest, as every release was before products existed."""
    manifest = json.loads((release / "manifest.json").read_text())
    del manifest["product"]
    (release / "manifest.json").write_text(json.dumps(manifest))
    resign(release, key, **overrides)
    return release


def sdk(background) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{background.url}/v1", api_key="unused-by-the-device", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, model: str) -> tuple[str, str]:
    """(the release it ran on, its text) of a greedy completion of PROMPT naming ``model``."""
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    return out.model, out.choices[0].text


def models(port: int) -> set[tuple[str, str, str]]:
    return {(m["id"], m["product"], m["channel"]) for m in call(port, "GET", "/v1/models")[1]["data"]}


def test_two_products_resident_on_one_device_answer_by_product_candidate_release_id_and_month(w):
    ids = {name: manifest_id(w[name]) for name in SIGNED_AS}
    with running_server(w, release_dirs=(w["root"],), products=("alpha", "beta")) as (app, background):
        port, client = background.port, sdk(background)
        for name in SIGNED_AS:
            product, channel = name.split("_")
            status, body = call(port, "POST", "/v1/adapters", {"path": str(w[name]), "channel": channel})
            assert status == 200 and (body["product"], body["channel"]) == (product, channel), body
        text_a, text_b = ask(client, ids["alpha_champion"])[1], ask(client, ids["alpha_candidate"])[1]
        assert text_a != text_b
        expected = {  # model -> the release it must run on, and that release's adapter's text
            "alpha": "alpha_champion", "alpha:champion": "alpha_champion", "alpha:candidate": "alpha_candidate",
            "champion": "alpha_champion", "candidate": "alpha_candidate", "2026-10": "alpha_champion",
            "beta": "beta_champion", "beta:candidate": "beta_candidate", ids["beta_candidate"]: "beta_candidate",
            f"beta:{ids['beta_champion']}": "beta_champion", "2026-12": "beta_champion", "2027-01": "beta_candidate",
            "beta:2026-12": "beta_champion",
        }
        text = {"a": text_a, "b": text_b}
        for model, name in expected.items():
            assert ask(client, model) == (ids[name], text[SIGNED_AS[name][0]]), model
        status, out = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert status == 200 and out["model"] == ids["alpha_champion"]  # no model: the default product's champion
        for model in ("beta:2026-10", "gamma", "gamma:candidate", f"alpha:{ids['beta_champion']}"):
            status, body = call(port, "POST", "/v1/completions", {"prompt": PROMPT, "model": model})
            assert (status, body["error"]["code"]) == (404, "model_not_found"), model

        listed = {(m.id, m.product, m.channel, m.month) for m in client.models.list().data}
        assert listed == {(ids[name], *name.split("_"), SIGNED_AS[name][2]) for name in SIGNED_AS}
        health = call(port, "GET", "/healthz")[1]
        assert {p: {c: card["release_id"] for c, card in cards.items()} for p, cards in health["products"].items()} == {
            "alpha": {"champion": ids["alpha_champion"], "candidate": ids["alpha_candidate"]},
            "beta": {"champion": ids["beta_champion"], "candidate": ids["beta_candidate"]}}
        assert health["release_id"] == ids["alpha_champion"]

        status, body = call(port, "POST", "/v1/adapters", {"path": str(w["a"])})  # the default product's: not served
        assert (status, body["error"]["code"]) == (409, "unknown_product")
        samples = scrape(port)
    asked = {"alpha": 2 + 1, "beta": 0}  # the two texts, the request without model
    for name in expected.values():
        asked[SIGNED_AS[name][1]] += 1
    assert {p: summed(samples, "adapter_release_requests_total", product=p) for p in asked} == asked
    assert sample(samples, "adapter_release_requests_total", release_id=ids["beta_candidate"], channel="candidate",
                  product="beta") == list(expected.values()).count("beta_candidate")
    for name in SIGNED_AS:
        _, product, month = SIGNED_AS[name]
        assert sample(samples, "adapter_release_info", release_id=ids[name], month=month,
                      channel=name.split("_")[1], product=product) == 1


def active(release_id: str, month: str, product: str) -> ActiveRelease:
    return ActiveRelease(release_id, 1, {"month": month, "product": product}, None, 0.0)


def test_a_month_is_the_default_products_then_the_one_product_that_has_it_and_rollback_is_per_product():
    residents = ResidentSet(6, ("alpha", "beta", "gamma", "delta"))
    residents.add(active("2026-11+20261101T000000Z", "2026-11", "alpha"), "champion", False)
    residents.add(active("2026-11+20261102T000000Z", "2026-11", "beta"), "champion", False)
    residents.add(active("2026-12+20261201T000000Z", "2026-12", "beta"), "candidate", False)
    residents.add(active("2026-12+20261202T000000Z", "2026-12", "gamma"), "champion", False)
    assert residents.find("2026-11").product == "alpha"  # the default product's, though beta has one too
    assert residents.find("beta:2026-11").release_id == "2026-11+20261102T000000Z"
    with pytest.raises(ResidencyError) as err:
        residents.find("2026-12")  # beta's and gamma's, neither the default
    assert err.value.code == "ambiguous_model" and "gamma:2026-12" not in str(err.value)
    assert residents.find("gamma:2026-12").product == "gamma"
    # a product's champion is compared with its own product's only: delta's month older than all is no rollback
    residents.add(active("2026-01+20260101T000000Z", "2026-01", "delta"), "champion", False)
    assert residents.holder("champion", "delta").release_id == "2026-01+20260101T000000Z"
    with pytest.raises(RollbackRefused, match="older than the champion 2026-11"):
        residents.add(active("2026-10+20261002T000000Z", "2026-10", "alpha"), "champion", False)
    with pytest.raises(ResidencyError) as err:
        residents.add(active("2026-12+20261203T000000Z", "2026-12", "epsilon"), "champion", False)
    assert err.value.code == "unknown_product"


def test_a_device_following_two_products_signed_channels_takes_each_products_champion_and_candidate(w, tmp_path):
    a, b = manifest_id(w["legacy_a"]), manifest_id(w["b"])
    beta_champion, beta_candidate = manifest_id(w["beta_champion"]), manifest_id(w["beta_candidate"])
    channel = Channel(tmp_path / "tuf", tmp_path / "tuf-keys")
    # the default product as a single-product publisher wrote it, a release packaged before products its champion
    publish_release(channel, w["legacy_a"], "2026-10", "2026-10")
    publish_release(channel, w["b"], "2026-11", "2026-10")
    publish_release(channel, w["beta_champion"], "2026-12", "2026-12", product="beta")
    state_dir = tmp_path / "state"
    with serve(channel.repo) as url, running_server(w, state_dir=state_dir, products=(DEFAULT_PRODUCT, "beta")) as (
            app, background):
        port = background.port
        watcher = ChannelWatcher(app, url, channel.metadata / "1.root.json", tmp_path / "metadata", interval=60)
        assert watcher.poll_once() == Outcome(FRESH)
        for gate in app.gates.values():
            gate.wait(30)
        assert models(port) == {(a, DEFAULT_PRODUCT, "champion"), (b, DEFAULT_PRODUCT, "candidate"),
                                (beta_champion, "beta", "champion")}

        publish_release(channel, w["beta_candidate"], "2027-01", "2026-12", product="beta")  # beta's next month
        assert watcher.poll_once() == Outcome(FRESH)
        assert (beta_candidate, "beta", "candidate") in models(port)
        publish_release(channel, w["beta_candidate"], "2027-01", "2027-01", product="beta")  # ... becomes its champion
        assert watcher.poll_once() == Outcome(FRESH)
        app.gates["beta"].wait(30)
        health = call(port, "GET", "/healthz")[1]
        assert (health["release_id"], health["products"]["beta"]["champion"]["release_id"]) == (a, beta_candidate)
        assert health["products"]["beta"]["device_state"]["state"] == "committed"
        assert health["update_channel"]["products"] == {DEFAULT_PRODUCT: {"champion": "2026-10", "candidate": "2026-11"},
                                                        "beta": {"champion": "2027-01", "candidate": "2027-01"}}
        assert ask(sdk(background), "beta")[0] == beta_candidate and ask(sdk(background), "champion")[0] == a

        # beta's champion signed as a target holding a release of the default product (its month right): refused
        # by the signed manifest's product, and beta's champion serves on
        misnamed_release(channel.repo, channel, w["legacy_late"], "2027-02", "beta")
        refused = watcher.poll_once()
        assert (refused.state, refused.reason) == (REFUSED, "product_mismatch"), refused
        assert f"release {manifest_id(w['legacy_late'])} of product {DEFAULT_PRODUCT}" in refused.detail
        assert call(port, "GET", "/healthz")[1]["products"]["beta"]["champion"]["release_id"] == beta_candidate
        samples = scrape(port)
    assert sample(samples, "adapter_refusals_total", reason="product_mismatch") == 1
    assert sample(samples, "adapter_champion_state", state="committed", product="beta") == 1
    assert sample(samples, "adapter_champion_state", state="committed", product=DEFAULT_PRODUCT) == 1
    assert json.loads((state_dir / "state.json").read_text())["active"] == a  # the default product's, where it was
    assert json.loads((state_dir / "products" / "beta" / "state.json").read_text())["active"] == beta_candidate


def test_a_single_product_device_state_reads_as_the_default_product_beside_a_new_one(w, tmp_path):
    a, beta = manifest_id(w["legacy_a"]), manifest_id(w["beta_champion"])
    state_dir = tmp_path / "state"
    shutil.copytree(w["legacy_a"], state_dir / "releases" / a)
    old = {"format_version": 1, "active": a, "status": "committed", "previous": None, "candidate": None,
           "high_water": a, "reverted": {}, "last_check": None, "updated_at": "2026-11-30T12:00:00Z"}
    (state_dir / "state.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")  # as serve wrote it before
    with running_server(w, state_dir=state_dir, release_dirs=(w["root"],), products=(DEFAULT_PRODUCT, "beta")) as (
            app, background):
        port = background.port
        assert app.active.release_id == a  # resumed, no network and no --package
        assert ask(sdk(background), DEFAULT_PRODUCT)[0] == a
        assert call(port, "POST", "/v1/adapters", {"path": str(w["beta_champion"])})[0] == 200
        app.gates["beta"].wait(30)
    assert json.loads((state_dir / "state.json").read_text()) == old  # the default product's record, untouched
    shown = subprocess.run([sys.executable, "-m", "runtime", "state", "--state-dir", str(state_dir)], cwd=REPO,
                           capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert shown.returncode == 0, shown.stderr[-2000:]
    printed = json.loads(shown.stdout)
    assert (printed["active"], printed["products"]["beta"]["active"], printed["products"]["beta"]["status"]) == (
        a, beta, "committed")


def test_pull_installs_a_products_champion_from_its_own_signed_channel(w, tmp_path):
    channel = Channel(tmp_path / "tuf", tmp_path / "tuf-keys")
    publish_release(channel, w["legacy_a"], "2026-10", "2026-10")
    publish_release(channel, w["beta_champion"], "2026-12", "2026-12", product="beta")
    keys = load_trusted_keys([w["trusted_key"]])
    with serve(channel.repo) as url:
        beta = tuf_pull(url, channel.metadata / "1.root.json", tmp_path / "metadata", tmp_path / "beta", keys,
                        channel="champion", product="beta")
        default = tuf_pull(url, channel.metadata / "1.root.json", tmp_path / "metadata", tmp_path / "default", keys,
                           channel="champion")
        with pytest.raises(UpdateRefused) as refused:  # beta has no release of 2026-10: the default product has
            tuf_pull(url, channel.metadata / "1.root.json", tmp_path / "metadata", tmp_path / "x", keys,
                     month="2026-10", product="beta")
    assert (beta.summary()["product"], beta.release_id) == ("beta", manifest_id(w["beta_champion"]))
    assert (default.summary()["product"], default.release_id) == (DEFAULT_PRODUCT, manifest_id(w["legacy_a"]))
    assert refused.value.reason == "unknown_target" and "products/beta/releases/2026-10.tar.gz" in str(refused.value)


def test_serve_given_two_products_follows_both_channels_and_resumes_both_after_a_restart(w, tmp_path):
    a, beta = manifest_id(w["legacy_a"]), manifest_id(w["beta_champion"])
    channel = Channel(tmp_path / "tuf", tmp_path / "tuf-keys")
    publish_release(channel, w["legacy_a"], "2026-10", "2026-10")
    publish_release(channel, w["beta_champion"], "2026-12", "2026-12", product="beta")
    config = tmp_path / "device.json"  # the products from the device config, the rest from flags
    config.write_text(json.dumps({"products": [DEFAULT_PRODUCT, "beta"], "state_dir": "state",
                                  "metadata_dir": "metadata", "tuf_interval": 0.2}))
    command = [sys.executable, "-m", "runtime", "serve", "--device-config", str(config), "--engine", str(w["engine"]),
               "--tokenizer", str(w["tokenizer"]), "--trusted-key", str(w["trusted_key"]), "--port", "0",
               "--health-window", "0", "--trusted-root", str(channel.metadata / "1.root.json")]

    def both_committed(port: int) -> dict:
        deadline = time.monotonic() + 60
        while True:
            products = call(port, "GET", "/healthz")[1]["products"]
            if all(p.get("device_state", {}).get("state") == "committed" for p in products.values()):
                return products
            assert time.monotonic() < deadline, products
            time.sleep(0.05)

    with serve(channel.repo) as url, serve_process(command + ["--tuf-url", url], tmp_path / "serve.log") as (_, port):
        products = both_committed(port)
        assert {p: cards["champion"]["release_id"] for p, cards in products.items()} == {DEFAULT_PRODUCT: a, "beta": beta}
    with serve_process(command, tmp_path / "serve.log") as (_, port):  # no channel now: both resume from the state
        products = both_committed(port)
        assert {p: cards["champion"]["release_id"] for p, cards in products.items()} == {DEFAULT_PRODUCT: a, "beta": beta}
        assert ask(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), "beta")[0] == beta


@pytest.mark.parametrize("products", [["beta", "beta"], [], ["Beta"], "beta"])
def test_a_device_config_naming_bad_products_is_refused_naming_the_key(tmp_path, capsys, products):
    from runtime.__main__ import main

    config = tmp_path / "device.json"
    config.write_text(json.dumps({"products": products, "state_dir": "state"}))
    assert main(["state", "--device-config", str(config)]) == 2
    assert "products (--product)" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # refused before anything was opened
