"""The learning task of a scenario: dataset, partitions, model, training settings.

One class serves both sides: the ServerApp uses ``initial_params`` and ``evaluate``,
the ClientApp ``build_model`` and ``partition``. Both rebuild it from the same spec,
so a client in another process or on another machine trains the same task.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from aggregation import Layout
from client.flat_model import FlatModel
from client.training import TrainConfig, check_model, evaluate
from privacy.dp import DPConfig
from simulations.attacks import Attack, AttackConfig
from simulations.datasets import Dataset, load_dataset
from simulations.feature_shift import distort
from simulations.models import build_model
from simulations.partitioners import client_test_split, partition
from simulations.population import (
    DEFAULT_CACHE_MB,
    OnDemandPopulation,
    make_source,
    resolve_population,
)

SPEC_KEYS = ("seed", "clients", "data", "model", "train")
OPTIONAL_SPEC_KEYS = ("dp", "attack")
CLIENT_TEST_FRACTION = 0.2  # [data] client_test_fraction when a spec does not say


def task_spec(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a resolved scenario that clients need to rebuild the task: the built-in
    ``[data]`` and ``[model]``, or the user's ``[task] module`` (``module_task.make_task``
    builds either)."""
    spec = {"seed": config["seed"], "clients": config["federation"]["clients"],
            "train": config["train"], "dp": config.get("dp", {})}
    module = (config.get("task") or {}).get("module")
    if module:
        spec["task"] = {"module": module, "client_test_fraction":
                        float(config["task"].get("client_test_fraction", 0.0))}
    else:
        spec.update(data=config["data"], model=config["model"])
    if AttackConfig(**config.get("attack", {})).enabled:
        spec["attack"] = config["attack"]
    return spec


@lru_cache(maxsize=4)
def _dataset(data_json: str, seed: int) -> Dataset:
    data = json.loads(data_json)
    return load_dataset(data["dataset"], seed=seed, test_fraction=data["test_fraction"],
                        **data.get("options", {}))


@lru_cache(maxsize=4)
def _partitions(data_json: str, seed: int, clients: int) -> tuple[np.ndarray, ...]:
    data = json.loads(data_json)
    ds = _dataset(data_json, seed)
    return tuple(partition(ds.y_train, clients, kind=data["partitioner"], seed=seed,
                           alpha=data["alpha"], shards_per_client=data["shards_per_client"],
                           min_size=data["min_size"], groups=ds.groups))


@lru_cache(maxsize=4)
def _population(data_json: str, seed: int) -> OnDemandPopulation:
    data = json.loads(data_json)
    source = make_source(data["dataset"], seed=seed, test_fraction=data["test_fraction"],
                         options=data.get("options", {}))
    cache_mb = float(data.get("cache_mb", DEFAULT_CACHE_MB))
    return OnDemandPopulation(source, cache_bytes=int(cache_mb * 2**20))


@lru_cache(maxsize=4)
def _input_scale(data_json: str, seed: int) -> float:
    """The training inputs' standard deviation: the unit of a feature shift's brightness."""
    return float(np.std(_dataset(data_json, seed).x_train, dtype=np.float64))


