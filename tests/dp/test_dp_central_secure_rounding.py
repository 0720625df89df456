"""Central DP under secure aggregation: what a client's words decode to stays within the C
the server's noise is calibrated to, rounding included, and the rounding draws are not
ones the server can replay from the run seed.

Each client goes through the real path (SETUP in a Flower message, ``client.secure_client``
clipping and quantizing, SecAgg+ masking); the test keeps the words it quantized and
decodes them alone, as the server's decoding would count them in the sum. The sizes are
ones where clipping to C and then rounding (the code before this check) decodes past C.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from aggregation.compression import CompressionConfig
from client import secure_client as sc
from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.npy import npy_view
from client.protocol.secagg import SecAggAction
from client.secure_client import register_secagg
from privacy.dp import DPConfig
from privacy.secagg.quantize import StatWords, dequantize_weighted, max_level
from server.compression import SharedPattern
from server.dp import DPController
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from server.secure_aggregation import central_dp_clip
from simulations.apps import build_task
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid

N, C = 3, 1.0


@dataclass
class Fixed:
    delta: np.ndarray
    metrics: MetricRecord


def recording_app(deltas: dict[int, np.ndarray], inputs: dict[int, np.ndarray]) -> ClientApp:
    """Clients answering with fixed deltas; ``inputs`` gets each one's quantized words."""
    app = ClientApp()
    register_secagg(app, lambda msg, ctx: Fixed(deltas[int(ctx.node_id)],
                                                 MetricRecord({MetricKey.NUM_EXAMPLES: 10})))

    def recording(msg: Message, context: Context) -> Message:
        reply = app(msg, context)
        if msg.metadata.message_type == f"train.{SecAggAction.SECAGG}":
            inputs[int(context.node_id)] = np.array(npy_view(
                context.state[sc.INPUT]["input"]))
        return reply

    return recording  # type: ignore[return-value]


def central(clip: float = C) -> DPController:
    return DPController(DPConfig(mode="central", clip=clip, noise_multiplier=1.0),
                        clients=N, clients_per_round=N, sampling="fixed")


def big_deltas(dim: int, seed: int = 0) -> dict[int, np.ndarray]:
    """Deltas far outside the clip (norm ~ 3 sqrt(dim)): each is clipped to its boundary."""
    rng = np.random.default_rng(seed)
    return {node: (rng.standard_normal(dim) * 3).astype(np.float32) for node in range(1, N + 1)}


def run(deltas, settings, *, dp, seed=7, sparse=None, weight_by="uniform"):
    inputs: dict[int, np.ndarray] = {}
    dim = next(iter(deltas.values())).size
    session = SecAggSession(InProcessGrid(recording_app(deltas, inputs), len(deltas)), settings,
                            weight_by, 5, 30.0, 0.001, dp)
    out = session.run(list(deltas), 1,
                      TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: seed}), dim,
                                 sparse=sparse))
    assert out.status == "completed", out.abort_reason
    return out, inputs


def decoded_norms(out, inputs, settings, weight_by="uniform") -> list[float]:
    """The L2 norm of each client's contribution to the decoded sum (its words alone)."""
    norms = []
    cap = settings.weight_cap(weight_by)
    for words in inputs.values():
        alone, weight = dequantize_weighted(words[:out.coordinates + 1], 1,  # not the stats
                                            clip_range=settings.clip_range,
                                            scale=out.scale, max_weight=cap)
        assert weight == pytest.approx(1.0 if weight_by == "uniform" else 10.0,
                                       abs=1 / out.scale)
        norms.append(float(np.linalg.norm(alone)))
    return norms


