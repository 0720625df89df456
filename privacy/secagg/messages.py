"""Wire format: one encode/decode pair per message type.

Every message starts with a 24-byte little-endian header::

    magic "SA" | version u8 | type u8 | run_id u64 | round_id u32 | client_id u64

``client_id`` is the sender of a client message and the recipient of a server
message. Bodies (all integers little-endian, ids u64, counts u32)::

    SETUP             n u32, k u32, t u32, bits u8, dim u64, seed 32B, n ids
    ADVERTISE_KEYS    c_pk 32B, s_pk 32B, commitment to b_u 32B
    PUBLIC_KEYS       m u32, m x (id, c_pk 32B, s_pk 32B)
    SHARE_KEYS        m u32, m x (receiver id, ciphertext 94B)
    FORWARDED_SHARES  m u32, m x (sender id, ciphertext 94B)
    MASKED_INPUT      word u8 (1|2|4|8), 3 zero bytes, f u32, dim u64, f failed-peer ids,
                      dim words (at an offset that is a multiple of 8: aligned)

A masked vector's words are the narrowest that hold values mod 2^bits
(:func:`wire_dtype`: one byte up to 8 bits, two up to 16, four up to 32, else eight),
so a smaller modulus makes a smaller upload.
    UNMASK_REQUEST    s u32, d u32, s survivor ids, d dropped ids
    UNMASK_RESPONSE   m u32, m x (peer id, kind u8 (0 self-mask, 1 mask key), share 33B)

The malicious mode (:mod:`privacy.secagg.malicious`) changes four bodies and adds two
messages (the semi-honest bodies above are unchanged)::

    SETUP             as above, then mode u8 (1: malicious)
    ADVERTISE_KEYS    as above, then identity 32B, signature 64B
    PUBLIC_KEYS       m u32, m x (id, c_pk, s_pk, commitment, identity, signature),
                      L u32, L x (id, advertisement digest 32B), ids increasing
    UNMASK_REQUEST    as above, then m u32, m x (signer's advertisement as in
                      PUBLIC_KEYS, consistency signature 64B)
    CONSISTENCY_CHECK       s u32, s survivor ids (increasing)
    CONSISTENCY_SIGNATURE   signature 64B[, f u32, f ids of failed-share senders]

SETUP's mode byte holds bits: 0x01 malicious, 0x10 the merged flow (absent: semi-honest,
classic flow: a SETUP means what it meant before the merged flow). The merged flow
(:data:`~privacy.secagg.params.MERGED`) adds three messages::

    SHARES_AND_INPUT   SHARE_KEYS body, zero bytes to a multiple of 8, MASKED_INPUT body
                       with f = 0 (the words aligned)
    SHARES_AND_CHECK   m u32, m x (sender id, ciphertext 94B), then a CONSISTENCY_CHECK body
    SHARES_AND_UNMASK  m u32, m x (sender id, ciphertext 94B), then an UNMASK_REQUEST body

and UNMASK_RESPONSE (like CONSISTENCY_SIGNATURE) may end with f u32, f ids: the senders
whose shares, received with the request, did not authenticate (sent only when f > 0).

Keys advertised a round ahead (:mod:`privacy.secagg.ahead`) add two SETUP mode bits, 0x20
(``keys_ahead``: the session's keys are those advertised with the previous round's last
reply) and 0x40 (``advertise_ahead``: the last reply advertises the next round's keys),
each only with the merged flow's bit, and two bundles of two whole messages::

    SETUP_AND_KEYS        u32 length of the SETUP message, SETUP, PUBLIC_KEYS (both for
                          this header's run, round and recipient)
    UNMASK_AND_ADVERTISE  u32 length of the UNMASK_RESPONSE, UNMASK_RESPONSE, then an
                          ADVERTISE_KEYS of the same run and sender for round + 1

A pre-signed survivor set (``SessionParams.presign``: malicious mode, keys advertised
ahead) adds SETUP mode bit 0x80 (only with 0x01 and 0x20) and one message::

    PRESIGNED_INPUT       consistency signature 64B (on the whole advertisement list as
                          the survivor set), then a SHARES_AND_INPUT body

A ciphertext is nonce 12B || AES-GCM(b-share 33B || sk-share 33B) || tag 16B.
Encoders return ``bytes``, except MASKED_INPUT: :func:`new_masked_input` gives a
``bytearray`` to write the vector into, and :func:`masked_input_head` the bytes before
the vector, for a client that writes its masked vector into its own buffer.
Decoders accept any contiguous bytes-like object.
Decoders check lengths exactly and raise :class:`ProtocolError` on anything
malformed (truncated, trailing bytes, wrong magic/version/type, bad counts,
duplicate ids, values out of range); nothing else escapes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from itertools import pairwise
from typing import TypeVar

import numpy as np

from privacy.secagg.errors import ProtocolError
from privacy.secagg.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES
from privacy.secagg.keys import KEY_BYTES, NONCE_BYTES, TAG_BYTES
from privacy.secagg.params import (
    CLASSIC,
    MALICIOUS,
    MAX_CLIENTS,
    MERGED,
    SEED_BYTES,
    SEMI_HONEST,
    SessionParams,
)
from privacy.secagg.shamir import PRIME, SHARE_BYTES
from privacy.secagg.stages import MsgType

MAGIC = b"SA"
VERSION = 1
HEADER = struct.Struct("<2sBBQIQ")
SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES
CIPHERTEXT_BYTES = NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES

_U32 = struct.Struct("<I")
_SETUP = struct.Struct(f"<IIIBQ{SEED_BYTES}s")
_KEYS = struct.Struct(f"<{KEY_BYTES}s{KEY_BYTES}s{KEY_BYTES}s")
_PEER_KEYS = struct.Struct(f"<Q{KEY_BYTES}s{KEY_BYTES}s")
_ADDRESSED_CT = struct.Struct(f"<Q{CIPHERTEXT_BYTES}s")
_REQUEST_COUNTS = struct.Struct("<II")
_VECTOR_HEAD = struct.Struct("<B3xIQ")  # word, padding, failed count, dim
_SHARE = struct.Struct(f"<QB{SHARE_BYTES}s")
_SIGNED = struct.Struct(f"<{PUBLIC_KEY_BYTES}s{SIGNATURE_BYTES}s")  # identity, signature
_SIGNED_PEER = struct.Struct(f"<Q{KEY_BYTES}s{KEY_BYTES}s{KEY_BYTES}s"
                             f"{PUBLIC_KEY_BYTES}s{SIGNATURE_BYTES}s")
_LIST_ENTRY = struct.Struct(f"<Q{KEY_BYTES}s")
_SIG = struct.Struct(f"<{SIGNATURE_BYTES}s")
_SIGNED_SET = struct.Struct(_SIGNED_PEER.format + f"{SIGNATURE_BYTES}s")  # + consistency sig.
_MODE_MALICIOUS = 1  # SETUP's optional mode byte: these bits; absent: semi-honest, classic
_MODE_MERGED = 0x10
_MODE_KEYS_AHEAD = 0x20
_MODE_ADVERTISE_AHEAD = 0x40
_MODES = {(False, False): 0, (True, False): _MODE_MALICIOUS,
          (False, True): _MODE_MERGED, (True, True): _MODE_MALICIOUS | _MODE_MERGED}
_MODE_PRESIGN = 0x80
_AHEAD_BITS = _MODE_KEYS_AHEAD | _MODE_ADVERTISE_AHEAD | _MODE_PRESIGN

T = TypeVar("T")


class ShareKind(IntEnum):
    """Which of a peer's two secrets a revealed share belongs to."""

    SELF_MASK = 0  # b_u, revealed for survivors
    MASK_KEY = 1  # s_u^SK, revealed for dropped clients


