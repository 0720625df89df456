"""Client side of SecAgg+: a state machine fed with server messages (bytes in, bytes out).

Flow (one call of :meth:`SecAggClient.handle` per server message)::

    SETUP            -> ADVERTISE_KEYS   fresh X25519 keys c (encryption) and s (masking)
    PUBLIC_KEYS      -> SHARE_KEYS       t-of-k Shamir shares of b_u and s_u^SK, encrypted
                                         per neighbour under HKDF(X25519(c_u, c_v))
    FORWARDED_SHARES -> MASKED_INPUT     y = x + PRG(b_u) + sum_v +-PRG(s_uv) mod 2^bits
    UNMASK_REQUEST   -> UNMASK_RESPONSE  b-shares of survivors, s^SK-shares of dropped peers

In the merged flow (``SessionParams.flow``, the default) a client with its input set
answers PUBLIC_KEYS with SHARES_AND_INPUT: its shares and y masked over exactly the
neighbours listed there. Its forwarded shares then come with the next message
(SHARES_AND_CHECK in the malicious mode, SHARES_AND_UNMASK otherwise), decrypted and
checked as FORWARDED_SHARES's; a share that fails there is left out of the reply and
named in it. If the server falls back to FORWARDED_SHARES instead, the client masks
again over the senders received. It accepts forwarded shares once per round, and
refuses the other flow's messages.

Any message that breaks the protocol raises :class:`ProtocolError` and leaves the
state unchanged, and so does a session below the client's own policy
(:mod:`privacy.secagg.policy`: k >= 3 or the full graph, a connected graph, t > k/2,
checked on SETUP; no unmasking share unless the request lists at least
``min_survivors - 1`` surviving neighbours besides this client); in particular a
request that would reveal both shares of one peer (in one request or across several)
is refused. The state can be saved
between messages with :meth:`export_state` (it holds secrets: keep it local). It
keeps only what the next stages need, already derived: after PUBLIC_KEYS the two
private keys are gone and each neighbour's share-decryption key and pair-mask seed
are kept instead, so restoring a session does no key agreement or derivation.
Threat model: honest-but-curious server and authenticated client-server channels
(the transport's job). In the malicious mode (``security="malicious"``: a client built
with an :class:`~privacy.secagg.identity.Identity` and the
:class:`~privacy.secagg.identity.TrustedKeys` it accepts) it signs its advertisement,
checks its peers' and the derived graph, signs the survivor set in a consistency check
(CONSISTENCY_CHECK -> CONSISTENCY_SIGNATURE) and unmasks only for a quorum of signatures
on that set (:mod:`privacy.secagg.malicious`); a client that requires it refuses a
semi-honest SETUP.

Keys advertised a round ahead (``SessionParams.advertise_ahead``, :mod:`privacy.secagg.ahead`):
the last reply of a session (UNMASK_AND_ADVERTISE) also carries a fresh advertisement for
the next round, whose secrets the client keeps (:meth:`SecAggClient.carry_over` hands them
to that round's session, :meth:`SecAggClient.inherit` takes them). A SETUP with
``keys_ahead`` (SETUP_AND_KEYS) uses them, for that round only and once; a client that
used them refuses a fresh SETUP for the same round, and a fresh SETUP discards them.

A pre-signed survivor set (``SessionParams.presign``: malicious mode, keys advertised ahead):
the client answers SETUP_AND_KEYS with PRESIGNED_INPUT, its SHARES_AND_INPUT with its
consistency signature on S = every client of the advertisement list, and records S as the
one set it signed this round, as if CONSISTENCY_CHECK had shown it S. It then refuses any
CONSISTENCY_CHECK (and SHARES_AND_CHECK) and FORWARDED_SHARES in that round (it masks
once, and signs one set); its shares come with the unmask request (SHARES_AND_UNMASK),
answered only for a quorum of signatures on S, as always.
"""

from __future__ import annotations

import os
import struct
from functools import lru_cache

import numpy as np

from privacy.secagg import keys as kx
from privacy.secagg import malicious as mal
from privacy.secagg import messages as msg
from privacy.secagg.buffers import POOL
from privacy.secagg.errors import ProtocolError
from privacy.secagg.graph import node_neighbours
from privacy.secagg.identity import Identity, TrustedKeys
from privacy.secagg.messages import Header, MsgType, PeerKeys, RevealedShare, ShareKind
from privacy.secagg.params import MALICIOUS, SECURITY_MODES, SEMI_HONEST, SessionParams
from privacy.secagg.policy import DEFAULT_POLICY, SecAggPolicy
from privacy.secagg.prg import combine
from privacy.secagg.shamir import SHARE_BYTES, split_secret
from privacy.secagg.stages import Stage

_STATE_MAGIC = b"SC"
_STATE_VERSION = 6  # 6: the keys advertised ahead (pending, and the round they were used)
_EARLY = 4  # state flag: the masked input went with the shares, the shares not yet back
_STATE_HEAD = struct.Struct("<2sBBQBQI")
_BLOB = struct.Struct("<I")
_PEER = struct.Struct(f"<Q{kx.KEY_BYTES}s{kx.KEY_BYTES}s")  # id, share key to us, pair seed
_HELD = struct.Struct(f"<Q{SHARE_BYTES}s{SHARE_BYTES}s")  # id, b-share, sk-share
_REVEALED = struct.Struct("<QB")
_LISTED = struct.Struct(f"<Q{kx.KEY_BYTES}s")  # id, advertisement digest
# pending keys advertised ahead: run, round, c_sk, s_sk, b_u's seed
_PENDING = struct.Struct(f"<QI{kx.KEY_BYTES}s{kx.KEY_BYTES}s32s")
_SPENT = struct.Struct("<QI")  # the run and round whose session used keys advertised ahead


