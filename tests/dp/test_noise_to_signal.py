"""Central DP records each round's noise to signal (the added noise's L2 norm over the mean
clipped update's, on the released scale) and warns once, naming the keys that help, when
it stays above 1: the run that learns nothing at z = 0.8 over 10 clients gets a hint.

The ratio is checked against the released model itself: every client sends the same u
(inside the clip), so the round releases (n u + noise) / n and the test reads the noise
back from the model change; and against N(0, (z C)^2)'s expected norm, z C sqrt(d). The
same holds under secure aggregation, where the server noises the decoded sum.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from rich.console import Console

from client.protocol.keys import MetricKey
from privacy.dp import DPConfig
from server.config import FederationConfig
from server.dp import DPController, dp_controller, noise_hint
from server.reporter import round_line
from server.store.serialize import pack_state, unpack_state
from simulations.apps import build_task
from simulations.config import load_scenario
from simulations.progress import RichReporter
from tests.dp.test_dp_central_public_count import secure_app

CENTRAL = ['dp.mode="central"', 'aggregation.weight_by="uniform"', "dp.delta=1e-5"]
KNOBS = ("federation.clients", "federation.sample_fraction", "dp.noise_multiplier", "dp.clip")


def same_update_app(u: np.ndarray) -> ClientApp:
    """Every client returns the global weights plus u (flat, split over the layers)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays, moved, at = msg.content["arrays"], {}, 0
        for name, array in arrays.items():
            w = array.numpy()
            moved[name] = Array(w + u[at:at + w.size].reshape(w.shape))
            at += w.size
        return Message(RecordDict({"arrays": ArrayRecord(moved),
                                   "metrics": MetricRecord({MetricKey.NUM_EXAMPLES: 10})}),
                       reply_to=msg)

    return app


def fedring_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "fedring" and r.levelno == logging.WARNING]


@pytest.mark.parametrize(("z", "secure"), [(0.05, False), (0.8, False), (0.8, True)],
                         ids=["z0.05", "z0.8", "z0.8-secure-sum"])
def test_ratio_is_the_released_noise_over_the_mean_clipped_update(run_inprocess, store, z,
                                                                  secure):
    clients, clip = 5, 0.5
    cfg = load_scenario("default", [*CENTRAL, f"federation.clients={clients}",
                                    "federation.rounds=1", f"dp.clip={clip}",
                                    f"dp.noise_multiplier={z}",
                                    f"secagg.enabled={str(secure).lower()}"])
    dim = build_task(cfg).initial_params()[0].size
    u = np.random.default_rng(1).standard_normal(dim)
    u = (u * (0.9 * clip / np.linalg.norm(u))).astype(np.float32)  # not clipped
    models: list[np.ndarray] = []
    app = secure_app(u) if secure else same_update_app(u)  # secure: each masks u
    summary = run_inprocess(cfg, app, models=models)
    [row] = [r for r in store.rounds(summary["run_id"]) if r.round == 1]
    assert row.num_accepted == clients

    change = models[1].astype(np.float64) - models[0]  # FedAvg at lr 1: the released mean
    mean_update = u.astype(np.float64)  # n u / n: the mean clipped update
    noise = change - mean_update  # the noise after the same division by n
    expected = np.linalg.norm(noise) / np.linalg.norm(mean_update)
    assert row.metrics["noise_to_signal"] == pytest.approx(expected, rel=1e-3)
    # and it is N(0, (z C)^2 I) / n's norm: z C sqrt(d) / n, within 6 standard errors
    # of a chi variable with d degrees of freedom (1 / sqrt(2 d) relative: 1% here)
    theory = z * clip * np.sqrt(dim) / clients / np.linalg.norm(mean_update)
    assert row.metrics["noise_to_signal"] == pytest.approx(theory, rel=6 / np.sqrt(2 * dim))


def test_issue_case_warns_once_and_records_the_ratio(run_inprocess, store, caplog, capsys):
    """Central DP, 10 clients, z = 0.8 on the default scenario: chance accuracy, a hint."""
    cfg = load_scenario("default", [*CENTRAL, "federation.clients=10", "federation.rounds=4",
                                    "dp.noise_multiplier=0.8", "train.local_epochs=2"])
    with caplog.at_level(logging.WARNING, logger="fedring"):
        summary = run_inprocess(cfg)
    ratios = [r.metrics["noise_to_signal"] for r in store.rounds(summary["run_id"])
              if r.round >= 1]
    assert len(ratios) == 4 and min(ratios) > 1
    hint = summary["dp_hint"]
    assert all(knob in hint for knob in KNOBS)
    hints = [m for m in fedring_warnings(caplog) if "noise to signal" in m]
    assert hints == [hint]  # once, though 4 rounds were above 1
    assert store.get_run(summary["run_id"]).summary["dp_hint"] == hint
    out = capsys.readouterr().out
    assert out.count("noise to signal") == 1 and hint in out
    lines = [line for line in out.splitlines() if line.startswith("round ")]
    assert [f"n/s {r:.3g}" in line for r, line in zip(ratios, lines, strict=True)] == [True] * 4


