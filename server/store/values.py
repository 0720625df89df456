"""Checking and coding the values of the store's columns.

* Integers are checked to fit the 64-bit columns (bools are refused).
* Metrics (round and update) are dicts of ``str`` to numbers; every value is stored as a
  Python ``float`` (numpy scalars and ints are converted). Anything else is a ValueError.
* JSON columns (``config``, ``summary``, ``metrics``) hold strict JSON, because
  PostgreSQL's ``json`` refuses the ``NaN``/``Infinity`` tokens. Non-finite floats are
  therefore stored as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (the
  spellings of Python's ``json`` module), in every JSON column alike, and are turned back
  into floats when read. The price: in ``config``/``summary`` a *string* value that is
  exactly one of those three words also reads back as a float.
* Float columns (``updates.norm``, ``updates.weight``): SQLite cannot store NaN in a REAL
  column (it silently becomes NULL), so NaN is stored as NULL on every back end and reads
  back as ``None``; ±infinity is stored as is.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def check_int(value: Any, what: str, *, minimum: int | None = None, nullable: bool = False,
              bits: int = 64) -> Any:
    """``value`` as a Python int that fits a signed ``bits``-bit column (None if nullable)."""
    half = 1 << (bits - 1)  # the column holds -half .. half - 1
    if type(value) is int and (minimum is None or value >= minimum) and -half <= value < half:
        return value  # the common case, without the checks below
    if value is None and nullable:
        return None
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be an integer, got a bool")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {out}")
    if not -half <= out < half:
        raise ValueError(f"{what} {out} does not fit in {bits} bits")
    return out


def float_column(value: Any, what: str) -> float | None:
    """A nullable Float column: NaN is stored as NULL (see the module docstring)."""
    if value is None:
        return None
    if type(value) is float:  # the common case, without the abstract class's check
        return None if value != value else value
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    out = float(value)
    return None if math.isnan(out) else out


def _json_float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def to_json(value: Any, where: str) -> Any:
    """Plain JSON (dicts with str keys, lists, str, int, float, bool, None), non-finite
    floats as strings; numpy scalars/arrays and tuples are converted."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return _json_float(float(value))
    if isinstance(value, np.generic):
        return to_json(value.item(), where)
    if isinstance(value, np.ndarray):
        return to_json(value.tolist(), where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        out = {}
        for key, sub in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where}: key {key!r} is a {type(key).__name__}; JSON keys must be str"
                )
            out[str(key)] = to_json(sub, f"{where}.{key}")
        return out
    if isinstance(value, list | tuple):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where} is a {type(value).__name__}, which cannot be stored as JSON")


def from_json(value: Any) -> Any:
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def metrics_to_json(metrics: Mapping[str, Any] | None, where: str) -> dict[str, float | str]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where} must be a dict of numbers, got {type(metrics).__name__}")
    out: dict[str, float | str] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; must be str")
        if type(value) is not float and not isinstance(value, numbers.Real):
            raise ValueError(
                f"{where}[{key!r}] is {value!r:.60} ({type(value).__name__}); "
                "metrics must be numbers"
            )
        out[key] = _json_float(float(value))
    return out


def metrics_from_json(metrics: dict | None) -> dict[str, float]:
    if not metrics:
        return {}
    return {k: (_NONFINITE[v] if isinstance(v, str) else float(v)) for k, v in metrics.items()}


def check_status(value: Any, allowed: Sequence[str], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} {value!r}: must be one of {', '.join(allowed)}")
    return value
