"""Scenario files: load a TOML, apply ``section.key=value`` overrides, validate everything.

The whole resolved configuration is checked once at start (unknown sections or keys,
bad values, impossible combinations) and stored with the run.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aggregation.compression import CompressionConfig
from client.training import TrainConfig
from privacy.dp import DPConfig
from server.config import (
    STALENESS_KEYS,
    AggregationConfig,
    AuditConfig,
    FederationConfig,
    check_choice,
    from_section,
)
from server.cross_silo_config import GossipConfig, SiloConfig
from server.driver_config import ClientsConfig, DriverConfig
from server.scenario import ServerScenario
from server.secagg_config import SecAggScenarioConfig
from server.settings_checks import check_settings, resolve_secure_qsgd
from simulations.attacks import AttackConfig, check_attack
from simulations.datasets import dataset_names
from simulations.engine_config import EngineConfig
from simulations.models import model_names
from simulations.module_task import resolve_module_ref
from simulations.partitioners import partitioner_names
from simulations.population import DEFAULT_CACHE_MB, POPULATIONS, resolve_population
from simulations.tracking import TrackingConfig

SCENARIO_DIR = Path(__file__).parent / "scenarios"
TOP_LEVEL_KEYS = ("name", "description", "seed")
NAME_MAX = 64  # characters of a run name


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the dataset, its split and how it is partitioned among clients."""

    dataset: str = "digits"
    partitioner: str = "dirichlet"
    alpha: float = 0.5
    shards_per_client: int = 2
    min_size: int = 1
    test_fraction: float = 0.2
    client_test_fraction: float = 0.2
    feature_shift: float = 0.0
    population: str = "auto"
    cache_mb: float = DEFAULT_CACHE_MB
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("data.dataset", self.dataset, dataset_names())
        check_choice("data.partitioner", self.partitioner, partitioner_names())
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"data.test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0 <= self.client_test_fraction < 1:
            raise ValueError(f"data.client_test_fraction must be in [0, 1) (the share of each "
                             f"client's partition it holds out to evaluate on, never trained "
                             f"on; 0: none), got {self.client_test_fraction}")
        if not self.feature_shift >= 0:
            raise ValueError(f"data.feature_shift must be >= 0 (the strength of each "
                             f"client's own affine distortion of its inputs; 0: none), got "
                             f"{self.feature_shift}")
        check_choice("data.population", self.population, POPULATIONS)
        if not self.cache_mb > 0:
            raise ValueError(f"data.cache_mb must be > 0 (MiB of clients made on demand kept "
                             f"for reuse), got {self.cache_mb}")
        if self.population == "on_demand":
            resolve_population(dataclasses.asdict(self), 0)


@dataclass(frozen=True)
class TaskConfig:
    """``[task]``: the user's own model and data, a module giving ``build_model`` and
    ``load_partition`` (``simulations.module_task``); empty: ``[data]`` and ``[model]``.
    ``client_test_fraction``: the share of each partition held out for federated
    evaluation when the module gives no ``load_client_test`` (0: none)."""

    module: str = ""
    client_test_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.client_test_fraction < 1:
            raise ValueError(f"task.client_test_fraction must be in [0, 1), got "
                             f"{self.client_test_fraction}")


