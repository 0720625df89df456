"""The cifar10 and shakespeare scenarios, end to end on miniatures of their data files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from miniature_files import write_cifar10, write_leaf_set

from client.app import training_seed
from client.flat_model import FlatModel
from client.training import train
from simulations.apps import build_task
from simulations.cli import run_simulation
from simulations.config import load_scenario
from simulations.task import ScenarioTask


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("scenario", "dataset", "kind"), [("cifar10", "cifar10", "resnet"),
                                                           ("shakespeare", "shakespeare",
                                                            "char_lstm")])
def test_scenarios_without_path_fail_at_start_saying_to_set_it(tmp_path, scenario, dataset,
                                                               kind):
    config = load_scenario(scenario)
    assert config["data"]["dataset"] == dataset and config["model"]["kind"] == kind
    with pytest.raises(ValueError, match=r"set data\.options\.path") as info:
        run_simulation(config, engine="inprocess", db=f"sqlite:///{tmp_path / 's.db'}")
    assert "--set data.options.path=" in str(info.value)
    assert not (tmp_path / "s.db").exists()  # nothing ran


def test_cifar10_scenario_settings():
    config = load_scenario("cifar10")
    assert config["data"]["partitioner"] == "dirichlet" and config["data"]["alpha"] == 0.3
    assert config["federation"]["clients"] == 100


def shakespeare_config(folder, **extra: object) -> dict:
    sets = [f"data.options.path={folder}", "data.options.max_users=4", "federation.clients=4",
            "federation.sample_fraction=1.0", "federation.min_clients=4",
            "federation.rounds=1", "model.hidden=32"]
    return load_scenario("shakespeare", sets + [f"{k}={v}" for k, v in extra.items()])


def test_shakespeare_round_is_fedavg_of_char_lstm_on_each_role(tmp_path, run_inprocess,
                                                                one_thread):
    """One round over 4 LEAF users: the server's new model is the example-weighted mean of
    each user's char LSTM trained here on that user's int64 character windows."""
    folder = write_leaf_set(tmp_path, "shakespeare", users=4)
    config = shakespeare_config(folder)
    models: list[np.ndarray] = []
    summary = run_inprocess(config, models=models)
    assert summary["versions"] == 1 and len(models) == 2
    start, got = models

    task = ScenarioTask.from_config(config)
    total, acc = 0, np.zeros_like(start)
    for pid in range(4):
        x, y = task.partition(pid)
        assert x.dtype == torch.int64 and x.shape[1:] == (80,)
        held_out = task.client_test(pid)
        assert held_out is not None
        assert len(x) + len(held_out[0]) == 6 + 2 * pid  # LEAF user pid, natural partition
        model = FlatModel(task.build_model())
        model.load(start)
        train(model.module, x, y, task.train_config, seed=training_seed(task.seed, 1, pid))
        acc += len(x) * (model.vector() - start)
        total += len(x)
    np.testing.assert_allclose(got, start + acc / total, atol=1e-5)
    assert np.abs(got - start).max() > 1e-3


def test_shakespeare_scenario_runs_from_the_cli_entry(tmp_path, one_thread):
    folder = write_leaf_set(tmp_path, "shakespeare", users=4)
    config = shakespeare_config(folder, **{"federation.rounds": 2})
    summary = run_simulation(config, engine="inprocess", db=f"sqlite:///{tmp_path / 's.db'}")
    assert summary["rounds"] == 2 and summary["versions"] == 2
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and np.isfinite(summary["final_loss"])


def test_shakespeare_natural_partition_needs_as_many_clients_as_users(tmp_path):
    folder = write_leaf_set(tmp_path, "shakespeare", users=4)
    config = shakespeare_config(folder, **{"data.options.max_users": 3})
    with pytest.raises(ValueError, match="the data has 3 groups but 4 clients were asked for"):
        build_task(config)


def cifar10_config(folder) -> dict:
    return load_scenario("cifar10", [f"data.options.path={folder}", "federation.clients=3",
                                     "federation.sample_fraction=1.0", "federation.min_clients=3",
                                     "federation.rounds=2", "model.width=8", "data.min_size=2",
                                     "train.local_epochs=1"])


def test_cifar10_scenario_runs_with_batch_norm(tmp_path, run_inprocess, one_thread):
    """The scenario's BatchNorm ResNet over a miniature of the CIFAR-10 batches: the batch
    norm statistics reach the server's model with the parameters."""
    config = cifar10_config(write_cifar10(tmp_path, train_rows=12))
    models: list[np.ndarray] = []
    summary = run_inprocess(config, models=models)
    assert summary["versions"] == 2 and np.isfinite(summary["final_loss"])
    _, layout = ScenarioTask.from_config(config).initial_params()
    where = dict(zip(layout.names, zip(layout.offsets, layout.sizes, strict=True), strict=True))
    off, size = where["1.running_mean"]  # the stem's batch norm
    assert np.array_equal(models[0][off:off + size], np.zeros(size))
    assert np.abs(models[-1][off:off + size]).min() > 0
    off, size = where["1.running_var"]
    assert np.array_equal(models[0][off:off + size], np.ones(size))
    assert not np.allclose(models[-1][off:off + size], 1.0)


def test_cifar10_scenario_from_the_cli_entry(tmp_path, one_thread):
    config = cifar10_config(write_cifar10(tmp_path, train_rows=12))
    summary = run_simulation(config, engine="inprocess", db=f"sqlite:///{tmp_path / 's.db'}")
    assert summary["rounds"] == 2 and summary["versions"] == 2


@pytest.mark.parametrize(("dataset", "model"), [("femnist", "cnn"), ("sent140", "logreg"),
                                                ("femnist", "resnet")])
def test_leaf_sets_train_as_natural_clients(tmp_path, one_thread, dataset, model):
    """FEMNIST and Sent140 from LEAF files, one client per LEAF user, a round each."""
    folder = write_leaf_set(tmp_path, dataset, users=3)
    scenario = tmp_path / "leaf.toml"
    scenario.write_text(f"""
[data]
dataset = "{dataset}"
partitioner = "natural"
options = {{ path = "{folder}" }}
[model]
kind = "{model}"
{"width = 4" if model == "resnet" else ""}
[federation]
clients = 3
min_clients = 3
rounds = 1
""")
    config = load_scenario(str(scenario))
    summary = run_simulation(config, engine="inprocess", db=f"sqlite:///{tmp_path / 's.db'}")
    assert summary["versions"] == 1 and np.isfinite(summary["final_loss"])


@pytest.mark.slow
def test_shakespeare_gives_the_same_model_on_flowers_engine(tmp_path):
    """Flower's Ray engine rebuilds the task from the LEAF files in its workers: the same
    model as the in-process engine (int64 characters into the LSTM)."""
    from server.store import Store

    config = shakespeare_config(write_leaf_set(tmp_path, "shakespeare", users=4))
    db = f"sqlite:///{tmp_path / 's.db'}"
    a = run_simulation(config, engine="inprocess", db=db)
    b = run_simulation(config, engine="flower", db=db)
    assert a["versions"] == b["versions"] == 1
    with Store(db) as store:
        pa = store.load_checkpoint(a["run_id"]).params
        pb = store.load_checkpoint(b["run_id"]).params
    assert np.abs(pa - store_initial(config)).max() > 1e-3  # the round changed the model
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)


def store_initial(config: dict) -> np.ndarray:
    return ScenarioTask.from_config(config).initial_params()[0]
