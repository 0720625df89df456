"""Keys advertised a round ahead over Flower messages: the session and the real ClientApp
(``client.secure_client``) on the in-process Grid, round after round. The first round
runs the usual flow; every later one whose cohort advertised ahead takes one exchange
fewer and gives the same sums; ``secagg.advertise_ahead = false`` gives the usual flow."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from secagg_helpers import Synthetic, empty_model, synthetic_inputs

from client.protocol.keys import MetricKey
from client.secure_client import register_secagg
from privacy.secagg.ahead import PendingAdverts
from privacy.secagg.identity import Identity, TrustedKeys
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid

N, DIM = 5, 40
IDENTITIES = {c: Identity.generate() for c in range(1, N + 1)}
TRUST = TrustedKeys(i.public for i in IDENTITIES.values())
EXCHANGES = {"semi_honest": 3, "malicious": 4}


class CountingGrid(InProcessGrid):
    """Counts the messages the server pushes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pushed = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self.pushed += len(messages)
        return super().push_messages(messages)


def _app(inputs) -> ClientApp:
    def local_update(msg: Message, context: Context) -> Synthetic:
        delta, examples = inputs[int(context.node_id)]
        return Synthetic(delta, MetricRecord({MetricKey.NUM_EXAMPLES: examples}))

    app = ClientApp()
    register_secagg(app, local_update,
                    identity=lambda context: (IDENTITIES[int(context.node_id)], TRUST))
    return app


def _rounds(security: str, ahead: bool, rounds: int = 4, presign: bool = False):
    grid = CountingGrid(_app(synthetic_inputs(N, DIM)), N)
    settings = SecAggScenarioConfig(enabled=True, security=security, advertise_ahead=ahead,
                                    presign=presign)
    session = SecAggSession(grid, settings, "examples", 7, 5.0, 0.001)
    pending = PendingAdverts()
    arrays, config = empty_model()
    out = []
    for rnd in range(1, rounds + 1):
        before = grid.pushed
        outcome = session.run(list(range(1, N + 1)), rnd, TrainStart(arrays, config, DIM),
                              pending=pending)
        assert outcome.status == "completed", outcome.abort_reason
        out.append((outcome, (grid.pushed - before) // N))
    return out, session, pending


@pytest.mark.parametrize("security", ["semi_honest", "malicious"])
def test_rounds_after_the_first_take_one_exchange_fewer_and_give_the_same_sums(security):
    ahead, _, _ = _rounds(security, True)
    usual, _, _ = _rounds(security, False)
    full = EXCHANGES[security]
    assert [e for _, e in ahead] == [full] + [full - 1] * 3
    assert [e for _, e in usual] == [full] * 4
    for (a, _), (b, _) in zip(ahead, usual, strict=True):
        np.testing.assert_array_equal(a.weighted_sum, b.weighted_sum)
        assert (a.total_weight, a.examples, a.replies) == (b.total_weight, b.examples, N)
        assert a.dropouts == b.dropouts and a.survivors == b.survivors
    # the first exchange is the training stage's, the share-keys work included
    assert "advertise_keys" in ahead[1][0].stage_seconds
    assert "share_keys" not in ahead[1][0].stage_seconds


def test_malicious_rounds_with_the_survivor_set_presigned_take_two_exchanges():
    """``secagg.presign`` (the default): a malicious round whose keys came ahead takes
    2 exchanges, as semi-honest, with the same sums as the usual flow."""
    assert SecAggScenarioConfig().presign is True
    signed, _, _ = _rounds("malicious", True, presign=True)
    usual, _, _ = _rounds("malicious", False, presign=True)  # no keys ahead: nothing to do
    assert [e for _, e in signed] == [4, 2, 2, 2]
    assert [e for _, e in usual] == [4] * 4
    for (a, _), (b, _) in zip(signed, usual, strict=True):
        np.testing.assert_array_equal(a.weighted_sum, b.weighted_sum)
        assert (a.total_weight, a.examples) == (b.total_weight, b.examples)
        assert a.survivors == b.survivors == list(range(1, N + 1))


def test_a_deployed_client_refuses_a_fresh_setup_for_a_round_its_ahead_keys_ran():
    out, session, pending = _rounds("semi_honest", True, rounds=2)
    assert out[1][1] == 2  # round 2 ran with the keys advertised ahead
    arrays, config = empty_model()
    again = session.run(list(range(1, N + 1)), 2, TrainStart(arrays, config, DIM))
    assert again.status == "aborted"
    assert all("one session per round" in why for why in again.errors.values())
    assert len(again.errors) == N
    nxt = session.run(list(range(1, N + 1)), 3, TrainStart(arrays, config, DIM),
                      pending=pending)  # round 3 still goes ahead: round 2's advertisements
    assert nxt.status == "completed", nxt.abort_reason