_SHARE_KINDS = {int(k): k for k in ShareKind}


@dataclass(frozen=True)
class Header:
    kind: MsgType
    run_id: int
    round_id: int
    client_id: int


@dataclass(frozen=True)
class AdvertiseKeys:
    c_pk: bytes
    s_pk: bytes
    b_commitment: bytes  # lets the server check a reconstructed self-mask seed
    identity: bytes = b""  # malicious mode: Ed25519 public key and its signature
    signature: bytes = b""


@dataclass(frozen=True)
class PeerKeys:
    client_id: int
    c_pk: bytes
    s_pk: bytes
    b_commitment: bytes = b""  # malicious mode: the whole signed advertisement
    identity: bytes = b""
    signature: bytes = b""


@dataclass(frozen=True)
class PublicKeys:
    entries: tuple[PeerKeys, ...]
    advertised: tuple[tuple[int, bytes], ...] = ()  # malicious: (id, digest) list


@dataclass(frozen=True)
class ConsistencyCheck:
    survivors: tuple[int, ...]


@dataclass(frozen=True)
class SignedSet:
    """A signer's advertisement and its consistency signature, forwarded to each survivor."""

    signer: PeerKeys
    signature: bytes


@dataclass(frozen=True)
class ShareKeys:
    """Ciphertexts addressed by the sender to each receiver."""

    shares: tuple[tuple[int, bytes], ...]


@dataclass(frozen=True)
class ForwardedShares:
    """Ciphertexts for one receiver, keyed by their sender."""

    shares: tuple[tuple[int, bytes], ...]


