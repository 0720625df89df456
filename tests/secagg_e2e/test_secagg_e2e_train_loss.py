"""Secure rounds record the round's training loss as plain rounds do (not under distributed
DP, whose guarantee holds against the server)."""

from __future__ import annotations

import pytest

from simulations.config import load_scenario

BASE = ["federation.clients=4", "federation.rounds=2", "train.local_epochs=1"]


def train_losses(run, store, overrides: list[str]) -> list[float | None]:
    summary = run(load_scenario("default", [*BASE, *overrides]))
    assert summary["versions"] == 2
    return [r.metrics.get("train_loss") for r in store.rounds(summary["run_id"])[1:]]


def test_a_secure_round_records_the_same_train_loss_as_a_plain_round(run_inprocess, store):
    plain = train_losses(run_inprocess, store, [])
    secure = train_losses(run_inprocess, store, ["secagg.enabled=true"])
    assert all(loss is not None for loss in plain)
    # round 1: the same clients train the same model, so the same example-weighted mean;
    # round 2 starts from models that differ by the secure sum's fixed-point rounding
    assert secure[0] == pytest.approx(plain[0], rel=1e-6)
    assert secure[1] == pytest.approx(plain[1], rel=1e-2)


def test_distributed_dp_reports_no_client_loss(run_inprocess, store):
    losses = train_losses(run_inprocess, store, [
        "secagg.enabled=true", "dp.mode=distributed", "dp.noise_multiplier=0.5",
        "aggregation.weight_by=uniform"])
    assert losses == [None, None]
