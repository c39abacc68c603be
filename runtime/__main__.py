"""The device's command line: verify, pull and serve releases.

    python -m runtime verify DIR_OR_TARBALL --trusted-key PUB [--engine DIR] [--tokenizer DIR]
                             [--active-release ID] [--allow-rollback]
    python -m runtime pull --registry PATH_OR_URL (--release YYYY-MM | --alias NAME) --to DIR
                           --trusted-key PUB [--engine DIR] [--rev REV] [--allow-rollback] [--product NAME]
    python -m runtime pull --tuf-url URL --trusted-root FILE --metadata-dir DIR (--release YYYY-MM | --alias NAME)
                           --to DIR --trusted-key PUB [--engine DIR] [--allow-rollback] [--product NAME]
    python -m runtime serve --engine DIR --package DIR --trusted-key PUB [--tokenizer DIR]
                            [--port 8080] [--host 127.0.0.1] [--watch DIR]
                            [--candidate DIR --canary-share F] [--max-resident N]
                            [--admin-token-file FILE --release-dir DIR ...]
                            [--state-dir DIR [--health-window S]] [--kv-budget-mb MB] [--kv-wait S] [--ort-memory MODE]
                            [--prefill-chunk N] [--no-kv-prefix-sharing] [--kv-swap-dir DIR [--kv-swap-mb MB]]
                            [--batch-invariant] [--tuf-url URL --trusted-root FILE --metadata-dir DIR [--tuf-interval S]]
                            [--product NAME ...]  (python -m runtime serve --help)
    python -m runtime state --state-dir DIR       the device state: active, previous, high-water mark, reverts
    python -m runtime rollback --state-dir DIR [--product NAME]
                                                  (serve stopped) the previous release becomes the active one
                                                  and the high-water mark comes down to it: a local, explicit act

A device serves and follows the products it is given (``--product``, repeatable; device config ``products``;
the first is its default, what requests without ``model`` get; default: the one product ``default``).

Trust and paths may come from a device config file instead (``--device-config FILE``, JSON;
relative paths are relative to the file); flags add to it or override it:

    {"trusted_keys": ["keys/release_signing.pub"], "engine": "engine", "tokenizer": "models/base",
     "backend": "onnxruntime", "threads": 2, "max_package_bytes": 268435456,
     "admin_token_file": "admin.token", "release_dirs": ["releases"], "max_resident": 3, "canary_share": 0.0,
     "state_dir": "/var/lib/adapter", "health_window": 30,
     "tuf_url": "http://updates.example:8000", "trusted_root": "1.root.json", "metadata_dir": "tuf-metadata",
     "tuf_interval": 300, "kv_budget_mb": 512, "kv_wait_s": 30, "products": ["default"], "ort_memory": "arena", "prefill_chunk": 64,
     "kv_prefix_sharing": true, "kv_swap_dir": "/var/cache/adapter-kv", "kv_swap_mb": 1024, "batch_invariant": false}

Exit codes: 0 success, 1 crash (a bug), 2 bad usage or device configuration, 30 the registry
could not give the release, 31-38 the update channel refused (``runtime.release.tuf_pull.EXIT_CODES``:
31 stale_metadata, 32 untrusted_metadata, 33 metadata_rollback, 34 hash_mismatch, 35 too_large,
36 unreachable, 37 unknown_target, 38 repository), and one code per refusal of ``runtime.release.verify.EXIT_CODES``:
10 malformed, 11 checksum, 12 unlisted_file, 13 signature, 14 backbone_mismatch,
15 interface_mismatch, 16 adapter, 17 kv_scales, 18 size_limit, 19 unsafe_path, 20 rollback,
21 expired, 22 tokenizer_mismatch, 23 reverted (serve with --state-dir), 24 month_mismatch (fetched by
another month's name), 25 product_mismatch (fetched as another product's).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from runtime.engine.errors import RefusedInput

# Not runtime.serve.channel_watch: it loads python-tuf and urllib3, which only a device following a channel
# needs (imported where the watcher starts).
from runtime.release.contract import DEFAULT_PRODUCT, DEFAULT_TUF_INTERVAL_S, check_product
from runtime.release.verify import DEFAULT_MAX_PACKAGE_BYTES, EXIT_CODES, PackageError
from runtime.serve.batcher import DEFAULT_PREFILL_CHUNK, KV_WAIT_S
from runtime.serve.health import DEFAULT_HEALTH_WINDOW_S
from runtime.serve.http_app import DECODE_MODES, DEFAULT_MAX_CONCURRENT, ServeSettings
from runtime.serve.residents import CANDIDATE, CHANNELS, DEFAULT_MAX_RESIDENT

EXIT_USAGE = 2
DEFAULT_KV_SWAP_MB = 1024  # the spill file's bound unless configured (the 0.5B shape's 4-bit pages: ~3.5 KB a token)
SERVE_EPILOG = ("exit codes: 0 stopped by SIGTERM or SIGINT after a graceful shutdown, 1 crash (a bug), 2 bad usage or "
                "device configuration, and for a --package refused at start: "
                + ", ".join(f"{code} {reason}" for reason, code in sorted(EXIT_CODES.items(), key=lambda kv: kv[1])))


class DeviceConfigError(RefusedInput):
    exit_code = EXIT_USAGE


def device_settings(args) -> dict:
    """Settings from ``--device-config`` (if any) overlaid with the flags given."""
    settings = {"trusted_keys": [], "engine": None, "tokenizer": None, "backend": "onnxruntime", "threads": 2,
                "max_package_bytes": DEFAULT_MAX_PACKAGE_BYTES, "admin_token_file": None, "release_dirs": [],
                "max_resident": None, "canary_share": 0.0, "state_dir": None,
                "health_window": DEFAULT_HEALTH_WINDOW_S,
                "tuf_url": None, "trusted_root": None, "metadata_dir": None, "tuf_interval": DEFAULT_TUF_INTERVAL_S,
                "kv_budget_mb": None, "kv_wait_s": KV_WAIT_S, "products": [DEFAULT_PRODUCT], "ort_memory": None,
                "prefill_chunk": DEFAULT_PREFILL_CHUNK, "kv_prefix_sharing": True, "kv_swap_dir": None,
                "kv_swap_mb": DEFAULT_KV_SWAP_MB, "batch_invariant": False}
    if args.device_config is not None:
        path = Path(args.device_config)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise DeviceConfigError(f"{path}: cannot read device config ({err})") from None
        unknown = sorted(set(raw) - set(settings))
        if unknown:
            raise DeviceConfigError(f"{path}: unknown key(s) {unknown}; known: {sorted(settings)}")
        for key in ("engine", "tokenizer", "admin_token_file", "state_dir", "trusted_root", "metadata_dir", "kv_swap_dir"):
            if raw.get(key) is not None:
                raw[key] = str(path.parent / raw[key])
        for key in ("trusted_keys", "release_dirs"):
            raw[key] = [str(path.parent / k) for k in raw.get(key, [])]
        settings |= raw
    settings["trusted_keys"] = list(settings["trusted_keys"]) + list(getattr(args, "trusted_key", None) or [])
    settings["release_dirs"] = list(settings["release_dirs"]) + list(getattr(args, "release_dir", None) or [])
    for key in ("engine", "tokenizer", "admin_token_file", "max_resident", "canary_share", "state_dir", "health_window",
                "tuf_url", "trusted_root", "metadata_dir", "tuf_interval", "kv_budget_mb", "kv_wait_s", "ort_memory",
                "prefill_chunk", "kv_prefix_sharing", "kv_swap_dir", "kv_swap_mb", "batch_invariant"):
        if getattr(args, key, None) is not None:
            settings[key] = getattr(args, key)
    if getattr(args, "product", None):
        settings["products"] = list(args.product)
    products = settings["products"]
    try:
        if not isinstance(products, list) or not products or len(set(products)) != len(products):
            raise ValueError(f"products {products!r}: a list of one or more product names, each once")
        for product in products:
            check_product(product)
    except ValueError as err:
        raise DeviceConfigError(f"products (--product): {err}") from None
    return settings


def _resident_settings(settings) -> tuple[int, float]:
    """``max_resident`` (default: DEFAULT_MAX_RESIDENT per product) and ``canary_share``, checked: from a flag
    or the device config alike."""
    max_resident, share = settings["max_resident"], settings["canary_share"]
    if max_resident is None:
        max_resident = DEFAULT_MAX_RESIDENT * len(settings["products"])
    if type(max_resident) is not int or max_resident < len(CHANNELS):
        raise DeviceConfigError(f"max_resident (--max-resident) {max_resident!r}: an integer of at least "
                                f"{len(CHANNELS)}, the champion and a candidate")
    if type(share) not in (int, float) or not 0 <= share <= 1:
        raise DeviceConfigError(f"canary_share (--canary-share) {share!r}: a fraction from 0 to 1")
    return max_resident, float(share)


def _ort_memory_option(settings) -> dict:
    """``{"memory": mode}`` for ONNX Runtime's ``OrtEngine`` when ``ort_memory`` is set (checked), else empty."""
    mode = settings["ort_memory"]
    if mode is None:
        return {}
    from runtime.engine.backends.onnxruntime import ORT_MEMORY_MODES

    if settings["backend"] != "onnxruntime" or mode not in ORT_MEMORY_MODES:
        raise DeviceConfigError(f"ort_memory (--ort-memory) {mode!r}: one of {', '.join(ORT_MEMORY_MODES)}, "
                                f"with backend onnxruntime (this device: {settings['backend']})")
    return {"memory": mode}


