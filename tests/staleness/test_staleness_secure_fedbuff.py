"""Secure FedBuff: each buffer of K updates is summed under SecAgg+ on the real apps.

The scripted clients send known deltas (the same whatever the model), so the buffers of
a secure run and of a plain FedBuff run with the same seed hold the same clients, and
their aggregates can be compared within the quantization bound of the secure sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from staleness_helpers import scenario, scripted_app, scripted_delta

from client.protocol.keys import MetricKey
from client.protocol.npy import npy_view
from client.protocol.secagg import REPLY_STAGE, SecAggAction, SecAggKey, SecAggRecord, stage_of
from client.secure_client import register_secagg
from privacy.secagg.messages import read_header
from server.secagg_config import SecAggScenarioConfig
from simulations.apps import build_task
from simulations.config import load_scenario

STRAGGLERS = ["clients.straggler_fraction=0.34", "clients.straggler_slowdown=6.0",
              "clients.speed_sigma=0.3"]
SECURE = ["secagg.enabled=true", 'secagg.neighbors="full"',
          "secagg.clip_range=1.0"]  # a fixed range: the scripted deltas stay far below it
EPS32 = float(np.finfo(np.float32).eps)


@dataclass
class Scripted:
    delta: np.ndarray
    metrics: MetricRecord


def examples(node: int) -> int:
    return 10 + (node - 1)  # scripted_app's default: 10 + partition id


def scripted_secure_app() -> ClientApp:
    """``scripted_app`` that also answers secure FedBuff with the same deltas."""
    app = scripted_app()

    def local_update(msg: Message, context: Context) -> Scripted:
        node = int(context.node_config["partition-id"]) + 1
        dim = sum(npy_view(a).size for a in msg.content["arrays"].values())
        return Scripted(scripted_delta(node, dim), MetricRecord({MetricKey.NUM_EXAMPLES:
                                                                  examples(node)}))

    register_secagg(app, local_update)
    return app


def quantization_bound(cfg: dict, k: int, total_weight: float, aggregate: float) -> float:
    """Worst error of sum(w s d) / sum(w) decoded from a K-client secure sum.

    Each of the two decoded sums is off by at most k / (2 scale) (rounding to nearest), so
    the ratio a = S / W is off by at most e (1 + |a|) / (W - e).
    """
    settings = SecAggScenarioConfig.from_dict(cfg["secagg"])
    e = k * 0.5 / settings.scale_for(k, cfg["aggregation"]["weight_by"])
    return e * (1 + abs(aggregate)) / (total_weight - e)


def fedbuff_step(updates, dim: int, s, lr: float) -> np.ndarray:
    """lr * sum(n_i s(tau_i) d_i) / sum(n_i) over the accepted updates, in float64."""
    accepted = [u for u in updates if u.fate == "accepted"]
    total = sum(examples(int(u.client_id)) for u in accepted)
    num = sum(examples(int(u.client_id)) * s(u.staleness)
              * scripted_delta(int(u.client_id), dim).astype(np.float64) for u in accepted)
    return lr * num / total


def test_equal_clients_give_the_model_of_fedbuff_and_sync_fedavg(run, store):
    common = ["federation.clients=4", "federation.rounds=2", "federation.sample_fraction=1.0"]
    buffered = [*common, "driver.kind=fedbuff", "driver.buffer_size=4"]
    runs = {}
    for name, overrides in {"sync": common, "fedbuff": buffered,
                            "secure": [*buffered, *SECURE]}.items():
        models: list[np.ndarray] = []
        summary = run(scenario(*overrides), models=models)  # fedring's ClientApp, training
        assert summary["versions"] == 2
        runs[name] = (summary["run_id"], models)
    # FedBuff with K = every client, all equally fast, is FedAvg
    for a, b in zip(runs["sync"][1], runs["fedbuff"][1], strict=True):
        np.testing.assert_array_equal(a, b)
    cfg = scenario(*buffered, *SECURE)
    run_id, secure = runs["secure"]
    plain = runs["fedbuff"][1]
    # one aggregate: the same up to the secure sum's quantization (and float32 rounding)
    step = plain[1].astype(np.float64) - plain[0]
    weight = sum(u.num_examples for _, u in store.updates(runs["fedbuff"][0], round=1))
    tol = (quantization_bound(cfg, 4, weight, float(np.abs(step).max()))
           + 2 * EPS32 * float(np.abs(plain[1]).max()))
    assert float(np.abs(secure[1].astype(np.float64) - plain[1]).max()) <= tol
    # later rounds train on models that differ by that much
    np.testing.assert_allclose(secure[-1], plain[-1], rtol=0, atol=1e-5)
    sessions = store.secagg_rounds(run_id)
    assert [(s["round"], s["status"], s["num_participants"], s["num_survivors"])
            for s in sessions] == [(1, "completed", 4, 4), (2, "completed", 4, 4)]
    for rnd in (1, 2):
        updates = [u for _, u in store.updates(run_id, round=rnd)]
        assert [(u.fate, u.base_version, u.staleness, u.weight, u.num_examples, u.norm)
                for u in updates] == [("accepted", rnd - 1, 0, 1.0, None, None)] * 4


def poly(a):
    return lambda tau: (1.0 + tau) ** -a


def test_secure_aggregate_equals_plain_fedbuff_with_stragglers(run, store):
    overrides = ["federation.clients=6", "federation.rounds=10", "driver.kind=fedbuff",
                 "driver.buffer_size=3", "driver.max_staleness=2", "driver.staleness=polynomial",
                 "driver.staleness_a=0.7", "aggregation.server_lr=0.5", *STRAGGLERS]
    cfg = scenario(*overrides, *SECURE)
    s, lr = poly(0.7), 0.5
    app = scripted_secure_app()
    plain_models: list[np.ndarray] = []
    plain = run(scenario(*overrides), app, models=plain_models)
    secure_models: list[np.ndarray] = []
    secure = run(cfg, app, models=secure_models)
    again_models: list[np.ndarray] = []
    again = run(cfg, app, models=again_models)
    assert secure["versions"] == plain["versions"] == 10
    assert secure["simulated_time"] == plain["simulated_time"]
    _, layout = build_task(cfg).initial_params()
    sessions = {x["round"]: x for x in store.secagg_rounds(secure["run_id"])}
    tol, stale, rejected = 0.0, 0, 0
    for rnd in range(1, 11):
        plain_updates = [u for _, u in store.updates(plain["run_id"], round=rnd)]
        updates = [u for _, u in store.updates(secure["run_id"], round=rnd)]
        by_client = {u.client_id: u for u in updates}
        assert len(updates) == len(plain_updates)
        for p in plain_updates:  # the same fates; the secure weight is s(tau) alone
            u = by_client[p.client_id]
            assert (u.fate, u.base_version, u.staleness) == (p.fate, p.base_version,
                                                              p.staleness)
            if p.fate == "accepted":
                assert u.weight == pytest.approx(s(u.staleness), rel=1e-12)
                assert u.weight * examples(int(u.client_id)) == pytest.approx(p.weight)
                assert u.num_examples is None and u.norm is None  # hidden by the sum
                stale += u.staleness > 0
            elif p.fate == "rejected":
                assert u.reason == p.reason == f"staleness {u.staleness} exceeds max_staleness 2"
                rejected += 1
        accepted = sorted(u.client_id for u in updates if u.fate == "accepted")
        assert len(accepted) == 3
        assert (sessions[rnd]["status"], sessions[rnd]["participants"]) == ("completed",
                                                                            accepted)
        step = fedbuff_step(updates, layout.dim, s, lr)
        weight = sum(examples(int(c)) for c in accepted)
        tol += (lr * quantization_bound(cfg, 3, weight, float(np.abs(step).max()) / lr)
                + 2 * EPS32 * float(np.abs(plain_models[rnd]).max()))
        diff = np.abs(secure_models[rnd].astype(np.float64) - plain_models[rnd]).max()
        assert diff <= tol
        expected = secure_models[rnd - 1].astype(np.float64) + step
        np.testing.assert_allclose(secure_models[rnd], expected, rtol=0, atol=tol)
    assert stale > 3 and rejected > 0  # the scenario exercises both
    # a fixed seed gives the same run again, bit for bit
    for a, b in zip(secure_models, again_models, strict=True):
        np.testing.assert_array_equal(a, b)
    assert ([(r, u) for r, u in store.updates(secure["run_id"])]
            == [(r, u) for r, u in store.updates(again["run_id"])])


def test_secure_fedbuff_on_the_wall_clock(run_inprocess, store):
    cfg = scenario("federation.clients=4", "federation.rounds=4", "driver.kind=fedbuff",
                   "driver.buffer_size=3", "driver.staleness=polynomial", *SECURE)
    models: list[np.ndarray] = []
    summary = run_inprocess(cfg, scripted_secure_app(), models=models)  # wall clock
    assert summary["versions"] == 4 and "simulated_time" not in summary
    _, layout = build_task(cfg).initial_params()
    sessions = store.secagg_rounds(summary["run_id"])
    stale = 0
    for rnd in range(1, 5):
        updates = [u for _, u in store.updates(summary["run_id"], round=rnd)]
        accepted = sorted(u.client_id for u in updates if u.fate == "accepted")
        assert len(accepted) == 3 and sessions[rnd - 1]["participants"] == accepted
        stale += sum(u.staleness > 0 for u in updates)
        expected = models[rnd - 1].astype(np.float64) + fedbuff_step(updates, layout.dim,
                                                                     poly(0.5), 1.0)
        np.testing.assert_allclose(models[rnd], expected, rtol=0, atol=1e-6)
    assert stale > 0


class FailingOnce:
    """The scripted secure app, except that ``node``'s first training task fails."""

    def __init__(self, node: int) -> None:
        self.app, self.node, self.failed = scripted_secure_app(), node, False

    def __call__(self, msg: Message, context: Context) -> Message:
        if (msg.metadata.message_type == f"train.{SecAggAction.HOLD}" and not self.failed
                and int(context.node_id) == self.node):
            self.failed = True
            raise RuntimeError("local training failed")
        return self.app(msg, context)