@dataclass(frozen=True, eq=False)
class MaskedInput:
    failed: tuple[int, ...]  # peers whose share ciphertext did not authenticate
    vector: np.ndarray


@dataclass(frozen=True)
class UnmaskRequest:
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: tuple[SignedSet, ...] = ()  # malicious mode


@dataclass(frozen=True)
class RevealedShare:
    peer: int
    kind: ShareKind
    share: bytes


@dataclass(frozen=True)
class UnmaskResponse:
    shares: tuple[RevealedShare, ...]
    failed: tuple[int, ...] = ()  # merged flow: senders whose shares did not authenticate


class _Reader:
    """Length-checked cursor over a message."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        if isinstance(data, bytes):
            self.data: bytes | memoryview = data
        elif isinstance(data, bytearray | memoryview):
            try:
                self.data = memoryview(data).cast("B").toreadonly()
            except TypeError:
                raise ProtocolError("message buffer is not contiguous") from None
        else:
            raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
        self.pos = 0

    def unpack(self, st: struct.Struct) -> tuple:
        if self.pos + st.size > len(self.data):
            raise ProtocolError("message truncated")
        out = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return out

    def count(self, entry_size: int) -> int:
        (m,) = self.unpack(_U32)
        if m > MAX_CLIENTS or m * entry_size > len(self.data) - self.pos:
            raise ProtocolError(f"count {m} does not fit the message length")
        return m

    def records(self, st: struct.Struct) -> list[tuple]:
        """A count, then that many fixed-size records, unpacked in one pass."""
        m = self.count(st.size)
        end = self.pos + m * st.size
        out = list(st.iter_unpack(self.data[self.pos : end]))
        self.pos = end
        return out

    def ids(self, m: int) -> tuple[int, ...]:
        out = self.unpack(struct.Struct(f"<{m}Q"))
        if len(set(out)) != m:
            raise ProtocolError("duplicate client id in message")
        return out

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{len(self.data) - self.pos} trailing bytes")


def _header_bytes(h: Header) -> bytes:
    return HEADER.pack(MAGIC, VERSION, h.kind, h.run_id, h.round_id, h.client_id)


def read_header(data: bytes | bytearray | memoryview) -> Header:
    """Parse and check only the header."""
    return _open(data, None)[0]


def _open(data: bytes | bytearray | memoryview, kind: MsgType | None) -> tuple[Header, _Reader]:
    r = _Reader(data)
    magic, version, raw_kind, run_id, round_id, client_id = r.unpack(HEADER)
    if magic != MAGIC:
        raise ProtocolError("not a secure-aggregation message (bad magic)")
    if version != VERSION:
        raise ProtocolError(f"unsupported message version {version}")
    try:
        msg_kind = MsgType(raw_kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {raw_kind}") from None
    if kind is not None and msg_kind != kind:
        raise ProtocolError(f"expected a {kind.name} message, got {msg_kind.name}")
    return Header(msg_kind, run_id, round_id, client_id), r


def _unique_peers(pairs: tuple[tuple[int, T], ...]) -> tuple[tuple[int, T], ...]:
    if len({p for p, _ in pairs}) != len(pairs):
        raise ProtocolError("duplicate client id in message")
    return pairs


# --- SETUP -----------------------------------------------------------------


def encode_setup(config: SessionParams, recipient: int) -> bytes:
    h = Header(MsgType.SETUP, config.run_id, config.round_id, recipient)
    body = _SETUP.pack(config.n, config.k, config.t, config.bits, config.dim, config.seed)
    bits = _MODES[(config.malicious, config.merged)]
    bits |= (_MODE_KEYS_AHEAD if config.keys_ahead else 0) | \
        (_MODE_ADVERTISE_AHEAD if config.advertise_ahead else 0) | \
        (_MODE_PRESIGN if config.presign else 0)
    mode = bytes([bits]) if bits else b""
    return _header_bytes(h) + body + struct.pack(f"<{config.n}Q", *config.participants) + mode


def decode_setup(data: bytes) -> tuple[Header, SessionParams]:
    h, r = _open(data, MsgType.SETUP)
    n, k, t, bits, dim, seed = r.unpack(_SETUP)
    if n > MAX_CLIENTS or len(r.data) - r.pos not in (8 * n, 8 * n + 1):
        raise ProtocolError(f"participant count {n} does not fit the message length")
    ids = r.unpack(struct.Struct(f"<{n}Q"))
    mode = 0
    if r.pos < len(r.data):
        (mode,) = r.unpack(struct.Struct("<B"))
        base = mode & ~_AHEAD_BITS
        if base not in _MODES.values() or not mode or (
                mode & _AHEAD_BITS and not base & _MODE_MERGED):
            raise ProtocolError(f"unknown security mode {mode}")
    r.end()
    security = MALICIOUS if mode & _MODE_MALICIOUS else SEMI_HONEST
    flow = MERGED if mode & _MODE_MERGED else CLASSIC
    try:
        config = SessionParams(ids, k, t, bits, dim, h.run_id, h.round_id, seed, security,
                               flow, bool(mode & _MODE_KEYS_AHEAD),
                               bool(mode & _MODE_ADVERTISE_AHEAD),
                               bool(mode & _MODE_PRESIGN))
    except ValueError as exc:
        raise ProtocolError(f"invalid configuration: {exc}") from None
    return h, config


# --- ADVERTISE_KEYS --------------------------------------------------------


def encode_advertise_keys(h: Header, m: AdvertiseKeys) -> bytes:
    signed = _SIGNED.pack(m.identity, m.signature) if m.identity else b""
    return _header_bytes(h) + _KEYS.pack(m.c_pk, m.s_pk, m.b_commitment) + signed


def decode_advertise_keys(data: bytes) -> tuple[Header, AdvertiseKeys]:
    """Either form: ``identity`` is b"" for an unsigned (semi-honest) advertisement."""
    h, r = _open(data, MsgType.ADVERTISE_KEYS)
    fields = r.unpack(_KEYS)
    signed = r.unpack(_SIGNED) if len(r.data) - r.pos == _SIGNED.size else ()
    r.end()
    return h, AdvertiseKeys(*fields, *signed)


# --- PUBLIC_KEYS -----------------------------------------------------------


def _pack_signed_peer(e: PeerKeys) -> bytes:
    return _SIGNED_PEER.pack(e.client_id, e.c_pk, e.s_pk, e.b_commitment, e.identity,
                             e.signature)


def encode_public_keys(h: Header, m: PublicKeys, *, signed: bool = False,
                       listed: bytes | None = None) -> bytes:
    """``listed``: :func:`encode_list` of ``m.advertised`` already made (the same for every
    recipient), used instead of encoding the list again."""
    parts = [_header_bytes(h), _U32.pack(len(m.entries))]
    if not signed:
        parts += [_PEER_KEYS.pack(e.client_id, e.c_pk, e.s_pk) for e in m.entries]
        return b"".join(parts)
    parts += [_pack_signed_peer(e) for e in m.entries]
    parts.append(encode_list(m.advertised) if listed is None else listed)
    return b"".join(parts)


def encode_list(advertised: tuple[tuple[int, bytes], ...]) -> bytes:
    """The advertisement list as PUBLIC_KEYS carries it (malicious mode)."""
    return _U32.pack(len(advertised)) + b"".join(_LIST_ENTRY.pack(c, d) for c, d in advertised)


def decode_public_keys(data: bytes, *, signed: bool = False) -> tuple[Header, PublicKeys]:
    """``signed``: the malicious mode's form, with whole advertisements and the list."""
    h, r = _open(data, MsgType.PUBLIC_KEYS)
    if not signed:
        entries = tuple(PeerKeys(*r.unpack(_PEER_KEYS))
                        for _ in range(r.count(_PEER_KEYS.size)))
        r.end()
        _unique_peers(tuple((e.client_id, e) for e in entries))
        return h, PublicKeys(entries)
    entries = tuple(PeerKeys(*e) for e in r.records(_SIGNED_PEER))
    listed = tuple(r.records(_LIST_ENTRY))
    r.end()
    _unique_peers(tuple((e.client_id, e) for e in entries))
    if any(a[0] >= b[0] for a, b in pairwise(listed)):
        raise ProtocolError("advertisement list ids are not increasing")
    return h, PublicKeys(entries, listed)


