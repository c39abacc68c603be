"""Ed25519 keys and detached signatures of release manifests.

The pipeline signs the exact bytes of ``manifest.json`` with a private key it keeps (PEM,
PKCS8, unencrypted, mode 0600); a device trusts the public keys named in its own
configuration (``--trusted-key`` or a device config file; never a key shipped inside a
package). Files:

  <key>.key   private key, PEM "BEGIN PRIVATE KEY"   (pipeline only)
  <key>.pub   public key,  PEM "BEGIN PUBLIC KEY" (SubjectPublicKeyInfo), what devices trust
  manifest.sig  the raw 64-byte Ed25519 signature of manifest.json, nothing else

A key is named by its ``key_id``: the first 16 hex digits of sha256 over the raw 32-byte
public key; the manifest records the id of the key that signed it, so a refusal can say
"signed by key X, which this device does not trust" rather than only "bad signature".
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runtime.engine.errors import RefusedInput

SIGNATURE_BYTES = 64
PUBLIC_KEY_SUFFIX = ".pub"


class SigningKeyError(RefusedInput):
    """A key file that cannot be used as an Ed25519 key; the message names the file."""


def public_key_path(private_key_path: str | Path) -> Path:
    """Where the public half of a private key is written: same name, suffix ``.pub``."""
    return Path(private_key_path).with_suffix(PUBLIC_KEY_SUFFIX)


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate_key(private_path: str | Path) -> Ed25519PrivateKey:
    """Create a new key at ``private_path`` (mode 0600, refusing to overwrite) and its ``.pub``."""
    private_path = Path(private_path)
    private_path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    # O_EXCL: two processes creating the key at once must not each sign with a different one.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public_key_path(private_path).write_bytes(public_pem(key.public_key()))
    return key


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    path = Path(path)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise SigningKeyError(f"{path}: not a readable unencrypted PEM private key ({err})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{path}: a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """A PEM public key (``BEGIN PUBLIC KEY``) or a file holding the raw 32 bytes."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SigningKeyError(f"{path}: cannot read trusted key ({err.strerror})") from None
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as err:
        raise SigningKeyError(f"{path}: not a PEM public key or 32 raw bytes ({err})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{path}: a {type(key).__name__}, not an Ed25519 public key")
    return key


def sign(private_key: Ed25519PrivateKey, data: bytes) -> bytes:
    return private_key.sign(data)


def verify_detached(trusted: dict[str, Ed25519PublicKey], data: bytes, signature: bytes, claimed_key_id: str | None) -> str:
    """The key id of the trusted key that signed ``data``; raise InvalidSignature otherwise.

    Only the key the manifest names is tried when it is trusted; when it is not, every trusted
    key is tried (a manifest whose key id field was altered still fails, since it is signed).
    """
    if len(signature) != SIGNATURE_BYTES:
        raise InvalidSignature(f"signature is {len(signature)} bytes, an Ed25519 signature is {SIGNATURE_BYTES}")
    candidates = [claimed_key_id] if claimed_key_id in trusted else list(trusted)
    for kid in candidates:
        try:
            trusted[kid].verify(signature, data)
            return kid
        except InvalidSignature:
            continue
    raise InvalidSignature("no trusted key verifies this signature")
