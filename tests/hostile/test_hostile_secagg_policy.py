"""A server that sends sessions below the secure-aggregation policy: every real ClientApp
refuses, before training, and the refusal is recorded as a dropout with its reason.

The hostile server is the real secure round (``server.secagg_session``) with its own checks
switched off: its settings hand out weak (k, t) and an explicit weak server policy, and
its session can rewrite unmask requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import server.secagg_session as secagg_session_module
from client.app import MESSAGE_REFUSED, refuse_unusable_messages
from client.protocol.keys import ConfigKey, MetricKey
from client.secure_client import MIN_SURVIVORS_KEY, client_policy, register_secagg
from privacy.secagg import SecAggServer, Stage
from privacy.secagg import messages as m
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid
from tests.weak_secagg import WeakSettings

DIM = 40


@dataclass
class Update:
    delta: np.ndarray
    metrics: MetricRecord


def app_and_log(n: int) -> tuple[ClientApp, list[tuple[int, str]], list[Message]]:
    """Synthetic clients behind fedring's refusal mod; (app, trained nodes, replies)."""
    trained: list[tuple[int, str]] = []
    replies: list[Message] = []

    def local_update(msg: Message, context: Context) -> Update:
        trained.append((int(context.node_id), msg.metadata.message_type))
        delta = np.full(DIM, 0.01 * int(context.node_id), np.float32)
        return Update(delta, MetricRecord({MetricKey.NUM_EXAMPLES: 10}))

    app = ClientApp(mods=[refuse_unusable_messages])
    register_secagg(app, local_update)

    def recording(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        replies.append(reply)
        return reply

    return recording, trained, replies  # type: ignore[return-value]


def weak(k: int, t: int) -> WeakSettings:
    settings = WeakSettings(enabled=True)
    object.__setattr__(settings, "forced", (k, t))
    return settings


def run(n: int, settings: SecAggScenarioConfig, app: ClientApp):
    grid = InProcessGrid(app, n)
    session = SecAggSession(grid, settings, "examples", 7, 5.0, 0.001)
    return session.run(list(range(1, n + 1)), 1,
                       TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}), DIM))


# (every graph of degree k >= 2 is connected whatever the seed, so no disconnected one
# gets past the degree rule: privacy.secagg.graph)
FORGED = [("k = 1, t = 1", 4, 1, 1, "k = 1 neighbours is below the minimum 3"),
          ("k = 2 cycles", 6, 2, 2, "k = 2 neighbours is below the minimum 3"),
          ("t <= k/2", 5, 4, 2, "threshold t = 2 is not more than half of k = 4"),
          ("two clients", 2, 1, 1, "2 participants can never give the 3")]


@pytest.mark.parametrize(("n", "k", "t", "fragment"), [c[1:] for c in FORGED],
                         ids=[c[0] for c in FORGED])
def test_every_client_refuses_a_forged_setup_and_the_server_records_why(n, k, t, fragment):
    app, trained, replies = app_and_log(n)
    out = run(n, weak(k, t), app)
    assert (out.k, out.t) == (k, t)  # the forged session really went out
    assert trained == []  # refused before training
    assert len(replies) == n and all(r.has_error() for r in replies)
    assert {r.error.code for r in replies} == {MESSAGE_REFUSED}
    assert out.status == "aborted" and out.weighted_sum is None
    assert out.dropouts["advertise_keys"] == list(range(1, n + 1))
    for record in out.update_records():
        assert record.fate == "dropped"
        assert record.reason.startswith("dropped at stage advertise_keys: train.secagg "
                                        "message refused: session below the "
                                        "secure-aggregation policy: ")
        assert fragment in record.reason


class LyingSession(SecAggServer):
    """Unmask requests that name only one survivor, whatever survived (in the merged flow
    the forwarded shares still go with them)."""

    def advance(self) -> dict[int, bytes]:
        out = super().advance()
        if self.stage is Stage.UNMASKING:
            for c, payload in out.items():
                _, shares, request = m.split_shares(payload)
                h, req = m.decode_unmask_request(request)
                lie = m.encode_unmask_request(h, m.UnmaskRequest(req.survivors[:1], ()))
                out[c] = m.with_shares(lie, shares)
        return out


def test_every_client_refuses_an_unmask_request_with_too_few_survivors(monkeypatch):
    monkeypatch.setattr(secagg_session_module, "SecAggServer", LyingSession)
    n = 4
    app, trained, replies = app_and_log(n)
    out = run(n, SecAggScenarioConfig(enabled=True), app)  # n = 4: k = 3, t = 2
    assert sorted(node for node, _ in trained) == [1, 2, 3, 4]
    unmask = [r for r in replies if r.has_error()]
    assert len(unmask) == n
    assert out.status == "aborted" and out.weighted_sum is None
    assert "only 0 of 2 shares" in out.abort_reason
    assert out.dropouts["unmasking"] == [1, 2, 3, 4]
    for record in out.update_records():
        assert record.fate == "dropped"
        assert "query.secagg message refused: unmask request refused: 2 survivors, fewer " \
               "than the minimum 3" in record.reason


def test_the_honest_server_completes_with_the_same_clients():
    n = 4
    app, trained, replies = app_and_log(n)
    out = run(n, SecAggScenarioConfig(enabled=True), app)
    assert out.status == "completed" and out.survivors == [1, 2, 3, 4]
    assert not any(r.has_error() for r in replies) and len(trained) == n


def test_a_node_raises_its_minimums_in_its_node_config_and_never_lowers_them():
    def ctx(value: object) -> Context:
        return Context(run_id=1, node_id=1, node_config={MIN_SURVIVORS_KEY: value},
                       state=RecordDict(), run_config={})

    assert client_policy(ctx(5)).min_survivors == 5
    for lower in (2, 0, "3", True):
        with pytest.raises(ValueError, match=f"{MIN_SURVIVORS_KEY}.*can only be raised"):
            client_policy(ctx(lower))


def test_a_raised_node_minimum_refuses_what_the_default_accepts():
    n = 4
    app, trained, _ = app_and_log(n)
    grid = InProcessGrid(app, n)
    grid._contexts[2].node_config[MIN_SURVIVORS_KEY] = 5  # node 2 wants sums of 5 or more
    session = SecAggSession(grid, SecAggScenarioConfig(enabled=True), "examples", 7, 5.0, 0.001)
    out = session.run(list(range(1, n + 1)), 1,
                      TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}), DIM))
    assert sorted(node for node, _ in trained) == [1, 3, 4]
    assert out.dropouts["advertise_keys"] == [2]
    record = {r.client_id: r for r in out.update_records()}["2"]
    assert record.fate == "dropped" and "4 participants can never give the 5" in record.reason
    assert out.status == "completed" and out.survivors == [1, 3, 4]  # the rest go on
