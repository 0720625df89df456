"""Malicious-mode SecAgg+ in every round kind beyond the sync round: secure FedBuff (held
updates), the cross-silo secure ring and secure federated evaluation, each on the real apps
in process with a PKI made for the run.

Each kind reaches the model (or the figures) of the semi-honest run of the same seed (the
masks cancel exactly either way), and each refuses a server that lies at unmasking: the
UNMASK_REQUEST to one client calls a survivor dropped, asking for shares of that
survivor's pairwise keys while the others reveal its self-mask seed (both would give the
server its masked input in the clear). Against the survivor set the client signed in the
consistency check, the client refuses, and its reason is stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message

from client.protocol.secagg import SecAggKey, SecAggRecord
from privacy.secagg import messages as msg
from privacy.secagg.messages import MsgType
from server.store import Store
from simulations.apps import client_app, spec_from_run_config
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.secagg_pki import make_pki
from simulations.silo_engine import ConcurrentGrid, silo_client_app
from simulations.task import ScenarioTask

App = Callable[[Message, Context], Message]
MALICIOUS = "secagg.security=malicious"
LIAR = 2  # the client the lying server sends a forged unmask request
REFUSAL = "lists as dropped a client of the signed survivor set"
COMMON = ["train.local_epochs=1", "data.partitioner=iid", "secagg.enabled=true"]


def lying(app: App | object, *, sessions: str = "") -> App:
    """``app`` behind a server that, in every session whose message group starts with
    ``sessions``, tells client :data:`LIAR` that another survivor dropped."""

    def deliver(message: Message, context: Context) -> Message:
        record = message.content.get(SecAggRecord.PROTOCOL)
        payload = record.get(SecAggKey.MSG) if isinstance(record, ConfigRecord) else None
        if int(context.node_id) == LIAR and isinstance(payload, bytes) and \
                message.metadata.group_id.startswith(sessions) and \
                msg.read_header(payload).kind is MsgType.UNMASK_REQUEST:
            h, m = msg.decode_unmask_request(payload, signed=True)
            victim = m.survivors[0]
            forged = dataclasses.replace(m, survivors=m.survivors[1:],
                                         dropped=tuple(sorted((*m.dropped, victim))))
            record[SecAggKey.MSG] = msg.encode_unmask_request(h, forged, signed=True)
        return app(message, context)  # type: ignore[operator]

    return deliver


def model(store: Store, summary: dict) -> np.ndarray:
    assert summary["status"] == "completed", summary
    return store.load_checkpoint(summary["run_id"]).params


def modes(store: Store, summary: dict) -> list[str]:
    return [row["security"] for row in store.secagg_rounds(summary["run_id"])]


def reasons(store: Store, summary: dict) -> list[str]:
    """Every stored reason of client :data:`LIAR`'s updates and evaluation answers."""
    run_id, cid = summary["run_id"], str(LIAR)
    return [u.reason or "" for _, u in store.updates(run_id) if u.client_id == cid] + \
        [e.reason or "" for _, e in store.evaluations(run_id) if e.client_id == cid]


# ---- secure FedBuff: the buffer's session starts from held updates (HeldStart)

FEDBUFF = ["federation.clients=4", "federation.rounds=2", *COMMON, "driver.kind=fedbuff",
           "driver.buffer_size=4"]


def test_secure_fedbuff_in_malicious_mode_reaches_the_semi_honest_model(run_inprocess, store):
    plain = run_inprocess(load_scenario("default", FEDBUFF))
    grid = InProcessGrid(client_app, 4, pki=make_pki(4))
    signed = run_inprocess(load_scenario("default", [*FEDBUFF, MALICIOUS]), grid=grid)
    np.testing.assert_array_equal(model(store, signed), model(store, plain))
    assert modes(store, plain) == ["semi_honest"] * 2
    assert modes(store, signed) == ["malicious"] * 2
    assert all("consistency_check" in row["dropouts"]
               for row in store.secagg_rounds(signed["run_id"]))


def test_secure_fedbuff_refuses_a_lying_server(run_inprocess, store):
    grid = InProcessGrid(lying(client_app), 4, pki=make_pki(4))
    summary = run_inprocess(load_scenario("default", [*FEDBUFF, MALICIOUS]), grid=grid)
    assert modes(store, summary) == ["malicious"] * 2
    assert sum(REFUSAL in why for why in reasons(store, summary)) == 2  # each buffer


# ---- the cross-silo secure ring: the masked-input stage runs over the ring

SILOS = 3