@pytest.mark.parametrize(("rounding", "dim"), [("nearest", 50_000), ("stochastic", 50_000)])
def test_a_decoded_contribution_stays_within_the_clip(rounding, dim):
    # under central DP each round's clip range is dp.clip (server.secure_range)
    settings = SecAggScenarioConfig(enabled=True, bits=12, rounding=rounding, clip_range=C)
    out, inputs = run(big_deltas(dim), settings, dp=central())
    assert out.scale == 512  # 12 bits for 3 clients: rounding errs by up to 1/1024 or 1/512
    norms = decoded_norms(out, inputs, settings)
    assert max(norms) <= C
    # the clip left room for the worst case, and no more: what the server's check reports
    kept = central_dp_clip(settings, clip=C, dim=dim, clients=N, weight_by="uniform")
    step = 0.5 if rounding == "nearest" else 1.0
    assert kept == pytest.approx(C - np.sqrt(dim) * step / 512, rel=1e-5)
    assert min(norms) > kept - np.sqrt(dim) * step / 512


def test_a_weighted_contribution_stays_within_the_clip():
    # the scenario refuses weights with central DP; a client does not rely on that: weight
    # 10 (its example count) multiplies its words, so it clips to C / 10
    settings = SecAggScenarioConfig(enabled=True, bits=32, clip_range=C)
    out, inputs = run(big_deltas(5_000), settings, dp=central(), weight_by="examples")
    norms = decoded_norms(out, inputs, settings, weight_by="examples")
    assert max(norms) <= C and min(norms) > 0.99 * C


def test_the_modulus_the_refusal_asks_for_is_the_least_that_fits():
    # the reported case: secure QSGD at 8 bits, a 1M-parameter model, 10 clients per sum
    dim, clients = 1_000_000, 10
    base = [f"federation.clients={clients}", "secagg.enabled=true", "dp.mode=central",
            f"dp.clip={C}", "dp.noise_multiplier=1", "aggregation.weight_by=uniform"]

    def check(overrides: list[str], qsgd: bool = False) -> float:
        cfg = load_scenario("default", [*base, *overrides])
        return central_dp_clip(SecAggScenarioConfig.from_dict(cfg["secagg"]).with_range(C),
                               clip=C,
                               dim=dim, clients=clients, weight_by="uniform", qsgd=qsgd)

    with pytest.raises(ValueError, match=r"compression\.bits to >= (\d+)") as err:
        check(["compression.kind=qsgd", "compression.bits=8"], qsgd=True)
    levels = int(err.value.args[0].split("compression.bits to >= ")[1].split(" ")[0])
    assert check(["compression.kind=qsgd", f"compression.bits={levels}"], qsgd=True) >= C / 2
    with pytest.raises(ValueError, match=r"compression\.bits"):
        check(["compression.kind=qsgd", f"compression.bits={levels - 1}"], qsgd=True)
    with pytest.raises(ValueError, match=r"secagg\.bits to >= (\d+)") as err:
        check(["secagg.bits=14", "secagg.rounding=stochastic"])
    need = int(err.value.args[0].split("secagg.bits to >= ")[1].split(",")[0])
    assert check([f"secagg.bits={need}", "secagg.rounding=stochastic"]) >= C / 2
    with pytest.raises(ValueError, match=r"secagg\.bits"):
        check([f"secagg.bits={need - 1}", "secagg.rounding=stochastic"])


def test_secure_qsgd_contribution_stays_within_the_clip():
    cfg = load_scenario("default", [f"federation.clients={N}", "secagg.enabled=true",
                                    "compression.kind=qsgd", "compression.bits=8",
                                    "dp.mode=central", f"dp.clip={C}", "dp.noise_multiplier=1",
                                    "aggregation.weight_by=uniform"])
    settings = SecAggScenarioConfig.from_dict(cfg["secagg"]).with_range(C)
    assert settings.rounding == "stochastic"  # the scenario resolved QSGD's modulus
    out, inputs = run(big_deltas(10_000), settings, dp=central())
    assert out.scale == 128  # 2^8 levels per coordinate
    assert max(decoded_norms(out, inputs, settings)) <= C


