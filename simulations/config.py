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
from privacy.dp.distributed import MAX_BITS as DISTRIBUTED_MAX_BITS
from server.audit import AuditConfig, check_audit
from server.compression import check_compression
from server.config import (
    STALENESS_KEYS,
    AggregationConfig,
    FederationConfig,
    check_choice,
    from_section,
)
from server.cross_silo_config import SiloConfig, check_cross_silo
from server.dp import dp_controller
from server.driver_config import ClientsConfig, DriverConfig, check_driver
from server.secagg_config import SecAggScenarioConfig, check_secagg
from simulations.attacks import AttackConfig, check_attack
from simulations.datasets import dataset_names
from simulations.models import model_names
from simulations.partitioners import partitioner_names

SCENARIO_DIR = Path(__file__).parent / "scenarios"
TOP_LEVEL_KEYS = ("name", "description", "seed")


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the dataset, its split and how it is partitioned among clients."""

    dataset: str = "digits"
    partitioner: str = "dirichlet"
    alpha: float = 0.5
    shards_per_client: int = 2
    min_size: int = 1
    test_fraction: float = 0.2
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("data.dataset", self.dataset, dataset_names())
        check_choice("data.partitioner", self.partitioner, partitioner_names())
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"data.test_fraction must be in (0, 1), got {self.test_fraction}")


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "train": TrainConfig,
    "federation": FederationConfig,
    "aggregation": AggregationConfig,
    "driver": DriverConfig,
    "clients": ClientsConfig,
    "secagg": SecAggScenarioConfig,
    "silo": SiloConfig,
    "attack": AttackConfig,
    "compression": CompressionConfig,
    "audit": AuditConfig,
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
    config: dict[str, Any] = {"name": str(raw.get("name", "scenario")),
                              "description": str(raw.get("description", "")), "seed": seed}
    misplaced = [k for k in STALENESS_KEYS if k in dict(raw.get("aggregation") or {})]
    if misplaced:
        raise ValueError(f"aggregation.{misplaced[0]} is set in [driver]: use "
                         f"driver.{misplaced[0]} (the staleness keys live in [driver])")
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        if not isinstance(values, Mapping):
            raise ValueError(f"[{section}] must be a table")
        config[section] = dataclasses.asdict(from_section(cls, section, values))
    model = dict(raw.get("model", {}))
    kind = model.setdefault("kind", "mlp")
    check_choice("model.kind", kind, model_names())
    config["model"] = model
    fed = FederationConfig(**config["federation"])
    AggregationConfig(**config["aggregation"]).check_clients(fed.max_per_round())
    dp = DPConfig.from_dict(raw.get("dp", {}))
    config["dp"] = dp.to_dict()
    check_compression(config, raw.get("secagg", {}))  # may resolve [secagg] bits for QSGD
    check_dp(config, dp, fed)
    check_driver(config)
    check_cross_silo(config)  # before [secagg]: its own message says why the ring refuses it
    check_secagg(config)
    check_attack(config)
    check_audit(config)
    return config


def check_dp(config: Mapping[str, Any], dp: DPConfig, fed: FederationConfig) -> None:
    """Combinations that would break the privacy analysis fail at start."""
    if not dp.enabled:
        return
    agg = config["aggregation"]
    secure = bool(config.get("secagg", {}).get("enabled", False))
    if dp.mode == "distributed":
        if not secure:
            raise ValueError("dp.mode='distributed' adds integer noise under secure "
                             "aggregation: set secagg.enabled = true (or use dp.mode='central')")
        if dp.adaptive:
            raise ValueError("dp.clip='adaptive' needs a noised count of clipped clients, "
                             "which distributed DP does not compute: set a numeric dp.clip")
        bits = int(config["secagg"]["bits"])
        if bits > DISTRIBUTED_MAX_BITS:
            raise ValueError(f"secagg.bits = {bits}: distributed DP decodes integer sums "
                             f"exactly only up to {DISTRIBUTED_MAX_BITS} bits; set secagg.bits "
                             f"<= {DISTRIBUTED_MAX_BITS}")
    if dp.mode == "central" and dp.adaptive and secure:
        raise ValueError("dp.clip='adaptive' needs the server to count the clipped updates, "
                         "which it cannot see under secure aggregation: set a numeric dp.clip "
                         "or turn secagg off")
    if dp.mode in ("central", "distributed"):
        if agg["weight_by"] != "uniform":
            raise ValueError(f"{dp.mode} DP bounds each client's effect on the sum by the clip "
                             "norm, which weighting by example count breaks: set "
                             "aggregation.weight_by = 'uniform'")
        if agg["combine"] not in ("mean", "sum"):
            raise ValueError(f"{dp.mode} DP noises a sum of clipped updates; "
                             f"aggregation.combine='{agg['combine']}' is not a sum: use 'mean'")
    check_dp_sampling(config, fed)
    dp_controller(dp, fed)  # the accountant refuses unsupported sampling/accountant pairs


def check_dp_sampling(config: Mapping[str, Any], fed: FederationConfig) -> None:
    """Features under which the cohorts are not the uniform draw the accountant charges
    (who can be sampled would depend on earlier secret cohorts, or a Poisson cohort would
    be cut to a size) fail at start; see ``server.dp``."""
    driver, clients = config.get("driver", {}), config.get("clients", {})
    if driver.get("late_policy") == "carry":
        raise ValueError("driver.late_policy = 'carry' with [dp]: a carried update enters a "
                         "later round's sum and its client is left out of the cohorts "
                         "meanwhile, which the privacy accountant does not model; set "
                         "driver.late_policy = 'drop'")
    if clients.get("offline_fraction", 0.0) > 0:
        raise ValueError("clients.offline_fraction > 0 with [dp]: cohorts would be drawn from "
                         "the clients online at a time that depends on earlier cohorts, "
                         "which the privacy accountant does not model; set "
                         "clients.offline_fraction = 0")
    cap = int(driver.get("concurrency", 0))
    if fed.sampling == "poisson" and 0 < cap < fed.clients:
        raise ValueError(f"driver.concurrency = {cap} with [dp] and federation.sampling = "
                         "'poisson': cutting a Poisson cohort to a cap is no longer Poisson "
                         "sampling, which the accountant charges; set driver.concurrency = 0 "
                         "or federation.sampling = 'fixed'")



def load_scenario(name_or_path: str = "default", overrides: Iterable[str] = (), *,
                  values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Load, override (``--set`` strings, then typed ``values``) and validate a scenario."""
    path = scenario_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"scenario '{path}' is not valid TOML: {exc}") from exc
    apply_overrides(raw, dict(parse_override(o) for o in overrides))
    apply_overrides(raw, dict(values or {}))
    raw.setdefault("name", path.stem)
    return validate(raw)