class SecAggClient:
    """One client's protocol state for one round.

    ``run_id`` / ``round_id``, when given, must match the SETUP message, so a setup
    replayed from another round is refused; all later messages must match it too.
    ``stage`` is the stage of the last message this client sent (SETUP: none yet).
    ``threads``: how many threads expand the masks (a local resource, not kept in the
    state; the masked vector is the same whatever it is). ``policy``: this client's own
    minimums (never taken from the server; not kept in the state either). ``identity`` and
    ``trusted``: its signing key and the peers' keys it accepts, needed for a malicious
    SETUP; ``security``: the least it accepts ("malicious" refuses a semi-honest SETUP).
    Like the policy, these are the client's own and passed again to :meth:`from_state`.
    """

    def __init__(
        self, client_id: int, *, run_id: int | None = None, round_id: int | None = None,
        threads: int = 1, policy: SecAggPolicy = DEFAULT_POLICY,
        identity: Identity | None = None, trusted: TrustedKeys | None = None,
        security: str = SEMI_HONEST,
    ) -> None:
        if security not in SECURITY_MODES:
            raise ValueError(f"security must be one of {', '.join(SECURITY_MODES)}, "
                             f"got {security!r}")
        if (identity is None) != (trusted is None):
            raise ValueError("a client needs both an identity and trusted keys, or neither")
        if security == MALICIOUS and identity is None:
            raise ValueError("the malicious mode needs an identity and trusted keys")
        self.client_id = client_id
        self.threads = threads
        self.policy = policy
        self.identity = identity
        self.trusted = trusted
        self.security = security
        self._listed: tuple[tuple[int, bytes], ...] = ()  # malicious: the advertisement list
        self._digest = b""  # and its digest
        self._own_digest = b""  # malicious: this client's advertisement digest, until listed
        self._signed_set: tuple[int, ...] = ()  # the survivor set this client signed
        self.expected_run_id = run_id
        self.expected_round_id = round_id
        self.stage = Stage.SETUP
        self.config: SessionParams | None = None
        self.neighbours: frozenset[int] = frozenset()
        self._input: np.ndarray | None = None
        self._setup_raw = b""  # the SETUP message (restores config and neighbours)
        self._c_sk: kx.X25519PrivateKey | None = None  # until PUBLIC_KEYS
        self._s_sk: kx.X25519PrivateKey | None = None  # until PUBLIC_KEYS
        self._b_seed = b""  # until the input is masked
        self._peers: dict[int, tuple[bytes, bytes]] = {}  # peer -> (its share key, pair seed)
        self._held: dict[int, tuple[bytes, bytes]] = {}  # peer -> (b-share, sk-share)
        self._revealed: dict[int, ShareKind] = {}
        self._early = False  # merged flow: masked input sent with the shares, shares not back
        self._failed: tuple[int, ...] = ()  # merged flow: failed shares, for this reply only
        self._pending: tuple[int, int, bytes, bytes, bytes] | None = None  # keys advertised
        #               ahead: (run, round, c_sk, s_sk, b_u's seed), for that round only
        self._spent: tuple[int, int] | None = None  # (run, round) that used such keys

    # --- public API --------------------------------------------------------

    def set_input(self, vector: np.ndarray) -> None:
        """The quantized vector to sum (integers in [0, 2^bits)); needed before masking.

        It is read once, chunk by chunk, while the masked sum is written straight
        into the reply message; it is not modified.
        """
        self._input = np.asarray(vector)

    def handle(self, payload: bytes) -> bytes | memoryview:
        """Process one server message and return the reply; ProtocolError if refused.

        The MASKED_INPUT reply is a memoryview of a buffer from :data:`buffers.POOL`,
        reused only once nothing refers to it any more.
        """
        kind = msg.read_header(payload).kind
        handlers = {
            MsgType.SETUP: self._on_setup,
            MsgType.PUBLIC_KEYS: self._on_public_keys,
            MsgType.FORWARDED_SHARES: self._on_forwarded_shares,
            MsgType.CONSISTENCY_CHECK: self._on_consistency_check,
            MsgType.UNMASK_REQUEST: self._on_unmask_request,
            MsgType.SHARES_AND_CHECK: self._on_shares_and,
            MsgType.SHARES_AND_UNMASK: self._on_shares_and,
            MsgType.SETUP_AND_KEYS: self._on_setup_and_keys,
        }
        if kind not in handlers:
            raise ProtocolError(f"a client does not accept {kind.name} messages")
        return handlers[kind](payload)

    def carry_over(self) -> SecAggClient:
        """A client for the next session, at stage SETUP, holding only what crosses rounds:
        the keys this one advertised ahead (if any) and the round that used keys advertised
        ahead (if any). Its :meth:`export_state` is what a node keeps between rounds."""
        nxt = SecAggClient(self.client_id, threads=self.threads, policy=self.policy,
                           identity=self.identity, trusted=self.trusted,
                           security=self.security)
        nxt._pending, nxt._spent = self._pending, self._spent
        return nxt

    def inherit(self, previous: SecAggClient) -> None:
        """Take the keys advertised ahead and the spent round of ``previous`` (a
        :meth:`carry_over` of this node's last session), before SETUP."""
        if previous.client_id != self.client_id or self.stage != Stage.SETUP:
            raise ValueError("a session inherits only its own node's state, before SETUP")
        self._pending, self._spent = previous._pending, previous._spent

    @property
    def carries_over(self) -> bool:
        """Whether :meth:`carry_over` holds anything: keys advertised ahead, or a round that
        used such keys."""
        return self._pending is not None or self._spent is not None

    @property
    def advertised_ahead(self) -> tuple[int, int] | None:
        """(run, round) of the keys this client advertised ahead and still holds, or None."""
        return None if self._pending is None else self._pending[:2]

    @property
    def held_peers(self) -> frozenset[int]:
        """Peers whose (authenticated) shares this client holds and masked with."""
        return frozenset(self._held)

    # --- stage handlers ----------------------------------------------------

    def _on_setup(self, payload: bytes) -> bytes:
        self._require_stage(Stage.SETUP, "SETUP")
        h, config = _decode_setup(payload)
        session = (config.run_id, config.round_id)
        if config.keys_ahead:
            if self._pending is None or self._pending[:2] != session:
                raise ProtocolError(f"SETUP uses keys advertised ahead for run {session[0]} "
                                    f"round {session[1]}; this client holds none for it")
        elif self._spent == session:
            raise ProtocolError(f"SETUP for round {session[1]}, whose session already ran "
                                "with the keys advertised ahead: one session per round")
        self._load_setup(h, config)
        if config.keys_ahead:  # used once, for this round only
            assert self._pending is not None
            _, _, c_sk, s_sk, self._b_seed = self._pending
            self._c_sk = kx.private_key_from_bytes(c_sk)
            self._s_sk = kx.private_key_from_bytes(s_sk)
            self._spent = session
        else:
            self._c_sk, self._s_sk = kx.new_private_key(), kx.new_private_key()
            self._b_seed = os.urandom(32)
        self._pending = None  # a fresh SETUP discards keys advertised ahead
        self._setup_raw = bytes(payload)
        advert, self._own_digest = self._advert()
        self.stage = Stage.ADVERTISE_KEYS
        if config.keys_ahead:  # advertised already: PUBLIC_KEYS comes with this SETUP
            return b""
        return msg.encode_advertise_keys(self._header(MsgType.ADVERTISE_KEYS), advert)

    def _on_setup_and_keys(self, payload: bytes) -> bytes | memoryview:
        """SETUP of a session with keys advertised ahead, and its PUBLIC_KEYS: the reply to
        PUBLIC_KEYS (the keys are used even if PUBLIC_KEYS is refused: once)."""
        _, setup, keys = msg.unbundle(payload)
        if not _decode_setup(setup)[1].keys_ahead:
            raise ProtocolError("SETUP_AND_KEYS carries a SETUP without keys advertised ahead")
        self._on_setup(setup)
        return self._on_public_keys(keys)

    def _advertise_next(self) -> bytes:
        """This session's advertisement for the next round (the same for every unmask
        request of the session), its secrets kept until that round's SETUP."""
        cfg = self._cfg
        nxt = (cfg.run_id, cfg.round_id + 1)
        if self._pending is None or self._pending[:2] != nxt:
            c_sk, s_sk = kx.new_private_key(), kx.new_private_key()
            self._pending = (*nxt, kx.private_bytes(c_sk), kx.private_bytes(s_sk),
                             os.urandom(32))
        _, rnd, c_sk_raw, s_sk_raw, b_seed = self._pending
        c_pk = kx.public_bytes(kx.private_key_from_bytes(c_sk_raw))
        s_pk = kx.public_bytes(kx.private_key_from_bytes(s_sk_raw))
        advert = self._signed_advert(cfg.run_id, rnd, c_pk, s_pk, kx.commit(b_seed))[0]
        h = Header(MsgType.ADVERTISE_KEYS, cfg.run_id, rnd, self.client_id)
        return msg.encode_advertise_keys(h, advert)

    def _advert(self) -> tuple[msg.AdvertiseKeys, bytes]:
        """This round's key advertisement (signed in the malicious mode) and its digest, the
        entry the advertisement list must hold for this client (b"" if unsigned)."""
        assert self._c_sk is not None and self._s_sk is not None
        c_pk, s_pk = kx.public_bytes(self._c_sk), kx.public_bytes(self._s_sk)
        return self._signed_advert(self._cfg.run_id, self._cfg.round_id, c_pk, s_pk,
                                   kx.commit(self._b_seed))

    def _signed_advert(self, run_id: int, round_id: int, c_pk: bytes, s_pk: bytes,
                       commitment: bytes) -> tuple[msg.AdvertiseKeys, bytes]:
        """An advertisement bound to ``run_id`` and ``round_id`` (signed in the malicious
        mode) and its digest (b"" if unsigned)."""
        if not self._cfg.malicious or self.identity is None:
            return msg.AdvertiseKeys(c_pk, s_pk, commitment), b""
        ident = self.identity.public
        message = mal.advert_message(run_id, round_id, self.client_id, c_pk, s_pk,
                                     commitment, ident)
        signature = self.identity.sign(message)
        return (msg.AdvertiseKeys(c_pk, s_pk, commitment, ident, signature),
                mal.advert_digest(message, signature))

    def _on_public_keys(self, payload: bytes) -> bytes:
        self._require_stage(Stage.ADVERTISE_KEYS, "PUBLIC_KEYS")
        h, m = msg.decode_public_keys(payload, signed=self._cfg.malicious)
        neighbours, digest = self.neighbours, b""
        if self._cfg.malicious:
            neighbours, digest = self._load_signed_keys(h, m)
        peers = self._load_public_keys(h, m, neighbours)
        cfg = self._cfg
        ids = sorted(peers)
        xs = [cfg.positions[v] + 1 for v in ids]
        b_shares = split_secret(self._b_seed, cfg.t, xs)
        sk_shares = split_secret(kx.private_bytes(self._s_sk), cfg.t, xs)
        out, derived = [], {}
        for v, b_share, sk_share in zip(ids, b_shares, sk_shares, strict=True):
            c_shared = kx.agree(self._c_sk, peers[v].c_pk)
            key = kx.share_key(c_shared, cfg.run_id, cfg.round_id, self.client_id, v)
            ad = kx.share_ad(cfg.run_id, cfg.round_id, self.client_id, v) + digest
            out.append((v, kx.encrypt(key, ad, b_share + sk_share)))
            theirs = kx.share_key(c_shared, cfg.run_id, cfg.round_id, v, self.client_id)
            s_shared = kx.agree(self._s_sk, peers[v].s_pk)
            derived[v] = (theirs, kx.pair_seed(s_shared, cfg.run_id, cfg.round_id,
                                               self.client_id, v))
        self._peers = derived
        shares = msg.ShareKeys(tuple(out))
        reply: bytes | memoryview
        presigned: tuple[int, ...] = ()
        if cfg.merged and self._input is not None:  # masked over exactly these neighbours
            word = msg.wire_dtype(cfg.bits)
            signature = b""
            if cfg.presign:  # S = the whole list, signed now: the one set of this round
                assert self.identity is not None
                presigned = tuple(c for c, _ in m.advertised)
                signature = self.identity.sign(mal.consistency_message(
                    cfg.run_id, cfg.round_id, presigned, digest))
            head = msg.shares_and_input_head(self._header(MsgType.SHARES_AND_INPUT), shares,
                                             cfg.dim, word, signature)
            reply = self._masked(head, self._checked_input(), derived, ids)
        else:  # no input (yet): the shares alone; the masked input follows FORWARDED_SHARES
            reply = msg.encode_share_keys(self._header(MsgType.SHARE_KEYS), shares)
        self._peers = derived
        self._early = not isinstance(reply, bytes)
        if cfg.malicious:
            self.neighbours, self._listed, self._digest = neighbours, m.advertised, digest
            self._signed_set = presigned
        self._c_sk = self._s_sk = None  # everything later needs is derived now
        self.stage = Stage.SHARE_KEYS
        return reply

    def _masked(self, head: bytes, x: np.ndarray, peers: dict[int, tuple[bytes, bytes]],
                mask_with: list[int]) -> memoryview:
        """``head`` then y = x + PRG(b_u) + sum over ``mask_with`` of +-PRG(s_uv), in a
        reused buffer (:data:`buffers.POOL`)."""
        cfg = self._cfg
        masks = [(self._b_seed, 1)]
        for v in sorted(mask_with):
            masks.append((peers[v][1], 1 if self.client_id < v else -1))
        word = msg.wire_dtype(cfg.bits)  # the narrowest word for 2^bits: what goes on the wire
        reply = POOL.take(len(head) + cfg.dim * word.itemsize)  # reused, not zeroed
        reply[: len(head)] = head
        body = np.frombuffer(reply, word, count=cfg.dim, offset=len(head))
        combine([x], masks, cfg.dim, cfg.bits, out=body,  # narrows to the wire word if need be
                threads=self.threads)
        return reply

    def _on_forwarded_shares(self, payload: bytes) -> memoryview:
        if self.stage > Stage.SHARE_KEYS:
            raise ProtocolError("forwarded shares already received this round: a second set "
                                "is refused")
        self._require_stage(Stage.SHARE_KEYS, "FORWARDED_SHARES")
        if self._signed_set:
            raise ProtocolError("FORWARDED_SHARES in a pre-signed round: this client masked "
                                "its input with its shares and signed its survivor set")
        x = self._checked_input()
        h, m = msg.decode_forwarded_shares(payload)
        held, failed = self._load_forwarded(h, m)
        cfg = self._cfg
        word = msg.wire_dtype(cfg.bits)
        head = msg.masked_input_head(self._header(MsgType.MASKED_INPUT), failed, cfg.dim, word)
        reply = self._masked(head, x, self._peers, sorted(held))  # the senders received
        self._held = held
        self._peers, self._b_seed = {}, b""
        self._input = None
        self._early = False
        self.stage = Stage.MASKED_INPUT
        return reply

    def _on_shares_and(self, payload: bytes) -> bytes:
        """Merged flow: the forwarded shares with the next message (the consistency check,
        or in the semi-honest mode the unmask request), checked as FORWARDED_SHARES's, then
        that message; nothing changes if either is refused."""
        cfg = self._cfg
        h, m, rest = msg.split_shares(payload)
        if not cfg.merged:
            raise ProtocolError(f"{h.kind.name} in a classic-flow session")
        if self.stage > Stage.SHARE_KEYS:
            raise ProtocolError("forwarded shares already received this round: a second set "
                                "is refused")
        if self.stage != Stage.SHARE_KEYS or not self._early:
            raise ProtocolError(f"{h.kind.name}, but this client sent no masked input with "
                                "its shares")
        want = MsgType.SHARES_AND_CHECK if cfg.malicious and not self._signed_set \
            else MsgType.SHARES_AND_UNMASK
        if h.kind is MsgType.SHARES_AND_CHECK and self._signed_set:
            raise ProtocolError("consistency check refused: this client pre-signed its "
                                "survivor set for this round (one set per round)")
        if h.kind is not want:
            raise ProtocolError(f"{h.kind.name} in a {cfg.security} session: the shares "
                                f"travel with {want.name}")
        held, failed = self._load_forwarded(h, m)
        saved = (self._held, self._failed, self.stage)
        # pre-signed: as if the consistency check had come and been signed
        stage = Stage.CONSISTENCY_CHECK if self._signed_set else Stage.MASKED_INPUT
        self._held, self._failed, self.stage = held, failed, stage
        try:
            reply = (self._on_consistency_check(rest) if want is MsgType.SHARES_AND_CHECK
                     else self._on_unmask_request(rest))
        except ProtocolError:
            self._held, self._failed, self.stage = saved
            raise
        finally:
            self._failed = ()
        self._peers, self._b_seed = {}, b""
        self._input = None
        self._early = False
        return reply

    def _on_consistency_check(self, payload: bytes) -> bytes:
        if not self._cfg.malicious:
            raise ProtocolError("CONSISTENCY_CHECK in a semi-honest session")
        if self._signed_set and self._cfg.presign:
            raise ProtocolError("consistency check refused: this client pre-signed its "
                                "survivor set for this round (one set per round)")
        self._require_stage(Stage.MASKED_INPUT, "CONSISTENCY_CHECK")
        h, m = msg.decode_consistency_check(payload)
        self._check_header(h)
        survivors = set(m.survivors)
        if self.client_id not in survivors:
            raise ProtocolError("consistency check: survivor set lacks this client")
        outside = survivors - {c for c, _ in self._listed}
        if outside:
            raise ProtocolError(f"consistency check: survivor {min(outside)} is not in the "
                                "advertisement list")
        assert self.identity is not None
        cfg = self._cfg
        signature = self.identity.sign(
            mal.consistency_message(cfg.run_id, cfg.round_id, m.survivors, self._digest))
        self._signed_set = m.survivors
        self.stage = Stage.CONSISTENCY_CHECK
        return msg.encode_consistency_signature(
            self._header(MsgType.CONSISTENCY_SIGNATURE), signature, self._failed)

    def _on_unmask_request(self, payload: bytes) -> bytes:
        malicious = self._cfg.malicious
        after = (Stage.CONSISTENCY_CHECK if malicious else Stage.MASKED_INPUT, Stage.UNMASKING)
        if self.stage not in after:
            raise ProtocolError(f"UNMASK_REQUEST not expected after stage {self.stage.name}")
        h, m, block = msg.decode_unmask_head(payload, signed=malicious)
        self._check_header(h)
        if malicious:
            self._check_signed_request(m, block)
        survivors, dropped = set(m.survivors), set(m.dropped)
        few = self.policy.survivors_violation(len(survivors - {self.client_id}) + 1)
        if few is not None:  # this client sees its surviving neighbours, and itself
            raise ProtocolError(f"unmask request refused: {few}")
        both = survivors & dropped
        if both:
            raise ProtocolError(
                f"request lists client {min(both)} as both surviving and dropped: "
                "refusing to reveal both shares of one peer"
            )
        skipped = set(self._failed)  # merged flow: failed with this request, reported
        for v in sorted((survivors | dropped) - skipped):
            if v not in self._held:
                raise ProtocolError(f"request names client {v}, whose shares this client lacks")
            kind = ShareKind.SELF_MASK if v in survivors else ShareKind.MASK_KEY
            if self._revealed.get(v, kind) != kind:
                raise ProtocolError(
                    f"request would reveal both shares of client {v} "
                    f"(its {self._revealed[v].name} share was already revealed)"
                )
        out = []
        for v in m.survivors:
            if v not in skipped:
                out.append(RevealedShare(v, ShareKind.SELF_MASK, self._held[v][0]))
                self._revealed[v] = ShareKind.SELF_MASK
        for v in m.dropped:
            if v not in skipped:
                out.append(RevealedShare(v, ShareKind.MASK_KEY, self._held[v][1]))
                self._revealed[v] = ShareKind.MASK_KEY
        self.stage = Stage.UNMASKING
        reply = msg.UnmaskResponse(tuple(out), self._failed)
        response = msg.encode_unmask_response(self._header(MsgType.UNMASK_RESPONSE), reply)
        if not self._cfg.advertise_ahead:
            return response
        return msg.bundle(MsgType.UNMASK_AND_ADVERTISE, response, self._advertise_next())

    # --- validation of server messages (no side effects but the returned values) ---

    def _load_setup(self, h: Header, config: SessionParams) -> None:
        if h.client_id != self.client_id:
            raise ProtocolError(f"SETUP addressed to client {h.client_id}, not {self.client_id}")
        if self.expected_run_id is not None and config.run_id != self.expected_run_id:
            raise ProtocolError(f"SETUP for run {config.run_id}, expected {self.expected_run_id}")
        if self.expected_round_id is not None and config.round_id != self.expected_round_id:
            raise ProtocolError(
                f"SETUP for round {config.round_id}, expected {self.expected_round_id}"
            )
        if self.client_id not in config.positions:
            raise ProtocolError("this client is not among the participants")
        if self.security == MALICIOUS and not config.malicious:
            raise ProtocolError(f"SETUP asks for {config.security} security; this client "
                                "requires malicious")
        if config.malicious and self.identity is None:
            raise ProtocolError("SETUP asks for malicious security; this client has no "
                                "identity key")
        self.policy.check(config)
        self.config = config
        if config.malicious:  # neighbours come from the advertisement list (PUBLIC_KEYS)
            self.neighbours = frozenset()
            return
        ids = config.participants
        row = node_neighbours(config.n, config.k, config.seed, config.positions[self.client_id])
        self.neighbours = frozenset(ids[j] for j in row.tolist())

    def _load_signed_keys(self, h: Header, m: msg.PublicKeys) -> tuple[frozenset[int], bytes]:
        """Malicious mode: check the list and the neighbours' signed advertisements; this
        client's neighbours derived from the list, and the list's digest."""
        self._check_header(h)
        cfg = self._cfg
        listed = dict(m.advertised)
        if not listed.keys() <= cfg.positions.keys():
            raise ProtocolError("advertisement list names a client outside the participants")
        if not self._own_digest or listed.get(self.client_id) != self._own_digest:
            raise ProtocolError("advertisement list lacks this client's own advertisement")
        assert self.identity is not None
        used = {self.identity.public: self.client_id}
        for e in m.entries:
            self._check_advert(e, listed, used, signature=True)
        digest = mal.list_digest(cfg.run_id, cfg.round_id, m.advertised)
        neighbours = self._derive_neighbours(m.advertised, digest)
        named = {e.client_id for e in m.entries}
        if named != neighbours:
            extra, missing = sorted(named - neighbours), sorted(neighbours - named)
            raise ProtocolError(f"neighbours are not the graph derived from the advertisement "
                                f"list (extra {extra}, missing {missing})")
        return neighbours, digest

    def _check_advert(self, e: PeerKeys, listed: dict[int, bytes], used: dict[bytes, int], *,
                      signature: bool) -> None:
        """A peer's signed advertisement: trusted identity, valid signature bound to this
        run, round and stage (when ``signature``), hashing to its list entry, identity not
        used by another node."""
        cfg = self._cfg
        assert self.trusted is not None
        c = e.client_id
        if e.identity not in self.trusted:
            raise ProtocolError(f"client {c}'s advertisement: identity not trusted")
        message = mal.advert_message(cfg.run_id, cfg.round_id, c, e.c_pk, e.s_pk,
                                     e.b_commitment, e.identity)
        if signature and not mal.verify(self.trusted, e.identity, e.signature, message):
            raise ProtocolError(f"client {c}'s advertisement: bad signature (or one bound "
                                "to another run, round or stage: a replay)")
        if used.setdefault(e.identity, c) != c:
            raise ProtocolError(f"client {c}'s advertisement: identity already used by "
                                f"client {used[e.identity]}")
        if listed.get(c) != mal.advert_digest(message, e.signature):
            raise ProtocolError(f"client {c}'s advertisement does not match the list")

    def _derive_neighbours(self, listed: tuple[tuple[int, bytes], ...],
                           digest: bytes) -> frozenset[int]:
        """This client's neighbours: the graph from the list's seed (``digest``: the list's),
        inside the list's t-core (the clients the server keeps); ProtocolError if this
        client is not kept."""
        cfg = self._cfg
        mine = mal.derived_neighbours(cfg.participants, cfg.k, cfg.t, listed, digest,
                                      self.client_id)
        if mine is None:
            raise ProtocolError("this client has fewer than t neighbours in the derived graph")
        return mine

    def _check_signed_request(self, m: msg.UnmaskRequest, block: bytes) -> None:
        """Malicious mode: a quorum of valid signatures (``block``, undecoded) on the set this
        client signed, from distinct trusted members; survivors in it, dropped peers
        outside it. A block that passed these checks for the same message, list and
        trusted keys in this process is not checked again
        (:func:`~privacy.secagg.malicious.remember_signers`)."""
        cfg = self._cfg
        assert self.trusted is not None
        signed = set(self._signed_set)
        message = mal.consistency_message(cfg.run_id, cfg.round_id, self._signed_set,
                                          self._digest)
        need = mal.quorum(len(self._listed), cfg.t, self.policy.corrupt_fraction)
        key = (block, message, self._listed, self.trusted.keys)
        count = mal.remembered_signers(key)
        if count is None:
            count = self._count_signers(msg.decode_signed_sets(block), signed, message)
            mal.remember_signers(key, count)
        if count < need:
            raise ProtocolError(f"unmask request refused: {count} consistency "
                                f"signatures, {need} needed")
        if not set(m.survivors) <= signed:
            raise ProtocolError("unmask request refused: it lists survivors outside the "
                                "signed survivor set")
        if set(m.dropped) & signed:
            raise ProtocolError("unmask request refused: it lists as dropped a client of the "
                                "signed survivor set")

    def _count_signers(self, signatures: tuple[msg.SignedSet, ...], signed: set[int],
                       message: bytes) -> int:
        """How many distinct trusted identities of listed members of ``signed`` signed
        ``message``; ProtocolError at the first signature that is not one of them."""
        assert self.trusted is not None
        listed = dict(self._listed)
        identities: set[bytes] = set()
        for x in signatures:
            e = x.signer
            if e.client_id not in signed:
                raise ProtocolError(f"unmask request refused: signer {e.client_id} is not in "
                                    "the signed survivor set")
            # a signer's advertisement needs no signature check: an honest identity signs
            # only a set holding its own node, under the list holding its own advertisement
            self._check_advert(e, listed, {}, signature=False)
            if e.identity in identities:
                raise ProtocolError("unmask request refused: two signatures by one identity")
            if not mal.verify(self.trusted, e.identity, x.signature, message):
                raise ProtocolError(f"unmask request refused: client {e.client_id}'s signature "
                                    "is not on the survivor set this client signed")
            identities.add(e.identity)
        return len(identities)

    def _load_public_keys(self, h: Header, m: msg.PublicKeys,
                          neighbours: frozenset[int]) -> dict[int, PeerKeys]:
        self._check_header(h)
        peers = {}
        for e in m.entries:
            if e.client_id not in neighbours:
                raise ProtocolError(f"public keys of client {e.client_id}, not a neighbour")
            peers[e.client_id] = e
        if len(peers) < self._cfg.t:
            raise ProtocolError(f"only {len(peers)} neighbours left, threshold is {self._cfg.t}")
        own = [kx.public_bytes(self._c_sk), kx.public_bytes(self._s_sk)]
        all_keys = own + [k for e in m.entries for k in (e.c_pk, e.s_pk)]
        if len(set(all_keys)) != len(all_keys):
            raise ProtocolError("public keys are not all distinct")
        return peers

    def _load_forwarded(
        self, h: Header, m: msg.ForwardedShares
    ) -> tuple[dict[int, tuple[bytes, bytes]], tuple[int, ...]]:
        self._check_header(h)
        cfg = self._cfg
        held: dict[int, tuple[bytes, bytes]] = {}
        failed = []
        for sender, ct in m.shares:
            if sender not in self.neighbours:
                raise ProtocolError(f"share from client {sender}, not a neighbour")
            if sender not in self._peers:
                raise ProtocolError(f"share from client {sender}, whose keys were not announced")
            ad = kx.share_ad(cfg.run_id, cfg.round_id, sender, self.client_id) + self._digest
            try:
                plain = kx.decrypt(self._peers[sender][0], ad, ct)
            except ProtocolError:
                failed.append(sender)
                continue
            held[sender] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])
        if len(held) < cfg.t:
            raise ProtocolError(
                f"only {len(held)} valid shares from neighbours, threshold is {cfg.t}"
            )
        return held, tuple(sorted(failed))

    # --- helpers ------------------------------------------------------------

    @property
    def _cfg(self) -> SessionParams:
        if self.config is None:
            raise ProtocolError("no SETUP received yet")
        return self.config

    def _require_stage(self, stage: Stage, what: str) -> None:
        if self.stage != stage:
            raise ProtocolError(f"{what} not expected after stage {self.stage.name}")

    def _check_header(self, h: Header) -> None:
        cfg = self._cfg
        if (h.run_id, h.round_id) != (cfg.run_id, cfg.round_id):
            raise ProtocolError(
                f"message from run {h.run_id} round {h.round_id}, "
                f"this session is run {cfg.run_id} round {cfg.round_id}"
            )
        if h.client_id != self.client_id:
            raise ProtocolError(f"message addressed to client {h.client_id}")

    def _header(self, kind: MsgType) -> Header:
        cfg = self._cfg
        return Header(kind, cfg.run_id, cfg.round_id, self.client_id)

    def _checked_input(self) -> np.ndarray:
        cfg = self._cfg
        x = self._input
        if x is None:
            raise ValueError("no input vector set (call set_input first)")
        if x.shape != (cfg.dim,) or x.dtype.kind not in "ui":
            raise ValueError(f"input must be {cfg.dim} integers, got {x.dtype} {x.shape}")
        fits = x.dtype.kind == "u" and 8 * x.dtype.itemsize <= cfg.bits
        if not fits and (int(x.min()) < 0 or int(x.max()) >> cfg.bits):
            raise ValueError(f"input values must lie in [0, 2^{cfg.bits})")
        return x

    # --- persistence between messages ---------------------------------------

    def export_state(self) -> bytes:
        """What the next stages need, to continue in another process (secret: keep local).

        Layout: a header, then four length-prefixed blobs (the SETUP message; the
        private keys and b_u's seed until PUBLIC_KEYS, then the seed alone until
        masking; per announced neighbour its share key and pair seed; per held
        peer its two shares; in the malicious mode also the advertisement list, or this
        client's own entry until the list comes, and the signed survivor set; then the keys
        advertised ahead, if held, and the run and round that used such keys, if any), then
        the shares revealed so far.
        """
        flags = (self.expected_run_id is not None) | (self.expected_round_id is not None) << 1
        flags |= _EARLY if self._early else 0
        head = _STATE_HEAD.pack(
            _STATE_MAGIC,
            _STATE_VERSION,
            self.stage,
            self.client_id,
            flags,
            self.expected_run_id or 0,
            self.expected_round_id or 0,
        )
        secrets = self._b_seed
        if self._c_sk is not None and self._s_sk is not None:
            secrets = kx.private_bytes(self._c_sk) + kx.private_bytes(self._s_sk) + secrets
        peers = b"".join(_PEER.pack(v, *p) for v, p in sorted(self._peers.items()))
        held = b"".join(_HELD.pack(v, *p) for v, p in sorted(self._held.items()))
        blobs = [self._setup_raw, secrets, peers, held]
        if self.config is not None and self.config.malicious:
            own = ((self.client_id, self._own_digest),)  # until the list comes
            blobs.append(_pack_listed(own if self.stage == Stage.ADVERTISE_KEYS
                                      else self._listed))
            blobs.append(struct.pack(f"<{len(self._signed_set)}Q", *self._signed_set))
        blobs.append(b"" if self._pending is None else _PENDING.pack(*self._pending))
        blobs.append(b"" if self._spent is None else _SPENT.pack(*self._spent))
        parts = [head] + [_BLOB.pack(len(b)) + b for b in blobs]
        parts.append(_BLOB.pack(len(self._revealed)))
        parts += [_REVEALED.pack(v, k) for v, k in sorted(self._revealed.items())]
        return b"".join(parts)

    @classmethod
    def from_state(cls, data: bytes, *, threads: int = 1,
                   policy: SecAggPolicy = DEFAULT_POLICY, identity: Identity | None = None,
                   trusted: TrustedKeys | None = None,
                   security: str = SEMI_HONEST) -> SecAggClient:
        """Rebuild a client from :meth:`export_state` (``threads``, ``policy``, ``identity``,
        ``trusted``, ``security``: as in the constructor); ProtocolError if malformed."""
        own = cls(0, policy=policy, identity=identity, trusted=trusted, security=security)
        try:
            client = cls._from_state(bytes(data), own)
        except (struct.error, ValueError, KeyError, IndexError) as exc:
            raise ProtocolError(f"malformed client state: {exc}") from None
        client.threads = threads
        return client

    @classmethod
    def _from_state(cls, data: bytes, own: SecAggClient) -> SecAggClient:
        magic, version, stage, cid, flags, run_id, round_id = _STATE_HEAD.unpack_from(data)
        if magic != _STATE_MAGIC or version != _STATE_VERSION:
            raise ProtocolError("not a client state of this version")
        pos = _STATE_HEAD.size
        blobs: list[bytes] = []
        count = 6  # eight once the SETUP (the first blob) says malicious
        while len(blobs) < count:
            (size,) = _BLOB.unpack_from(data, pos)
            if pos + 4 + size > len(data):
                raise ProtocolError("truncated client state")
            blobs.append(data[pos + 4 : pos + 4 + size])
            pos += 4 + size
            if len(blobs) == 1 and _is_malicious(blobs[0]):
                count = 8
        client = cls(
            cid, run_id=run_id if flags & 1 else None, round_id=round_id if flags & 2 else None,
            policy=own.policy, identity=own.identity, trusted=own.trusted,
            security=own.security,
        )
        client.stage = Stage(stage)
        client._early = bool(flags & _EARLY)
        setup, secrets, peers, held = blobs[:4]
        # what each stage keeps: (secrets length, announced peers, held shares)
        expected = {
            Stage.SETUP: (0, False, False),
            Stage.ADVERTISE_KEYS: (96, False, False),
            Stage.SHARE_KEYS: (32, True, False),
            Stage.MASKED_INPUT: (0, False, True),
            Stage.CONSISTENCY_CHECK: (0, False, True),
            Stage.UNMASKING: (0, False, True),
        }[client.stage]
        if (bool(setup), len(secrets), bool(peers), bool(held)) != (
            client.stage != Stage.SETUP,
            *expected,
        ):
            raise ProtocolError(f"client state does not match stage {client.stage.name}")
        if setup:
            client._load_setup(*_decode_setup(setup))
            client._setup_raw = setup
        if client._early and (client.stage != Stage.SHARE_KEYS or not client._cfg.merged):
            raise ProtocolError(f"client state does not match stage {client.stage.name}")
        if len(blobs) == 8:
            client._restore_malicious(blobs[4], blobs[5])
        pending, spent = blobs[-2:]
        if pending:
            client._pending = _PENDING.unpack(pending)
            kx.private_key_from_bytes(client._pending[2])  # ValueError if malformed
            kx.private_key_from_bytes(client._pending[3])
        if spent:
            client._spent = _SPENT.unpack(spent)
        if len(secrets) == 96:
            client._c_sk = kx.private_key_from_bytes(secrets[:32])
            client._s_sk = kx.private_key_from_bytes(secrets[32:64])
        client._b_seed = secrets[-32:] if secrets else b""
        client._peers = {v: (key, seed) for v, key, seed in _entries(_PEER, peers)}
        client._held = {v: (b, sk) for v, b, sk in _entries(_HELD, held)}
        for v in list(client._peers) + list(client._held):
            if v not in client.neighbours:
                raise ProtocolError(f"client state names client {v}, not a neighbour")
        (count,) = _BLOB.unpack_from(data, pos)
        pos += 4
        if pos + count * _REVEALED.size != len(data):
            raise ProtocolError("trailing or missing bytes in client state")
        for v, kind in _entries(_REVEALED, data[pos:]):
            if v not in client._held:
                raise ProtocolError(f"client state reveals a share of client {v}, not held")
            client._revealed[v] = ShareKind(kind)
        return client


    def _restore_malicious(self, listed: bytes, signed: bytes) -> None:
        """The advertisement list (and the neighbours derived from it), or until it comes
        this client's own entry; and the signed set."""
        entries = _unpack_listed(bytes(listed))
        if self.stage == Stage.ADVERTISE_KEYS:
            if [c for c, _ in entries] != [self.client_id]:
                raise ProtocolError("client state lacks this client's advertisement digest")
            self._own_digest = entries[0][1]
            entries = ()
        self._listed = entries
        if self._listed:
            cfg = self._cfg
            self._digest = mal.list_digest(cfg.run_id, cfg.round_id, self._listed)
            self.neighbours = self._derive_neighbours(self._listed, self._digest)
        elif self.stage > Stage.ADVERTISE_KEYS:
            raise ProtocolError("client state lacks the advertisement list")
        if len(signed) % 8:
            raise ProtocolError("malformed client state: a signed set id is cut short")
        self._signed_set = struct.unpack(f"<{len(signed) // 8}Q", signed)
        presigned = self._cfg.presign and self.stage == Stage.SHARE_KEYS and self._early
        if (self.stage >= Stage.CONSISTENCY_CHECK or presigned) != bool(self._signed_set):
            raise ProtocolError(f"client state does not match stage {self.stage.name}")
        if presigned and self._signed_set != tuple(c for c, _ in self._listed):
            raise ProtocolError("client state: a pre-signed set other than the whole list")


