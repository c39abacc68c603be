"""The release's trust chain on the device: from a signed package to a release an engine may run.

Owns the train-to-device contract (``contract``: the release's and the registry's file names, manifest
bytes, release ids), Ed25519 signing (``signing``), unpacking and verification (``package``), pulls
over DVC (``pull``) and TUF (``tuf_pull``), and the device state with its rollback protection
(``device_state``).

Imports ``runtime.engine`` only for what verifying a release needs (the adapter's, KV scales' and
interface's formats, hashes, atomic writes), never ``runtime.serve``. Torch-free.
"""