def test_shared_pattern_contribution_stays_within_the_clip():
    dim = 100_000
    cfg = load_scenario("default", [f"federation.clients={N}", "secagg.enabled=true",
                                    "secagg.bits=12", "compression.kind=topk",
                                    "compression.shared_pattern=true", "compression.fraction=0.5",
                                    "dp.mode=central", f"dp.clip={C}", "dp.noise_multiplier=1",
                                    "aggregation.weight_by=uniform"])
    settings = SecAggScenarioConfig.from_dict(cfg["secagg"]).with_range(C)
    pattern = SharedPattern.of(CompressionConfig(**cfg["compression"]),
                               secure=True).for_round("run", 1, dim)
    assert pattern.indices.size == dim // 2
    out, inputs = run(big_deltas(dim), settings, dp=central(), sparse=pattern)
    assert all(words.size == dim // 2 + 1 + StatWords(dim // 2, max_level(C, out.scale, 1.0),
                                                      1000.0).words
               for words in inputs.values())  # k values, the weight, the stat words
    assert max(decoded_norms(out, inputs, settings)) <= C


def test_a_setup_with_no_room_for_the_rounding_is_refused_by_the_client():
    settings = SecAggScenarioConfig(enabled=True, bits=12, rounding="stochastic", clip_range=C)
    deltas = big_deltas(400_000)  # sqrt(d) / scale = 1.2 > C
    inputs: dict[int, np.ndarray] = {}
    session = SecAggSession(InProcessGrid(recording_app(deltas, inputs), N), settings, "uniform",
                            5, 30.0, 0.001, central())
    out = session.run(list(deltas), 1,
                      TrainStart(ArrayRecord(), ConfigRecord({ConfigKey.SEED: 7}), 400_000))
    assert out.status == "aborted" and not inputs
    assert all("can move an update by more than dp-clip" in e for e in out.errors.values())


def test_stochastic_rounding_under_dp_is_not_replayable_from_the_run_seed():
    settings = SecAggScenarioConfig(enabled=True, bits=12, rounding="stochastic", clip_range=C)
    deltas = big_deltas(20_000)
    first = run(deltas, settings, dp=central(), seed=7)[1]
    again = run(deltas, settings, dp=central(), seed=7)[1]
    for node in deltas:  # same run seed, round, partition and delta: fresh draws
        assert np.count_nonzero(first[node] != again[node]) > 1000
    # without DP the rounding stays seeded from (run seed, round, partition): runs replay
    plain = [run(deltas, settings, dp=None, seed=7)[1] for _ in range(2)]
    for node in deltas:
        np.testing.assert_array_equal(plain[0][node], plain[1][node])


def test_a_scale_too_coarse_for_the_clip_fails_at_start_naming_the_key(run_inprocess):
    common = ["federation.clients=4", "federation.rounds=1", "secagg.enabled=true",
              "dp.mode=central", f"dp.clip={C}", "dp.noise_multiplier=1",
              "aggregation.weight_by=uniform"]
    qsgd = load_scenario("default", [*common, "compression.kind=qsgd", "compression.bits=8"])
    dim = build_task(qsgd).initial_params()[0].size
    settings = SecAggScenarioConfig.from_dict(qsgd["secagg"]).with_range(C)
    # the scale QSGD's modulus gives 4 clients, and what it leaves of the clip (< C / 2)
    scale = settings.scale_for(4, "uniform")
    assert C - np.sqrt(dim) / scale < C / 2
    with pytest.raises(ValueError, match=r"raise compression\.bits to >= \d+"):
        run_inprocess(qsgd)
    plain = load_scenario("default", [*common, "secagg.bits=11", "secagg.rounding=stochastic"])
    with pytest.raises(ValueError, match=r"raise secagg\.bits to >= (\d+)") as err:
        run_inprocess(plain)
    need = int(err.value.args[0].split("raise secagg.bits to >= ")[1].split(",")[0])
    fits = load_scenario("default", [*common, f"secagg.bits={need}", "secagg.rounding=stochastic"])
    summary = run_inprocess(fits)
    assert summary["status"] == "completed" and summary["dp_mode"] == "central"
