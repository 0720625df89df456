"""FedBuff's end of run through the run loop: the replies pulled after the last applied
buffer are stored as one aborted round, and every byte lands in exactly one round, the
clients' federated evaluation included (real ClientApp, in-process engine, real store)."""

from __future__ import annotations

from staleness_helpers import scenario

BYTES = ("bytes_up", "bytes_down")


def test_the_leftover_round_and_every_byte_once(run, store):
    cfg = scenario("federation.clients=6", "federation.rounds=1", "driver.kind=fedbuff",
                   "driver.buffer_size=4", "federation.evaluate_fraction=1")
    summary = run(cfg)
    assert (summary["rounds"], summary["versions"]) == (1, 1)  # the aborted round: not run
    rounds = store.rounds(summary["run_id"])
    applied, left = rounds[1], rounds[2]
    assert (left.round, left.status, left.model_version) == (2, "aborted", 1)
    assert (left.num_sampled, left.num_replies, left.num_accepted, left.num_dropped) == \
        (2, 2, 0, 2)
    assert "federated_accuracy" in applied.metrics
    # the model is unchanged: its figures are the applied round's, no client evaluated it
    assert left.metrics == {**{k: v for k, v in applied.metrics.items()
                               if not k.startswith("federated_") and k not in BYTES},
                            **{k: left.metrics[k] for k in BYTES}}
    # each reply in the round that processed it: two dense deltas left, four applied
    assert left.metrics["bytes_up"] * 4 == applied.metrics["bytes_up"] * 2 > 0
    for key in BYTES:  # the tasks, the deltas and the evaluation's messages, each once
        assert sum(r.metrics.get(key, 0.0) for r in rounds) == summary[key]
    assert applied.metrics["bytes_down"] > left.metrics["bytes_down"] == 0
    updates = [u for _, u in store.updates(summary["run_id"], round=2)]
    assert [(u.fate, u.base_version, u.staleness) for u in updates] == [("dropped", 0, 1)] * 2
    assert {u.reason for u in updates} == {"the run ended before it was processed"}