class ScenarioTask:
    """A built-in scenario's task, built from :func:`task_spec` (a JSON-able dict).

    It has the shape of a user's task module (``build_model``, ``load_partition``,
    ``load_client_test``, ``load_test``; see ``simulations.module_task``) and trains with
    fedring's own loops. ``[data] client_test_fraction`` of each partition (a split seeded
    by the run seed and the partition id) is the client's held-out split, never trained
    on; ``[data] feature_shift`` > 0 shows each client its inputs, training and held-out
    alike, through its own affine distortion (``simulations.feature_shift``).

    With ``[data] population = "on_demand"`` (``simulations.population``) a client's data is
    made or read when it is asked for: no whole dataset, no list of partitions; index
    arrays are then positions in the client's own records, and central evaluation uses
    the population's bounded test sample.
    """

    trainer = None  # fedring's training loop on partition(); no task-specific one
    evaluator = None

    def __init__(self, spec: Mapping[str, Any]) -> None:
        missing = [k for k in SPEC_KEYS if k not in spec]
        if missing:
            raise ValueError(f"task spec lacks {missing}")
        self.spec = {k: spec[k] for k in (*SPEC_KEYS, *OPTIONAL_SPEC_KEYS) if k in spec}
        self.seed = int(spec["seed"])
        self.clients = int(spec["clients"])
        self.train_config = TrainConfig(**spec["train"])
        self._data_json = json.dumps(spec["data"], sort_keys=True)
        self.on_demand = resolve_population(spec["data"], self.clients) == "on_demand"
        self.client_test_fraction = float(spec["data"].get("client_test_fraction",
                                                           CLIENT_TEST_FRACTION))
        self.feature_shift = float(spec["data"].get("feature_shift", 0.0))
        model = dict(spec["model"])
        self._model_kind = model.pop("kind")
        self._model_params = model
        self._eval_model: FlatModel | None = None
        dp = DPConfig.from_dict(spec.get("dp", {}))
        self.local_dp = ((float(dp.clip), dp.noise_multiplier) if dp.mode == "local" else None)
        self.attack = Attack.from_spec(spec.get("attack"), seed=self.seed, clients=self.clients)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ScenarioTask:
        return cls(task_spec(config))

    @property
    def dataset(self) -> Dataset:
        if self.on_demand:
            raise RuntimeError("data.population = 'on_demand' holds no whole dataset: use "
                               "partition(), client_test() and load_test()")
        return _dataset(self._data_json, self.seed)

    @property
    def population(self) -> OnDemandPopulation:
        """The clients made on demand (``data.population = "on_demand"`` only)."""
        if not self.on_demand:
            raise RuntimeError("the population is held in memory: use dataset and partitions()")
        return _population(self._data_json, self.seed)

    def partitions(self) -> tuple[np.ndarray, ...]:
        """Index arrays of every client's partition (raises if the data cannot be split)."""
        if self.on_demand:
            raise RuntimeError("data.population = 'on_demand' keeps no list of partitions")
        return _partitions(self._data_json, self.seed, self.clients)

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        ds = self.population if self.on_demand else self.dataset
        return build_model(self._model_kind, input_shape=ds.input_shape,
                           num_classes=ds.num_classes, **self._model_params)

    def split_indices(self, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``partition_id``'s (training, held-out) indices into the training set (on
        demand: into the client's own records)."""
        if not 0 <= partition_id < self.clients:
            raise ValueError(f"partition-id {partition_id} is out of range: the scenario has "
                             f"{self.clients} clients (0..{self.clients - 1})")
        if self.on_demand:
            n = len(self.population.client(partition_id)[1])
            return client_test_split(n, self.client_test_fraction, self.seed, partition_id)
        idx = self.partitions()[partition_id]
        train, held = client_test_split(len(idx), self.client_test_fraction, self.seed,
                                        partition_id)
        return idx[train], idx[held]

    def _records(self, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The (inputs, labels) that :meth:`split_indices` indexes."""
        if self.on_demand:
            return self.population.client(partition_id)
        ds = self.dataset
        return ds.x_train, ds.y_train

    def _inputs(self, partition_id: int, idx: np.ndarray) -> torch.Tensor:
        """The inputs at ``idx`` as client ``partition_id`` sees them (its feature shift)."""
        x = self._records(partition_id)[0][idx]
        if self.feature_shift > 0:
            scale = (self.population.input_scale() if self.on_demand
                     else _input_scale(self._data_json, self.seed))
            x = distort(x, strength=self.feature_shift, seed=self.seed,
                        partition_id=partition_id, scale=scale)
        return torch.from_numpy(x)

    def partition(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, labels) client ``partition_id`` trains on: its partition less its
        held-out split."""
        idx, _ = self.split_indices(partition_id)
        x, y = self._inputs(partition_id, idx), torch.from_numpy(
            self._records(partition_id)[1][idx])
        if self.attack is not None:
            num_classes = (self.population if self.on_demand else self.dataset).num_classes
            y = self.attack.labels(partition_id, y, num_classes)
        return x, y

    def client_test(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Client ``partition_id``'s held-out split (None when it has none)."""
        _, held = self.split_indices(partition_id)
        if not len(held):
            return None
        return (self._inputs(partition_id, held),
                torch.from_numpy(self._records(partition_id)[1][held]))

    def load_partition(self, partition_id: int, num_partitions: int) -> TensorDataset:
        """Client ``partition_id``'s training data, as a task module gives it."""
        self._check_count(num_partitions)
        return TensorDataset(*self.partition(partition_id))

    def load_client_test(self, partition_id: int, num_partitions: int) -> TensorDataset | None:
        """Client ``partition_id``'s held-out split, as a task module gives it."""
        self._check_count(num_partitions)
        held = self.client_test(partition_id)
        return None if held is None else TensorDataset(*held)

    def _check_count(self, num_partitions: int) -> None:
        if num_partitions != self.clients:
            raise ValueError(f"the scenario has {self.clients} partitions, not {num_partitions}")

    def _test(self) -> tuple[np.ndarray, np.ndarray]:
        """The central test set (on demand: the population's bounded test sample)."""
        if self.on_demand:
            return self.population.test_sample()
        ds = self.dataset
        return ds.x_test, ds.y_test

    def load_test(self) -> TensorDataset:
        """The held-out data central evaluation uses."""
        x, y = self._test()
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    def tamper(self, partition_id: int, delta: np.ndarray, seed: int) -> bool:
        """Poison a simulated attacker's delta in place (``[attack]``); True for attackers."""
        return self.attack is not None and self.attack.tamper(partition_id, delta, seed)

    def initial_params(self) -> tuple[np.ndarray, Layout]:
        model = FlatModel(self.build_model())
        return model.vector().copy(), model.layout

    def evaluate(self, params: np.ndarray) -> dict[str, float]:
        if self._eval_model is None:
            self._eval_model = FlatModel(self.build_model())
        self._eval_model.load(params)
        x, y = self._test()
        loss, acc = evaluate(self._eval_model.module, torch.from_numpy(x), torch.from_numpy(y))
        return {"loss": loss, "accuracy": acc}

    def task_spec(self) -> dict[str, Any]:
        return dict(self.spec)

    def check(self, config: Mapping[str, Any] | None = None) -> None:
        """Fail at start if the data cannot be loaded or split, the model not built, or
        local training cannot train it (DP-SGD with batch norm). On demand it indexes the
        data and checks the client count, but makes no client."""
        if self.on_demand:
            name, dtype = self.spec["data"]["dataset"], self.population.x_dtype
            if self.population.num_clients != self.clients:
                n = self.population.num_clients
                raise ValueError(
                    f"natural partition makes one client per group: the data has {n} "
                    f"groups but {self.clients} clients were asked for; set "
                    f"federation.clients = {n} (for the synthetic dataset, "
                    "data.options.num_users sets the groups)")
        else:
            self.partitions()
            name, dtype = self.dataset.name, self.dataset.x_train.dtype
        if self.feature_shift > 0 and not np.issubdtype(dtype, np.floating):
            raise ValueError(f"data.feature_shift distorts real-valued inputs, but dataset "
                             f"'{name}' has {dtype} inputs: set data.feature_shift = 0")
        check_model(self.build_model(), self.train_config)
