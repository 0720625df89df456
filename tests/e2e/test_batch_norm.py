"""Batch norm through the real ServerApp and ClientApp on the in-process engine.

Each client's training is redone here on a plain torch module (no flat vector), with the
client's batch order and optimizer, so what travels is checked against what torch itself
computes: running statistics averaged like the weights, FedBN's statistics kept on each
client across rounds, and ``num_batches_tracked`` counted exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from torch.nn import functional as F

from client.app import MESSAGE_REFUSED, training_seed
from client.local_state import LOCAL_STATE
from client.protocol.keys import MetricKey
from client.protocol.npy import npy_array, npy_view
from client.protocol.updates import read_delta
from simulations.apps import build_task, client_app
from simulations.config import load_scenario
from simulations.task import ScenarioTask

COUNT = "2.num_batches_tracked"  # bn_mlp: Flatten, Linear, BatchNorm1d, ReLU, Linear
BN = ("2.weight", "2.bias", "2.running_mean", "2.running_var")


def _config(*extra: str, clients: int = 3, rounds: int = 1) -> dict[str, Any]:
    return load_scenario("default", [f"federation.clients={clients}",
                                     f"federation.rounds={rounds}", "federation.min_clients=1",
                                     "train.local_epochs=1", "model.kind=bn_mlp",
                                     "model.hidden=[16]", *extra])


def _reference(task: ScenarioTask, start: dict[str, np.ndarray], rnd: int, pid: int,
               count: int = 0) -> dict[str, torch.Tensor]:
    """Client ``pid``'s training in round ``rnd`` on a plain torch module loaded with
    ``start`` (and batch count ``count``): its state dict afterwards."""
    module = task.build_model()
    assert COUNT not in start  # never in the vector
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in start.items()},
                           strict=False)
    module.get_buffer(COUNT).fill_(count)
    cfg = task.train_config
    anchor = [p.detach().clone() for p in module.parameters()]  # FedProx: parameters only
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(training_seed(task.seed, rnd, pid))
    x, y = task.partition(pid)
    module.train()
    for _ in range(cfg.local_epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            if len(idx) < 2:  # batch norm cannot train on one sample
                continue
            opt.zero_grad()
            prox = sum(((p - a) ** 2).sum() for p, a in zip(module.parameters(), anchor,
                                                           strict=True))
            (F.cross_entropy(module(x[idx]), y[idx]) + cfg.proximal_mu / 2 * prox).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Recorder:
    """fedring's ClientApp, recording every reply's delta and each node's kept tensors;
    ``preset`` puts tensors into a node's state before its first message."""

    def __init__(self, app: ClientApp = client_app,
                 preset: dict[int, dict[str, np.ndarray]] | None = None) -> None:
        self.app, self.preset = app, dict(preset or {})
        self.deltas: dict[tuple[int, int], np.ndarray] = {}  # (round, partition) -> delta
        self.examples: dict[int, int] = {}
        self.kept: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def __call__(self, msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid in self.preset:
            arrays = self.preset.pop(pid)
            context.state[LOCAL_STATE] = ArrayRecord({k: npy_array(v) for k, v in arrays.items()})
        reply = self.app(msg, context)
        rnd = int(msg.content["config"]["server-round"])
        if reply.has_content() and "delta" in reply.content:
            self.deltas[rnd, pid] = read_delta(reply.content["delta"]).copy()  # a reused buffer
            self.examples[pid] = int(reply.content["metrics"][MetricKey.NUM_EXAMPLES])
        kept = context.state.get(LOCAL_STATE)
        if isinstance(kept, ArrayRecord):
            self.kept[rnd, pid] = {k: np.array(npy_view(kept[k])) for k in kept}
        return reply


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_running_statistics_are_averaged_like_the_weights(run_inprocess, mu) -> None:
    """After one round the server's whole model, running mean and variance included, is the
    example-weighted mean of what plain torch training gives on each client (with FedProx
    too, whose term covers the parameters only)."""
    config = _config(f"train.proximal_mu={mu}")
    task = build_task(config)
    params, layout = task.initial_params()
    assert layout.trainable == (True, True, True, True, False, False, True, True)
    recorder, models = Recorder(), []
    run_inprocess(config, recorder, models=models)
    start = layout.unflatten(params)
    trained = {pid: _reference(task, start, 1, pid) for pid in range(3)}
    weights = {pid: len(task.partition(pid)[0]) for pid in range(3)}
    assert recorder.examples == weights
    got = layout.unflatten(models[1])
    for name in layout.names:
        expected = sum(weights[p] * trained[p][name].numpy() for p in trained) / sum(
            weights.values())
        np.testing.assert_allclose(got[name], expected, atol=2e-5, err_msg=name)
    for name in ("2.running_mean", "2.running_var"):  # the buffers did move
        assert np.abs(got[name] - start[name]).max() > 1e-2
        assert len({trained[p][name].numpy().tobytes() for p in trained}) == 3
    # the integer count never entered the vector: each client kept its own, exactly
    for pid in range(3):
        assert recorder.kept[1, pid][COUNT] == int(trained[pid][COUNT])
        assert recorder.kept[1, pid][COUNT].dtype == np.int64


def test_secure_aggregation_sums_the_buffers_too(run_inprocess) -> None:
    plain, secure = [], []
    run_inprocess(_config(), models=plain)
    run_inprocess(_config("secagg.enabled=true"), models=secure)
    layout = build_task(_config()).initial_params()[1]
    moved = np.abs(plain[1] - plain[0])
    assert moved[~layout.mask(layout.trainable)].max() > 1e-2  # buffers are in the sum
    np.testing.assert_allclose(secure[1], plain[1], atol=1e-3)


def test_fedbn_keeps_each_client_s_statistics_across_rounds(run_inprocess) -> None:
    """FedBN: a client's batch-norm tensors in round 2 continue from its own round-1
    values; the server averages none of them and keeps its own as built."""
    config = _config("aggregation.local_buffers=true", clients=2, rounds=2)
    task = build_task(config)
    params, layout = task.initial_params()
    local = layout.mask(layout.local)
    assert [n for n, f in zip(layout.names, layout.local, strict=True) if f] == list(BN)
    recorder, models = Recorder(), []
    run_inprocess(config, recorder, models=models)
    for (rnd, pid), delta in recorder.deltas.items():  # zero where the clients keep theirs
        assert not delta[local].any(), (rnd, pid)
        assert np.abs(delta[~local]).max() > 1e-3
    assert np.array_equal(models[2][local], params[local])  # the server's BN as built
    assert np.abs(models[2][~local] - params[~local]).max() > 1e-2
    for pid in range(2):
        round1 = _reference(task, layout.unflatten(params), 1, pid)
        for name in BN:
            np.testing.assert_allclose(recorder.kept[1, pid][name], round1[name], atol=1e-6)
        own = dict(layout.unflatten(models[1]))
        own.update({name: round1[name].numpy() for name in BN})
        round2 = _reference(task, own, 2, pid, count=int(round1[COUNT]))
        from_global = _reference(task, layout.unflatten(models[1]), 2, pid,
                                 count=int(round1[COUNT]))
        for name in BN:
            np.testing.assert_allclose(recorder.kept[2, pid][name], round2[name], atol=1e-5)
            assert np.abs(round2[name] - from_global[name]).max() > 1e-3  # it matters
        assert recorder.kept[2, pid][COUNT] == int(round2[COUNT])
        # its non-local delta is trained from its own batch norm too
        nonlocal_ = [n for n, f in zip(layout.names, layout.local, strict=True) if not f]
        delta = layout.unflatten(recorder.deltas[2, pid])
        for name in nonlocal_:
            np.testing.assert_allclose(delta[name], round2[name].numpy() - own[name], atol=2e-5)


def test_a_batch_count_above_float32_precision_survives_exactly(run_inprocess) -> None:
    """num_batches_tracked never passes through float32: a count of 2**24 + 1 (not a
    float32) goes on exactly, and batch norm's cumulative average (momentum None), which
    divides by it, trains from it as plain torch does."""
    big = 2**24 + 1
    assert int(np.float32(big)) != big
    config = _config("model.cumulative=true", clients=2, rounds=2)
    task = build_task(config)
    params, layout = task.initial_params()
    assert task.build_model()[2].momentum is None
    recorder, models = Recorder(preset={0: {COUNT: np.array(big, dtype=np.int64)}}), []
    run_inprocess(config, recorder, models=models)
    steps = {}
    for pid in range(2):
        n, bs = len(task.partition(pid)[0]), task.train_config.batch_size
        steps[pid] = n // bs + (n % bs >= 2)  # batches of two or more samples, one epoch
    assert recorder.kept[1, 0][COUNT] == big + steps[0]
    assert recorder.kept[2, 0][COUNT] == big + 2 * steps[0]
    assert recorder.kept[2, 1][COUNT] == 2 * steps[1]
    for pid, count in ((0, big), (1, 0)):
        expected = _reference(task, layout.unflatten(params), 1, pid, count=count)
        assert int(expected[COUNT]) == recorder.kept[1, pid][COUNT]
        delta = layout.unflatten(recorder.deltas[1, pid])
        start = layout.unflatten(params)
        for name in ("2.running_mean", "2.running_var"):
            np.testing.assert_allclose(delta[name], expected[name].numpy() - start[name],
                                       atol=1e-6)
    # with a huge count the cumulative average barely moves; from zero it does
    moved = {pid: np.abs(layout.unflatten(recorder.deltas[1, pid])["2.running_mean"]).max()
             for pid in range(2)}
    assert moved[0] < 1e-4 < 1e-2 < moved[1]


def test_dp_sgd_with_batch_norm_fails_at_start_suggesting_group_norm() -> None:
    config = _config("train.dp_sgd_noise_multiplier=1.0")
    with pytest.raises(ValueError, match="GroupNorm") as err:
        build_task(config)
    assert "train.dp_sgd_noise_multiplier" in str(err.value)
    from simulations.cli import run_simulation

    with pytest.raises(ValueError, match="GroupNorm"):
        run_simulation(config, engine="inprocess", db="sqlite://")


def test_cuda_without_cuda_fails_at_start_and_auto_trains_where_it_can(run_inprocess) -> None:
    from simulations.cli import run_simulation

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"train.device = 'cuda' but CUDA is not available"):
            run_simulation(_config("train.device=cuda"), engine="inprocess", db="sqlite://")
    here = "cuda" if torch.cuda.is_available() else "cpu"
    auto, explicit = [], []
    run_inprocess(_config("train.device=auto"), models=auto)
    run_inprocess(_config(f"train.device={here}"), models=explicit)
    np.testing.assert_allclose(auto[1], explicit[1], atol=1e-6)
    assert np.abs(auto[1] - auto[0]).max() > 1e-2