def _kv_settings(settings, iface) -> tuple[int | None, float]:
    """(KV budget in bytes, seconds a request waits for KV blocks), checked. The budget bounds a paged
    engine's pool (interface version 6): ``kv_budget_mb``, or by default a quarter of the available memory
    (``runtime.engine.kv_blocks.default_kv_budget_bytes``); a padded engine has no pool and takes none."""
    budget, wait = settings["kv_budget_mb"], settings["kv_wait_s"]
    if budget is not None and (type(budget) not in (int, float) or budget <= 0):
        raise DeviceConfigError(f"kv_budget_mb (--kv-budget-mb) {budget!r}: megabytes (2^20 bytes), more than 0")
    if type(wait) not in (int, float) or wait <= 0:
        raise DeviceConfigError(f"kv_wait_s (--kv-wait) {wait!r}: seconds, more than 0")
    if not iface.paged:
        if budget is not None:
            raise DeviceConfigError(f"kv_budget_mb (--kv-budget-mb): the engine {settings['engine']} has a padded KV "
                                    f"cache (interface version {iface.version}); a budget needs a paged engine (version 6)")
        return None, float(wait)
    from runtime.engine.kv_blocks import default_kv_budget_bytes

    return (int(budget * (1 << 20)) if budget is not None else default_kv_budget_bytes()), float(wait)


