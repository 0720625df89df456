"""Secure aggregation with the real ServerApp, ClientApp, training and store (in process)."""

from __future__ import annotations

import numpy as np
from flwr.app import Message

from client.protocol.secagg import dropout_stage
from privacy.secagg.messages import MsgType
from simulations.apps import build_task, client_app
from simulations.config import load_scenario

SMALL = ["federation.clients=5", "federation.rounds=2", "train.local_epochs=1"]


def test_secure_run_matches_the_plain_run_within_quantization_noise(run_inprocess, store):
    plain = run_inprocess(load_scenario("default", SMALL))
    secure = run_inprocess(load_scenario("default", [*SMALL, "secagg.enabled=true"]))
    assert secure["status"] == "completed" and secure["versions"] == 2
    # Same clients, seeds and training; only the aggregate differs: fixed point with scale
    # 2^18 (5 clients, 32 bits, clip_range 1, max_weight 1000) puts the decoded weighted
    # mean within 5 / (2 * 2^18 * total weight) < 1e-7 of the exact one, about float32's
    # own rounding of the plain mean; round 2's training keeps that below 1e-4.
    pa = store.load_checkpoint(plain["run_id"]).params
    pb = store.load_checkpoint(secure["run_id"]).params
    assert np.abs(pa - pb).max() < 1e-4
    assert abs(plain["final_accuracy"] - secure["final_accuracy"]) <= 0.01  # <= 3 of 360
    rows = store.secagg_rounds(secure["run_id"])
    assert [r["status"] for r in rows] == ["completed", "completed"]
    assert all(r["survivors"] == r["participants"] and r["num_participants"] == 5 for r in rows)
    rounds = store.rounds(secure["run_id"])
    assert [r.status for r in rounds[1:]] == ["completed", "completed"]
    assert all(r.num_accepted == 5 for r in rounds[1:])


def test_injected_dropouts_complete_with_the_survivors_and_are_recorded(run_inprocess, store):
    n, fraction = 8, 0.25

    def predicted(seed: int, rnd: int) -> dict[int, str]:  # node id -> stage name
        return {pid + 1: s.name.lower() for pid in range(n)
                if (s := dropout_stage(seed, rnd, pid, fraction, "random", n)) is not None}

    seed = next(s for s in range(100)
                if all(1 <= len(predicted(s, r)) <= 2 for r in (1, 2))
                and len({st for r in (1, 2) for st in predicted(s, r).values()}) >= 2)
    cfg = load_scenario("default", [f"federation.clients={n}", "federation.rounds=2",
                                    "train.local_epochs=1", "secagg.enabled=true",
                                    f"secagg.dropout={fraction}"], values={"seed": seed})
    summary = run_inprocess(cfg)
    assert summary["status"] == "completed" and summary["versions"] == 2
    rows = store.secagg_rounds(summary["run_id"])
    for row in rows:
        drops = predicted(seed, row["round"])
        assert row["status"] == "completed", row["abort_reason"]
        assert row["participants"] == [str(i) for i in range(1, n + 1)]
        recorded = {int(c): stage for stage, ids in row["dropouts"].items() for c in ids}
        assert recorded == drops
        counted = {i for i in range(1, n + 1)
                   if i not in drops or drops[i] == "unmasking"}
        assert row["survivors"] == [str(i) for i in sorted(counted)]
        assert row["abort_reason"] is None and row["rejected"] == {}
        updates = store.updates(summary["run_id"], round=row["round"])
        fates = {int(u.client_id): u.fate for _, u in updates}
        assert {c for c, f in fates.items() if f == "accepted"} == counted
        assert {c for c, f in fates.items() if f == "dropped"} == set(drops) - counted
    rounds = store.rounds(summary["run_id"])
    assert [r.num_accepted for r in rounds[1:]] == [len(r["survivors"]) for r in rows]