# --- SHARE_KEYS / FORWARDED_SHARES -----------------------------------------


def _encode_addressed(h: Header, shares: tuple[tuple[int, bytes], ...]) -> bytes:
    for _, ct in shares:
        if len(ct) != CIPHERTEXT_BYTES:
            raise ValueError(f"a ciphertext must be {CIPHERTEXT_BYTES} bytes")
    parts = [_header_bytes(h), _U32.pack(len(shares))]
    parts += [_ADDRESSED_CT.pack(cid, ct) for cid, ct in shares]
    return b"".join(parts)


def _decode_addressed(data: bytes, kind: MsgType) -> tuple[Header, tuple[tuple[int, bytes], ...]]:
    h, r = _open(data, kind)
    shares = tuple(r.unpack(_ADDRESSED_CT) for _ in range(r.count(_ADDRESSED_CT.size)))
    r.end()
    return h, _unique_peers(shares)


def encode_share_keys(h: Header, m: ShareKeys) -> bytes:
    return _encode_addressed(h, m.shares)


def decode_share_keys(data: bytes) -> tuple[Header, ShareKeys]:
    h, shares = _decode_addressed(data, MsgType.SHARE_KEYS)
    return h, ShareKeys(shares)


def encode_forwarded_shares(h: Header, m: ForwardedShares) -> bytes:
    return _encode_addressed(h, m.shares)