def test_ray_clients_get_a_gpu_share_only_on_cuda() -> None:
    from simulations.cli import engine_on
    from simulations.engine_config import EngineConfig

    assert engine_on("cpu", EngineConfig()).client_gpus == 0.0
    share = engine_on("cuda", EngineConfig()).client_gpus
    assert 0 < share <= 1
    assert engine_on("cuda", EngineConfig(client_gpus=0.5)).client_gpus == 0.5


def test_dp_clips_the_whole_delta_buffers_included(run_inprocess) -> None:
    """What is aggregated is what DP clips: a local-DP client's delta (with little noise
    here) is its whole trained delta, running statistics included, scaled to norm
    ``dp.clip``."""
    clip = 0.5
    config = _config("dp.mode=local", f"dp.clip={clip}", "dp.noise_multiplier=0.001",
                     "aggregation.weight_by=uniform", clients=2)
    task = build_task(config)
    params, layout = task.initial_params()
    recorder = Recorder()
    run_inprocess(config, recorder)
    for pid in range(2):
        trained = _reference(task, layout.unflatten(params), 1, pid)
        full = layout.flatten(trained) - params
        assert np.linalg.norm(full) > clip
        np.testing.assert_allclose(recorder.deltas[1, pid], full * clip / np.linalg.norm(full),
                                   atol=6 * 0.001 * clip)  # six noise deviations
        assert np.abs(recorder.deltas[1, pid][~layout.mask(layout.trainable)]).max() > 1e-4


