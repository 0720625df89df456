"""Server optimizers: turn the aggregate delta (a pseudo-gradient) into a model step.

FedAvg, FedAvgM (Hsu et al. 2019) and FedAdagrad, FedYogi, FedAdam exactly as in
Algorithm 2 of Reddi et al. 2021, "Adaptive Federated Optimization" (no bias
correction; v starts at tau^2). The delta points downhill (``w_local - w_base``),
so every step adds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class ServerOptimizer:
    """Base class: ``step`` updates params in place and returns them."""

    def step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state, got keys {sorted(state)}")


def _positive(name: str, value: float, key: str) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}: set aggregation.{key} to a "
                         "positive number")


def _unit(name: str, value: float, key: str) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value}: set aggregation.{key} "
                         "in [0, 1)")


@dataclass
class FedAvg(ServerOptimizer):
    """x <- x + lr * delta (lr = 1 is McMahan et al.'s FedAvg)."""

    lr: float = 1.0

    def __post_init__(self) -> None:
        _positive("server lr", self.lr, "server_lr")

    def step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        params += np.float32(self.lr) * delta
        return params


@dataclass
class FedAvgM(ServerOptimizer):
    """m <- momentum * m + delta; x <- x + lr * m.

    ``lr`` > 1 takes a longer step than FedAvg along the same buffer; the buffer (and a
    centre kept from it, ``clip_center = "momentum"``) stays in units of the aggregate.
    """

    lr: float = 1.0
    momentum: float = 0.9
    m: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _positive("server lr", self.lr, "server_lr")
        _unit("momentum", self.momentum, "momentum")

    def step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        if self.m is None:
            self.m = np.zeros_like(params)
        self.m *= np.float32(self.momentum)
        self.m += delta
        params += np.float32(self.lr) * self.m
        return params

    def state_dict(self) -> dict[str, Any]:
        return {} if self.m is None else {"m": self.m.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = np.array(state["m"], dtype=np.float32) if "m" in state else None


@dataclass
class _Adaptive(ServerOptimizer):
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    m: np.ndarray | None = field(default=None, repr=False)
    v: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _positive("server lr", self.lr, "server_lr")
        _positive("tau", self.tau, "tau")
        _unit("beta1", self.beta1, "beta1")
        _unit("beta2", self.beta2, "beta2")

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        raise NotImplementedError

    def step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        if self.m is None or self.v is None:
            self.m = np.zeros_like(params)
            self.v = np.full_like(params, self.tau**2)
        self.m *= np.float32(self.beta1)
        self.m += np.float32(1 - self.beta1) * delta
        self._second_moment(self.v, np.square(delta))
        params += np.float32(self.lr) * self.m / (np.sqrt(self.v) + np.float32(self.tau))
        return params

    def state_dict(self) -> dict[str, Any]:
        if self.m is None or self.v is None:
            return {}
        return {"m": self.m.copy(), "v": self.v.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = np.array(state["m"], dtype=np.float32) if "m" in state else None
        self.v = np.array(state["v"], dtype=np.float32) if "v" in state else None


class FedAdagrad(_Adaptive):
    """v <- v + delta^2."""

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        v += d2


class FedYogi(_Adaptive):
    """v <- v - (1 - beta2) delta^2 sign(v - delta^2)."""

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        v -= np.float32(1 - self.beta2) * d2 * np.sign(v - d2)


class FedAdam(_Adaptive):
    """v <- beta2 v + (1 - beta2) delta^2."""

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        v *= np.float32(self.beta2)
        v += np.float32(1 - self.beta2) * d2


SERVER_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {
    "fedavg": FedAvg, "fedavgm": FedAvgM, "fedadagrad": FedAdagrad, "fedyogi": FedYogi,
    "fedadam": FedAdam,
}


def make_server_optimizer(name: str, **params: float) -> ServerOptimizer:
    """Build a server optimizer by name with its hyper-parameters."""
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(f"unknown server optimizer '{name}'; choose one of: "
                         f"{', '.join(SERVER_OPTIMIZERS)}")
    cls = SERVER_OPTIMIZERS[name]
    allowed = {f for f in cls.__dataclass_fields__ if f not in ("m", "v")}  # type: ignore[attr-defined]
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for server optimizer '{name}'; "
                         f"it takes: {', '.join(sorted(allowed))}")
    return cls(**params)