def _open_interface(engine_dir):
    from runtime.engine.interface import read_interface

    return read_interface(engine_dir) if engine_dir is not None else None


def _tokenizer_checks(settings) -> dict:
    """What a release is checked against on this device's tokenizer: its file hash and stop ids."""
    if settings.get("tokenizer") is None:
        return {}
    from runtime.engine.tokenizer import DeviceTokenizer

    tokenizer = DeviceTokenizer(settings["tokenizer"])
    return {"tokenizer_sha256": tokenizer.sha256, "stop_token_ids": tokenizer.stop_ids}


def cmd_verify(args, settings) -> int:
    from runtime.release.contract import release_order
    from runtime.release.verify import load_trusted_keys, verify_path

    if args.active_release is not None:
        try:
            release_order(args.active_release)
        except ValueError as err:
            raise DeviceConfigError(f"--active-release: {err}") from None
    verified = verify_path(
        args.package, load_trusted_keys(settings["trusted_keys"]), iface=_open_interface(settings["engine"]),
        active_release=args.active_release, allow_rollback=args.allow_rollback,
        max_bytes=settings["max_package_bytes"], **_tokenizer_checks(settings),
    )
    print(json.dumps(verified.summary(), indent=2, sort_keys=True))
    return 0


def cmd_pull(args, settings) -> int:
    from runtime.release.verify import load_trusted_keys

    if (args.registry is None) == (settings["tuf_url"] is None):
        raise DeviceConfigError("pull needs exactly one source: --registry (dvc get) or --tuf-url (update channel)")
    checks = dict(iface=_open_interface(settings["engine"]), allow_rollback=args.allow_rollback,
                  max_bytes=settings["max_package_bytes"], **_tokenizer_checks(settings))
    keys = load_trusted_keys(settings["trusted_keys"])
    if len(settings["products"]) != 1:
        raise DeviceConfigError(f"pull installs one product's release; products: {settings['products']} (--product NAME)")
    checks["product"] = settings["products"][0]
    if args.registry is not None:
        from runtime.release.pull import pull

        verified = pull(args.registry, args.to, keys, month=args.release, alias=args.alias, rev=args.rev, **checks)
    else:
        from runtime.release.tuf_pull import tuf_pull

        _check_channel(settings, "pull")
        verified = tuf_pull(settings["tuf_url"], settings["trusted_root"], settings["metadata_dir"], args.to, keys,
                            month=args.release, channel=args.alias, **checks)
    print(json.dumps(verified.summary() | {"installed": str(verified.path)}, indent=2, sort_keys=True))
    return 0


