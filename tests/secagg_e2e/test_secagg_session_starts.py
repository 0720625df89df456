"""A SecAgg+ session's start decides its first message and nothing else: a training start
sends the model and train config (``train.secagg``), a held start only SETUP and each
node's staleness factor (``query.secagg``), an evaluation start the model and evaluate
config (``evaluate.secagg``, in its own message group); every later stage is
``query.secagg`` in the same group."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message
from secagg_helpers import empty_model, synthetic_app, synthetic_inputs
from test_secure_evaluation import counting_app

from client.protocol.keys import ConfigKey
from client.protocol.secagg import SecAggKey, SecAggRecord
from privacy.secagg.eval_words import EvalWords
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import EvalStart, HeldStart, SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid

N, DIM, ROUND = 5, 40, 3


class PushedGrid(InProcessGrid):
    """Keeps every message the server pushes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pushed: list[Message] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        self.pushed.extend(messages)
        return super().push_messages(messages)


def kinds(grid: PushedGrid) -> list[tuple[str, str]]:
    """(message type, group) of the pushed messages, in push order, repeats left out."""
    seen: list[tuple[str, str]] = []
    for m in grid.pushed:
        kind = (m.metadata.message_type, m.metadata.group_id)
        if not seen or seen[-1] != kind:
            seen.append(kind)
    return seen


def session(grid: InProcessGrid) -> SecAggSession:
    return SecAggSession(grid, SecAggScenarioConfig(enabled=True), "examples", 7, 5.0, 0.001)


def test_a_training_start_sends_the_model_first_then_queries_in_the_rounds_group():
    grid = PushedGrid(synthetic_app(synthetic_inputs(N, DIM)), N)
    arrays, config = empty_model()
    out = session(grid).run(list(range(1, N + 1)), ROUND, TrainStart(arrays, config, DIM))
    assert out.status == "completed", out.abort_reason
    assert kinds(grid) == [("train.secagg", "3"), ("query.secagg", "3")]
    assert len(grid.pushed) == 3 * N  # three exchanges (the merged flow), nobody dropped
    first = grid.pushed[0].content
    assert "arrays" in first and "config" in first
    assert SecAggKey.FACTOR not in first[SecAggRecord.PROTOCOL]


def test_a_held_start_sends_each_node_its_factor_and_no_model():
    grid = PushedGrid(synthetic_app(synthetic_inputs(N, DIM)), N)
    factors = {node: 1.0 / node for node in range(1, N + 1)}
    session(grid).run(list(factors), ROUND, HeldStart(factors, DIM))  # no node holds a delta
    first = [m for m in grid.pushed if m.metadata.message_type == "query.secagg"][:N]
    assert {m.metadata.group_id for m in first} == {"3"}
    assert all("arrays" not in m.content and "config" not in m.content for m in first)
    assert {m.metadata.dst_node_id: m.content[SecAggRecord.PROTOCOL][SecAggKey.FACTOR]
            for m in first} == factors


def test_an_evaluation_start_sends_the_model_in_its_own_group():
    evaluated: list[int] = []
    grid = PushedGrid(counting_app(evaluated), N)
    start = EvalStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0}), EvalWords.for_sum(N, 32))
    out = session(grid).run(list(range(1, N + 1)), ROUND, start)
    assert out.status == "completed", out.abort_reason
    assert sorted(evaluated) == list(range(1, N + 1))
    assert kinds(grid) == [("evaluate.secagg", "eval-3"), ("query.secagg", "eval-3")]
    assert len(grid.pushed) == 3 * N  # the merged flow
    assert out.evaluation is not None and out.weighted_sum is None


def test_an_evaluation_session_takes_no_dp():
    dp = object()  # any DP controller: an evaluation is not covered by the accounting
    grid = InProcessGrid(counting_app([]), N)
    start = EvalStart(ArrayRecord(), ConfigRecord(), EvalWords.for_sum(N, 32))
    with pytest.raises(ValueError, match="a secure evaluation takes no DP"):
        SecAggSession(grid, SecAggScenarioConfig(enabled=True), "examples", 7, 5.0, 0.001,
                      dp).run([1, 2, 3], 1, start)  # type: ignore[arg-type]
