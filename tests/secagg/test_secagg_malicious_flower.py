"""The malicious mode over Flower messages: fedring's SecAgg+ session and ClientApps on the
in-process engine, each node's identity from a PKI made for the run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.secagg import SecAggKey, SecAggRecord
from client.secure_client import SECURITY_KEY, register_secagg
from privacy.secagg import keys as kx
from privacy.secagg import messages as msg
from privacy.secagg.messages import MsgType
from privacy.secagg.quantize import error_bound
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid
from simulations.secagg_pki import make_pki

N, DIM, ROUND = 8, 200, 1
App = Callable[[Message, Context], Message]


@dataclasses.dataclass
class Update:
    delta: np.ndarray
    metrics: MetricRecord


def inputs() -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {node: (rng.standard_normal(DIM) * 0.3).astype(np.float32)
            for node in range(1, N + 1)}


def client_app(deltas: dict[int, np.ndarray]) -> ClientApp:
    app = ClientApp()
    register_secagg(app, lambda m, c: Update(deltas[int(c.node_id)],
                                             MetricRecord({MetricKey.NUM_EXAMPLES: 10})))
    return app


def run(app: App | ClientApp, *, pki: bool = True, **settings: object):
    arrays, config = ArrayRecord(), ConfigRecord({ConfigKey.SEED: 0})
    grid = InProcessGrid(app, N, pki=make_pki(N) if pki else None)  # type: ignore[arg-type]
    cfg = SecAggScenarioConfig(enabled=True, clip_range=1.0, max_weight=100.0,
                               **settings)  # type: ignore[arg-type]
    return SecAggSession(grid, cfg, "uniform", 7, 5.0, 0.001).run(
        list(range(1, N + 1)), ROUND, TrainStart(arrays, config, DIM))


def expected(deltas: dict[int, np.ndarray], nodes: list[int]) -> np.ndarray:
    return sum(np.clip(deltas[n].astype(np.float64), -1, 1) for n in nodes)


@pytest.mark.parametrize("stage", [None, "share_keys", "unmasking"])
def test_malicious_round_over_flower_messages_decodes_the_sum(stage: str | None) -> None:
    deltas = inputs()
    extra = {} if stage is None else {"dropout": 0.2, "dropout_stage": stage}
    out = run(client_app(deltas), security="malicious", **extra)
    assert out.status == "completed", (out.abort_reason, out.errors)
    assert "consistency_check" in out.dropouts
    assert all("simulated dropout" in why for why in out.errors.values())
    if stage is not None:
        assert out.dropouts[stage]
    bound = error_bound(len(out.survivors), out.scale, "nearest") * 1.01
    np.testing.assert_allclose(out.weighted_sum, expected(deltas, out.survivors), atol=bound)


def test_semi_honest_round_is_unchanged_by_the_identities() -> None:
    deltas = inputs()
    out = run(client_app(deltas))
    assert out.status == "completed" and "consistency_check" not in out.dropouts


def test_malicious_setup_without_identities_is_refused() -> None:
    out = run(client_app(inputs()), pki=False, security="malicious")
    assert out.status == "aborted"
    assert len(out.errors) == N
    assert all("this client has no identity key" in why for why in out.errors.values())


def test_node_requiring_malicious_refuses_a_semi_honest_setup() -> None:
    app = client_app(inputs())

    def strict(message: Message, context: Context) -> Message:
        if int(context.node_id) == 3:
            context.node_config[SECURITY_KEY] = "malicious"
        return app(message, context)

    out = run(strict)
    assert "requires malicious" in out.errors[3]
    assert 3 not in out.survivors and out.status == "completed"


def test_substituted_key_in_transit_is_refused_by_the_clients() -> None:
    """The server's PUBLIC_KEYS to node 2 carries another encryption key for node 1."""
    app = client_app(inputs())
    fake = kx.public_bytes(kx.new_private_key())

    def lying(message: Message, context: Context) -> Message:
        record = message.content.get(SecAggRecord.PROTOCOL)
        payload = record.get(SecAggKey.MSG) if isinstance(record, ConfigRecord) else None
        if int(context.node_id) == 2 and isinstance(payload, bytes) and \
                msg.read_header(payload).kind is MsgType.PUBLIC_KEYS:
            h, m = msg.decode_public_keys(payload, signed=True)
            entries = tuple(dataclasses.replace(e, c_pk=fake) if e.client_id == 1 else e
                            for e in m.entries)
            record[SecAggKey.MSG] = msg.encode_public_keys(
                h, dataclasses.replace(m, entries=entries), signed=True)
        return app(message, context)

    out = run(lying, security="malicious")
    assert "client 1's advertisement: bad signature" in out.errors[2]
    assert 2 not in out.survivors


def test_security_key_is_checked() -> None:
    with pytest.raises(ValueError, match=r"secagg\.security must be one of semi_honest, "
                                         r"malicious"):
        SecAggScenarioConfig(security="paranoid")
