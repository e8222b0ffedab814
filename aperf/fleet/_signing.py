"""End-to-end authenticity: a host signs its messages, readers check them with its key.

Optional (``JetStreamSink(signing_key=...)``, ``FleetReader(host_keys=...)``). Without
keys the NATS subject permission is the only authentication (docs/fleet.md). With
them, a sink signs each message: Ed25519 over a SHA-512 digest of a fixed label, the
subject, the ``Aperf-Boot-Offset-Ns`` header's value and the payload, sent in the
``Aperf-Signature`` header (base64); a reader given the hosts' public keys refuses
whatever is unsigned, signed by another key, or from a host it has no key for.

Keys are those of ``cryptography`` (imported only when keys are used). A signing
key is read from a PEM (PKCS#8) or OpenSSH private key file that only its owner may
read; public keys from a hosts file of ``<host> ssh-ed25519 <base64> [comment]``
lines (``python -m aperf.fleet keygen`` writes a key and prints its line).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union, cast

from ._args import name_problem
from ._errors import FleetConfigError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

SIGNATURE_HEADER = "Aperf-Signature"
_LABEL = b"aperf.fleet signature 1\n"
SIGNATURE_BYTES = 64
KeyPath = Union[str, "os.PathLike[str]"]


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "signing keys need the cryptography package: pip install 'aperf-bpf[nats]'"
        ) from None
    return ed25519


def digest(subject: str, offset: str | None, payload: bytes) -> bytes:
    """What is signed: the label, then a SHA-512 of the subject, the boot offset header
    (empty if none) and the payload, each length-prefixed (no copy of the payload)."""
    h = hashlib.sha512()
    for part in (subject.encode("utf-8"), (offset or "").encode("ascii", "replace")):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(payload)
    return _LABEL + h.digest()


def sign(key: Ed25519PrivateKey, subject: str, offset: str | None, payload: bytes) -> str:
    """The ``Aperf-Signature`` header's value for a message."""
    return base64.b64encode(key.sign(digest(subject, offset, payload))).decode("ascii")


def verify(key: Ed25519PublicKey, value: str | None, subject: str, offset: str | None,
           payload: bytes) -> str:
    """Why the message's signature does not hold ("" if it does)."""
    if value is None:
        return "it is not signed"
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeError, ValueError):
        return "its signature is not base64"
    if len(raw) != SIGNATURE_BYTES:
        return f"its signature is {len(raw)} bytes, not {SIGNATURE_BYTES}"
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(raw, digest(subject, offset, payload))
    except InvalidSignature:
        return "its signature does not verify with the host's key"
    return ""


def load_signing_key(value: object) -> Ed25519PrivateKey:
    """``signing_key=``: an ``Ed25519PrivateKey``, or the path of a PEM (PKCS#8) or
    OpenSSH private key file that neither group nor others may read."""
    ed25519 = _ed25519()
    if isinstance(value, ed25519.Ed25519PrivateKey):
        return cast("Ed25519PrivateKey", value)
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"signing_key must be an Ed25519PrivateKey or a path, not "
                        f"{type(value).__name__}")
    path = os.fspath(value)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise FleetConfigError("signing_key", f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise FleetConfigError("signing_key", f"{path} is not a regular file")
        if info.st_mode & 0o077:
            raise FleetConfigError(
                "signing_key", f"{path} may be read by others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}): chmod 600 it, as ssh asks of its keys"
            )
        data = file.read(1 << 16)
    from cryptography.hazmat.primitives import serialization

    key: Any = None
    for load in (serialization.load_pem_private_key, serialization.load_ssh_private_key):
        try:
            key = load(data, password=None)
            break
        except (ValueError, TypeError):
            continue
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise FleetConfigError("signing_key", f"{path} holds no unencrypted Ed25519 private "
                               "key (PEM or OpenSSH)")
    return cast("Ed25519PrivateKey", key)


def public_line(host: str, key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The hosts file line of ``host``'s key."""
    from cryptography.hazmat.primitives import serialization

    public = key.public_key() if hasattr(key, "public_key") else key
    text = public.public_bytes(serialization.Encoding.OpenSSH,
                               serialization.PublicFormat.OpenSSH).decode("ascii")
    return f"{host} {text}"


def load_host_keys(value: object) -> dict[str, Ed25519PublicKey]:
    """``host_keys=``: a mapping of host names to ``Ed25519PublicKey`` (or their 32 raw
    bytes), or the path of a hosts file (``<host> ssh-ed25519 <base64> [comment]``
    lines; blank lines and ``#`` comments skipped)."""
    ed25519 = _ed25519()
    keys: dict[str, Any] = {}
    if isinstance(value, Mapping):
        for host, key in value.items():
            _check_host(host, "host_keys")
            if isinstance(key, (bytes, bytearray)) and len(key) == 32:
                key = ed25519.Ed25519PublicKey.from_public_bytes(bytes(key))
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise TypeError(f"host_keys[{host!r}] must be an Ed25519PublicKey or its 32 "
                                f"bytes, not {type(key).__name__}")
            keys[host] = key
        return keys
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"host_keys must be a mapping or a path, not {type(value).__name__}")
    path = os.fspath(value)
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read(1 << 24).splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise FleetConfigError("host_keys", f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"{path}:{number}"
        if len(fields) < 3:
            raise FleetConfigError("host_keys", f"{where}: expected '<host> ssh-ed25519 "
                                   "<base64>'")
        host = _check_host(fields[0], "host_keys", where)
        try:
            key = serialization.load_ssh_public_key(" ".join(fields[1:3]).encode("ascii"))
        except (ValueError, UnicodeError, UnsupportedAlgorithm):
            key = None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise FleetConfigError("host_keys", f"{where}: not an ssh-ed25519 public key")
        if host in keys:
            raise FleetConfigError("host_keys", f"{where}: a second key for {host!r}")
        keys[host] = key
    return keys


def _check_host(host: object, argument: str, where: str = "") -> str:
    if not isinstance(host, str) or name_problem(host):
        problem = name_problem(host) if isinstance(host, str) else "is not a str"
        raise FleetConfigError(argument, f"{where + ': ' if where else ''}the host name "
                               f"{host!r} {problem}")
    return host


def new_key() -> Ed25519PrivateKey:
    key: Ed25519PrivateKey = _ed25519().Ed25519PrivateKey.generate()
    return key


def write_key(key: Ed25519PrivateKey, path: str) -> None:
    """Write ``key`` (PEM, PKCS#8) to a new file ``path`` only its owner may read."""
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
