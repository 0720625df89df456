"""Central DP divides the noisy sum by the public number of clients per round, also when a
sampled client crashes mid-round: the released noise std is z*C over that count, never over
the clients that happened to answer (which would tie the noise scale to the data and, with
full participation everywhere else, goes unnoticed).

Every client sends the same update u (inside the clip), so the released model change is
(4 u + N(0, (zC)^2)) / 5: the run has 5 clients per round and one of them crashes. Dividing
the noise by the 4 that answered gives a std 25% above z*C/5; dividing the sum by them
before the noise leaves u / 5 instead of 4 u / 5. Both the plain path and the secure-sum
path are checked, through the real ServerApp and ClientApps on the in-process engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.protocol.keys import MetricKey
from client.protocol.secagg import SecAggKey, SecAggRecord
from client.secure_client import register_secagg
from privacy.secagg.messages import read_header
from privacy.secagg.stages import MsgType
from simulations.apps import build_task
from simulations.config import load_scenario

CLIENTS, Z, CLIP, CRASHING = 5, 0.05, 0.5, 5
CENTRAL = [f"federation.clients={CLIENTS}", "federation.rounds=1", "train.local_epochs=1",
           'dp.mode="central"', 'aggregation.weight_by="uniform"', f"dp.clip={CLIP}",
           f"dp.noise_multiplier={Z}", "dp.delta=1e-5"]


def crashing(app, when) -> ClientApp:
    """``app``, except that node CRASHING raises on the messages ``when`` picks."""
    def handle(msg: Message, context: Context) -> Message:
        if int(context.node_id) == CRASHING and when(msg):
            raise RuntimeError("client crashed")
        return app(msg, context)

    return handle  # type: ignore[return-value]


def shared_update(shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """u, one array per layer: random, with L2 norm 0.9 C (no client is clipped)."""
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    norm = np.sqrt(sum(float(np.sum(p.astype(np.float64) ** 2)) for p in parts))
    return [p * np.float32(0.9 * CLIP / norm) for p in parts]


def plain_app(shapes: list[tuple[int, ...]]) -> ClientApp:
    """Plain rounds: every client returns the global weights plus u."""
    app = ClientApp()
    update = shared_update(shapes)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"]
        moved = {name: Array(array.numpy() + u) for (name, array), u in
                 zip(arrays.items(), update, strict=True)}
        return Message(RecordDict({"arrays": ArrayRecord(moved),
                                   "metrics": MetricRecord({MetricKey.NUM_EXAMPLES: 10})}),
                       reply_to=msg)

    return app


@dataclass
class Fixed:
    delta: np.ndarray
    metrics: MetricRecord


def secure_app(u: np.ndarray) -> ClientApp:
    """Secure rounds: every client masks u."""
    app = ClientApp()
    register_secagg(app, lambda msg, ctx: Fixed(u, MetricRecord({MetricKey.NUM_EXAMPLES: 10})))
    return app


def is_stage(kind: MsgType):
    def when(msg: Message) -> bool:
        record = msg.content.get(SecAggRecord.PROTOCOL)
        return isinstance(record, ConfigRecord) and read_header(record[SecAggKey.MSG]).kind is kind
    return when


def released_change(run_inprocess, store, cfg, app) -> tuple[np.ndarray, str]:
    """The model change of the run's one round, and the run id."""
    models: list[np.ndarray] = []
    summary = run_inprocess(cfg, app, models=models)
    assert summary["status"] == "completed" and summary["versions"] == 1
    row = store.rounds(summary["run_id"])[-1]
    assert row.num_sampled == CLIENTS and row.num_accepted == CLIENTS - 1  # one crashed
    return models[1].astype(np.float64) - models[0], summary["run_id"]


def assert_divided_by_the_public_count(change: np.ndarray, u: np.ndarray) -> None:
    expected = Z * CLIP / CLIENTS  # N(0, (zC)^2) over the 5 clients per round
    noise = change - (CLIENTS - 1) * u.astype(np.float64) / CLIENTS  # 4 of 5 sent u
    # The server's noise comes from OS entropy, so each bound is 6 standard errors: a false
    # failure once in 10^8 runs, while the bugs above move the figures by 25% or more.
    assert np.std(noise) == pytest.approx(expected, rel=0.065)  # 4810 values: 1% error
    assert abs(np.mean(noise)) < 6 * expected / np.sqrt(noise.size)
    # the sum's share is 4/5 of u: its projection on u is that, up to the noise's (0.011)
    assert np.dot(change, u) / np.dot(u, u) == pytest.approx(0.8, abs=0.07)


def layers(cfg) -> list[tuple[int, ...]]:
    return [tuple(shape) for shape in build_task(cfg).initial_params()[1].shapes]


def test_plain_round_with_a_crashed_client_divides_by_the_public_count(run_inprocess, store):
    cfg = load_scenario("default", CENTRAL)
    shapes = layers(cfg)
    app = crashing(plain_app(shapes), lambda msg: True)
    u = np.concatenate([p.ravel() for p in shared_update(shapes)])
    assert_divided_by_the_public_count(released_change(run_inprocess, store, cfg, app)[0], u)


@pytest.mark.parametrize("stage", [MsgType.SETUP, MsgType.PUBLIC_KEYS],  # merged flow
                         ids=["training", "share_keys"])
def test_secure_round_with_a_crashed_client_divides_by_the_public_count(run_inprocess, store,
                                                                        stage):
    cfg = load_scenario("default", [*CENTRAL, "secagg.enabled=true"])
    u = np.concatenate([p.ravel() for p in shared_update(layers(cfg))])
    app = crashing(secure_app(u), is_stage(stage))
    change, run_id = released_change(run_inprocess, store, cfg, app)
    [session] = store.secagg_rounds(run_id)
    assert session["status"] == "completed"
    assert sorted(session["survivors"]) == [str(n) for n in range(1, CLIENTS + 1) if n != CRASHING]
    assert_divided_by_the_public_count(change, u)