def test_fedbn_server_keeps_its_batch_norm_under_central_noise(run_inprocess) -> None:
    """Central DP noises every coordinate of the sum; under FedBN the server still leaves
    the batch-norm entries (which no client averages) as built."""
    config = _config("aggregation.local_buffers=true", "dp.mode=central", "dp.clip=1.0",
                     "dp.noise_multiplier=1.0", "aggregation.weight_by=uniform", clients=3)
    params, layout = build_task(config).initial_params()
    local = layout.mask(layout.local)
    models: list[np.ndarray] = []
    run_inprocess(config, models=models)
    assert np.array_equal(models[1][local], params[local])
    assert np.abs(models[1][~local] - params[~local]).max() > 1e-2


@pytest.mark.parametrize("setting, words", [
    ("train.dp_sgd_noise_multiplier=1.0", "GroupNorm"),
    pytest.param("train.device=cuda", "train.device = 'cuda' but CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_a_client_refuses_what_it_cannot_train_naming_the_key(setting, words) -> None:
    """A SuperNode checks too: a server elsewhere may not have run the start-up checks."""
    from flwr.app import RecordDict

    from client.app import task_spec_json
    from client.protocol.train import train_config
    from client.protocol.updates import model_record
    from simulations.inprocess import InProcessGrid
    from simulations.task import task_spec

    params, layout = build_task(_config()).initial_params()
    spec = task_spec(_config(setting))
    grid = InProcessGrid(client_app, 1)
    msg = grid.create_message(RecordDict({"arrays": model_record(layout, params),
                                          "config": train_config(1, 0, task_spec_json(spec), 0)}),
                              "train", 1, "")
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and words in reply.error.reason
    assert reply.error.code == MESSAGE_REFUSED  # refused before training, not a crash in it