def decode_forwarded_shares(data: bytes) -> tuple[Header, ForwardedShares]:
    h, shares = _decode_addressed(data, MsgType.FORWARDED_SHARES)
    return h, ForwardedShares(shares)


# --- the merged flow: SHARES_AND_INPUT, SHARES_AND_CHECK, SHARES_AND_UNMASK --------


def shares_and_input_head(h: Header, m: ShareKeys, dim: int, dtype: np.dtype,
                          signature: bytes = b"") -> bytes:
    """Everything of a SHARES_AND_INPUT message before its ``dim`` words: the SHARE_KEYS
    body, zero bytes up to a multiple of 8, then a MASKED_INPUT body's head (no failed
    peers), so the words are aligned. With ``signature`` (a pre-signed round) the message
    is a PRESIGNED_INPUT: the consistency signature first, then the same body."""
    shares = _encode_addressed(h, m.shares)
    if signature:
        if len(signature) != SIGNATURE_BYTES:
            raise ValueError(f"a consistency signature is {SIGNATURE_BYTES} bytes")
        kind = Header(MsgType.PRESIGNED_INPUT, h.run_id, h.round_id, h.client_id)
        shares = _header_bytes(kind) + _SIG.pack(signature) + shares[HEADER.size :]
    pad = -len(shares) % 8
    tail = masked_input_head(h, (), dim, dtype)[HEADER.size :]
    return shares + bytes(pad) + tail


def decode_shares_and_input(data: bytes) -> tuple[Header, ShareKeys, MaskedInput]:
    """A SHARES_AND_INPUT message; the vector is a read-only zero-copy view, as in
    :func:`decode_masked_input`."""
    h, shares, masked, _ = _decode_shares_and_input(data, MsgType.SHARES_AND_INPUT)
    return h, shares, masked


def decode_presigned_input(data: bytes) -> tuple[Header, ShareKeys, MaskedInput, bytes]:
    """A PRESIGNED_INPUT message: as :func:`decode_shares_and_input`, and the consistency
    signature it carries."""
    return _decode_shares_and_input(data, MsgType.PRESIGNED_INPUT)


def _decode_shares_and_input(data: bytes, kind: MsgType
                             ) -> tuple[Header, ShareKeys, MaskedInput, bytes]:
    h, r = _open(data, kind)
    signature = r.unpack(_SIG)[0] if kind is MsgType.PRESIGNED_INPUT else b""
    shares = _unique_peers(tuple(r.unpack(_ADDRESSED_CT)
                                 for _ in range(r.count(_ADDRESSED_CT.size))))
    pad = -r.pos % 8
    if any(r.data[r.pos : r.pos + pad]):
        raise ProtocolError("nonzero padding bytes")
    r.pos += pad
    if r.pos + _VECTOR_HEAD.size <= len(r.data) and any(r.data[r.pos + 1 : r.pos + 4]):
        raise ProtocolError("nonzero padding bytes")
    word, nfailed, dim = r.unpack(_VECTOR_HEAD)
    if word not in WORD_SIZES:
        raise ProtocolError(f"word size must be 1, 2, 4 or 8 bytes, got {word}")
    if nfailed:
        raise ProtocolError("a masked input sent with the shares reports no failed peers")
    if dim * word != len(r.data) - r.pos:
        raise ProtocolError(f"{dim} words do not fit the message length")
    vec = np.frombuffer(r.data, dtype=f"<u{word}", count=dim, offset=r.pos)
    return h, ShareKeys(shares), MaskedInput((), vec), signature


_WITH_SHARES = {MsgType.CONSISTENCY_CHECK: MsgType.SHARES_AND_CHECK,
                MsgType.UNMASK_REQUEST: MsgType.SHARES_AND_UNMASK}
_WITHOUT_SHARES = {v: k for k, v in _WITH_SHARES.items()}


def with_shares(message: bytes, m: ForwardedShares) -> bytes:
    """A CONSISTENCY_CHECK or UNMASK_REQUEST message with the recipient's forwarded shares
    in front of its body: SHARES_AND_CHECK or SHARES_AND_UNMASK (merged flow)."""
    h = read_header(message)
    if h.kind not in _WITH_SHARES:
        raise ValueError(f"shares do not travel with a {h.kind.name} message")
    block = _encode_addressed(h, m.shares)[HEADER.size :]
    kind = _WITH_SHARES[h.kind]
    return _header_bytes(Header(kind, h.run_id, h.round_id, h.client_id)) + block + \
        bytes(message[HEADER.size :])