def _check_channel(settings, command: str) -> None:
    """``tuf_url`` comes with ``trusted_root`` and ``metadata_dir`` (and serve's ``tuf_interval`` is seconds)."""
    missing = [f"--{k.replace('_', '-')}" for k in ("trusted_root", "metadata_dir") if settings[k] is None]
    if missing:
        raise DeviceConfigError(f"{command} --tuf-url needs {' and '.join(missing)} (or the device config keys)")
    interval = settings["tuf_interval"]
    if type(interval) not in (int, float) or interval <= 0:
        raise DeviceConfigError(f"tuf_interval (--tuf-interval) {interval!r}: seconds, more than 0")


def cmd_serve(args, settings) -> int:
    from runtime.engine.engine import open_engine
    from runtime.engine.tokenizer import TOKENIZER_FILE, DeviceTokenizer
    from runtime.release.verify import load_trusted_keys
    from runtime.serve.http_server import configure_json_logging, serve
    from runtime.serve.server import AdapterServer

    configure_json_logging()  # every line of a serving device is JSON, the first release's load included
    if settings["engine"] is None:
        raise DeviceConfigError("serve needs --engine (or engine in the device config)")
    if settings["tokenizer"] is None:
        default = Path(settings["engine"]) / TOKENIZER_FILE
        if not default.exists():
            raise DeviceConfigError("serve needs --tokenizer: the base model's directory (with tokenizer.json); "
                                    f"the engine {settings['engine']} does not hold one")
        settings["tokenizer"] = str(default)
    if settings["tuf_url"] is not None:
        _check_channel(settings, "serve")
    state = _open_state(settings)
    products = tuple(settings["products"])
    if args.package is None and args.watch is None and settings["tuf_url"] is None and (
            state is None or all(state.for_product(p).record.active is None for p in products)):
        raise DeviceConfigError("serve needs --package DIR (or --watch DIR or --tuf-url URL to wait for one, or a "
                                "--state-dir holding an active release)")
    if args.candidate is not None and args.package is None:
        raise DeviceConfigError("--candidate needs --package: a candidate is compared with the champion")
    max_resident, canary_share = _resident_settings(settings)
    serve_settings = ServeSettings(
        max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens, max_context_tokens=args.max_context_tokens,
        decode=args.decode, max_concurrent=getattr(args, "max_concurrent", None),  # None: the mode's default
        max_queue=args.max_queue, header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        keep_alive_s=args.keep_alive, graceful_shutdown_s=args.graceful_shutdown,
        admin_token=_admin_token(settings["admin_token_file"]),
        release_dirs=tuple(Path(d).resolve() for d in settings["release_dirs"]), canary_share=canary_share)
    kv_budget, kv_wait = _kv_settings(settings, _open_interface(settings["engine"]))
    keys = load_trusted_keys(settings["trusted_keys"])
    options = ({"kv_budget_bytes": kv_budget} if kv_budget is not None else {}) | _ort_memory_option(settings)
    if type(settings["batch_invariant"]) is not bool:
        raise DeviceConfigError(f"batch_invariant {settings['batch_invariant']!r}: true or false")
    if settings["batch_invariant"]:
        if kv_budget is None:
            raise DeviceConfigError(f"batch_invariant (--batch-invariant): the engine {settings['engine']} has a padded "
                                    "KV cache; pairing rows needs a paged one")
        options["paired_rows"] = True
    engine = open_engine(settings["engine"], settings["backend"], threads=settings["threads"], **options)
    if kv_budget is not None:
        logging.getLogger(__name__).info("KV budget %d MiB: %d blocks of %d tokens", kv_budget >> 20,
                                         engine.pool.capacity, engine.pool.block_size)
    chunk = settings["prefill_chunk"]
    if type(chunk) is not int or chunk < 1:
        raise DeviceConfigError(f"prefill_chunk (--prefill-chunk) {chunk!r}: tokens per prefill forward, at least 1")
    sharing = settings["kv_prefix_sharing"]
    if type(sharing) is not bool:
        raise DeviceConfigError(f"kv_prefix_sharing {sharing!r}: true or false")
    swap_dir, swap_mb = settings["kv_swap_dir"], settings["kv_swap_mb"]
    if swap_dir is not None and (kv_budget is None or not Path(swap_dir).is_dir()):
        raise DeviceConfigError(f"kv_swap_dir (--kv-swap-dir) {swap_dir}: " + (
            "a directory that exists" if kv_budget is not None else "swap needs a paged engine (it has a KV budget)"))
    if not isinstance(swap_mb, (int, float)) or isinstance(swap_mb, bool) or swap_mb <= 0:
        raise DeviceConfigError(f"kv_swap_mb (--kv-swap-mb) {swap_mb!r}: megabytes (2^20 bytes), more than 0")
    app = AdapterServer(engine, DeviceTokenizer(settings["tokenizer"]), keys, settings["max_package_bytes"],
                        max_resident, products, kv_wait, chunk, sharing, swap_dir, int(swap_mb * (1 << 20)))
    if state is not None:
        from runtime.serve.health import ReleaseGate

        for product in products:
            ReleaseGate(app, state.for_product(product), settings["health_window"], serve_settings.decode,
                        product).resume()
    if args.package is not None:
        app.load(args.package)
    if args.candidate is not None:
        app.load(args.candidate, channel=CANDIDATE)
    watchers = []
    if args.watch is not None:
        from runtime.serve.server import Watcher

        watchers.append(Watcher(app, Path(args.watch), args.watch_interval))
        watchers[-1].poll_once()
    if settings["tuf_url"] is not None:
        from runtime.serve.channel_watch import ChannelWatcher

        # its first poll runs on its thread: a channel that is down never delays serving the resumed release
        watchers.append(ChannelWatcher(app, settings["tuf_url"], settings["trusted_root"], settings["metadata_dir"],
                                       settings["tuf_interval"]))
    return serve(app, serve_settings, args.host, args.port, watchers)


