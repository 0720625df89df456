"""Long-term identities for SecAgg+ against a server that lies: Ed25519 keys and a trust set.

Each client holds an Ed25519 identity key (:class:`Identity`) and trusts a set of peers'
public keys given out of band (:class:`TrustedKeys`: the file the operator distributes,
or a PKI generated for a simulated run). A key advertisement and a consistency-check
answer are signed with the identity key over a domain-separated, length-prefixed
encoding of what they bind (:func:`signed_bytes`), so that a signature made for one run,
round, stage or purpose verifies for no other. Public keys travel as their 32 raw bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
DOMAIN = b"fedring-secagg/v1/"
_MAX_PARSED = 1 << 14  # every node of a large simulation, and their trusted set
# Parsed identity keys and trusted sets by their exact text: a node reads its node config
# on every message of a round, and the nodes of a simulation share one trusted set.
_PARSED: dict[tuple[type, bytes | str], object] = {}


def _memo(key: tuple[type, bytes | str], value: object) -> None:
    while _PARSED and len(_PARSED) >= _MAX_PARSED:  # the oldest first
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[key] = value


def signed_bytes(purpose: str, *parts: bytes | int) -> bytes:
    """The bytes a signature covers: the domain and ``purpose``, then each part
    length-prefixed (integers as 8-byte little-endian), so no two inputs collide."""
    out = [DOMAIN, purpose.encode(), b"\x00"]
    for part in parts:
        blob = struct.pack("<Q", part) if isinstance(part, int) else bytes(part)
        out.append(struct.pack("<I", len(blob)))
        out.append(blob)
    return b"".join(out)


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class Identity:
    """A client's long-term signing key."""

    key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @cached_property
    def public(self) -> bytes:
        """The 32-byte raw public key peers trust (derived once: a node asks on every
        message)."""
        return raw_public(self.key.public_key())

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)

    def to_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    @classmethod
    def from_pem(cls, data: bytes, *, source: str = "identity key") -> Identity:
        """ValueError naming ``source`` unless ``data`` is an unencrypted PEM Ed25519 key."""
        memo = (cls, bytes(data)) if isinstance(data, bytes | bytearray | memoryview) else None
        found = _PARSED.get(memo) if memo is not None else None
        if isinstance(found, cls):
            return found
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{source}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{source}: an Ed25519 key is needed, got {type(key).__name__}")
        identity = cls(key)
        if memo is not None:
            _memo(memo, identity)
        return identity


class TrustedKeys:
    """The identities a client accepts: a set of 32-byte Ed25519 public keys."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = frozenset(bytes(k) for k in keys)
        bad = [k for k in self.keys if len(k) != PUBLIC_KEY_BYTES]
        if bad:
            raise ValueError(f"a trusted key must be {PUBLIC_KEY_BYTES} raw bytes")

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def verify(self, public: bytes, signature: bytes, message: bytes) -> bool:
        """True when ``public`` is trusted and ``signature`` is its signature of ``message``."""
        if bytes(public) not in self.keys or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(bytes(public)).verify(bytes(signature), message)
        except InvalidSignature:
            return False
        return True

    def to_text(self) -> str:
        """One hex public key per line (the trusted-keys file)."""
        return "".join(f"{k.hex()}\n" for k in sorted(self.keys))

    @classmethod
    def from_text(cls, text: str, *, source: str = "trusted keys") -> TrustedKeys:
        """One hex public key per line; blank lines and ``#`` comments are skipped."""
        found = _PARSED.get((cls, text)) if isinstance(text, str) else None
        if isinstance(found, cls):
            return found
        keys = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                key = bytes.fromhex(line)
            except ValueError:
                key = b""
            if len(key) != PUBLIC_KEY_BYTES:
                raise ValueError(f"{source}, line {number}: not a {PUBLIC_KEY_BYTES}-byte "
                                 f"hex Ed25519 public key")
            keys.append(key)
        if not keys:
            raise ValueError(f"{source}: no trusted key")
        trusted = cls(keys)
        if isinstance(text, str):
            _memo((cls, text), trusted)
        return trusted

    @classmethod
    def read(cls, path: str | Path) -> TrustedKeys:
        return cls.from_text(Path(path).read_text(), source=str(path))