def split_shares(data: bytes) -> tuple[Header, ForwardedShares, bytes]:
    """:func:`with_shares` undone: (header, the forwarded shares, the message without
    them, a CONSISTENCY_CHECK or UNMASK_REQUEST to decode as such)."""
    h, r = _open(data, None)
    if h.kind not in _WITHOUT_SHARES:
        raise ProtocolError(f"a {h.kind.name} message carries no forwarded shares")
    shares = _unique_peers(tuple(r.unpack(_ADDRESSED_CT)
                                 for _ in range(r.count(_ADDRESSED_CT.size))))
    base = Header(_WITHOUT_SHARES[h.kind], h.run_id, h.round_id, h.client_id)
    return h, ForwardedShares(shares), _header_bytes(base) + bytes(r.data[r.pos :])


def _encode_failed(failed: tuple[int, ...]) -> bytes:
    """An optional trailing list of failed-share senders: absent when empty."""
    if not failed:
        return b""
    return _U32.pack(len(failed)) + struct.pack(f"<{len(failed)}Q", *failed)


def _decode_failed(r: _Reader) -> tuple[int, ...]:
    """:func:`_encode_failed` undone at the reader's end: () when nothing is left."""
    if r.pos == len(r.data):
        return ()
    failed = r.ids(r.count(8))
    if not failed:
        raise ProtocolError("an empty failed-share list is sent as none")
    return failed


# --- keys advertised ahead: SETUP_AND_KEYS, UNMASK_AND_ADVERTISE -----------------

#: Each bundle: the two message types it carries, and by how much the second's round
#: exceeds the bundle's.
_BUNDLES = {MsgType.SETUP_AND_KEYS: (MsgType.SETUP, MsgType.PUBLIC_KEYS, 0),
            MsgType.UNMASK_AND_ADVERTISE: (MsgType.UNMASK_RESPONSE, MsgType.ADVERTISE_KEYS, 1)}


def bundle(kind: MsgType, first: bytes, second: bytes) -> bytes:
    """Two whole messages in one (SETUP_AND_KEYS or UNMASK_AND_ADVERTISE), under the first
    one's run, round and client."""
    h = read_header(first)
    return _header_bytes(Header(kind, h.run_id, h.round_id, h.client_id)) + \
        _U32.pack(len(first)) + bytes(first) + bytes(second)


def unbundle(data: bytes) -> tuple[Header, bytes, bytes]:
    """:func:`bundle` undone: (header, first message, second message), each checked for its
    type and for the bundle's run, client and round (the next round for the advertisement
    of UNMASK_AND_ADVERTISE); their bodies are left to their own decoders."""
    h, r = _open(data, None)
    if h.kind not in _BUNDLES:
        raise ProtocolError(f"a {h.kind.name} message bundles no other")
    (size,) = r.unpack(_U32)
    if size > len(r.data) - r.pos:
        raise ProtocolError("bundled message length does not fit the message")
    first = bytes(r.data[r.pos : r.pos + size])
    second = bytes(r.data[r.pos + size :])
    first_kind, second_kind, step = _BUNDLES[h.kind]
    for part, kind, rnd in ((first, first_kind, h.round_id), (second, second_kind,
                                                               h.round_id + step)):
        inner = _open(part, kind)[0]
        if (inner.run_id, inner.round_id, inner.client_id) != (h.run_id, rnd, h.client_id):
            raise ProtocolError(f"a bundled {kind.name} of run {inner.run_id} round "
                                f"{inner.round_id} client {inner.client_id}, expected run "
                                f"{h.run_id} round {rnd} client {h.client_id}")
    return h, first, second


# --- MASKED_INPUT ----------------------------------------------------------


WORD_SIZES = (1, 2, 4, 8)  # bytes per masked word on the wire


def wire_dtype(bits: int) -> np.dtype:
    """The narrowest little-endian unsigned word holding values mod 2^bits (1 <= bits <= 64):
    uint8, uint16, uint32 or uint64, the words of a MASKED_INPUT vector."""
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    return np.dtype(f"<u{next(w for w in WORD_SIZES if bits <= 8 * w)}")


def masked_input_head(h: Header, failed: tuple[int, ...], dim: int, dtype: np.dtype) -> bytes:
    """Everything of a MASKED_INPUT message before its ``dim`` words."""
    word = np.dtype(dtype).itemsize
    if word not in WORD_SIZES:
        raise ValueError(f"masked vector words must be {WORD_SIZES} bytes, got {word}")
    return b"".join(
        [
            _header_bytes(h),
            _VECTOR_HEAD.pack(word, len(failed), dim),
            struct.pack(f"<{len(failed)}Q", *failed),
        ]
    )


