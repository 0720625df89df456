"""The in-process worker builds a round's post-training steps once for all its clients
(``client.app._Worker.post_training``): the replies are those of steps built for each
client, a changed or malformed setting is read again, and local DP is built per client."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from client import app as client_module
from client.protocol.keys import ConfigKey
from client.protocol.train import train_config
from client.protocol.updates import model_record, read_delta
from simulations.apps import client_app
from simulations.config import load_scenario
from simulations.inprocess import InProcessGrid
from simulations.task import ScenarioTask, task_spec

NODES = 2


def spec_of(*overrides: str) -> dict[str, Any]:
    return task_spec(load_scenario("default", [f"federation.clients={NODES}",
                                               "train.local_epochs=1", *overrides]))


def round_replies(spec: dict[str, Any], rnd: int, **settings: Any
                  ) -> list[tuple[np.ndarray | None, str | None]]:
    """Every node's (delta, None) or (None, error reason) for one train message each, all
    carrying one content object (as a server sends a round)."""
    params, layout = ScenarioTask(spec).initial_params()
    center = settings.pop("center", None)
    if center is not None:
        center = (np.full(layout.dim, center, np.float32), 0.05)
    config = train_config(rnd, 0, json.dumps(spec, sort_keys=True), 0, center=center,
                          **settings)
    return send(spec, RecordDict({"arrays": model_record(layout, params), "config": config}))


def send(spec: dict[str, Any], content: RecordDict) -> list[tuple[np.ndarray | None, str | None]]:
    grid = InProcessGrid(client_app, NODES)
    msgs = [grid.create_message(content, "train", n, "1") for n in grid.get_node_ids()]
    out = []
    for m in grid.send_and_receive(msgs):
        out.append((None, m.error.reason) if m.has_error()
                   else (read_delta(m.content["delta"]).copy(), None))
    return out


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """The names of every pipeline the client app builds, in order."""
    made: list[tuple[str, ...]] = []
    build = client_module.fedring_pipeline

    def counted(*args: Any, **kwargs: Any) -> Any:
        pipe = build(*args, **kwargs)
        made.append(pipe.names)
        return pipe

    monkeypatch.setattr(client_module, "fedring_pipeline", counted)
    client_module._WORKERS.clear()
    return made


@pytest.mark.parametrize("settings", [{}, {"client_momentum": 0.5}, {"center": 0.01}])
def test_one_build_a_round_and_the_same_replies(builds, monkeypatch, settings):
    spec = spec_of()
    reused = round_replies(spec, 1, **settings)
    assert len(builds) == 1 and all(err is None for _, err in reused)
    monkeypatch.setattr(client_module, "_same", lambda key, other: False)  # built each time
    fresh = round_replies(spec, 1, **settings)
    assert len(builds) == 1 + NODES
    assert builds[0] == builds[-1]
    if settings:  # the setting's step is there
        assert builds[0][-1] in ("client_momentum", "client_clip") or \
            "client_momentum" in builds[0]
    for (a, _), (b, _) in zip(reused, fresh, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_changed_setting_builds_again(builds):
    spec = spec_of()
    round_replies(spec, 1)
    round_replies(spec, 2, client_momentum=0.5)
    round_replies(spec, 3, client_momentum=0.5)  # the same settings: kept
    round_replies(spec, 4, center=0.01)
    round_replies(spec, 5, center=0.01)  # new centre bytes: read again
    assert builds == [("tamper",), ("client_momentum", "tamper"), ("tamper", "client_clip"),
                      ("tamper", "client_clip")]


def content(spec: dict[str, Any], rnd: int, momentum: Any) -> RecordDict:
    params, layout = ScenarioTask(spec).initial_params()
    entries = dict(train_config(rnd, 0, json.dumps(spec, sort_keys=True), 0))
    entries[ConfigKey.CLIENT_MOMENTUM] = momentum
    return RecordDict({"arrays": model_record(layout, params), "config": ConfigRecord(entries)})


@pytest.mark.parametrize(("good", "bad"), [(0.5, True), (0.5, "0.5"), (0.5, float("nan")),
                                           (0.0, False)])  # (False == 0.0 in Python)
def test_a_malformed_setting_is_refused_after_a_good_round(builds, good, bad):
    spec = spec_of()
    assert all(err is None for _, err in send(spec, content(spec, 1, good)))
    got = send(spec, content(spec, 2, bad))
    assert all(delta is None and ConfigKey.CLIENT_MOMENTUM in err for delta, err in got)


def test_local_dp_builds_for_each_client(builds):
    spec = spec_of("dp.mode=local", "dp.clip=0.5", "dp.noise_multiplier=0.1",
                   "aggregation.weight_by=uniform")
    round_replies(spec, 1)
    assert builds == [("local_dp", "tamper")] * NODES