def silos(*extra: str) -> dict:
    return load_scenario("default", [f"federation.clients={SILOS}", "federation.rounds=1",
                                     "federation.min_clients=2", "driver.kind=cross_silo",
                                     *COMMON, *extra])


def silo_app() -> App:
    return silo_client_app(ScenarioTask, spec_from_run_config)  # type: ignore[return-value]


@pytest.mark.slow
def test_secure_ring_in_malicious_mode_reaches_the_semi_honest_model(run_inprocess, store):
    plain = run_inprocess(silos(), grid=ConcurrentGrid(silo_app(), SILOS))
    grid = ConcurrentGrid(silo_app(), SILOS, pki=make_pki(SILOS))
    signed = run_inprocess(silos(MALICIOUS), grid=grid)
    np.testing.assert_array_equal(model(store, signed), model(store, plain))
    assert modes(store, signed) == ["malicious"] and modes(store, plain) == ["semi_honest"]


@pytest.mark.slow
def test_secure_ring_refuses_a_lying_server(run_inprocess, store):
    grid = ConcurrentGrid(lying(silo_app()), SILOS, pki=make_pki(SILOS))
    summary = run_inprocess(silos(MALICIOUS), grid=grid)
    assert modes(store, summary) == ["malicious"]
    assert any(REFUSAL in why for why in reasons(store, summary))


# ---- secure federated evaluation: the evaluation totals' session (EvalStart)

EVAL = ["federation.clients=4", "federation.rounds=1", *COMMON,
        "federation.secure_evaluation=true", "federation.evaluate_fraction=1.0"]
FIGURES = ("federated_accuracy", "federated_loss", "federated_clients")


def figures(store: Store, summary: dict) -> dict[str, float]:
    [_, rnd] = store.rounds(summary["run_id"])
    return {key: rnd.metrics[key] for key in FIGURES}


def test_secure_evaluation_in_malicious_mode_gives_the_semi_honest_figures(run_inprocess,
                                                                          store):
    plain = run_inprocess(load_scenario("default", EVAL))
    grid = InProcessGrid(client_app, 4, pki=make_pki(4))
    signed = run_inprocess(load_scenario("default", [*EVAL, MALICIOUS]), grid=grid)
    assert figures(store, signed) == figures(store, plain)
    assert figures(store, signed)["federated_clients"] == 4
    assert [e.fate for _, e in store.evaluations(signed["run_id"])] == ["accepted"] * 4


def test_secure_evaluation_refuses_a_lying_server(run_inprocess, store):
    grid = InProcessGrid(lying(client_app, sessions="eval-"), 4, pki=make_pki(4))
    summary = run_inprocess(load_scenario("default", [*EVAL, MALICIOUS]), grid=grid)
    [(_, answer)] = [(r, e) for r, e in store.evaluations(summary["run_id"])
                     if e.client_id == str(LIAR)]
    assert REFUSAL in (answer.reason or "")
    assert not any(REFUSAL in u.reason for _, u in store.updates(summary["run_id"])
                   if u.reason)  # the training session was told the truth


@pytest.mark.slow
def test_a_silo_silent_in_the_consistency_check_takes_no_further_part(run_inprocess, store):
    """Silo 4 fails its round-1 consistency check: the other three sign (a quorum of the
    four listed), the round completes with its masked input, and round 2 runs without it,
    as after a silo silent in a key stage."""
    app = silo_app()

    def silent_once(message: Message, context: Context) -> Message:
        record = message.content.get(SecAggRecord.PROTOCOL)
        payload = record.get(SecAggKey.MSG) if isinstance(record, ConfigRecord) else None
        if int(context.node_id) == 4 and message.metadata.group_id == "1" and \
                isinstance(payload, bytes) and \
                msg.read_header(payload).kind is MsgType.CONSISTENCY_CHECK:
            raise RuntimeError("silo 4 went away")
        return app(message, context)

    grid = ConcurrentGrid(silent_once, 4, pki=make_pki(4))
    summary = run_inprocess(load_scenario("default", [
        "federation.clients=4", "federation.rounds=2", "federation.min_clients=2",
        "driver.kind=cross_silo", *COMMON, MALICIOUS]), grid=grid)
    first, second = store.secagg_rounds(summary["run_id"])
    assert first["status"] == "completed" and first["dropouts"]["consistency_check"] == ["4"]
    assert second["status"] == "completed" and second["participants"] == ["1", "2", "3"]
    [silent] = [u for rnd, u in store.updates(summary["run_id"], round=1) if u.client_id == "4"]
    assert silent.fate == "accepted" and silent.reason == (
        "masked input counted; no consistency signature (RuntimeError: silo 4 went away)")
