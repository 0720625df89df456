"""Staleness functions s(tau), tau = server version now - the update's base version."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    """s(tau) = 1."""

    def __call__(self, tau: int) -> float:
        return 1.0


@dataclass(frozen=True)
class Polynomial:
    """s(tau) = (1 + tau)^-a (Xie et al. 2019)."""

    a: float = 0.5

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError(f"polynomial staleness exponent a must be >= 0, got {self.a}")

    def __call__(self, tau: int) -> float:
        return float((1.0 + tau) ** -self.a)


@dataclass(frozen=True)
class Hinge:
    """s(tau) = 1 if tau <= b else 1 / (a (tau - b) + 1) (Xie et al. 2019)."""

    a: float = 10.0
    b: int = 4

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0:
            raise ValueError(f"hinge staleness needs a >= 0 and b >= 0, got a={self.a} b={self.b}")

    def __call__(self, tau: int) -> float:
        return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)


StalenessFn = Constant | Polynomial | Hinge


def make_staleness(kind: str, **params: float) -> StalenessFn:
    """Build a staleness function by name: constant, polynomial(a) or hinge(a, b)."""
    kinds = {"constant": Constant, "polynomial": Polynomial, "hinge": Hinge}
    if kind not in kinds:
        raise ValueError(f"unknown staleness function '{kind}'; choose one of: "
                         f"{', '.join(kinds)}")
    try:
        return kinds[kind](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for staleness '{kind}': {params}") from exc


def staleness_function(kind: str, a: float, b: int) -> StalenessFn:
    """``make_staleness(kind)`` from a configuration's ``a`` and ``b``, each kind given only
    the parameters it takes (constant none, polynomial a, hinge a and b)."""
    params = {"polynomial": {"a": a}, "hinge": {"a": a, "b": b}}
    return make_staleness(kind, **params.get(kind, {}))