class VanishingAt:
    """``FailingOnce(node=4)``, and each (buffer round, node) of ``plan`` vanishes from the
    given stage on: it answers no secure message of that round from then (an error reply,
    which the server counts as a dropout of that stage)."""

    def __init__(self, plan: dict[tuple[int, int], str]) -> None:
        self.app, self.plan = FailingOnce(node=4), plan

    def __call__(self, msg: Message, context: Context) -> Message:
        record = msg.content.get(SecAggRecord.PROTOCOL)
        if isinstance(record, ConfigRecord) and isinstance(record.get(SecAggKey.MSG), bytes):
            header = read_header(record[SecAggKey.MSG])
            stage = self.plan.get((header.round_id, int(context.node_id)))
            if stage is not None and REPLY_STAGE[header.kind] >= stage_of(stage):
                raise RuntimeError(f"vanished at stage {stage}")
        return self.app(msg, context)


def test_dropouts_in_a_buffers_secure_stages_recover_or_abort_and_the_run_goes_on(run, store):
    n = 5
    # buffer 1 loses one client after it sent its keys (recovered); buffer 2 loses three:
    # too few left for the threshold t = 3 (abort); buffer 3 loses none
    plan = {(1, 2): "share_keys", (2, 1): "advertise_keys", (2, 3): "share_keys",
            (2, 5): "masked_input"}

    def drops(rnd: int) -> dict[int, str]:
        return {node: stage for (r, node), stage in plan.items() if r == rnd}

    cfg = scenario(f"federation.clients={n}", "federation.rounds=3", "driver.kind=fedbuff",
                   f"driver.buffer_size={n}", *SECURE, "federation.checkpoint_every=1")
    models: list[np.ndarray] = []
    summary = run(cfg, VanishingAt(plan), models=models)
    run_id = summary["run_id"]
    assert (summary["status"], summary["rounds"], summary["versions"]) == ("completed", 3, 2)
    rounds = store.rounds(run_id)
    assert [(r.round, r.status, r.model_version) for r in rounds] == [
        (0, "completed", 0), (1, "completed", 1), (2, "aborted", 1), (3, "completed", 2)]
    sessions = store.secagg_rounds(run_id)
    assert [x["status"] for x in sessions] == ["completed", "aborted", "completed"]
    _, layout = build_task(cfg).initial_params()

    # buffer 1: node 4's failed task is rejected with its reason, its retry joins the
    # buffer; one client drops in the secure stages and the sum of the others is recovered
    (gone, stage), = drops(1).items()
    updates = [u for _, u in store.updates(run_id, round=1)]
    failed = [u for u in updates if u.fate == "rejected"]
    assert [u.client_id for u in failed] == ["4"]
    assert failed[0].reason.startswith("client error 1: RuntimeError: local training failed")
    assert sessions[0]["dropouts"][stage] == [str(gone)]
    survivors = [str(x) for x in range(1, n + 1) if x != gone]
    assert sessions[0]["survivors"] == survivors
    dropped = [u for u in updates if u.fate == "dropped"]
    assert [(u.client_id, u.reason.split(":")[0]) for u in dropped] == [
        (str(gone), f"dropped at stage {stage}")]
    accepted = [u for u in updates if u.fate == "accepted"]
    assert sorted(u.client_id for u in accepted) == survivors
    step = fedbuff_step(updates, layout.dim, lambda tau: 1.0, 1.0)
    tol = (quantization_bound(cfg, n, sum(examples(int(c)) for c in survivors),
                              float(np.abs(step).max()))
           + 2 * EPS32 * float(np.abs(models[1]).max()))
    np.testing.assert_allclose(models[1], models[0].astype(np.float64) + step, rtol=0, atol=tol)

    # buffer 2 aborts: the model stays, every update and the dropouts seen are recorded
    recorded = {int(c): st for st, ids in sessions[1]["dropouts"].items() for c in ids}
    assert sessions[1]["abort_reason"] and recorded
    assert recorded.items() <= drops(2).items()
    np.testing.assert_array_equal(models[2], models[1])
    updates = [u for _, u in store.updates(run_id, round=2)]
    assert len(updates) == n and not any(u.fate == "accepted" for u in updates)

    # buffer 3 applies again, from the same model version
    updates = [u for _, u in store.updates(run_id, round=3)]
    assert [(u.fate, u.base_version) for u in updates] == [("accepted", 1)] * n
    np.testing.assert_allclose(
        models[3], models[2].astype(np.float64) + fedbuff_step(updates, layout.dim,
                                                               lambda tau: 1.0, 1.0),
        rtol=0, atol=1e-6)


def test_fedasync_with_secagg_fails_at_start():
    with pytest.raises(ValueError, match="a single update cannot be hidden in a sum"):
        load_scenario("default", ["driver.kind=fedasync", "secagg.enabled=true"])
    with pytest.raises(ValueError, match=r"raise driver.buffer_size \(got 1\) to >= 3"):
        load_scenario("default", ["driver.kind=fedbuff", "driver.buffer_size=1",
                                  "secagg.enabled=true"])
    with pytest.raises(ValueError, match=r"aggregation\.combine = 'median'"):
        load_scenario("default", ["driver.kind=fedbuff", "aggregation.combine=median",
                                  "secagg.enabled=true"])
    cfg = load_scenario("default", ["driver.kind=fedbuff", "driver.buffer_size=4",
                                    "secagg.enabled=true"])
    assert cfg["driver"]["kind"] == "fedbuff" and cfg["secagg"]["enabled"]
