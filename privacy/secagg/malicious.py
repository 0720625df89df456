"""The malicious-server mode's derivations, computed alike by the server and every client.

In ``security = "malicious"`` (:class:`~privacy.secagg.params.SessionParams`) a round adds
to SecAgg+ (after Bonawitz et al., CCS 2017, active variant; Bell et al., CCS 2020):

- signed key advertisements: each ADVERTISE_KEYS carries the client's Ed25519 identity
  and its signature over (run, round, stage, node id, both X25519 keys, the self-mask
  commitment, the identity) (:func:`advert_message`); a client refuses a peer's
  advertisement whose signature fails, whose identity is not trusted or already used by
  another node, or that is bound to another run, round or stage;
- the advertisement list: (node id, :func:`advert_digest`) of every stage-1 survivor,
  sent to every client in PUBLIC_KEYS. The graph seed is derived from it
  (:func:`derive_seed`), not chosen by the server; every client recomputes the graph and
  the t-core of the list (:func:`threshold_core`) and refuses other neighbours. Share
  ciphertexts bind the list's digest, so only clients with the same list decrypt them;
- a consistency check before unmasking: each survivor signs (run, round, the survivor
  set S, the list's digest) (:func:`consistency_message`) and answers an unmask request
  only with :func:`quorum` valid signatures on its own S from distinct trusted members of
  S, and only for the kinds of share S implies.

What a server colluding with corrupt clients can still do: choose which advertisements
enter the list (and have corrupt clients make fresh ones), so it can try many graphs and
keep one where a target has t corrupt neighbours. Each try succeeds with probability at
most n * P[Bin(k, gamma) >= t] <= 2^-security_bits (:mod:`privacy.secagg.params`), so
2^w tries lower the bound to 2^(w - security_bits). The quorum holds while at most
ceil(gamma * L) of the L listed identities are corrupt: two quorums on different sets then
share an honest signer, who signs one set per round, so all honest clients that unmask
agree on S and none reveals both shares of a peer; a server with more corrupt identities
can split the honest clients into two groups that each reach a quorum. Identities are not
bound to node ids (the trusted set is a set of keys), so a corrupt identity may stand for
any node id, once per client's view.
"""

from __future__ import annotations

import hashlib
import math
import struct
from bisect import bisect_left
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from privacy.secagg.graph import neighbour_array, node_neighbours
from privacy.secagg.identity import TrustedKeys, signed_bytes
from privacy.secagg.stages import Stage

DIGEST_BYTES = 32
_ENTRY = struct.Struct(f"<Q{DIGEST_BYTES}s")
_VERIFIED: dict[tuple[bytes, bytes, bytes], None] = {}  # signatures found valid
_MAX_VERIFIED = 1 << 14
_SIGNERS: dict[tuple[object, ...], int] = {}  # signature blocks found valid: their signers
_MAX_SIGNERS = 64


def forget() -> None:
    """Empty the memos of valid signatures and signature blocks (what a client in a
    process of its own starts with)."""
    _VERIFIED.clear()
    _SIGNERS.clear()


def remembered_signers(key: tuple[object, ...]) -> int | None:
    """The count :func:`remember_signers` stored for exactly ``key``, if any."""
    return _SIGNERS.get(key)


def remember_signers(key: tuple[object, ...], count: int) -> None:
    """Remember that an unmask request's signature block passed every check a client
    makes of it, with ``count`` distinct valid signers. ``key`` must hold every input of
    those checks (the block's exact bytes, the signed message, the advertisement list,
    the trusted keys): the clients of a round in one process get the same block, so the
    first one checks it and the others find its result, as with :func:`verify`."""
    if len(_SIGNERS) >= _MAX_SIGNERS:
        _SIGNERS.pop(next(iter(_SIGNERS)), None)
    _SIGNERS[key] = count


def verify(trusted: TrustedKeys, public: bytes, signature: bytes, message: bytes) -> bool:
    """:meth:`TrustedKeys.verify`, remembering the last few thousand valid signatures: the
    clients and the server of a round in one process (a simulation) check the same ones
    (a pure function of the exact key, message and signature). Only a valid
    signature is remembered, and trust is checked on every call."""
    if public not in trusted:
        return False
    key = (bytes(public), bytes(signature), bytes(message))
    if key in _VERIFIED:
        return True
    if not trusted.verify(public, signature, message):
        return False
    if len(_VERIFIED) >= _MAX_VERIFIED:
        _VERIFIED.pop(next(iter(_VERIFIED)), None)
    _VERIFIED[key] = None
    return True


_ADVERT_HEAD = signed_bytes("advertise")
_ADVERT_KEY = 32
# signed_bytes("advertise", 4 integers, 4 keys of 32 bytes) in one pack: the same bytes
_ADVERT = struct.Struct("<" + "IQ" * 4 + f"I{_ADVERT_KEY}s" * 4)