def test_small_noise_and_many_clients_do_not_warn(run_inprocess, store, caplog):
    cfg = load_scenario("default", [*CENTRAL, "federation.clients=40", "federation.rounds=3",
                                    "dp.noise_multiplier=0.02", "train.local_epochs=1"])
    with caplog.at_level(logging.WARNING, logger="fedring"):
        summary = run_inprocess(cfg)
    ratios = [r.metrics["noise_to_signal"] for r in store.rounds(summary["run_id"])
              if r.round >= 1]
    assert len(ratios) == 3 and max(ratios) < 1
    assert "dp_hint" not in summary
    assert not [m for m in fedring_warnings(caplog) if "noise" in m]


def test_local_dp_records_no_ratio(run_inprocess, store):
    """The server never sees a local-DP client's noise apart from its update."""
    cfg = load_scenario("default", ['dp.mode="local"', 'aggregation.weight_by="uniform"',
                                    "federation.clients=4",
                                    "federation.rounds=1", "train.local_epochs=1"])
    summary = run_inprocess(cfg)
    assert all("noise_to_signal" not in r.metrics for r in store.rounds(summary["run_id"]))


def test_progress_line_shows_the_ratio_and_logs_the_hint(caplog):
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    with (caplog.at_level(logging.WARNING, logger="fedring"),
          RichReporter(2, console=console) as reporter):
        reporter.round_finished(1, {"loss": 2.0, "accuracy": 0.1, "epsilon": 1.5,
                                    "noise_to_signal": 5.734})
        reporter.message("central DP: the noise outweighed the mean clipped update")
    shown = console.file.getvalue()
    assert "n/s 5.73" in shown and "noise outweighed" in shown
    assert fedring_warnings(caplog) == ["central DP: the noise outweighed the mean clipped "
                                        "update"]
    assert "n/s" not in round_line(1, 2, {"accuracy": 0.5, "epsilon": 1.0})


@pytest.mark.parametrize(("median", "says"), [
    (0.3, "a smaller dp.clip, near the updates' median norm 0.3"),
    (4.9, "dp.clip scales noise and signal alike while the updates reach it"),
    (None, "a clip above most updates' norms adds noise without signal")])
def test_hint_sizes_the_cohort_and_multiplier_and_reads_the_clip(median, says):
    hint = noise_hint(5.0, cohort=10, noise_multiplier=0.8, median_norm=median, clip=1.0)
    assert "at least 50 instead of 10" in hint and "below 0.16" in hint and says in hint


def test_hint_fires_once_over_a_checkpoint():
    """A resumed run neither repeats the hint nor forgets it or the rounds counted so far:
    the noise stage's state goes through the checkpoint's payload."""
    dp = DPConfig(mode="central", clip=1.0, noise_multiplier=1.0)
    fed = FederationConfig(clients=10, rounds=10)

    def resumed(previous) -> DPController:
        controller = dp_controller(dp, fed)
        [noise] = controller.stages()[1]
        _, state = unpack_state(pack_state(np.zeros(1), previous.stages()[1][0].state_dict()))
        noise.load_state_dict(state)
        return controller

    first = dp_controller(dp, fed)
    for ratio in (3.0, 0.5, 2.0, 2.0):  # a round below 1 restarts the count
        first.note_noise(ratio, 1.0)
        assert first.end_round(released=True).hint is None
    second = resumed(first)
    second.note_noise(2.0, 1.0)
    spent = second.end_round(released=True)
    assert spent.noise_to_signal == 2.0 and "2 in the last" in spent.hint
    third = resumed(second)
    third.note_noise(2.0, 1.0)
    assert third.end_round(released=True).hint is None and third.summary()["dp_hint"]
    third.note_noise(2.0, 1.0)  # a round that released nothing records no ratio
    assert third.end_round(released=False).noise_to_signal is None
    assert set(third.state_dict()) == {"figures"}  # the ledger's state holds no noise
