"""An in-process round: server and clients exchange only the byte messages.

For tests and benchmarks, and as the reference for a transport: each server
message is handed to its client, each reply back to the server, then the
server closes the stage. Dropouts and message tampering are injected here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from privacy.secagg.ahead import PendingAdverts
from privacy.secagg.client import SecAggClient
from privacy.secagg.errors import ProtocolError
from privacy.secagg.identity import Identity, TrustedKeys
from privacy.secagg.params import MALICIOUS, MERGED, SEMI_HONEST, SessionParams
from privacy.secagg.policy import DEFAULT_POLICY, SecAggPolicy
from privacy.secagg.server import SecAggServer, Status
from privacy.secagg.stages import Stage

#: (open stage, sender, receiver, payload) -> payload to deliver, or None to lose it.
#: The server is ``None``; both the server's prompt for stage s and the client's
#: reply are seen with stage s (e.g. PUBLIC_KEYS and SHARE_KEYS with Stage.SHARE_KEYS).
Intercept = Callable[[Stage, int | None, int | None, bytes], bytes | None]


def run_secagg_round(
    inputs: Sequence[np.ndarray],
    *,
    k: int | None = None,
    t: int | None = None,
    bits: int = 32,
    drop: Mapping[int, Stage] | None = None,
    ids: Sequence[int] | None = None,
    run_id: int = 0,
    round_id: int = 0,
    seed: bytes | None = None,
    intercept: Intercept | None = None,
    client_errors: dict[int, str] | None = None,
    client_seconds: dict[int, float] | None = None,
    policy: SecAggPolicy = DEFAULT_POLICY,
    security: str = SEMI_HONEST,
    identities: Mapping[int, Identity] | None = None,
    trusted: TrustedKeys | None = None,
    server_trusted: TrustedKeys | None = None,
    clients_out: dict[int, SecAggClient] | None = None,
    flow: str = MERGED,
    pending: PendingAdverts | None = None,
    previous: Mapping[int, SecAggClient] | None = None,
    exchanges: list[int] | None = None,
    presign: bool = False,
) -> tuple[np.ndarray | None, SecAggServer]:
    """Run one round; returns (sum mod 2^bits, server), or (None, server) if aborted.

    ``inputs[i]`` belongs to client ``ids[i]`` (default 1..n). ``drop[c] = s`` makes
    client c go silent from stage s on: it sends no reply belonging to stage s or
    later (Stage.UNMASKING: it masks its input but never answers the unmask
    request; Stage.MASKED_INPUT in the merged flow: it sends its shares without its
    masked input). A client that refuses a server message (ProtocolError) is silent from
    then on; its reason goes to ``client_errors``. ``client_seconds`` receives each
    client's total time in :meth:`SecAggClient.handle`. ``policy`` is both the server's
    and every client's (ValueError if the configuration is below it).

    ``security`` "malicious": every client gets ``identities[c]`` (fresh ones by default)
    and trusts ``trusted`` (by default exactly those identities) and requires the mode;
    the server gets ``server_trusted`` (None: it checks signatures, not trust).
    ``clients_out`` receives the clients. ``flow``: the message flow
    (:data:`~privacy.secagg.params.MERGED` or ``CLASSIC``).

    ``pending`` (keys advertised a round ahead, :mod:`privacy.secagg.ahead`): the clients
    advertise their next round's keys with their last reply, kept there, and the round
    uses those of this round when every client has one; ``previous``: the clients of
    the node's last round (each new client inherits its keys advertised ahead).
    ``presign``: in a malicious round that uses keys advertised ahead, the clients sign the
    survivor set (the whole list) with their masked inputs (``SessionParams.presign``).
    ``exchanges`` receives the number of server messages sent to clients in turn
    (exchanges) this round took.
    """
    n = len(inputs)
    ids = list(ids) if ids is not None else list(range(1, n + 1))
    drop = dict(drop or {})
    dim = int(np.asarray(inputs[0]).size)
    given = pending.take(run_id, round_id, ids) if pending is not None else None
    config = SessionParams.create(
        ids, dim, bits=bits, k=k, t=t, run_id=run_id, round_id=round_id, seed=seed,
        security=security, flow=flow, keys_ahead=given is not None,
        advertise_ahead=pending is not None,
        presign=presign,
    )
    server = SecAggServer(config, policy, server_trusted, given)
    if security == MALICIOUS:
        identities = identities or {c: Identity.generate() for c in ids}
        trusted = trusted or TrustedKeys(identities[c].public for c in ids)
        clients = {c: SecAggClient(c, run_id=run_id, round_id=round_id, policy=policy,
                                   identity=identities[c], trusted=trusted, security=MALICIOUS)
                   for c in ids}
    else:
        clients = {c: SecAggClient(c, run_id=run_id, round_id=round_id, policy=policy)
                   for c in ids}
    for c, client in clients.items():
        if previous is not None and c in previous:
            client.inherit(previous[c].carry_over())
    if clients_out is not None:
        clients_out.update(clients)
    for c, x in zip(ids, inputs, strict=True):
        if drop.get(c, Stage.UNMASKING) > Stage.MASKED_INPUT:  # else it never masks
            clients[c].set_input(x)
    silent: set[int] = set()
    outbox = server.start()
    sent = 0
    while server.status is Status.RUNNING:
        sent += bool(outbox)
        stage = server.stage
        for c, payload in outbox.items():
            if c in silent or drop.get(c, Stage.UNMASKING + 1) <= stage:
                continue
            if intercept is not None:
                payload = intercept(stage, None, c, payload)
                if payload is None:
                    continue
            started = time.perf_counter()
            try:
                reply = clients[c].handle(payload)
            except ProtocolError as exc:
                silent.add(c)
                if client_errors is not None:
                    client_errors[c] = exc.reason
                continue
            finally:
                if client_seconds is not None:
                    elapsed = time.perf_counter() - started
                    client_seconds[c] = client_seconds.get(c, 0.0) + elapsed
            if intercept is not None:
                reply = intercept(stage, c, None, reply)
                if reply is None:
                    continue
            server.receive(c, reply)
        outbox = server.advance()
    if exchanges is not None:
        exchanges.append(sent)
    if pending is not None:
        pending.offer(server.ahead)
    return (server.result() if server.status is Status.COMPLETED else None), server
