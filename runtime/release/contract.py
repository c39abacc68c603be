"""The train-to-device contract: the release's and the registry's file names and formats, defined once.

The pipeline (``tasks/``) writes with these definitions and the device (``runtime/``) reads with
them; neither has another copy. The formats the engine itself reads live in ``runtime.engine``, below
this package, and are named here only to say where each is: the adapter's (``runtime.engine.adapter_config``)
and the engine folder's (``runtime.engine.interface``).
Torch-free, so the ONNX Runtime serving path can import it. Folders and their files:

  adapter   (tasks/stages/finetune.py)   adapter_config.json, adapter_model.safetensors (PEFT, unchanged),
                                  provenance.json (backbone hash, params hash, library versions)
  release   (tasks/stages/package.py;    the adapter's files, manifest.json (sorted keys; ``kv_format`` null: no KV
   verified:                      scales since the static cache went, quantized pages seal their own), manifest.sig
   runtime/release/verify.py)     (Ed25519 over the manifest bytes, runtime/release/signing.py)
  engine    (tasks/stages/compile.py)    model.onnx, interface.json, cache_key.json
  registry  (tasks/release/registry.py;    releases/<month>/ (a release, tracked by DVC), releases/index.json,
   pulled:                        channels.json, and a git tag release/<month> per published month
   runtime/release/pull.py)       (the default product's; another product's under products/<name>/, below)

Products: a product is a named line of releases on one backbone (``data.product``; the signed manifest's
``product``). The registry, the update channel and the device state keep champion and candidate per
product. The default product's paths are the ones written before products existed (``releases/<month>``,
``channels.json``, tag ``release/<month>``), so a registry, an update channel or a release of then is the
default product's as it stands; every other product's sit under ``products/<name>/`` (tag
``release/<name>/<month>``). A manifest without ``product`` is the default product's.

Release ids, for rollback protection: ``<month>+<created UTC YYYYMMDDTHHMMSSZ>``; releases compare
by (month, created stamp), a later month always wins and within a month the later build.
"""

from __future__ import annotations

import datetime as dt
import json
import re

# ---------------------------------------------------------------- products

# The product of everything written before products existed, and of a project that names none. Not the
# embedded task's name: a user's own model and data (docs/own-model.md) are the same one line of releases.
DEFAULT_PRODUCT = "default"
# A letter first (never a month or a release id, which start with a digit), no ":" (``product:candidate``).
PRODUCT = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")
PRODUCTS_DIR = "products"


def check_product(name) -> str:
    """``name`` if it can name a product; ValueError saying why not."""
    if not isinstance(name, str) or not PRODUCT.match(name):
        raise ValueError(f"product {name!r}: lowercase letters, digits, '-' or '_', a letter first, at most 40")
    if name in (*TUF_CHANNELS, "standby"):  # what ``runtime.serve.residents`` calls a release on no channel
        raise ValueError(f"product {name!r}: a channel's name, which a request's model already means")
    return name


def product_path(path: str, product: str = DEFAULT_PRODUCT) -> str:
    """``path`` (relative, ``/``-separated) of the default product, as it is for ``product``."""
    return path if product == DEFAULT_PRODUCT else f"{PRODUCTS_DIR}/{check_product(product)}/{path}"


def manifest_product(manifest: dict) -> str:
    """The product a (verified) manifest's release belongs to; one packaged before products existed: the default."""
    return manifest.get("product", DEFAULT_PRODUCT)


# ---------------------------------------------------------------- file names

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
REGISTRY_CHANNELS = "channels.json"  # alias -> month
REGISTRY_RELEASES = "releases"  # one release directory per published month, and the index
REGISTRY_INDEX = f"{REGISTRY_RELEASES}/index.json"  # month -> release id, adapter sha256, headline metrics
RELEASE_NOTES = "RELEASE_NOTES.md"  # beside each published release: releases/<month>.RELEASE_NOTES.md


def registry_release_path(month: str, product: str = DEFAULT_PRODUCT) -> str:
    """Where a published month's release directory sits in the registry (relative, ``/``-separated)."""
    return product_path(f"{REGISTRY_RELEASES}/{month}", product)


def release_tag(month: str, product: str = DEFAULT_PRODUCT) -> str:
    """The registry's git tag on the commit that published ``month``."""
    return f"release/{month}" if product == DEFAULT_PRODUCT else f"release/{check_product(product)}/{month}"


def parse_channels(raw: bytes, where: str) -> dict[str, str]:
    """A ``channels.json`` (the registry's and the update channel's, one per product): an object of channel
    (alias) -> month. ValueError naming ``where`` when it is not."""
    try:
        channels = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: {REGISTRY_CHANNELS} is not JSON ({err})") from None
    if not isinstance(channels, dict):
        raise ValueError(f"{where}: {REGISTRY_CHANNELS} is not an object of channel -> month")
    bad = sorted(k for k, v in channels.items() if not (isinstance(v, str) and MONTH.match(v)))
    if bad:
        raise ValueError(f"{where}: {REGISTRY_CHANNELS} names no month YYYY-MM for {bad}")
    return channels


def channels_bytes(channels: dict[str, str]) -> bytes:
    """What ``channels.json`` holds: sorted keys, 2-space indent, trailing newline."""
    return (json.dumps(channels, indent=2, sort_keys=True) + "\n").encode()


# The update channel's TUF repository: metadata/<version>.root.json, metadata/timestamp.json,
# metadata/<version>.{snapshot,targets}.json (consistent snapshots), targets/<dir>/<sha256>.<name>.
TUF_METADATA_DIR = "metadata"
TUF_TARGETS_DIR = "targets"
TUF_CHANNELS_TARGET = REGISTRY_CHANNELS  # {"champion": month, "candidate": month}, a signed target
TUF_CHANNELS = ("champion", "candidate")
DEFAULT_TUF_INTERVAL_S = 300.0  # a device polls its channel every 5 min; the timestamp lives a day
# The ``custom`` fields of a release target: what a device can check before downloading it.
TUF_TARGET_CUSTOM = ("month", "release_id", "base_model_hash", "engine_interface_hash")


def release_target_path(month: str, product: str = DEFAULT_PRODUCT) -> str:
    """The TUF target path of a published month's release tarball."""
    return product_path(f"{REGISTRY_RELEASES}/{month}.tar.gz", product)


# ---------------------------------------------------------------- manifest bytes and release ids

FORMAT = "adapter-release"
FORMAT_VERSION = 1
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
MONTH = re.compile(r"^\d{4}-(?:0[1-9]|1[0-2])$")
RELEASE_ID = re.compile(r"^(\d{4}-(?:0[1-9]|1[0-2]))(?:\+(\d{8}T\d{6}Z))?$")


def manifest_bytes(manifest: dict) -> bytes:
    """The canonical bytes that are signed: sorted keys, 2-space indent, trailing newline."""
    return (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def format_time(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime(TIME_FORMAT)


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, TIME_FORMAT).replace(tzinfo=dt.timezone.utc)


def make_release_id(month: str, created: dt.datetime) -> str:
    return f"{month}+{created.astimezone(dt.timezone.utc).strftime(STAMP_FORMAT)}"


def release_order(release_id: str) -> tuple[str, str]:
    """(month, created stamp) of a release id; a bare month ``YYYY-MM`` sorts before all its builds."""
    m = RELEASE_ID.match(str(release_id))
    if m is None:
        raise ValueError(f"release id {release_id!r} is not YYYY-MM or YYYY-MM+YYYYMMDDTHHMMSSZ")
    return m.group(1), m.group(2) or ""