def test_too_many_dropouts_abort_the_round_and_the_run_goes_on(run_inprocess, store):
    asked: list[tuple[str, int]] = []

    def flaky(msg: Message, context):  # four of six clients vanish in round 1, stage 2
        rnd, kind = msg.metadata.group_id, msg.metadata.message_type
        asked.append((rnd, len(msg.content["secagg"]["msg"]) if "secagg" in msg.content
                      else 0))
        if rnd == "1" and kind == "query.secagg" and int(context.node_id) <= 4:
            raise ConnectionError("client vanished")
        return client_app(msg, context)

    cfg = load_scenario("default", ["federation.clients=6", "federation.rounds=2",
                                    "train.local_epochs=1", "secagg.enabled=true"])
    summary = run_inprocess(cfg, flaky)
    assert summary["status"] == "completed" and summary["versions"] == 1
    rounds = store.rounds(summary["run_id"])
    assert [(r.status, r.model_version) for r in rounds] == [
        ("completed", 0), ("aborted", 0), ("completed", 1)]
    assert rounds[1].num_accepted == 0 and rounds[1].num_dropped >= 4
    initial, _ = build_task(cfg).initial_params()
    np.testing.assert_array_equal(store.load_checkpoint(summary["run_id"], round=1).params,
                                  initial)  # the aborted round left the model unchanged
    first, second = store.secagg_rounds(summary["run_id"])
    assert first["status"] == "aborted" and "neighbours left" in first["abort_reason"]
    assert first["dropouts"]["share_keys"] == ["1", "2", "3", "4"]
    assert first["survivors"] == [] and second["status"] == "completed"
    # round 1 ended after stage 2: no unmask request (nor forwarded shares) went out
    assert sum(rnd == "1" for rnd, _ in asked) == 6 + 6
    updates = store.updates(summary["run_id"], round=1)
    assert all(u.fate != "accepted" for _, u in updates)


def test_three_clients_with_one_dropping_after_masking_reveal_no_sum(run_inprocess, store):
    """The policy's acceptance run, with the scenario's own seed: a round of three where a
    client vanishes after the masked-input stage (0.34 of 3 clients: one in every round)
    would reveal the sum of two; every round aborts before any unmask request, and the
    same rounds without dropouts complete."""
    fraction, rounds = 0.34, 3

    def dropping(seed: int, rnd: int) -> set[int]:
        return {pid + 1 for pid in range(3)
                if dropout_stage(seed, rnd, pid, fraction, "masked_input", 3) is not None}

    asked: list[str] = []

    def spy(msg: Message, context):
        record = msg.content.get("secagg")
        if record is not None and len(record["msg"]) > 3:
            asked.append(msg.metadata.message_type + f":{record['msg'][3]}")
        return client_app(msg, context)

    cfg = load_scenario("default", ["federation.clients=3", f"federation.rounds={rounds}",
                                    "train.local_epochs=1", "secagg.enabled=true",
                                    f"secagg.dropout={fraction}",
                                    'secagg.dropout_stage="masked_input"'])
    seed = cfg["seed"]
    assert all(len(dropping(seed, r)) >= 1 for r in range(1, rounds + 1))
    summary = run_inprocess(cfg, spy)
    assert summary["versions"] == 0
    initial, _ = build_task(cfg).initial_params()
    np.testing.assert_array_equal(store.load_checkpoint(summary["run_id"]).params, initial)
    rows = store.secagg_rounds(summary["run_id"])
    assert [r["status"] for r in rows] == ["aborted"] * rounds
    for row in rows:
        gone = dropping(seed, row["round"])
        assert row["dropouts"]["masked_input"] == [str(c) for c in sorted(gone)]
        assert "fewer than the minimum 3" in row["abort_reason"]
        assert "no share was requested" in row["abort_reason"]
    assert [r.status for r in store.rounds(summary["run_id"])[1:]] == ["aborted"] * rounds
    unmask = int(MsgType.UNMASK_REQUEST)
    assert not any(a.endswith(f":{unmask}") for a in asked)  # nothing asked that reveals

    cfg = load_scenario("default", ["federation.clients=3", "federation.rounds=1",
                                    "train.local_epochs=1", "secagg.enabled=true"])
    assert run_inprocess(cfg)["versions"] == 1  # all three stayed: their sum is revealed
