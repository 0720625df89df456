"""simulations.population: clients made on demand give what the in-memory population gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from miniature_files import leaf_users, write_leaf, write_leaf_set

from server.store import Store
from simulations.cli import run_simulation
from simulations.config import load_scenario
from simulations.leaf import LeafIndex
from simulations.population import AUTO_CLIENTS, OnDemandPopulation, SyntheticSource
from simulations.task import ScenarioTask

SYNTH = ["data.dataset=synthetic", "data.partitioner=natural", "federation.clients=6",
         "data.options.num_users=6", "data.options.max_samples_per_user=90",
         "model.kind=logreg", "federation.rounds=2", "train.local_epochs=1",
         "federation.sample_fraction=0.5", "federation.evaluate_fraction=1"]


def _task(*overrides: str) -> ScenarioTask:
    return ScenarioTask.from_config(load_scenario("default", [*SYNTH, *overrides]))


def _run(tmp_path, population: str, *overrides: str):
    db = f"sqlite:///{tmp_path / population}.db"
    config = load_scenario("default", [*SYNTH, f"data.population={population}", *overrides])
    summary = run_simulation(config, engine="inprocess", db=db)
    with Store(db) as store:
        params = store.load_checkpoint(summary["run_id"]).params
        rounds = [{k: v for k, v in r.metrics.items() if not k.endswith("_s")}
                  for r in store.rounds(summary["run_id"])]
    return params, rounds


def test_the_same_seed_gives_the_same_model_in_memory_and_on_demand(tmp_path):
    """A real two-round run, the population held in memory or made on demand: the same
    final model, bit for bit, and the same central and federated evaluation."""
    memory, memory_rounds = _run(tmp_path, "memory")
    on_demand, on_demand_rounds = _run(tmp_path, "on_demand")
    np.testing.assert_array_equal(memory, on_demand)
    assert memory_rounds == on_demand_rounds
    assert memory_rounds[-1]["accuracy"] > 0


def test_clients_on_demand_are_the_memory_partitions():
    """Every client's training and held-out split, with a feature shift and label-flipping
    attackers, is what the memory population gives; and the central test set."""
    extra = ["data.feature_shift=0.5", "attack.fraction=0.34", "attack.kind=label_flip"]
    mem, dem = _task("data.population=memory", *extra), _task("data.population=on_demand",
                                                              *extra)
    assert not mem.on_demand and dem.on_demand
    assert dem.attack is not None and dem.attack.attackers == mem.attack.attackers
    dem.check()
    for pid in (5, 0, 3, 0):
        for a, b in zip(mem.partition(pid), dem.partition(pid), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(mem.client_test(pid), dem.client_test(pid), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(mem.load_test().tensors, dem.load_test().tensors, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    params, _ = dem.initial_params()
    assert mem.evaluate(params) == dem.evaluate(params)


def test_on_demand_keeps_no_whole_dataset_and_no_partition_list():
    task = _task("data.population=on_demand")
    with pytest.raises(RuntimeError, match="holds no whole dataset"):
        task.dataset  # noqa: B018
    with pytest.raises(RuntimeError, match="no list of partitions"):
        task.partitions()
    with pytest.raises(ValueError, match="partition-id 6 is out of range"):
        task.partition(6)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["data.partitioner=dirichlet"],
         r"data\.population = 'on_demand'.*data\.partitioner = 'dirichlet'.*set "
         r"data\.partitioner = 'natural' or data\.population = 'memory'"),
        (["data.dataset=digits"], r"cannot make clients of dataset 'digits'.*data\.population"),
        (["data.population=lazy"], r"data\.population"),
        (["data.cache_mb=0"], r"data\.cache_mb must be > 0"),
    ],
)
def test_bad_population_settings_fail_at_start(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_scenario("default", [*SYNTH, "data.population=on_demand", *overrides])


def test_on_demand_client_count_must_match_the_users():
    task = _task("data.population=on_demand", "federation.clients=7")
    with pytest.raises(ValueError, match=r"6 groups but 7 clients.*federation\.clients = 6"):
        task.check()


def test_auto_is_memory_for_every_small_or_pooled_scenario():
    assert not ScenarioTask.from_config(load_scenario("default")).on_demand
    assert not _task().on_demand
    big = [f"federation.clients={AUTO_CLIENTS + 1}", f"data.options.num_users={AUTO_CLIENTS + 1}"]
    assert _task(*big).on_demand
    assert not _task(*big, "data.population=memory").on_demand
    assert not _task(*big, "data.partitioner=iid").on_demand


def test_the_cache_is_bounded_in_bytes_and_a_client_comes_back_the_same():
    source = SyntheticSource(seed=4, test_fraction=0.2, num_users=50, max_samples_per_user=50)
    one = sum(a.nbytes for a in source.train(0))
    pop = OnDemandPopulation(source, cache_bytes=3 * one)  # three clients of 40 samples each
    first = [np.array(a) for a in pop.client(7)]
    for i in range(10):
        pop.client(i)
        assert pop.cached_bytes <= 3 * one
    assert list(pop._cache) == [7, 8, 9]
    assert (pop.hits, pop.misses) == (0, 11)  # 7 had left before the loop came to it
    pop.client(8)  # a hit: 8 becomes the most recent
    pop.client(0)  # evicts 7, the least recent
    assert (pop.hits, pop.misses, list(pop._cache)) == (1, 12, [9, 8, 0])
    again = pop.client(7)  # made again: the same data
    assert pop.misses == 13
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="read-only"):
        again[0][0, 0] = 1.0


def test_the_central_test_sample_is_bounded():
    source = SyntheticSource(seed=1, test_fraction=0.5, num_users=1000)
    pop = OnDemandPopulation(source, cache_bytes=1, test_sample=500)
    x, y = pop.test_sample()
    assert len(x) == len(y) == 500
    held = np.concatenate([source.spec.split(i, 0.5)[2] for i in range(4)])
    np.testing.assert_array_equal(x[:len(held[:500])], held[:500])
    assert pop.test_sample()[0] is x  # made once


MILLION = '''
import json, sys
import numpy as np

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

from simulations.config import load_scenario
from simulations.task import ScenarioTask
before = status("VmRSS:")
config = load_scenario("default", ["data.dataset=synthetic", "data.partitioner=natural",
                                   "federation.clients=1000000",
                                   "data.options.num_users=1000000", "model.kind=logreg",
                                   "data.population=on_demand"])
task = ScenarioTask.from_config(config)
task.check()
sizes = []
for pid in np.random.default_rng(0).choice(1_000_000, 5, replace=False):
    x, y = task.partition(int(pid))
    sizes.append(len(y) + len(task.client_test(int(pid))[1]))
print(json.dumps({"growth": status("VmHWM:") - before, "sizes": sizes,
                  "test": len(task.load_test())}))
'''


def test_a_million_clients_on_demand_build_check_and_sample_in_bounded_memory():
    """1,000,000 synthetic clients: building the task, checking it and making 5 random
    clients stay under 300 MB of peak resident growth (VmHWM of a fresh interpreter)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", MILLION], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["sizes"]) == 5 and min(got["sizes"]) >= 1
    assert 0 < got["test"] <= 10_000
    assert got["growth"] < 300 * 2**20, got