SECTIONS: dict[str, type] = {
    "task": TaskConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "federation": FederationConfig,
    "aggregation": AggregationConfig,
    "driver": DriverConfig,
    "clients": ClientsConfig,
    "secagg": SecAggScenarioConfig,
    "silo": SiloConfig,
    "gossip": GossipConfig,
    "attack": AttackConfig,
    "compression": CompressionConfig,
    "audit": AuditConfig,
    "engine": EngineConfig,
    "tracking": TrackingConfig,
}
FREE_SECTIONS = ("model", "dp")  # checked by building the model / by DPConfig


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def scenario_path(name_or_path: str) -> Path:
    """A scenario name from simulations/scenarios/ or a path to a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ValueError(f"scenario file '{name_or_path}' does not exist")
        return path
    candidate = SCENARIO_DIR / f"{name_or_path}.toml"
    if not candidate.is_file():
        raise ValueError(f"unknown scenario '{name_or_path}'; choose one of: "
                         f"{', '.join(scenario_names())}, or give a path to a .toml file")
    return candidate


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value`` with the value read as TOML (a bare word becomes a string)."""
    if "=" not in text:
        raise ValueError(f"override '{text}' must look like section.key=value")
    key, raw = (s.strip() for s in text.split("=", 1))
    if "." not in key:
        raise ValueError(f"override key '{key}' must be section.key (e.g. federation.rounds)")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Set dotted keys in the nested scenario dict (creating sections as needed)."""
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        node = raw
        for part in path:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"cannot set '{dotted}': '{part}' is not a section")
            node = child
        node[last] = value


def drop_other_kinds_params(raw: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """An override that switches ``model.kind`` drops the scenario's parameters of the old
    kind (e.g. ``hidden`` of an MLP), keeping only those the overrides set too."""
    model = raw.get("model")
    new_kind = overrides.get("model.kind")
    if not isinstance(model, dict) or new_kind is None or new_kind == model.get("kind", "mlp"):
        return
    raw["model"] = {k: v for k, v in model.items()
                    if k == "kind" or f"model.{k}" in overrides}


def check_run_name(name: object, where: str = "name") -> str:
    """A run name: a non-empty printable string of at most ``NAME_MAX`` characters."""
    if not isinstance(name, str):
        raise ValueError(f"{where} must be a string, got {name!r}")
    if not name.strip() or not name.isprintable() or len(name) > NAME_MAX:
        raise ValueError(f"{where} {name!r} is not a usable run name: give 1 to {NAME_MAX} "
                         "printable characters (no tabs or newlines), e.g. 'median-3-rounds'")
    return name


def validate(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved configuration: every section with its defaults, or a clear error."""
    unknown = sorted(k for k in raw if k not in SECTIONS and k not in FREE_SECTIONS
                     and k not in TOP_LEVEL_KEYS)
    if unknown:
        raise ValueError(f"unknown section or key(s) {', '.join(unknown)}; sections are "
                         f"{', '.join(sorted((*SECTIONS, *FREE_SECTIONS)))} and top-level "
                         f"keys {', '.join(TOP_LEVEL_KEYS)}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    config: dict[str, Any] = {"name": check_run_name(raw.get("name", "scenario")),
                              "description": str(raw.get("description", "")), "seed": seed}
    misplaced = [k for k in STALENESS_KEYS if k in dict(raw.get("aggregation") or {})]
    if misplaced:
        raise ValueError(f"aggregation.{misplaced[0]} is set in [driver]: use "
                         f"driver.{misplaced[0]} (the staleness keys live in [driver])")
    module = _task_module(raw)
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        if not isinstance(values, Mapping):
            raise ValueError(f"[{section}] must be a table")
        if section == "data" and module:
            continue  # the task module gives the data
        config[section] = dataclasses.asdict(from_section(cls, section, values))
    config["task"]["module"] = module
    if not module:
        model = dict(raw.get("model", {}))
        kind = model.setdefault("kind", "mlp")
        check_choice("model.kind", kind, model_names())
        config["model"] = model
    fed = FederationConfig(**config["federation"])
    AggregationConfig(**config["aggregation"]).check_clients(fed.max_per_round())
    config["dp"] = DPConfig.from_dict(raw.get("dp", {})).to_dict()
    resolve_secure_qsgd(config, raw.get("secagg", {}))  # [secagg] bits for secure QSGD
    scenario = ServerScenario.of(config)
    check_settings(scenario)
    check_attack(scenario)
    return config


def _task_module(raw: Mapping[str, Any], base: Path | None = None) -> str:
    """``task.module`` with a ``.py`` path made absolute (against ``base``, default the
    working directory); refuses ``[data]`` or ``[model]`` beside it."""
    task = raw.get("task") or {}
    module = task.get("module", "") if isinstance(task, Mapping) else ""
    if not isinstance(module, str):
        raise ValueError(f"task.module must be a string (an import name or a path to a .py "
                         f"file), got {module!r}")
    if not module:
        return ""
    given = [section for section in ("data", "model") if section in raw]
    if given:
        keys = [f"{section}.{key}" for section in given for key in raw[section] or {}]
        raise ValueError(f"task.module '{module}' gives the model and the data, so "
                         f"[{'] and ['.join(given)}] do not apply: remove "
                         f"{', '.join(keys) or 'them'} (or unset task.module for the "
                         "built-in data and models)")
    attack = raw.get("attack") or {}
    if attack.get("kind") == "label_flip" and attack.get("fraction", 0):
        raise ValueError("attack.kind 'label_flip' needs the classes of a built-in dataset; "
                         "with task.module use sign_flip, scale or gaussian_noise")
    return resolve_module_ref(module, base or Path.cwd())


def load_scenario(name_or_path: str = "default", overrides: Iterable[str] = (), *,
                  values: Mapping[str, Any] | None = None,
                  name: str | None = None) -> dict[str, Any]:
    """Load, override (``--set`` strings, then typed ``values``) and validate a scenario.

    The run is named ``name`` (``--name``), else by the file's top-level ``name``, else by
    the file's stem; ``"scenario"`` keeps the scenario it came from and ``"overrides"``
    the keys set over it (``{"federation.rounds": 3}``), as they were given.
    """
    path = scenario_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"scenario '{path}' is not valid TOML: {exc}") from exc
    given = {**dict(parse_override(o) for o in overrides), **dict(values or {})}
    if given.get("task.module"):
        # the user's module replaces the file's data and model (and the file's module)
        for section in ("data", "model"):
            raw.pop(section, None)
    elif isinstance(raw.get("task"), dict) and raw["task"].get("module"):
        raw["task"]["module"] = _task_module(raw, path.parent.resolve())  # the file's folder
    drop_other_kinds_params(raw, given)
    apply_overrides(raw, given)
    raw.setdefault("name", path.stem)
    if name is not None:
        raw["name"] = check_run_name(name, "--name")
    config = validate(raw)
    config["scenario"] = path.stem if path.parent.resolve() == SCENARIO_DIR.resolve() \
        else str(path.resolve())
    config["overrides"] = given
    return config