def _open_state(settings, exclusive: bool = True):
    """The device state of ``state_dir`` (None without one), ``health_window`` checked."""
    window = settings["health_window"]
    if type(window) not in (int, float) or window < 0:
        raise DeviceConfigError(f"health_window (--health-window) {window!r}: seconds, 0 or more")
    if settings["state_dir"] is None:
        return None
    from runtime.release.device_state import DeviceState

    return DeviceState(settings["state_dir"], exclusive)


def _named_state(settings, exclusive: bool = True):
    state = _open_state(settings, exclusive)
    if state is None:
        raise DeviceConfigError("needs --state-dir DIR (or state_dir in the device config)")
    return state


def cmd_state(args, settings) -> int:
    """The default product's record, and under ``products`` every other product's kept there."""
    from dataclasses import asdict

    state = _named_state(settings, exclusive=False)
    others = {p: asdict(state.for_product(p).record) for p in state.other_products()}
    print(json.dumps(asdict(state.record) | ({"products": others} if others else {}), indent=2, sort_keys=True))
    return 0


def cmd_rollback(args, settings) -> int:
    from dataclasses import asdict

    if len(settings["products"]) != 1:
        raise DeviceConfigError(f"rollback acts on one product; products: {settings['products']} (--product NAME)")
    state = _named_state(settings).for_product(settings["products"][0])
    print(json.dumps(asdict(state.rollback()), indent=2, sort_keys=True))
    return 0