def advert_message(run_id: int, round_id: int, node: int, c_pk: bytes, s_pk: bytes,
                   commitment: bytes, identity: bytes) -> bytes:
    """What a key advertisement's signature covers."""
    n = _ADVERT_KEY
    if not len(c_pk) == len(s_pk) == len(commitment) == len(identity) == n:
        return signed_bytes("advertise", run_id, round_id, int(Stage.ADVERTISE_KEYS), node,
                            c_pk, s_pk, commitment, identity)
    return _ADVERT_HEAD + _ADVERT.pack(8, run_id, 8, round_id, 8, int(Stage.ADVERTISE_KEYS),
                                       8, node, n, bytes(c_pk), n, bytes(s_pk), n,
                                       bytes(commitment), n, bytes(identity))


def advert_digest(message: bytes, signature: bytes) -> bytes:
    """The 32-byte digest of a signed advertisement (its list entry)."""
    return hashlib.sha256(b"fedring-secagg/v1/advert-digest\x00" + message + signature).digest()


def list_digest(run_id: int, round_id: int, entries: Sequence[tuple[int, bytes]]) -> bytes:
    """The digest of the advertisement list (ids increasing); memoized for a tuple of
    entries (a client's list, restored with its session on each message)."""
    try:
        return _list_digest(run_id, round_id, entries)
    except TypeError:  # unhashable entries
        return _list_digest.__wrapped__(run_id, round_id, entries)


@lru_cache(maxsize=16)
def _list_digest(run_id: int, round_id: int, entries: Sequence[tuple[int, bytes]]) -> bytes:
    h = hashlib.sha256(b"fedring-secagg/v1/advert-list\x00" + struct.pack("<QI", run_id, round_id))
    for node, digest in entries:
        h.update(_ENTRY.pack(node, digest))
    return h.digest()


def derive_seed(digest: bytes) -> bytes:
    """The graph seed of a round: H(list digest, 0). Any seed gives a connected graph
    (:mod:`privacy.secagg.graph`: k-connected), so there is nothing to draw again."""
    return hashlib.sha256(b"fedring-secagg/v1/graph-seed\x00" + digest +
                          struct.pack("<I", 0)).digest()


def threshold_core(neighbours: np.ndarray, active: np.ndarray, t: int) -> np.ndarray:
    """The largest subset of ``active`` (a boolean mask over the rows of the (n, k) index
    array ``neighbours``) where each keeps >= t neighbours inside it, as a mask: what the
    server's pruning leaves. Every round drops all rows below t at once; a dropped row
    has fewer than t in any subset of the current set, so none of the core is ever
    dropped, and the result is the same whatever the order of removal."""
    core = np.asarray(active, dtype=bool).copy()
    while True:
        keep = core & (np.count_nonzero(core[neighbours], axis=1) >= t)
        if np.array_equal(keep, core):
            return core
        core = keep


@lru_cache(maxsize=8)
def _core(participants: tuple[int, ...], k: int, t: int, listed: tuple[int, ...],
          seed: bytes) -> np.ndarray:
    """The t-core of the listed clients (a read-only mask over the participants'
    positions). Memoized: the clients of a round in one process share it."""
    n = len(participants)
    active = np.zeros(n, dtype=bool)
    active[np.searchsorted(np.array(participants, dtype=np.uint64),
                           np.array(listed, dtype=np.uint64))] = True
    core = threshold_core(neighbour_array(n, k, seed), active, t)
    core.setflags(write=False)
    return core


def derived_neighbours(participants: tuple[int, ...], k: int, t: int,
                       listed: Sequence[tuple[int, bytes]], digest: bytes,
                       client: int) -> frozenset[int] | None:
    """``client``'s neighbours in the k-regular graph on the participants from the list's
    seed, inside the list's t-core (the clients the server keeps); None when ``client``
    is not kept. The list's ids are participants, increasing. When every participant is
    listed the core is everybody (each has k >= t neighbours): only ``client``'s row is
    derived; otherwise the core is peeled over the whole graph (memoized)."""
    n = len(participants)
    seed = derive_seed(digest)
    ids = tuple(c for c, _ in listed)
    position = bisect_left(participants, client)
    if position == n or participants[position] != client:
        return None
    row = node_neighbours(n, k, seed, position)
    if ids != participants:
        core = _core(participants, k, t, ids, seed)
        if not core[position]:
            return None
        row = row[core[row]]
    return frozenset(participants[j] for j in row.tolist())


def consistency_message(run_id: int, round_id: int, survivors: Sequence[int],
                        digest: bytes) -> bytes:
    """What a consistency-check signature covers: the survivor set S and the list."""
    ids = struct.pack(f"<{len(survivors)}Q", *sorted(survivors))
    return signed_bytes("consistency", run_id, round_id, ids, digest)


def quorum(listed: int, t: int, corrupt_fraction: float) -> int:
    """Signatures an unmask request needs: more than (L + c) / 2 with c = ceil(gamma L)
    corrupt identities among the L listed (two quorums then share an honest signer),
    and at least t."""
    corrupt = math.ceil(corrupt_fraction * listed)
    return max(t, (listed + corrupt) // 2 + 1)
