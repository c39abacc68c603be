"""The device's command line: verify, pull and serve releases.

    python -m runtime verify DIR_OR_TARBALL --trusted-key PUB [--engine DIR] [--tokenizer DIR]
                             [--active-release ID] [--allow-rollback]
    python -m runtime pull --registry PATH_OR_URL (--release YYYY-MM | --alias NAME) --to DIR
                           --trusted-key PUB [--engine DIR] [--rev REV] [--allow-rollback]
    python -m runtime serve --engine DIR --package DIR --trusted-key PUB [--tokenizer DIR]
                            [--port 8080] [--host 127.0.0.1] [--watch DIR]

Trust and paths may come from a device config file instead (``--device-config FILE``, JSON;
relative paths are relative to the file); flags add to it or override it:

    {"trusted_keys": ["keys/release_signing.pub"], "engine": "engine", "tokenizer": "models/base",
     "backend": "onnxruntime", "threads": 2, "max_package_bytes": 268435456}

Exit codes: 0 success, 1 crash (a bug), 2 bad usage or device configuration, 30 the registry
could not give the release, and one code per refusal of ``runtime.package.EXIT_CODES``:
10 malformed, 11 checksum, 12 unlisted_file, 13 signature, 14 backbone_mismatch,
15 interface_mismatch, 16 adapter, 17 kv_scales, 18 size_limit, 19 unsafe_path, 20 rollback,
21 expired, 22 tokenizer_mismatch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from runtime.errors import RefusedInput
from runtime.package import DEFAULT_MAX_PACKAGE_BYTES, PackageError

EXIT_USAGE = 2


class DeviceConfigError(RefusedInput):
    exit_code = EXIT_USAGE


def device_settings(args) -> dict:
    """Settings from ``--device-config`` (if any) overlaid with the flags given."""
    settings = {"trusted_keys": [], "engine": None, "tokenizer": None, "backend": "onnxruntime", "threads": 2,
                "max_package_bytes": DEFAULT_MAX_PACKAGE_BYTES}
    if args.device_config is not None:
        path = Path(args.device_config)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise DeviceConfigError(f"{path}: cannot read device config ({err})") from None
        unknown = sorted(set(raw) - set(settings))
        if unknown:
            raise DeviceConfigError(f"{path}: unknown key(s) {unknown}; known: {sorted(settings)}")
        for key in ("engine", "tokenizer"):
            if raw.get(key) is not None:
                raw[key] = str(path.parent / raw[key])
        raw["trusted_keys"] = [str(path.parent / k) for k in raw.get("trusted_keys", [])]
        settings |= raw
    settings["trusted_keys"] = list(settings["trusted_keys"]) + list(args.trusted_key or [])
    for key in ("engine", "tokenizer"):
        if getattr(args, key, None) is not None:
            settings[key] = args.engine if key == "engine" else args.tokenizer
    return settings


def _open_interface(engine_dir):
    from runtime.interface import read_interface

    return read_interface(engine_dir) if engine_dir is not None else None


def _tokenizer_checks(settings) -> dict:
    """What a release is checked against on this device's tokenizer: its file hash and stop ids."""
    if settings.get("tokenizer") is None:
        return {}
    from runtime.tokenizer import DeviceTokenizer

    tokenizer = DeviceTokenizer(settings["tokenizer"])
    return {"tokenizer_sha256": tokenizer.sha256, "stop_token_ids": tokenizer.stop_ids}


def cmd_verify(args, settings) -> int:
    from runtime.contract import release_order
    from runtime.package import load_trusted_keys, verify_path

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
    from runtime.package import load_trusted_keys
    from runtime.pull import pull

    verified = pull(
        args.registry, args.to, load_trusted_keys(settings["trusted_keys"]), month=args.release, alias=args.alias,
        rev=args.rev, iface=_open_interface(settings["engine"]), allow_rollback=args.allow_rollback,
        max_bytes=settings["max_package_bytes"], **_tokenizer_checks(settings),
    )
    print(json.dumps(verified.summary() | {"installed": str(verified.path)}, indent=2, sort_keys=True))
    return 0


def cmd_serve(args, settings) -> int:
    from runtime.engine import open_engine
    from runtime.package import load_trusted_keys
    from runtime.server import AdapterServer, serve
    from runtime.tokenizer import TOKENIZER_FILE, DeviceTokenizer

    if settings["engine"] is None:
        raise DeviceConfigError("serve needs --engine (or engine in the device config)")
    if settings["tokenizer"] is None:
        default = Path(settings["engine"]) / TOKENIZER_FILE
        if not default.exists():
            raise DeviceConfigError("serve needs --tokenizer: the base model's directory (with tokenizer.json); "
                                    f"the engine {settings['engine']} does not hold one")
        settings["tokenizer"] = str(default)
    if args.package is None and args.watch is None:
        raise DeviceConfigError("serve needs --package DIR (or --watch DIR to wait for one)")
    keys = load_trusted_keys(settings["trusted_keys"])
    engine = open_engine(settings["engine"], settings["backend"], threads=settings["threads"])
    app = AdapterServer(engine, DeviceTokenizer(settings["tokenizer"]), keys, settings["max_package_bytes"])
    if args.package is not None:
        app.load(args.package)
    serve(app, args.host, args.port, Path(args.watch) if args.watch else None, args.watch_interval)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Verify, pull and serve adapter releases.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--trusted-key", action="append", metavar="PUB", help="trusted Ed25519 public key (PEM); repeatable")
    common.add_argument("--device-config", metavar="FILE", help="device config JSON (trusted_keys, engine, tokenizer, ...)")
    common.add_argument("--engine", metavar="DIR", help="compiled engine directory (interface.json)")
    common.add_argument("--tokenizer", metavar="DIR", help="base model directory or tokenizer.json")
    common.add_argument("--allow-rollback", action="store_true", help="accept a release older than the active one")
    sub = parser.add_subparsers(dest="command", required=True)

    v = sub.add_parser("verify", parents=[common], help="verify a release directory or tarball")
    v.add_argument("package", metavar="DIR_OR_TARBALL")
    v.add_argument("--active-release", metavar="ID", help="release id (or month) active on the device: older ones are refused")
    v.set_defaults(run=cmd_verify)

    p = sub.add_parser("pull", parents=[common], help="fetch a release from the registry with dvc, verify, install")
    p.add_argument("--registry", required=True, metavar="PATH_OR_URL", help="git URL or path of the release registry")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--release", metavar="YYYY-MM")
    which.add_argument("--alias", metavar="NAME", help="a channel of channels.json, e.g. champion")
    p.add_argument("--rev", help="registry revision to read channels.json at (default: its default branch)")
    p.add_argument("--to", required=True, metavar="DIR", help="install directory (replaced only after verification)")
    p.set_defaults(run=cmd_pull)

    s = sub.add_parser("serve", parents=[common], help="serve generation over HTTP and hot-swap releases")
    s.add_argument("--package", metavar="DIR_OR_TARBALL", help="release to serve at start")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--watch", metavar="DIR", help="swap in newer verified releases that appear in DIR")
    s.add_argument("--watch-interval", type=float, default=2.0, metavar="S")
    s.set_defaults(run=cmd_serve)
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