def new_masked_input(
    h: Header, failed: tuple[int, ...], dim: int, dtype: np.dtype
) -> tuple[bytearray, np.ndarray]:
    """A MASKED_INPUT message with its vector left to fill: (message, writable view)."""
    word = np.dtype(dtype).itemsize
    head = masked_input_head(h, failed, dim, dtype)
    buf = bytearray(len(head) + dim * word)
    buf[: len(head)] = head
    return buf, np.frombuffer(buf, dtype=f"<u{word}", count=dim, offset=len(head))


def encode_masked_input(h: Header, m: MaskedInput) -> bytearray:
    vec = m.vector
    if vec.ndim != 1 or vec.dtype.kind != "u":
        raise ValueError("masked vector must be a 1-D unsigned integer array")
    buf, view = new_masked_input(h, m.failed, vec.size, vec.dtype)
    view[:] = vec
    return buf


def decode_masked_input(data: bytes) -> tuple[Header, MaskedInput]:
    """The vector is a read-only zero-copy view of the message buffer: keep it unchanged."""
    h, r = _open(data, MsgType.MASKED_INPUT)
    if r.pos + _VECTOR_HEAD.size <= len(r.data) and any(r.data[r.pos + 1 : r.pos + 4]):
        raise ProtocolError("nonzero padding bytes")
    word, nfailed, dim = r.unpack(_VECTOR_HEAD)
    if word not in WORD_SIZES:
        raise ProtocolError(f"word size must be 1, 2, 4 or 8 bytes, got {word}")
    if nfailed > MAX_CLIENTS or 8 * nfailed + dim * word != len(r.data) - r.pos:
        raise ProtocolError(f"{nfailed} ids and {dim} words do not fit the message length")
    failed = r.ids(nfailed)
    vec = np.frombuffer(r.data, dtype=f"<u{word}", count=dim, offset=r.pos)
    return h, MaskedInput(failed, vec)


# --- UNMASK_REQUEST --------------------------------------------------------


def encode_unmask_request(h: Header, m: UnmaskRequest, *, signed: bool = False,
                          block: bytes | None = None) -> bytes:
    """``block``: :func:`encode_signed_sets` of ``m.signatures`` already made (the same for
    every survivor), used instead of encoding them again."""
    s, d = len(m.survivors), len(m.dropped)
    ids = struct.pack(f"<{s + d}Q", *m.survivors, *m.dropped)
    out = _header_bytes(h) + _REQUEST_COUNTS.pack(s, d) + ids
    if signed:
        out += encode_signed_sets(m.signatures) if block is None else block
    return out


def encode_signed_sets(signatures: tuple[SignedSet, ...]) -> bytes:
    """The signature block of a malicious-mode UNMASK_REQUEST (the same for every survivor)."""
    parts = [_U32.pack(len(signatures))]
    parts += [_pack_signed_peer(x.signer) + x.signature for x in signatures]
    return b"".join(parts)


def decode_unmask_request(data: bytes, *, signed: bool = False) -> tuple[Header, UnmaskRequest]:
    h, m, block = decode_unmask_head(data, signed=signed)
    if signed:
        m = UnmaskRequest(m.survivors, m.dropped, decode_signed_sets(block))
    return h, m


def decode_unmask_head(data: bytes, *, signed: bool = False
                       ) -> tuple[Header, UnmaskRequest, bytes]:
    """An UNMASK_REQUEST without decoding its signature block (malicious mode): the request
    with no signatures, and the block's bytes (b"" unless ``signed``), checked only for its
    length; :func:`decode_signed_sets` decodes them."""
    h, r = _open(data, MsgType.UNMASK_REQUEST)
    s, d = r.unpack(_REQUEST_COUNTS)
    rest = len(r.data) - r.pos
    if s > MAX_CLIENTS or d > MAX_CLIENTS or (8 * (s + d) > rest if signed else
                                              8 * (s + d) != rest):
        raise ProtocolError("survivor/dropped counts do not fit the message length")
    survivors = r.ids(s)
    dropped = r.ids(d)
    block = b""
    if signed:
        start = r.pos
        count = r.count(_SIGNED_SET.size)
        r.pos += count * _SIGNED_SET.size
        block = bytes(r.data[start : r.pos])
    r.end()
    return h, UnmaskRequest(survivors, dropped), block


def decode_signed_sets(block: bytes) -> tuple[SignedSet, ...]:
    """:func:`encode_signed_sets` undone; ProtocolError if malformed or a signer repeats."""
    r = _Reader(block)
    sets = tuple(SignedSet(PeerKeys(*e[:6]), e[6]) for e in r.records(_SIGNED_SET))
    r.end()
    _unique_peers(tuple((x.signer.client_id, x) for x in sets))
    return sets