def _npz(tmp_path, *, sort: bool, compressed: bool = False):
    rng = np.random.default_rng(3)
    groups = rng.integers(10, 15, 60)
    if sort:
        groups = np.sort(groups)
    arrays = {"x_train": rng.integers(0, 9, (60, 2, 3)).astype(np.uint8),
              "y_train": rng.integers(0, 4, 60), "x_test": rng.normal(size=(9, 2, 3)),
              "y_test": rng.integers(0, 5, 9), "groups": groups}
    path = tmp_path / f"data{sort}{compressed}.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return str(path)


@pytest.mark.parametrize("sort", [True, False])
def test_npz_groups_are_read_one_client_at_a_time(tmp_path, sort):
    path = _npz(tmp_path, sort=sort)
    base = [s for s in SYNTH if not s.startswith(("data.options", "federation.clients"))]
    config = load_scenario("default", [*base, f"data.options.path={path}", "data.dataset=npz",
                                       "federation.clients=5"])
    mem = ScenarioTask.from_config(config)
    dem = ScenarioTask.from_config({**config, "data": {**config["data"],
                                                       "population": "on_demand"}})
    assert dem.on_demand and not mem.on_demand
    dem.check()
    for pid in range(5):
        for a, b in zip(mem.partition(pid), dem.partition(pid), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(mem.load_test().tensors, dem.load_test().tensors, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert dem.population.num_classes == mem.dataset.num_classes
    source = dem.population.source
    assert isinstance(source.x, np.memmap)  # read from the file when a client is made
    assert (source.order is None) == sort


def test_npz_compressed_or_without_groups_is_refused_on_demand(tmp_path):
    from simulations.population import NpzSource

    with pytest.raises(ValueError, match=r"stores 'x_train' compressed.*np\.savez.*"
                                         r"data\.population = 'memory'"):
        NpzSource(path=_npz(tmp_path, sort=True, compressed=True))
    path = tmp_path / "nogroups.npz"
    np.savez(path, x_train=np.zeros((2, 1)), y_train=np.zeros(2, int), x_test=np.zeros((1, 1)),
             y_test=np.zeros(1, int))
    with pytest.raises(ValueError, match=r"lacks 'groups'.*data\.population = 'memory'"):
        NpzSource(path=str(path))


@pytest.mark.parametrize("kind", ["femnist", "shakespeare", "sent140"])
def test_leaf_users_are_read_one_at_a_time(tmp_path, kind):
    """A LEAF miniature in the published format, users over two training files and one
    spread over both: every client's records on demand are the in-memory partition."""
    rng = np.random.default_rng(5)
    train = [leaf_users(kind, rng, {"a": 5, "b": 0, "c": 7}),
             leaf_users(kind, rng, {"d": 4, "a": 3, "é": 6})]
    test = [leaf_users(kind, rng, {"é": 2, "c": 3, "a": 2, "zz": 4})]
    folder = write_leaf(tmp_path / kind, {"train": train, "test": test})
    base = [s for s in SYNTH if not s.startswith(("data.options", "federation.clients",
                                                  "model.kind"))]
    model = "char_lstm" if kind == "shakespeare" else "logreg"
    config = load_scenario("default", [*base, f"data.dataset={kind}", f"model.kind={model}",
                                       f"data.options.path={folder}", "federation.clients=4"])
    mem = ScenarioTask.from_config(config)
    dem = ScenarioTask.from_config({**config, "data": {**config["data"],
                                                       "population": "on_demand"}})
    dem.check()
    assert dem.population.num_clients == 4
    for pid in (3, 0, 2, 1):
        for a, b in zip(mem.partition(pid), dem.partition(pid), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the test sample: held-out records of clients 0, 1, 2, ... (a, c, d, é)
    y_test = dem.load_test().tensors[1]
    assert len(y_test) == 2 + 3 + 0 + 2
    assert sorted(y_test.tolist()) == sorted(mem.load_test().tensors[1].tolist())


def test_leaf_index_keeps_a_few_numbers_per_client(tmp_path):
    folder = write_leaf_set(tmp_path, "femnist", users=6)
    index = LeafIndex("femnist", path=str(folder), max_users=5)
    assert index.num_clients == 5
    offsets, spans = index._index["train"]
    assert offsets.dtype == spans.dtype == np.int64 and spans.shape == (5, 3)
    assert [len(index.train(i)[1]) for i in range(5)] == [6, 8, 10, 12, 14]
    (folder / "train" / sorted(p.name for p in (folder / "train").iterdir())[0]).write_text(
        '{"users": ["x"], "num_samples": [2], "user_data": {"x": {"x": [], "y": []}}}')
    with pytest.raises(ValueError, match=r"user 'x' has 0 samples and num_samples 2"):
        LeafIndex("femnist", path=str(folder))
