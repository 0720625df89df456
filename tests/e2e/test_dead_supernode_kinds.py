"""A node that dies mid-run is a dropout on every round kind, never a rejected client.

The SuperLink answers a message to a node that stopped sending heartbeats with an error
reply of its own, sent from ``SUPERLINK_NODE_ID``; the Grid below answers exactly that way
(Flower's own ``create_message_error_unavailable_res_message``) and, as the SuperLink does,
no longer lists the node once it is gone. Each round kind must record the node as
``dropped`` with ``node <id> unreachable: <Flower's reason>`` and go on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.server.superlink.linkstate.utils import (
    NODE_UNAVAILABLE_ERROR_REASON,
    create_message_error_unavailable_res_message,
)

from client.protocol.ring import RingRecord
from server.cross_silo import judge
from server.settle import settle, unreachable
from simulations.apps import client_app, spec_from_run_config
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.silo_engine import ConcurrentGrid, silo_client_app
from simulations.task import ScenarioTask

DEAD = 2  # not node 1: in process, node ids start at 1, the SuperLink's own id
WHY = f"node {DEAD} unreachable: {NODE_UNAVAILABLE_ERROR_REASON}"


class GoneNode:
    """Mixin before a Grid class: node ``DEAD`` dies on its first message of type ``on``;
    from then on the SuperLink answers for it, and lists it no more."""

    def __init__(self, *args: Any, on: str = "train", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on, self.gone = on, False
        self.answered: list[Message] = []  # the SuperLink's replies for the dead node

    def get_node_ids(self) -> Iterable[int]:
        nodes = super().get_node_ids()  # type: ignore[misc]
        return [n for n in nodes if not (self.gone and n == DEAD)]

    def _deliver(self, msg_id: str, msg: Message) -> Message:
        kind = msg.metadata.message_type.split(".")[0]
        if msg.metadata.dst_node_id == DEAD and (self.gone or kind == self.on):
            self.gone = True
            reply = create_message_error_unavailable_res_message(msg.metadata, "node_unavail")
            self.answered.append(reply)
            return reply
        return super()._deliver(msg_id, msg)  # type: ignore[misc]


class GoneInProcess(GoneNode, InProcessGrid):
    pass


class GoneSilo(GoneNode, ConcurrentGrid):
    pass


FAST = ["train.local_epochs=1", "federation.min_clients=2"]
SECURE = ["secagg.enabled=true", 'secagg.neighbors="full"']
FEDBUFF = ["driver.kind=fedbuff", "federation.rounds=2"]
SILO = ["federation.clients=3", "federation.rounds=2", "silo.join_timeout_s=2.0",
        "silo.ring_timeout_s=2.0"]
KINDS: dict[str, tuple[list[str], str]] = {  # kind -> (overrides, the message it dies on)
    "sync": (["federation.clients=4", "federation.rounds=2"], "train"),
    "secure": (["federation.clients=4", "federation.rounds=2", *SECURE], "train"),
    "fedbuff": (["federation.clients=4", *FEDBUFF, "driver.buffer_size=2"], "train"),
    "secure_fedbuff": (["federation.clients=4", *FEDBUFF, "driver.buffer_size=3", *SECURE],
                       "train"),
    "cross_silo": ([*SILO, "driver.kind=cross_silo"], "train"),
    "gossip": ([*SILO, "driver.kind=gossip"], "train"),
    "secure_cross_silo": ([*SILO, "driver.kind=cross_silo", "federation.clients=4", *SECURE],
                          "train"),
    "evaluation": (["federation.clients=4", "federation.rounds=1",
                    "federation.evaluate_fraction=1"], "evaluate"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_node_the_superlink_says_is_gone_is_dropped(kind, run_inprocess, store):
    overrides, on = KINDS[kind]
    config = load_scenario("default", [*FAST, *overrides])
    clients = config["federation"]["clients"]
    silo = config["driver"]["kind"] in ("cross_silo", "gossip")
    grid = (GoneSilo(silo_client_app(ScenarioTask, spec_from_run_config), clients, on=on)
            if silo else GoneInProcess(client_app, clients, on=on))
    summary = run_inprocess(config, grid=grid)
    assert summary["status"] == "completed", summary
    assert grid.answered, "the node never died"
    run_id = summary["run_id"]
    if kind == "evaluation":
        mine = [e for _, e in store.evaluations(run_id) if e.client_id == str(DEAD)]
    else:
        mine = [u for _, u in store.updates(run_id) if u.client_id == str(DEAD)]
    assert mine and all(r.fate == "dropped" and WHY in r.reason for r in mine), mine
    if kind == "evaluation":
        others = [e for _, e in store.evaluations(run_id) if e.client_id != str(DEAD)]
        assert {e.fate for e in others} == {"accepted"}
    elif not silo:  # the others' updates go on; a ring fails with its member gone
        others = [u for _, u in store.updates(run_id) if u.client_id != str(DEAD)]
        assert {u.fate for u in others} <= {"accepted", "dropped"}
        assert any(u.fate == "accepted" for u in others)
    assert summary["versions"] >= 1  # the model went on without it
    if kind == "sync":  # the SuperLink's reply is no reply of the client's
        assert store.rounds(run_id)[1].num_replies == clients - 1


def sent_to(node: int, msg_id: str = "m1") -> Message:
    """A train message as the server pushed it to ``node``."""
    msg = Message(RecordDict(), node, "train", group_id="1")
    msg.metadata.__dict__["_message_id"] = msg_id
    return msg


def superlink_reply(msg: Message, error_type: str = "node_unavail") -> Message:
    return create_message_error_unavailable_res_message(msg.metadata, error_type)


def test_only_the_superlinks_own_error_reply_means_the_node_is_gone():
    msg = sent_to(7)
    assert unreachable(superlink_reply(msg), 7) == f"node 7 unreachable: " \
                                                  f"{NODE_UNAVAILABLE_ERROR_REASON}"
    assert "unreachable: Error: Reply Message Unavailable" in unreachable(
        superlink_reply(msg, "msg_unavail"), 7)
    crashed = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), reply_to=msg)
    claims = Message(Error(ErrorCode.NODE_UNAVAILABLE, "I am gone"), reply_to=msg)
    assert claims.metadata.src_node_id == 7  # a client cannot speak for the SuperLink
    assert unreachable(crashed, 7) is None and unreachable(claims, 7) is None
    forged = Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    forged.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
    assert unreachable(forged, 7) is None
    assert settle({"m1": (7, None)}, forged, None)[2] == (
        "reply to the message sent to node 7 says it comes from node 1")
    assert settle({"m1": (7, None)}, superlink_reply(msg), None) == ("7", None, None)


def test_a_gone_silo_keeps_its_reason_even_when_it_had_joined_the_rendezvous():
    order = [10, 11, 12]
    peer = Message(RecordDict({RingRecord.RESULT: ConfigRecord(
        {"status": "ring-timeout", "peers": [], "error": "ring rendezvous"}),
        "metrics": MetricRecord()}), 0, "train")
    outcome = judge(order, {10: superlink_reply(sent_to(10)), 11: peer}, dim=4,
                    joined={10, 11, 12})
    gone = next(r for r in outcome.records(version=0) if r.client_id == "10")
    assert gone.fate == "dropped"
    assert gone.reason.startswith(f"node 10 unreachable: {NODE_UNAVAILABLE_ERROR_REASON}")
    assert 10 in outcome.blamed  # as a silo that never came: its SuperNode is gone
