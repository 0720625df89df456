"""Secure aggregation changes who sees what, nothing else.

Real runs of fedring's ServerApp and ClientApp on the in-process engine: no client's loss
or example count reaches the server in the clear, the round's figures come out of the
secure sum (checked against what each client encoded), the model matches a plain run's
with ``clip_range = "auto"``, and what clients clip is counted and warned about.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from secagg_helpers import empty_model, synthetic_app, synthetic_inputs

import client.secure_client as secure_client
from client.protocol.keys import MetricKey
from privacy.secagg import max_scale
from privacy.secagg.quantize import LOSS_RANGE, LOSS_STEP, StatWords, error_bound, max_level
from server import secure_range
from server.app import make_server_app
from server.reporter import LogReporter, round_line
from server.secagg_config import AUTO_START_RANGE, SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from server.secure_aggregation import SecureAggregation
from server.secure_range import GROW, SHRINK
from server.store import Store
from simulations.apps import build_task, client_app, config_from_run_config
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.report import report_columns, round_table
from tests.recording_grid import RecordsReplies

BN_TASK = str(Path(__file__).with_name("bn_cnn_task.py"))
SECURE = "secagg.enabled=true"
CLEAR_KEYS = ("train_loss", MetricKey.NUM_EXAMPLES)


class RecordingGrid(RecordsReplies, InProcessGrid):
    """The in-process engine, keeping every reply the server pulls."""


class Messages(LogReporter):
    """The log reporter, keeping the run's messages and round lines."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        self.lines: list[str] = []

    def round_finished(self, rnd: int, metrics: dict[str, float]) -> None:
        self.lines.append(round_line(rnd, None, metrics))
        super().round_finished(rnd, metrics)

    def message(self, text: str) -> None:
        self.texts.append(text)
        super().message(text)


