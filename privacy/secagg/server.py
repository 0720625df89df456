"""Server side of SecAgg+: a session driven by any transport.

Use::

    server = SecAggServer(config)
    outbox = server.start()                    # {client_id: SETUP bytes}
    while server.status is Status.RUNNING:
        ... deliver outbox; for each reply: server.receive(sender_id, reply_bytes)
        ... until server.awaiting is empty or a deadline passes, then:
        outbox = server.advance()              # closes the stage, next messages
    total = server.result()                    # sum mod 2^bits, or raises Aborted

``sender_id`` is the transport's authenticated identity of the sender. A reply
that breaks the protocol never raises: :meth:`receive` records the client in
``rejected`` with the reason and the round goes on without it (a client rejected
during unmasking stays in the sum, only its shares are ignored). Clients that do
not answer before :meth:`advance` are recorded in ``dropouts`` for that stage.

Checked here: AES-GCM on every share (reported by its receiver), a commitment to
each self-mask seed, each reconstructed masking key against its public key.
Not checkable without signatures: a masked vector or public key altered in
transit, so channels must be authenticated (e.g. TLS), as in Bonawitz et al.'s
honest-but-curious setting.

The session meets a policy (:mod:`privacy.secagg.policy`, strict by default): its
configuration must (ValueError otherwise), and it aborts as soon as fewer than
``min_survivors`` clients are left in the protocol. Before asking for any share in
stage 4 it checks that at least ``min_survivors`` clients survive, that the graph on
the survivors is connected (else the server would learn each component's sum), and
that every secret it will need has at least t holders among the survivors; otherwise
it aborts without asking, so an aborted round reveals nothing. It aborts in stage 4 if
responders drop so that fewer than t shares of a needed secret arrive.

In the malicious mode (``config.security``, :mod:`privacy.secagg.malicious`) the server
checks each advertisement's signature (and, given ``trusted``, its identity), builds the
advertisement list, derives the graph from it at the close of stage 1, and runs the
consistency check (stage CONSISTENCY_CHECK) between masking and unmasking: it unmasks
only with a quorum of signatures on the survivor set, which it forwards to each signer.

In the merged flow (``config.flow``, the default) the masked inputs come with the shares
(SHARES_AND_INPUT): when every client sent PUBLIC_KEYS answers with shares, the stage
SHARE_KEYS closes as the masked-input stage too (``merged``; no time is spent in stage
MASKED_INPUT) and each survivor's ciphertexts go with the next message (the consistency
check, or the unmask request); otherwise the early vectors are dropped and the classic
FORWARDED_SHARES -> MASKED_INPUT stage runs. A share that fails authentication is then
reported with the next reply: its sender is rejected, its vector stays in the sum.

Keys advertised a round ahead (:mod:`privacy.secagg.ahead`): with
``config.advertise_ahead`` each client's last reply (UNMASK_AND_ADVERTISE) carries its
advertisement for the next round, kept in :attr:`SecAggServer.ahead` once the response is
accepted; with ``config.keys_ahead`` the session is given every participant's advertisement
(``ahead``), takes them as stage 1's replies (each checked as one) in :meth:`start`, and
sends each client SETUP and PUBLIC_KEYS at once (SETUP_AND_KEYS): one exchange fewer.

A pre-signed survivor set (``config.presign``: malicious mode, keys ahead): each client
answers SETUP_AND_KEYS with PRESIGNED_INPUT, its masked input with its consistency
signature on S = the whole advertisement list, each checked as it comes (a masked input
without a valid one is rejected; shares alone make their sender a dropout of the masked
input). When every listed client's arrived, the survivor set is S and
the session skips the consistency check: the forwarded shares go with the unmask request
(SHARES_AND_UNMASK), which carries a quorum of those signatures. Otherwise it aborts
before any share is requested: the pre-signers signed their one set of the round, so no
other survivor set can reach a quorum.

Cost: masked vectors are added into one running sum as they arrive (a sender
rejected later is subtracted again), so only that sum is kept for stage 4, where
the secrets are rebuilt (one set of Lagrange coefficients per set of holders)
and every mask to remove is expanded and subtracted in place, chunk by chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from enum import Enum

import numpy as np

from privacy.secagg import keys as kx
from privacy.secagg import malicious as mal
from privacy.secagg import messages as msg
from privacy.secagg.errors import Aborted, ProtocolError
from privacy.secagg.graph import component_of, neighbour_array
from privacy.secagg.identity import TrustedKeys
from privacy.secagg.messages import Header, MsgType, PeerKeys, ShareKind
from privacy.secagg.params import DEFAULT_CORRUPT_FRACTION, SessionParams
from privacy.secagg.policy import DEFAULT_POLICY, SecAggPolicy
from privacy.secagg.prg import combine
from privacy.secagg.shamir import reconstruct_secret, reconstruct_secrets
from privacy.secagg.stages import REPLY_TYPE, Stage
from privacy.secagg.workers import cpu_seconds, default_threads


class Status(Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    ABORTED = "aborted"


class SecAggServer:
    """One round of secure aggregation, server side."""

    def __init__(self, config: SessionParams, policy: SecAggPolicy = DEFAULT_POLICY,
                 trusted: TrustedKeys | None = None,
                 ahead: Mapping[int, bytes] | None = None) -> None:
        why = policy.violation(config)
        if why is not None:
            raise ValueError(f"session below the secure-aggregation policy: {why}")
        if config.keys_ahead != (ahead is not None) or (
                ahead is not None and set(ahead) != set(config.participants)):
            raise ValueError("a session with keys advertised ahead needs exactly one "
                             "advertisement per participant, and only such a session")
        self._given = dict(ahead or {})  # keys_ahead: the advertisements, until start()
        self.ahead: dict[int, bytes] = {}  # advertise_ahead: next round's, by sender
        self.config = config
        self.policy = policy
        self.trusted = trusted  # malicious mode: advertisements by others are rejected
        self.neighbours: dict[int, frozenset[int]] = self._graph(config.seed)
        self.advertised: tuple[tuple[int, bytes], ...] = ()  # malicious: the list
        self.list_digest = b""
        self._signatures: dict[int, bytes] = {}  # malicious: consistency signatures
        self._consistency = b""  # malicious: what they sign
        self._presigned: dict[int, bytes] = {}  # presign: the valid pre-signatures
        self.stage = Stage.SETUP  # the stage whose replies are awaited
        self.status = Status.RUNNING
        self.abort_reason: str | None = None
        self.dropouts: dict[Stage, frozenset[int]] = {}
        self.rejected: dict[int, str] = {}
        self.excluded: dict[int, str] = {}  # left out through no fault (too few neighbours)
        self.ignored: list[tuple[int, str]] = []  # late or unsolicited messages
        self.survivors: frozenset[int] = frozenset()
        self.seconds: dict[Stage, float] = {}  # wall time spent in the session per stage
        self.cpu_seconds: dict[Stage, float] = {}  # and this thread's CPU time
        self.awaiting: set[int] = set()
        self._received: dict[int, object] = {}
        self._keys: dict[int, PeerKeys] = {}
        self._commitments: dict[int, bytes] = {}  # u -> commitment to b_u
        self._told_keys: dict[int, frozenset[int]] = {}  # u -> peers whose keys u got
        self._cts: dict[int, dict[int, bytes]] = {}  # sender -> receiver -> ciphertext
        self._forwarded: dict[int, frozenset[int]] = {}  # u -> senders forwarded to u
        self._masked_with: dict[int, frozenset[int]] = {}  # survivor -> peers in its masks
        self._holds: dict[int, frozenset[int]] = {}  # survivor -> peers whose shares it holds
        self._early: dict[int, msg.MaskedInput] = {}  # merged flow: inputs with the shares
        self._pending: dict[int, msg.ForwardedShares] = {}  # merged: shares for the next msg
        self.merged = False  # whether the masked inputs came with the shares (no fallback)
        self._late_failed: dict[int, tuple[int, ...]] = {}  # merged: failed shares reported
        self._summed: dict[int, np.ndarray] = {}  # masked vectors added into _sum so far
        self._sum: np.ndarray | None = None  # their running sum (words, wrapping)
        self._requested: dict[int, frozenset[tuple[int, ShareKind]]] = {}
        self._dropped_needed: frozenset[int] = frozenset()
        self._result: np.ndarray | None = None
        self._probe = kx.new_private_key()  # agrees with each advertised key, to check it

    # --- public API --------------------------------------------------------

    @property
    def participants(self) -> tuple[int, ...]:
        return self.config.participants

    def _graph(self, seed: bytes) -> dict[int, frozenset[int]]:
        cfg = self.config
        rows = np.array(cfg.participants, dtype=np.uint64)[neighbour_array(cfg.n, cfg.k, seed)]
        return {c: frozenset(row) for c, row in zip(cfg.participants, rows.tolist(),
                                                    strict=True)}

    def start(self) -> dict[int, bytes]:
        """The SETUP message for every participant; opens stage 1."""
        if self.stage != Stage.SETUP:
            raise RuntimeError("session already started")
        self._open(Stage.ADVERTISE_KEYS, set(self.participants))
        setups = {c: msg.encode_setup(self.config, c) for c in self.participants}
        if not self.config.keys_ahead:
            return setups
        given, self._given = self._given, {}
        for c in self.participants:  # stage 1's replies, checked as such
            self.receive(c, given[c])
        keys = self.advance()
        return {c: msg.bundle(MsgType.SETUP_AND_KEYS, setups[c], payload)
                for c, payload in keys.items()}

    def receive(self, sender: int, payload: bytes) -> bool:
        """Take one client reply; False (and a recorded reason) if not accepted."""
        if self.status is not Status.RUNNING:
            self.ignored.append((sender, f"session {self.status.value}"))
            return False
        if sender not in self.neighbours:
            self.rejected[sender] = "not a participant of this round"
            return False
        if sender in self._received:
            self._reject(sender, f"duplicate message in stage {self.stage.name}")
            return False
        if sender not in self.awaiting:
            why = "already rejected" if sender in self.rejected else "not awaited in this stage"
            self.ignored.append((sender, f"{why} ({self.stage.name})"))
            return False
        started = time.perf_counter(), cpu_seconds()
        try:
            accepted = self._accept(sender, payload)
            if isinstance(accepted, msg.MaskedInput):
                self._add_vector(sender, accepted.vector)
            self._received[sender] = accepted
        except ProtocolError as exc:
            self._reject(sender, exc.reason)
            return False
        finally:
            self._clock(self.stage, started)
        self.awaiting.discard(sender)
        return True

    def receive_sum(self, senders: list[int], total: np.ndarray,
                    failed: dict[int, tuple[int, ...]] | None = None) -> bool:
        """Stage 3 summed outside the session (e.g. over a ring of silos): ``total`` is the
        sum mod 2^bits of the masked vectors of ``senders``, in place of one MASKED_INPUT
        each, so the session never holds a single vector; ``failed`` gives each sender's
        peers whose shares did not authenticate. A sum cannot be taken apart, so it must
        hold exactly the clients awaited in this stage, none of them reporting a failed
        share; otherwise the session aborts (no share was requested yet) and this returns
        False."""
        if self.status is not Status.RUNNING or self.stage is not Stage.MASKED_INPUT:
            raise RuntimeError(f"a masked sum belongs to stage MASKED_INPUT, not "
                               f"{self.stage.name} ({self.status.value})")
        started = time.perf_counter(), cpu_seconds()
        cfg, who = self.config, set(senders)
        bad = {u: tuple(v) for u, v in (failed or {}).items() if v}
        try:
            if who != self.awaiting or self._received:
                reason = (f"the sum holds clients {sorted(who)}, the stage awaits exactly "
                          f"{sorted(self.awaiting | set(self._received))}")
            elif bad:
                u = min(bad)
                reason = (f"client {u} could not authenticate the shares of {list(bad[u])}; "
                          "their vectors cannot be taken out of a sum")
            elif total.shape != (cfg.dim,) or total.dtype.kind != "u":
                reason = f"the sum is {total.dtype} {total.shape}, expected {cfg.dim} words"
            elif cfg.bits < 8 * total.dtype.itemsize and int(total.max(initial=0)) >> cfg.bits:
                reason = f"the sum has values >= 2^{cfg.bits}"
            else:
                self._sum = np.array(total, dtype=cfg.word_dtype)
                none = np.empty(0, cfg.word_dtype)
                self._received = {u: msg.MaskedInput((), none) for u in sorted(who)}
                self.awaiting = set()
                return True
            self._abort(f"masked sum refused: {reason}")
            return False
        finally:
            self._clock(Stage.MASKED_INPUT, started)

    def advance(self) -> dict[int, bytes]:
        """Close the open stage (missing replies count as dropouts); next messages."""
        if self.status is not Status.RUNNING:
            return {}
        if self.stage == Stage.SETUP:
            raise RuntimeError("call start() first")
        stage = self.stage
        self.dropouts[stage] = frozenset(self.awaiting)
        closers: dict[Stage, Callable[[], dict[int, bytes]]] = {
            Stage.ADVERTISE_KEYS: self._close_advertise_keys,
            Stage.SHARE_KEYS: self._close_share_keys,
            Stage.MASKED_INPUT: self._close_masked_input,
            Stage.CONSISTENCY_CHECK: self._close_consistency_check,
            Stage.UNMASKING: self._close_unmasking,
        }
        started = time.perf_counter(), cpu_seconds()
        try:
            return closers[stage]()
        except Aborted as exc:
            self._abort(exc.reason)
            return {}
        finally:
            self._clock(stage, started)

    def result(self) -> np.ndarray:
        """The sum mod 2^bits of the survivors' inputs; raises Aborted if aborted."""
        if self.status is Status.ABORTED:
            raise Aborted(self.abort_reason or "aborted")
        if self._result is None:
            raise RuntimeError(f"round not finished (awaiting {self.stage.name})")
        return self._result

    # --- receiving ---------------------------------------------------------

    def _accept(self, sender: int, payload: bytes) -> object:
        h = msg.read_header(payload)
        cfg = self.config
        if (h.run_id, h.round_id) != (cfg.run_id, cfg.round_id):
            raise ProtocolError(
                f"replayed or misdirected: message of run {h.run_id} round {h.round_id}, "
                f"session is run {cfg.run_id} round {cfg.round_id}"
            )
        if h.client_id != sender:
            raise ProtocolError(f"header names client {h.client_id}, sent by {sender}")
        expected = REPLY_TYPE[self.stage]
        if h.kind not in expected or (h.kind is MsgType.SHARES_AND_INPUT
                                      and not cfg.merged):
            raise ProtocolError(f"{h.kind.name} message in stage {self.stage.name}")
        handler = {
            Stage.ADVERTISE_KEYS: self._accept_keys,
            Stage.SHARE_KEYS: self._accept_shares,
            Stage.MASKED_INPUT: self._accept_masked_input,
            Stage.CONSISTENCY_CHECK: self._accept_consistency,
            Stage.UNMASKING: self._accept_unmask_response,
        }[self.stage]
        return handler(sender, payload)

    def _accept_keys(self, sender: int, payload: bytes) -> tuple[PeerKeys, bytes]:
        _, m = msg.decode_advertise_keys(payload)
        if m.c_pk == m.s_pk:
            raise ProtocolError("the two advertised public keys are identical")
        kx.agree(self._probe, m.c_pk)  # ProtocolError for low-order or malformed points
        kx.agree(self._probe, m.s_pk)
        if bool(m.identity) != self.config.malicious:
            raise ProtocolError("a signed advertisement is needed in the malicious mode, an "
                                "unsigned one otherwise")
        if m.identity:
            cfg = self.config
            message = mal.advert_message(cfg.run_id, cfg.round_id, sender, m.c_pk, m.s_pk,
                                         m.b_commitment, m.identity)
            checker = self.trusted or TrustedKeys([m.identity])
            if not mal.verify(checker, m.identity, m.signature, message):
                why = "untrusted identity" if m.identity not in checker else "bad signature"
                raise ProtocolError(f"advertisement refused: {why}")
            return PeerKeys(sender, m.c_pk, m.s_pk, m.b_commitment, m.identity,
                            m.signature), m.b_commitment
        return PeerKeys(sender, m.c_pk, m.s_pk), m.b_commitment

    def _accept_consistency(self, sender: int, payload: bytes) -> bytes:
        """A consistency signature, verified when the stage closes (as far as needed)."""
        _, signature, failed = msg.decode_consistency_reply(payload)
        self._late_failed.pop(sender, None)
        if failed:
            self._check_failed(sender, failed)
            self._late_failed[sender] = failed
        return signature

    def _check_failed(self, sender: int, failed: tuple[int, ...]) -> None:
        """Failed shares reported after the merged flow's shares: only of their senders."""
        if not self.merged:
            raise ProtocolError("reports failed shares outside the merged flow")
        unknown = set(failed) - self._forwarded[sender]
        if unknown:
            raise ProtocolError(f"reports failed shares it was never sent: {sorted(unknown)}")

    def _accept_shares(self, sender: int, payload: bytes) -> dict[int, bytes]:
        early = None
        kind = msg.read_header(payload).kind
        if self.config.presign and kind is MsgType.SHARES_AND_INPUT:
            raise ProtocolError("a pre-signed round needs the masked input with the shares "
                                f"and a consistency signature, got {kind.name}")
        if kind is MsgType.PRESIGNED_INPUT:
            if not self.config.presign:
                raise ProtocolError("a pre-signed input in a round that asks for none")
            _, m, early, signature = msg.decode_presigned_input(payload)
            identity = self._keys[sender].identity
            if not mal.verify(TrustedKeys([identity]), identity, signature, self._consistency):
                raise ProtocolError("pre-signature does not verify (on the whole "
                                    "advertisement list as the survivor set)")
            self._check_vector(early)
        elif kind is MsgType.SHARES_AND_INPUT:
            _, m, early = msg.decode_shares_and_input(payload)
            self._check_vector(early)
        else:
            _, m = msg.decode_share_keys(payload)
        told = self._told_keys[sender]
        cts = dict(m.shares)
        for receiver in cts:
            if receiver not in self.neighbours[sender]:
                raise ProtocolError(f"share addressed to client {receiver}, not a neighbour")
            if receiver not in told:
                raise ProtocolError(f"share addressed to client {receiver}, not in its key list")
        missing = told - cts.keys()
        if missing:
            raise ProtocolError(f"no share for neighbours {sorted(missing)}")
        if early is not None:  # summed as it comes; taken out again if the fallback runs
            self._early[sender] = early
            self._add_vector(sender, early.vector)
            if kind is MsgType.PRESIGNED_INPUT:
                self._presigned[sender] = signature
        return cts

    def _accept_masked_input(self, sender: int, payload: bytes) -> msg.MaskedInput:
        _, m = msg.decode_masked_input(payload)
        self._check_vector(m)
        unknown = set(m.failed) - self._forwarded[sender]
        if unknown:
            raise ProtocolError(f"reports failed shares it was never sent: {sorted(unknown)}")
        return m

    def _check_vector(self, m: msg.MaskedInput) -> None:
        """A masked vector's length, word size and range."""
        cfg = self.config
        dtype = msg.wire_dtype(cfg.bits)  # narrowest word; summed in cfg.word_dtype
        if m.vector.size != cfg.dim or m.vector.dtype.itemsize != dtype.itemsize:
            raise ProtocolError(
                f"masked vector has {m.vector.size} words of {m.vector.dtype.itemsize} bytes, "
                f"expected {cfg.dim} of {dtype.itemsize}"
            )
        if cfg.bits < 8 * dtype.itemsize and int(m.vector.max()) >> cfg.bits:
            raise ProtocolError(f"masked vector has values >= 2^{cfg.bits}")

    def _accept_unmask_response(self, sender: int, payload: bytes) -> msg.UnmaskResponse:
        advert = None
        if msg.read_header(payload).kind is MsgType.UNMASK_AND_ADVERTISE:
            if not self.config.advertise_ahead:
                raise ProtocolError("an advertisement ahead in a session that asks for none")
            _, payload, advert = msg.unbundle(payload)
        _, m = msg.decode_unmask_response(payload)
        kinds: dict[int, ShareKind] = {}
        for s in m.shares:
            if kinds.setdefault(s.peer, s.kind) != s.kind:
                raise ProtocolError(f"response carries both shares of client {s.peer}")
        if m.failed:  # merged flow: shares that came with the request and did not decrypt
            self._check_failed(sender, m.failed)
        got = {(s.peer, s.kind) for s in m.shares}
        want = {(v, kind) for v, kind in self._requested[sender] if v not in m.failed}
        if got != want:
            raise ProtocolError("response does not match the shares requested")
        self._late_failed.pop(sender, None)
        if m.failed:
            self._late_failed[sender] = m.failed
        if advert is not None:
            try:  # checked in full (signature, keys) when the next round takes it
                msg.decode_advertise_keys(advert)
                self.ahead[sender] = advert
            except ProtocolError as exc:
                self.ignored.append((sender, f"advertisement ahead: {exc.reason}"))
        return m

    # --- closing stages ------------------------------------------------------

    def _close_advertise_keys(self) -> dict[int, bytes]:
        received: dict[int, tuple[PeerKeys, bytes]] = dict(self._received)  # type: ignore[arg-type]
        self._keys = {c: keys for c, (keys, _) in received.items()}
        self._commitments = {c: commitment for c, (_, commitment) in received.items()}
        owners: dict[bytes, list[int]] = {}
        for c, pk in self._keys.items():
            for key in (pk.c_pk, pk.s_pk):
                owners.setdefault(key, []).append(c)
        for clients in owners.values():
            if len(set(clients)) > 1:
                for c in clients:
                    self._reject(c, "public key also advertised by another client")
                    self._keys.pop(c, None)
        if self.config.malicious:
            self._derive_graph()
        if self.config.presign:  # what every listed client signs with its masked input
            cfg, ids = self.config, tuple(c for c, _ in self.advertised)
            self._consistency = mal.consistency_message(cfg.run_id, cfg.round_id, ids,
                                                        self.list_digest)
        active = self._prune(set(self._keys), "keys")
        self._told_keys = {u: self.neighbours[u] & active for u in active}
        out = {}
        listed = msg.encode_list(self.advertised) if self.config.malicious else None
        for u in sorted(active):
            entries = tuple(self._keys[v] for v in sorted(self._told_keys[u]))
            h = self._header(MsgType.PUBLIC_KEYS, u)
            out[u] = msg.encode_public_keys(h, msg.PublicKeys(entries, self.advertised),
                                            signed=self.config.malicious, listed=listed)
        self._open(Stage.SHARE_KEYS, active)
        return out

    def _derive_graph(self) -> None:
        """Malicious mode: the advertisement list of the valid advertisers (one identity
        each) and the graph from its digest."""
        cfg = self.config
        holders: dict[bytes, list[int]] = {}
        for c, pk in self._keys.items():
            holders.setdefault(pk.identity, []).append(c)
        for clients in holders.values():
            if len(clients) > 1:
                for c in clients:
                    self._reject(c, "identity also used by another client")
                    self._keys.pop(c, None)
        entries = []
        for c in sorted(self._keys):
            pk = self._keys[c]
            message = mal.advert_message(cfg.run_id, cfg.round_id, c, pk.c_pk, pk.s_pk,
                                         pk.b_commitment, pk.identity)
            entries.append((c, mal.advert_digest(message, pk.signature)))
        self.advertised = tuple(entries)
        self.list_digest = mal.list_digest(cfg.run_id, cfg.round_id, self.advertised)
        self.neighbours = self._graph(mal.derive_seed(self.list_digest))

    def _close_share_keys(self) -> dict[int, bytes]:
        """Merged flow, every client sent PUBLIC_KEYS answered with shares: the masked
        inputs that came with them are the masked-input stage's (a client that sent shares
        alone is its dropout), and each survivor's shares go with the next message.
        Otherwise (the fallback, or the classic flow) the shares are forwarded and the
        masked-input stage runs: the early inputs are discarded."""
        self._cts = dict(self._received)  # type: ignore[arg-type]
        if self.config.presign:
            self._check_presigned()
        self.merged = bool(self._early) and self._cts.keys() == self._told_keys.keys()
        if not self.merged:
            for u in list(self._summed):
                self._remove_vector(u)
            self._early, self._summed, self._sum = {}, {}, None
        active = self._prune(set(self._cts), "shares")
        out, shares = {}, {}
        for v in sorted(active):
            senders = sorted(self.neighbours[v] & active)
            self._forwarded[v] = frozenset(senders)
            shares[v] = msg.ForwardedShares(tuple((u, self._cts[u][v]) for u in senders))
            if not self.merged:
                h = self._header(MsgType.FORWARDED_SHARES, v)
                out[v] = msg.encode_forwarded_shares(h, shares[v])
        self._open(Stage.MASKED_INPUT, active)
        if not self.merged:
            return out
        self._received = dict(self._early)
        self.dropouts[Stage.MASKED_INPUT] = frozenset(active - self._early.keys())
        self.awaiting, self._early, self._pending = set(), {}, shares
        return self._close_masked_input()

    def _with_shares(self, out: dict[int, bytes]) -> dict[int, bytes]:
        """Merged flow: each message of ``out`` with its recipient's forwarded shares in
        front (the first message after the shares came, once)."""
        pending, self._pending = self._pending, {}
        if not pending:
            return out
        return {w: msg.with_shares(payload, pending[w]) for w, payload in out.items()}

    def _close_masked_input(self) -> dict[int, bytes]:
        inputs: dict[int, msg.MaskedInput] = dict(self._received)  # type: ignore[arg-type]
        for u in sorted(inputs):
            for v in inputs[u].failed:
                if v not in self.rejected:
                    self.rejected[v] = (
                        f"its share for client {u} failed authentication (AES-GCM tag)"
                    )
        survivors = frozenset(u for u in inputs if u not in self.rejected)
        self.survivors = survivors
        if not survivors:
            raise Aborted("no client sent a valid masked input")
        few = self.policy.survivors_violation(len(survivors))
        if few is not None:
            raise Aborted(f"{few}; no share was requested")
        self._masked_with = {u: self._forwarded[u] - set(inputs[u].failed) for u in survivors}
        self._holds = dict(self._masked_with)
        if self.policy.require_connected:
            links = {u: self._masked_with[u] & survivors for u in survivors}
            part = component_of(min(survivors), links)
            if len(part) < len(survivors):
                raise Aborted(f"the survivors' graph is disconnected ({len(part)} of "
                              f"{len(survivors)} clients reachable from client "
                              f"{min(survivors)}): each part's sum would be revealed; "
                              "no share was requested")
        for u in set(self._summed) - survivors:
            self._remove_vector(u)
        self._summed = {}  # the sum is all that is kept of the survivors' vectors
        if self.config.presign:  # signed already: S is the whole list, checked at close
            if survivors != {c for c, _ in self.advertised}:  # unreachable after the check
                raise Aborted("pre-signed round: the survivors are not the signed list; "
                              "no share was requested")
            self._signatures = dict(self._presigned)
            return self._with_shares(self._unmask_requests(survivors))
        if self.config.malicious:
            return self._with_shares(self._consistency_check())
        return self._with_shares(self._unmask_requests(survivors))

    def _check_presigned(self) -> None:
        """A pre-signed round: every listed client must have sent its masked input with a
        valid pre-signature (the survivor set is then the list); else abort, since the
        pre-signers signed their one set of the round and no other set can reach a
        quorum."""
        listed = [c for c, _ in self.advertised]
        missing = [c for c in listed if c not in self._presigned or c in self.rejected]
        if not missing:
            return
        why = []
        for c in missing[:5]:
            if c in self.rejected:
                why.append(f"{c}: rejected: {self.rejected[c]}")
            elif c in self.excluded:
                why.append(f"{c}: {self.excluded[c]}")
            elif c in self.dropouts.get(Stage.SHARE_KEYS, ()):
                why.append(f"{c}: dropped")
            elif c in self._cts:
                why.append(f"{c}: sent its shares without its masked input")
            else:
                why.append(f"{c}: no masked input with a pre-signature")
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise Aborted(f"pre-signed round: {len(missing)} of the {len(listed)} listed clients "
                      f"sent no valid masked input with a pre-signature ({'; '.join(why)}"
                      f"{more}); the others signed the whole list as their one survivor set "
                      "of this round, so no other set can reach a quorum; no share was "
                      "requested")

    def _consistency_check(self) -> dict[int, bytes]:
        """Malicious mode: send every survivor the survivor set to sign."""
        cfg, ids = self.config, tuple(sorted(self.survivors))
        self._consistency = mal.consistency_message(cfg.run_id, cfg.round_id, ids,
                                                    self.list_digest)
        body = msg.consistency_check_body(msg.ConsistencyCheck(ids))
        out = {w: msg.encode_consistency_check(self._header(MsgType.CONSISTENCY_CHECK, w),
                                               msg.ConsistencyCheck(ids), body=body)
               for w in ids}
        self._open(Stage.CONSISTENCY_CHECK, set(self.survivors))
        return out

    def _close_consistency_check(self) -> dict[int, bytes]:
        """Verify the signatures in id order until a quorum is valid: those are the ones
        forwarded, and a signer whose signature fails is rejected. Later ones are not
        verified: no client relies on them (each checks the forwarded quorum itself), and
        their signers answer the unmask request like the others."""
        self._signatures = dict(self._received)  # type: ignore[arg-type]
        self._blame_failed()
        for v in self.rejected:
            self._signatures.pop(v, None)
        need = self._quorum()
        valid = 0
        for w in sorted(self._signatures):
            if valid == need:
                break
            identity = self._keys[w].identity
            if mal.verify(TrustedKeys([identity]), identity, self._signatures[w],
                          self._consistency):
                valid += 1
            else:
                del self._signatures[w]
                self._reject(w, "consistency signature does not verify")
        if valid < need:
            raise Aborted(f"{valid} consistency signatures, {need} needed; "
                          "no share was requested")
        return self._unmask_requests(frozenset(self._signatures))

    def _quorum(self) -> int:
        """The consistency signatures forwarded: the quorum of this policy, or of the
        default one (the clients') where that asks for more."""
        fraction = max(self.policy.corrupt_fraction, DEFAULT_CORRUPT_FRACTION)
        return mal.quorum(len(self.advertised), self.config.t, fraction)

    def _unmask_requests(self, responders: frozenset[int]) -> dict[int, bytes]:
        """Check that every needed secret has t holders among ``responders`` (the survivors,
        or those who signed the survivor set), then ask each for its shares."""
        survivors = self.survivors
        holders: dict[int, list[int]] = {}
        for w in sorted(responders):
            for v in self._holds[w]:
                holders.setdefault(v, []).append(w)
        t = self.config.t
        for u in sorted(survivors):
            if len(holders.get(u, ())) < t:
                raise Aborted(
                    f"client {u}'s self-mask would have {len(holders.get(u, ()))} of "
                    f"{t} shares among survivors; no share was requested"
                )
        dropped = frozenset(holders) - survivors
        for v in sorted(dropped):
            if len(holders[v]) < t:
                raise Aborted(
                    f"dropped client {v}'s masking key would have {len(holders[v])} of "
                    f"{t} shares among survivors; no share was requested"
                )
        self._dropped_needed = dropped
        malicious = self.config.malicious
        need = self._quorum()
        signed = tuple(msg.SignedSet(self._keys[w], self._signatures[w])
                       for w in sorted(self._signatures)[:need]) if malicious else ()
        block = msg.encode_signed_sets(signed) if malicious else None  # one for all
        out = {}
        for w in sorted(responders):
            mine = self._holds[w]
            req = msg.UnmaskRequest(tuple(sorted(mine & survivors)),
                                    tuple(sorted(mine & dropped)), signed)
            self._requested[w] = frozenset(
                [(v, ShareKind.SELF_MASK) for v in req.survivors]
                + [(v, ShareKind.MASK_KEY) for v in req.dropped]
            )
            out[w] = msg.encode_unmask_request(self._header(MsgType.UNMASK_REQUEST, w), req,
                                               signed=malicious, block=block)
        self._open(Stage.UNMASKING, set(responders))
        return out

    def _close_unmasking(self) -> dict[int, bytes]:
        responses: dict[int, msg.UnmaskResponse] = dict(self._received)  # type: ignore[arg-type]
        for v in self._blame_failed():
            responses.pop(v, None)  # its shares are ignored; its vector stays in the sum
        cfg = self.config
        shares: dict[tuple[int, ShareKind], list[tuple[int, bytes]]] = {}
        for w in sorted(responses):
            x = cfg.positions[w] + 1
            for s in responses[w].shares:
                shares.setdefault((s.peer, s.kind), []).append((x, s.share))
        needed = [(u, ShareKind.SELF_MASK) for u in sorted(self.survivors)]
        needed += [(v, ShareKind.MASK_KEY) for v in sorted(self._dropped_needed)]
        for key in needed:
            got = shares.get(key, [])
            if len(got) < cfg.t:
                what = "self-mask" if key[1] is ShareKind.SELF_MASK else "masking key"
                raise Aborted(f"only {len(got)} of {cfg.t} shares of client {key[0]}'s {what}")
        secrets = self._recover_all({key: shares[key] for key in needed})
        masks = []
        for u in sorted(self.survivors):
            masks.append((secrets[(u, ShareKind.SELF_MASK)], -1))
        for v in sorted(self._dropped_needed):
            sk = kx.private_key_from_bytes(secrets[(v, ShareKind.MASK_KEY)])
            for w in sorted(self.survivors):
                if v in self._masked_with[w]:
                    shared = kx.agree(sk, self._keys[w].s_pk)
                    seed = kx.pair_seed(shared, cfg.run_id, cfg.round_id, v, w)
                    masks.append((seed, -1 if w < v else 1))  # undo w's +-PRG(s_wv)
        total = self._sum
        if total is None:  # unreachable: every survivor's vector is in the sum
            raise Aborted("no masked input to unmask")
        self._result = combine([], masks, cfg.dim, cfg.bits, out=total, accumulate=True,
                               threads=default_threads())
        self._sum = None
        self.status = Status.COMPLETED
        self.awaiting = set()
        return {}

    # --- helpers ------------------------------------------------------------

    def _blame_failed(self) -> set[int]:
        """Merged flow: reject the senders of shares reported failed with the next message
        (their vectors are in the sum already and stay there); the holders lose them."""
        blamed = set()
        for u, failed in sorted(self._late_failed.items()):
            if u in self._holds:
                self._holds[u] = self._holds[u] - set(failed)
            for v in failed:
                blamed.add(v)
                self.rejected.setdefault(
                    v, f"its share for client {u} failed authentication (AES-GCM tag)")
        self._late_failed = {}
        return blamed

    def _valid(self, key: tuple[int, ShareKind]) -> tuple[Callable[[bytes], bool], str]:
        """How a reconstructed secret is checked, and what it is (for an abort reason)."""
        c, kind = key
        if kind is ShareKind.SELF_MASK:
            return (lambda b: kx.commit(b) == self._commitments[c],
                    f"client {c}'s self-mask (commitment)")
        return (lambda b: kx.public_bytes(kx.private_key_from_bytes(b)) == self._keys[c].s_pk,
                f"client {c}'s masking key (public key)")

    def _recover_all(
        self, points: dict[tuple[int, ShareKind], list[tuple[int, bytes]]]
    ) -> dict[tuple[int, ShareKind], bytes]:
        """Every secret from its first t shares, checked; secrets whose first t holders
        coincide share one set of Lagrange coefficients. A secret that fails its check
        (or a group that fails to reconstruct) goes through :meth:`_recover`."""
        t = self.config.t
        groups: dict[tuple[int, ...], list[tuple[int, ShareKind]]] = {}
        for key, pts in points.items():
            groups.setdefault(tuple(x for x, _ in pts[:t]), []).append(key)
        out = {}
        for xs, keys in groups.items():
            try:
                values: list[bytes | None] = list(
                    reconstruct_secrets(xs, [[s for _, s in points[key][:t]] for key in keys])
                )
            except ProtocolError:
                values = [None] * len(keys)
            for key, value in zip(keys, values, strict=True):
                valid, what = self._valid(key)
                if value is not None and valid(value):
                    out[key] = value
                else:
                    out[key] = self._recover(points[key], valid, what)
        return out

    def _recover(
        self, points: list[tuple[int, bytes]], valid: Callable[[bytes], bool], what: str
    ) -> bytes:
        """The secret from t of the shares, checked; tries a second subset when it can."""
        t = self.config.t
        for subset in dict.fromkeys((tuple(points[:t]), tuple(points[-t:]))):
            try:
                secret = reconstruct_secret(subset)
            except ProtocolError:
                continue
            if valid(secret):
                return secret
        raise Aborted(f"shares of {what} do not reconstruct a matching value")

    def _add_vector(self, sender: int, vector: np.ndarray) -> None:
        """Add an accepted masked vector into the running sum as it arrives."""
        if self._sum is None:
            self._sum = np.array(vector, dtype=self.config.word_dtype)
        else:
            np.add(self._sum, vector, out=self._sum)
        self._summed[sender] = vector

    def _remove_vector(self, sender: int) -> None:
        """Take a vector back out of the running sum (its sender was rejected)."""
        vector = self._summed.pop(sender, None)
        if vector is not None and self._sum is not None:
            np.subtract(self._sum, vector, out=self._sum)

    def _prune(self, active: set[int], what: str) -> set[int]:
        """Leave out clients with fewer than t neighbours in ``active``, until stable; abort
        when fewer than the policy's ``min_survivors`` are left."""
        t = self.config.t
        changed = True
        while changed:
            changed = False
            for u in sorted(active):
                have = len(self.neighbours[u] & active)
                if have < t:
                    active.discard(u)
                    self.excluded[u] = (
                        f"only {have} neighbours left with {what} in stage "
                        f"{self.stage.name}, threshold {t}"
                    )
                    changed = True
        if not active:
            raise Aborted(f"no client has {t} neighbours left after stage {self.stage.name}")
        self._check_left(active)
        return active

    def _check_left(self, active: set[int]) -> None:
        few = self.policy.survivors_violation(len(active))
        if few is not None:
            raise Aborted(f"after stage {self.stage.name}: {few}; no share was requested")

    def _open(self, stage: Stage, expected: set[int]) -> None:
        self.stage = stage
        self.awaiting = set(expected)
        self._received = {}

    def _reject(self, sender: int, reason: str) -> None:
        self.rejected.setdefault(sender, reason)
        self.awaiting.discard(sender)
        self._received.pop(sender, None)
        self._late_failed.pop(sender, None)
        if self.stage in (Stage.SHARE_KEYS, Stage.MASKED_INPUT):
            self._early.pop(sender, None)
            self._remove_vector(sender)

    def _abort(self, reason: str) -> None:
        self.status = Status.ABORTED
        self.abort_reason = reason
        self.awaiting = set()
        self._summed, self._sum = {}, None

    def _clock(self, stage: Stage, started: tuple[float, float]) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started[0]
        self.cpu_seconds[stage] = self.cpu_seconds.get(stage, 0.0) + cpu_seconds() - started[1]

    def _header(self, kind: MsgType, client: int) -> Header:
        return Header(kind, self.config.run_id, self.config.round_id, client)