def _is_malicious(setup: bytes) -> bool:
    """Whether a saved SETUP message is a malicious-mode one (its state has two more blobs)."""
    return bool(setup) and _decode_setup(setup)[1].malicious


_SETUPS: dict[bytes, SessionParams] = {}  # recently decoded SETUP bodies
_MAX_SETUPS = 16


def _decode_setup(payload: bytes) -> tuple[Header, SessionParams]:
    """:func:`messages.decode_setup`, remembering the configuration of the last few SETUP
    bodies: every client of a round gets the same one, and a session restored on each
    message decodes it again (n ids checked, a position table built)."""
    h = msg.read_header(payload)
    key = struct.pack("<QI", h.run_id, h.round_id) + bytes(payload[msg.HEADER.size :])
    config = _SETUPS.get(key) if h.kind is MsgType.SETUP else None
    if config is None:
        h, config = msg.decode_setup(payload)
        if len(_SETUPS) >= _MAX_SETUPS:
            _SETUPS.pop(next(iter(_SETUPS)), None)
        _SETUPS[key] = config
    return h, config


@lru_cache(maxsize=16)
def _pack_listed(listed: tuple[tuple[int, bytes], ...]) -> bytes:
    """A saved advertisement list (memoized: a session is saved after every message)."""
    return b"".join(_LISTED.pack(c, d) for c, d in listed)


@lru_cache(maxsize=16)
def _unpack_listed(blob: bytes) -> tuple[tuple[int, bytes], ...]:
    """:func:`_pack_listed` undone (memoized: a session is restored on every message)."""
    return tuple((c, d) for c, d in _entries(_LISTED, blob))


def _entries(st: struct.Struct, blob: bytes) -> list[tuple]:
    """Fixed-size records of ``blob``, distinct ids first; ProtocolError if malformed."""
    if len(blob) % st.size:
        raise ProtocolError("malformed client state: a record is cut short")
    out = list(st.iter_unpack(blob))
    if len({r[0] for r in out}) != len(out):
        raise ProtocolError("malformed client state: a client id occurs twice")
    return out