# --- CONSISTENCY_CHECK / CONSISTENCY_SIGNATURE (malicious mode) --------------


def encode_consistency_check(h: Header, m: ConsistencyCheck, *,
                             body: bytes | None = None) -> bytes:
    """``body``: :func:`consistency_check_body` of ``m`` already made (the same for every
    survivor)."""
    return _header_bytes(h) + (consistency_check_body(m) if body is None else body)


def consistency_check_body(m: ConsistencyCheck) -> bytes:
    s = len(m.survivors)
    return _U32.pack(s) + struct.pack(f"<{s}Q", *m.survivors)


def decode_consistency_check(data: bytes) -> tuple[Header, ConsistencyCheck]:
    h, r = _open(data, MsgType.CONSISTENCY_CHECK)
    survivors = r.ids(r.count(8))
    r.end()
    if any(a >= b for a, b in pairwise(survivors)):
        raise ProtocolError("survivor ids are not increasing")
    return h, ConsistencyCheck(survivors)


def encode_consistency_signature(h: Header, signature: bytes,
                                 failed: tuple[int, ...] = ()) -> bytes:
    """``failed`` (merged flow): the senders whose forwarded shares did not authenticate,
    a trailing list (f u32, f ids) sent only when not empty."""
    return _header_bytes(h) + _SIG.pack(signature) + _encode_failed(failed)


def decode_consistency_signature(data: bytes) -> tuple[Header, bytes]:
    h, signature, _ = decode_consistency_reply(data)
    return h, signature


def decode_consistency_reply(data: bytes) -> tuple[Header, bytes, tuple[int, ...]]:
    """A CONSISTENCY_SIGNATURE with its failed-share senders (() when none)."""
    h, r = _open(data, MsgType.CONSISTENCY_SIGNATURE)
    (signature,) = r.unpack(_SIG)
    failed = _decode_failed(r)
    r.end()
    return h, signature, failed


# --- UNMASK_RESPONSE -------------------------------------------------------


def encode_unmask_response(h: Header, m: UnmaskResponse) -> bytes:
    parts = [_header_bytes(h), _U32.pack(len(m.shares))]
    parts += [_SHARE.pack(s.peer, s.kind, s.share) for s in m.shares]
    parts.append(_encode_failed(m.failed))
    return b"".join(parts)


def decode_unmask_response(data: bytes) -> tuple[Header, UnmaskResponse]:
    h, r = _open(data, MsgType.UNMASK_RESPONSE)
    count = r.count(_SHARE.size)
    end = r.pos + count * _SHARE.size
    out = []
    seen = set()
    for peer, raw_kind, share in _SHARE.iter_unpack(r.data[r.pos : end]):
        kind = _SHARE_KINDS.get(raw_kind)
        if kind is None:
            raise ProtocolError(f"unknown share kind {raw_kind}")
        if (peer, kind) in seen:
            raise ProtocolError(f"duplicate {kind.name} share of client {peer}")
        if share[-1] and int.from_bytes(share, "little") >= PRIME:  # top byte 0: < 2^256
            raise ProtocolError("share value outside the field")
        seen.add((peer, kind))
        out.append(RevealedShare(peer, kind, share))
    r.pos = end
    failed = _decode_failed(r)
    r.end()
    return h, UnmaskResponse(tuple(out), failed)


DECODERS = {
    MsgType.SETUP: decode_setup,
    MsgType.ADVERTISE_KEYS: decode_advertise_keys,
    MsgType.PUBLIC_KEYS: decode_public_keys,
    MsgType.SHARE_KEYS: decode_share_keys,
    MsgType.FORWARDED_SHARES: decode_forwarded_shares,
    MsgType.MASKED_INPUT: decode_masked_input,
    MsgType.UNMASK_REQUEST: decode_unmask_request,
    MsgType.UNMASK_RESPONSE: decode_unmask_response,
    MsgType.CONSISTENCY_CHECK: decode_consistency_check,
    MsgType.CONSISTENCY_SIGNATURE: decode_consistency_signature,
    MsgType.SHARES_AND_INPUT: decode_shares_and_input,
    MsgType.PRESIGNED_INPUT: decode_presigned_input,
    MsgType.SHARES_AND_CHECK: split_shares,
    MsgType.SHARES_AND_UNMASK: split_shares,
    MsgType.SETUP_AND_KEYS: unbundle,
    MsgType.UNMASK_AND_ADVERTISE: unbundle,
}


def decode(data: bytes) -> tuple[Header, object]:
    """Decode any message by its type byte."""
    return DECODERS[read_header(data).kind](data)