def _admin_token(path) -> str | None:
    """The admin token: the file's first line; None (admin API off) without a file."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise DeviceConfigError(f"admin token file {path}: {err.strerror}") from None
    if len(token) < 16:
        raise DeviceConfigError(f"admin token file {path}: the token must be at least 16 characters")
    return token


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Verify, pull and serve adapter releases.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--trusted-key", action="append", metavar="PUB", help="trusted Ed25519 public key (PEM); repeatable")
    common.add_argument("--device-config", metavar="FILE", help="device config JSON (trusted_keys, engine, tokenizer, ...)")
    common.add_argument("--engine", metavar="DIR", help="compiled engine directory (interface.json)")
    common.add_argument("--tokenizer", metavar="DIR", help="base model directory or tokenizer.json")
    common.add_argument("--allow-rollback", action="store_true", help="accept a release older than the active one")
    channel = argparse.ArgumentParser(add_help=False)
    channel.add_argument("--tuf-url", metavar="URL", help="base URL of the update channel (TUF metadata/ and "
                         "targets/; device config tuf_url)")
    channel.add_argument("--trusted-root", metavar="FILE", help="the update channel's root metadata given out of band")
    channel.add_argument("--metadata-dir", metavar="DIR", help="where this device keeps the TUF metadata it has verified")
    channel.add_argument("--product", action="append", metavar="NAME", default=argparse.SUPPRESS,
                         help="a product (line of releases) this device pulls, serves and follows; repeatable for "
                         "serve, the first the default for requests without model (device config products; "
                         f"default {DEFAULT_PRODUCT})")
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", parents=[common], help="verify a release directory or tarball")
    v.add_argument("package", metavar="DIR_OR_TARBALL")
    v.add_argument("--active-release", metavar="ID", help="release id (or month) active on the device: older ones are refused")
    v.set_defaults(run=cmd_verify)

    p = sub.add_parser("pull", parents=[common, channel], help="fetch a release (registry with dvc, or update channel with TUF), "
                       "verify, install")
    p.add_argument("--registry", metavar="PATH_OR_URL", help="git URL or path of the release registry (dvc get)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--release", metavar="YYYY-MM")
    which.add_argument("--alias", metavar="NAME", help="a channel of channels.json, e.g. champion (signed, with --tuf-url)")
    p.add_argument("--rev", help="registry revision to read channels.json at (default: its default branch)")
    p.add_argument("--to", required=True, metavar="DIR", help="install directory (replaced only after verification)")
    p.set_defaults(run=cmd_pull)

    d = ServeSettings()
    s = sub.add_parser("serve", parents=[common, channel], help="serve generation over HTTP and hot-swap releases",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, epilog=SERVE_EPILOG,
                       description="Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                                   "/v1/models), /healthz, /ready, /metrics, and the admin API (/v1/adapters).")
    s.add_argument("--package", metavar="DIR_OR_TARBALL", help="release to serve at start")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 exposes the device")
    s.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one")
    s.add_argument("--candidate", metavar="DIR_OR_TARBALL", help="release to load at start as the candidate "
                   "(not older than --package), for requests naming model candidate and the canary share")
    s.add_argument("--canary-share", type=float, default=argparse.SUPPRESS, metavar="F",
                   help="fraction of requests without model sent to the candidate, split exactly "
                   "(device config canary_share; default 0)")
    s.add_argument("--max-resident", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="releases kept resident; beyond, the least recently used standby one is unloaded "
                   f"(device config max_resident; default {DEFAULT_MAX_RESIDENT} per product)")
    s.add_argument("--watch", metavar="DIR", help="load as champion newer verified releases that appear in DIR")
    s.add_argument("--watch-interval", type=float, default=2.0, metavar="S", help="seconds between polls of --watch")
    s.add_argument("--tuf-interval", type=float, default=argparse.SUPPRESS, metavar="S",
                   help="with --tuf-url: seconds between polls of the update channel, which load as champion (and "
                   "candidate) the newer releases its signed channels.json names; /ready stays 200 while a champion "
                   "serves, and says the channel's state (device config tuf_interval; default "
                   f"{DEFAULT_TUF_INTERVAL_S:g})")
    s.add_argument("--admin-token-file", metavar="FILE", help="file holding the bearer token of the admin API "
                   "(POST /v1/adapters); without it the admin API is off (404)")
    s.add_argument("--release-dir", action="append", metavar="DIR", help="directory the admin API may load "
                   "releases from (symlinks resolved; repeatable); any other path is refused (403)")
    s.add_argument("--max-tokens", type=int, default=d.max_tokens, help="cap on a request's max_tokens (400 above it)")
    s.add_argument("--max-context-tokens", type=int, default=d.max_context_tokens,
                   help="a prompt's tokens plus max_tokens must fit in this (400 above it)")
    s.add_argument("--decode", choices=DECODE_MODES, default=d.decode,
                   help="batched: the requests on one release decode together, step by step, joining after their "
                   "prefill and leaving when they stop (continuous batching); fork: each request decodes alone on "
                   "its own fork of the engine (also what engines whose KV cache has fp16 sink tokens get)")
    s.add_argument("--max-concurrent", type=int, default=argparse.SUPPRESS,
                   help="generations (requests) decoding at once; batched: the requests in their release's batch, "
                   f"each with its prompts as rows (default {DEFAULT_MAX_CONCURRENT['batched']}); fork: engine forks "
                   f"sharing the session's threads (default {DEFAULT_MAX_CONCURRENT['fork']})")
    s.add_argument("--max-queue", type=int, default=d.max_queue, help="generations waiting for a slot; beyond, 503")
    s.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="request body limit (413 above it)")
    s.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                   help="request line and headers must arrive within this (408, then close)")
    s.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                   help="request body must arrive within this (408)")
    s.add_argument("--keep-alive", type=int, default=d.keep_alive_s, metavar="S", help="idle keep-alive connections close after this")
    s.add_argument("--graceful-shutdown", type=int, default=d.graceful_shutdown_s, metavar="S",
                   help="on SIGTERM, stop accepting and give requests in flight this long to finish")
    s.add_argument("--state-dir", metavar="DIR", default=argparse.SUPPRESS,
                   help="device state (device config state_dir): the active and previous releases kept, the "
                   "high-water mark; a restart resumes from it, and every new champion is health-checked")
    s.add_argument("--health-window", type=float, default=argparse.SUPPRESS, metavar="S",
                   help="with --state-dir: after a new champion's probes pass, a request failing on it within "
                   f"this many seconds reverts it; 0 commits after the probes (default {DEFAULT_HEALTH_WINDOW_S:g})")
    s.add_argument("--kv-budget-mb", type=float, default=argparse.SUPPRESS, metavar="MB",
                   help="a paged engine's KV cache holds at most this many MiB (device config kv_budget_mb; default "
                   "a quarter of the memory available at start); a request waits for its worst case (prompt + "
                   "max_tokens) to fit, or gets 503 with Retry-After")
    s.add_argument("--kv-wait", dest="kv_wait_s", type=float, default=argparse.SUPPRESS, metavar="S",
                   help=f"seconds a request waits for KV blocks before its 503 (device config kv_wait_s; default {KV_WAIT_S:g})")
    s.add_argument("--ort-memory", dest="ort_memory", default=argparse.SUPPRESS, metavar="MODE",
                   help="how ONNX Runtime holds intermediate tensors (device config ort_memory): arena (its default: "
                   "what a long prefill once took stays resident), shrink (the arena handed back after each run), "
                   "no_arena (runtime.engine.backends.onnxruntime.ORT_MEMORY_MODES)")
    s.add_argument("--prefill-chunk", dest="prefill_chunk", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="prefill a prompt at most N tokens per forward through the KV cache (device config "
                   f"prefill_chunk; default {DEFAULT_PREFILL_CHUNK}): bounds a long prompt's activations, the peak "
                   "resident set")
    s.add_argument("--no-kv-prefix-sharing", dest="kv_prefix_sharing", action="store_false", default=argparse.SUPPRESS,
                   help="prefill every prompt whole (device config kv_prefix_sharing: false); by default a paged engine "
                   "indexes each prompt's full KV pages and a prompt that starts with the same tokens on the same "
                   "release reuses them (runtime.engine.kv_prefix)")
    s.add_argument("--kv-swap-dir", dest="kv_swap_dir", default=argparse.SUPPRESS, metavar="DIR",
                   help="a request the KV budget cannot admit preempts the newest running rows into a private spill file "
                   "in DIR (unnamed, mode 0600, gone when the process ends) instead of waiting; they resume when blocks "
                   "free up (device config kv_swap_dir; default: no swap)")
    s.add_argument("--kv-swap-mb", dest="kv_swap_mb", type=float, default=argparse.SUPPRESS, metavar="MB",
                   help=f"the spill file's size at most (device config kv_swap_mb; default {DEFAULT_KV_SWAP_MB})")
    s.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=argparse.SUPPRESS,
                   help="every forward runs an even number of rows (an odd batch's last row twice), so a request's "
                   "tokens are those it gets alone whatever shares its batch (device config batch_invariant: true; "
                   "default off: a request decoding alone then costs a pair's step; docs/device.md)")
    s.set_defaults(run=cmd_serve)

    state_only = argparse.ArgumentParser(add_help=False)
    state_only.add_argument("--device-config", metavar="FILE", help="device config JSON (its state_dir)")
    state_only.add_argument("--state-dir", metavar="DIR", default=argparse.SUPPRESS, help="the serve --state-dir")
    state_only.add_argument("--product", action="append", metavar="NAME", default=argparse.SUPPRESS,
                            help=f"rollback: the product to roll back (default {DEFAULT_PRODUCT})")
    sub.add_parser("state", parents=[state_only], help="print the device state of a state directory"
                   ).set_defaults(run=cmd_state)
    sub.add_parser("rollback", parents=[state_only], help="with serve stopped: make the previous release the active "
                   "one and lower the high-water mark to it (the release left is remembered as reverted)"
                   ).set_defaults(run=cmd_rollback)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args, device_settings(args))
    except PackageError as err:
        print(f"error: refused ({err.reason}): {err}", file=sys.stderr)
        return err.exit_code
    except RefusedInput as err:  # pull errors, device config, keys, engine interface, tokenizer
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