def run(config: dict[str, Any], db: str, *, grid: InProcessGrid | None = None,
        reporter: LogReporter | None = None,
        table: list[str] | None = None) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """A real run on the in-process engine: its summary and each round's metrics
    (``table``: gets the columns ``fedring report`` shows)."""
    result: dict[str, Any] = {}
    app = make_server_app(build_task, config_from_run_config, config=config, store_url=db,
                          on_summary=result.update, reporter=reporter)
    app(grid or InProcessGrid(client_app, config["federation"]["clients"]),
        Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    store = Store(db)
    try:
        rounds = [dict(r.metrics) for r in store.rounds(result["run_id"])[1:]]
        if table is not None:
            table += report_columns(round_table(store.rounds(result["run_id"])), wide=False)
    finally:
        store.close()
    return result, rounds


class Spy:
    """What each client encodes, by round: its stat words' inputs and its clipped delta."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.where = threading.local()
        self.stats: list[tuple[int, int, int, float, float | None]] = []
        self.deltas: list[tuple[int, np.ndarray, float]] = []
        encode, quantize = StatWords.encode, secure_client.quantize_into

        def spy_stats(words: StatWords, clipped: int, examples: float, loss: float | None):
            self.stats.append((self.where.round, self.where.node, clipped, examples, loss))
            return encode(words, clipped, examples, loss)

        def spy_quantize(delta: np.ndarray, weight: float, **kw: Any):
            self.deltas.append((self.where.round, np.array(delta, np.float64),
                                kw["clip_range"]))
            return quantize(delta, weight, **kw)

        monkeypatch.setattr(StatWords, "encode", spy_stats)
        monkeypatch.setattr(secure_client, "quantize_into", spy_quantize)

    def app(self, msg: Message, context: Context) -> Message:
        self.where.round, self.where.node = int(msg.metadata.group_id), int(context.node_id)
        return client_app(msg, context)

    def expected_loss(self, rnd: int) -> float:
        rows = [(e, loss) for r, _, _, e, loss in self.stats if r == rnd and loss is not None]
        return sum(e * loss for e, loss in rows) / sum(e for e, _ in rows)

    def clipped(self, rnd: int) -> int:
        """Coordinates beyond the range, counted here from the deltas the clients encoded."""
        return sum(int(np.count_nonzero(np.abs(d) > c)) for r, d, c in self.deltas if r == rnd)


def in_the_clear(reply: Message) -> list[str]:
    """The per-client figures a reply carries outside the masked vector."""
    if reply.has_error():
        return []
    found = []
    for name, record in reply.content.items():
        if isinstance(record, MetricRecord | ConfigRecord):
            found += [f"{name}.{key}" for key in record if key in CLEAR_KEYS]
    return found


def fast(*extra: str, clients: int = 6, rounds: int = 2) -> list[str]:
    return [f"federation.clients={clients}", f"federation.rounds={rounds}",
            "train.local_epochs=1", *extra]


@pytest.mark.parametrize("driver", [
    [], ["driver.kind=fedbuff", "driver.buffer_size=3", 'secagg.neighbors="full"']])
def test_no_client_figure_reaches_the_server_and_the_round_loss_is_their_mean(
        driver, tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    grid = RecordingGrid(spy.app, 6)
    config = load_scenario("default", fast(SECURE, *driver))
    summary, rounds = run(config, f"sqlite:///{tmp_path / 'r.db'}", grid=grid)
    assert summary["versions"] == 2
    assert len(grid.replies) >= 2 * 3 * 4  # every stage's replies of every round
    leaks = [found for reply in grid.replies if (found := in_the_clear(reply))]
    assert leaks == []
    for rnd, metrics in enumerate(rounds, start=1):
        # the decode of the summed stat words against what the clients themselves encoded
        assert metrics["train_loss"] == pytest.approx(spy.expected_loss(rnd), rel=1e-6)
        assert metrics["secagg_clipped"] == spy.clipped(rnd) == 0
    assert {r for r, *_ in spy.stats} == {1, 2}


def test_a_plain_round_does_send_its_figures_so_the_inspection_can_see_them(tmp_path):
    grid = RecordingGrid(client_app, 4)
    run(load_scenario("default", fast(clients=4, rounds=1)), f"sqlite:///{tmp_path / 'r.db'}",
        grid=grid)
    assert all(in_the_clear(reply) for reply in grid.replies)


def test_distributed_dp_sends_no_stat_words_and_no_loss(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    grid = RecordingGrid(spy.app, 4)
    config = load_scenario("default", fast(SECURE, "dp.mode=distributed",
                                           "dp.noise_multiplier=0.5",
                                           "aggregation.weight_by=uniform", clients=4,
                                           rounds=1))
    _, rounds = run(config, f"sqlite:///{tmp_path / 'r.db'}", grid=grid)
    assert spy.stats == [] and "train_loss" not in rounds[0]
    assert "secagg_clipped" not in rounds[0]
    assert [found for reply in grid.replies if (found := in_the_clear(reply))] == []


def test_under_central_dp_the_range_is_the_dp_clip_and_nothing_is_clipped(tmp_path):
    clip = 0.25
    config = load_scenario("default", fast(SECURE, "dp.mode=central", f"dp.clip={clip}",
                                           "dp.noise_multiplier=0.5",
                                           "aggregation.weight_by=uniform", clients=4))
    _, rounds = run(config, f"sqlite:///{tmp_path / 'r.db'}")
    assert [m["secagg_clip_range"] for m in rounds] == [clip, clip]
    assert [m["secagg_clipped"] for m in rounds] == [0.0, 0.0]  # |x_i| <= ||x|| <= clip


def accuracies(scenario: list[str], seed: int, tmp_path: Path) -> tuple[float, float, list]:
    plain, _ = run(load_scenario("default", scenario, values={"seed": seed}),
                   f"sqlite:///{tmp_path / 'plain.db'}")
    secure, rounds = run(load_scenario("default", [*scenario, SECURE], values={"seed": seed}),
                         f"sqlite:///{tmp_path / 'secure.db'}")
    return plain["final_accuracy"], secure["final_accuracy"], rounds


@pytest.mark.parametrize("seed", [5, 6])
def test_secure_matches_plain_on_the_default_scenario(seed, tmp_path):
    plain, secure, rounds = accuracies(fast(clients=10, rounds=3), seed, tmp_path)
    assert abs(secure - plain) <= 0.01, (plain, secure)
    assert [m["secagg_clipped"] for m in rounds] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("seed", [5, 6])
def test_secure_matches_plain_on_a_batch_norm_task_module(seed, tmp_path):
    scenario = [f"task.module={BN_TASK}", *fast(clients=5, rounds=3)]
    plain, secure, rounds = accuracies(scenario, seed, tmp_path)
    assert abs(secure - plain) <= 0.01, (plain, secure)
    assert [m["secagg_clipped"] for m in rounds] == [0.0, 0.0, 0.0]
    assert rounds[0]["secagg_clip_range"] == AUTO_START_RANGE


def test_the_clipped_count_is_what_the_clients_clipped_and_warns_once(tmp_path, monkeypatch,
                                                                      caplog):
    spy = Spy(monkeypatch)
    reporter = Messages()
    config = load_scenario("default", [f"task.module={BN_TASK}",
                                       *fast(SECURE, "secagg.clip_range=1", clients=4)])
    columns: list[str] = []
    with caplog.at_level(logging.WARNING, logger="server.secure_range"):
        _, rounds = run(config, f"sqlite:///{tmp_path / 'r.db'}",
                        grid=InProcessGrid(spy.app, 4), reporter=reporter, table=columns)
    dim = spy.deltas[0][1].size
    for rnd, metrics in enumerate(rounds, start=1):
        counted = spy.clipped(rnd)
        assert counted > 0 and metrics["secagg_clipped"] == counted
        assert metrics["secagg_clipped_fraction"] == pytest.approx(counted / (4 * dim))
        assert metrics["secagg_clip_range"] == 1.0
        assert f"{counted} values clipped" in reporter.lines[rnd - 1]
    assert "secagg_clipped" in columns  # fedring report's table, without --wide
    warnings = [r for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "server.secure_range"]
    assert len(warnings) == 1 and "secagg.clip_range" in warnings[0].getMessage()
    assert len([t for t in reporter.texts if "secagg.clip_range" in t]) == 1


def test_the_auto_range_grows_with_the_updates_and_the_sum_still_decodes_exactly(monkeypatch):
    margin = 16.0  # the mechanism's arithmetic, whatever the margin's value
    monkeypatch.setattr(secure_range, "MARGIN", margin)
    n, dim, cap = 5, 40, 100.0
    cfg = SecAggScenarioConfig(enabled=True, neighbors="full", max_weight=cap)
    secure = SecureAggregation(cfg, combine="mean", weight_by="examples", max_clients=n)
    arrays, config = empty_model()
    ranges, scales = [], []
    # round 1's mean is 400 everywhere (range margin * 400 next); round 2's deltas of 1500
    # would be clipped at round 1's range; round 3's of 20000 are clipped at round 2's, and
    # their signs (weights 10 to 50) leave a mean of a fifteenth of the range
    for rnd, size, signs in ((1, 400.0, "+++++"), (2, 1500.0, "-+-+-"), (3, 20000.0, "++--+")):
        inputs = {node: (np.full(dim, size * (1 if signs[node - 1] == "+" else -1),
                                 np.float32), 10 * node) for node in range(1, n + 1)}
        session = SecAggSession(InProcessGrid(synthetic_app(inputs), n),
                                secure.round_settings(None), "examples", 1, 30, 0.01)
        out = session.run(list(inputs), rnd, TrainStart(arrays, config, dim))
        assert out.status == "completed"
        r = out.clip_range
        assert out.scale == max_scale(n, cfg.bits, r, cap)  # the headroom redone for r
        assert n * max_level(r, out.scale, cap) < 1 << cfg.bits
        exact = sum(w * np.clip(d.astype(np.float64), -r, r) for d, w in inputs.values())
        np.testing.assert_allclose(out.weighted_sum, exact, rtol=0,
                                   atol=error_bound(n, out.scale, "nearest"))
        assert out.clipped == (n * dim if size > r else 0)
        secure.aggregate(out, None)
        ranges.append(r)
        scales.append(out.scale)
    assert ranges[0] == AUTO_START_RANGE
    assert ranges[1] == pytest.approx(margin * 400.0) and ranges[1] > ranges[0]
    assert scales[1] < scales[0]
    # round 2's mean: 1500 * (-10 + 20 - 30 + 40 - 50) / 150 = -300
    assert ranges[2] == pytest.approx(max(margin * 300.0, SHRINK * ranges[1]))
    # round 3 clipped: the range grows although margin / 15 of it would do for its mean
    assert margin / 15 < GROW
    assert secure.round_settings(None).clip_range == pytest.approx(GROW * ranges[2])


def test_synthetic_clients_clip_and_report_through_the_sum_only():
    n, dim = 5, 64
    inputs = synthetic_inputs(n, dim)  # some coordinates beyond 1
    cfg = SecAggScenarioConfig(enabled=True, clip_range=1.0, neighbors="full")
    arrays, config = empty_model()
    session = SecAggSession(InProcessGrid(synthetic_app(inputs), n), cfg, "examples", 1, 30, 0.01)
    out = session.run(list(inputs), 1, TrainStart(arrays, config, dim))
    assert out.status == "completed"
    assert out.clipped == sum(int(np.count_nonzero(np.abs(d) > 1.0)) for d, _ in
                              inputs.values()) > 0
    assert out.examples == 0 and out.train_loss() == {}  # no client reported a loss


@pytest.mark.parametrize("level", [255, 4095, max_level(1.0, 2.0**20, 100.0)])
def test_stat_words_sum_to_the_totals_and_count_what_they_clip(level):
    layout = StatWords(dim=5000, level=level, max_examples=1000.0)
    rows = [(3, 120, 0.75), (0, 999, 2.5), (1, 5000, 1.0), (0, 40, -3.0), (2, 7, 1e6),
            (0, 60, float("nan")), (0, 80, None), (5000, 1, 0.5)]
    words = [layout.encode(c, e, loss) for c, e, loss in rows]
    assert all(w.size == layout.words and w.max() <= level for w in words)
    assert len(rows) * level < 2**32  # their sum cannot wrap 32-bit words
    clipped, examples, loss_sum = layout.decode(np.sum(words, axis=0))
    # the coordinates, the 5000 examples, the 1e6 loss, the NaN loss; at most dim + 2 each
    assert clipped == 3 + 1 + 2 + 5000 + 1 + 1 + 1
    kept = [(min(e, 1000), min(max(loss, -LOSS_RANGE), LOSS_RANGE) if loss == loss
             else LOSS_RANGE) for _, e, loss in rows if loss is not None]
    assert examples == sum(e for e, _ in kept)  # whole examples, exactly
    assert loss_sum == pytest.approx(sum(e * loss for e, loss in kept), rel=0,
                                     abs=len(kept) * LOSS_STEP / 2 + 1e-9)


@pytest.mark.parametrize(("override", "key"), [
    ('secagg.clip_range="wide"', "secagg.clip_range"), ("secagg.clip_range=0", "secagg.clip_range"),
    ("secagg.scale=1024.0", "secagg.scale")])
def test_bad_clip_range_settings_fail_at_start_naming_the_key(override, key):
    with pytest.raises(ValueError, match=key):
        load_scenario("default", [SECURE, override])


def test_the_default_range_is_auto_and_a_number_fixes_it():
    assert SecAggScenarioConfig().clip_range == "auto"
    assert SecAggScenarioConfig(clip_range=2).start_range == 2.0
    assert SecAggScenarioConfig().start_range == AUTO_START_RANGE
