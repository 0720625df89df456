"""Populations made on demand: a function from client id to its data, not a list in memory.

``[data] population = "on_demand"`` makes client ``i``'s natural partition (its own
records) only when ``i`` is asked for: FedProx Synthetic generates user ``i`` from
(seed, i) (:class:`~simulations.datasets.SyntheticSpec`), the LEAF sets read the user's
records at byte offsets indexed once (:class:`~simulations.leaf.LeafIndex`), and an
``.npz`` file with ``groups`` reads the group's rows from its arrays mapped in memory
(:class:`NpzSource`). Recently used clients stay in an LRU cache bounded in bytes
(``[data] cache_mb``); central evaluation uses a fixed test sample of at most
:data:`TEST_SAMPLE` examples: the held-out records of clients 0, 1, 2, ... in order (an
npz file: the first rows of ``x_test``).

``"auto"`` (the default) chooses on demand when the dataset can make clients one by one,
the partitioner is ``natural`` and there are more than :data:`AUTO_CLIENTS` clients;
otherwise the whole dataset is held in memory and split as before.
"""

from __future__ import annotations

import os
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from simulations.datasets import SYNTHETIC_CLASSES, SYNTHETIC_DIM, SyntheticSpec

__all__ = ["AUTO_CLIENTS", "DEFAULT_CACHE_MB", "POPULATIONS", "TEST_SAMPLE", "ClientSource",
           "NpzSource", "OnDemandPopulation", "make_source", "resolve_population"]

POPULATIONS = ("auto", "memory", "on_demand")
AUTO_CLIENTS = 10_000  # "auto" makes clients on demand above this many
DEFAULT_CACHE_MB = 64.0
TEST_SAMPLE = 10_000  # examples in the central test sample made on demand
ON_DEMAND_DATASETS = ("femnist", "npz", "sent140", "shakespeare", "synthetic")


class ClientSource(Protocol):
    """What a dataset gives to be made client by client."""

    num_clients: int
    num_classes: int
    input_shape: tuple[int, ...]
    x_dtype: np.dtype

    def train(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``i``'s natural partition: its training records, in the loader's order."""

    def held_out(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``i``'s held-out records (the central test set's share of its user), or,
        where the test set is not per client, ``test_sample(limit)``: at most ``limit``
        held-out records, always the same."""


def held_out_sample(held_out: Any, num_clients: int, limit: int, input_shape: tuple[int, ...],
                    dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The held-out records of clients 0, 1, 2, ... (``held_out(i)``) in order, cut at
    ``limit`` examples; at most ``limit`` clients are visited."""
    xs, ys, n = [], [], 0
    for i in range(min(num_clients, limit)):
        if n >= limit:
            break
        x, y = held_out(i)
        xs.append(x[:limit - n])
        ys.append(y[:limit - n])
        n += len(ys[-1])
    if not n:
        return np.empty((0, *input_shape), dtype), np.empty(0, np.int64)
    return np.concatenate(xs), np.concatenate(ys)


class SyntheticSource:
    """FedProx Synthetic, user ``i`` generated from (seed, i) alone."""

    num_classes = SYNTHETIC_CLASSES
    input_shape = (SYNTHETIC_DIM,)
    x_dtype = np.dtype(np.float32)

    def __init__(self, *, seed: int, test_fraction: float, **options: Any) -> None:
        self.spec = SyntheticSpec(seed=seed, **options)
        self.test_fraction = test_fraction
        self.num_clients = int(self.spec.num_users)

    def train(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        x, y, _, _ = self.spec.split(i, self.test_fraction)
        return x, y

    def held_out(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        _, _, x, y = self.spec.split(i, self.test_fraction)
        return x, y


class NpzSource:
    """An ``.npz`` file with ``groups``, its arrays mapped in memory (members saved
    uncompressed, as ``np.savez`` does): one client per distinct group value, in increasing
    order, its rows in file order. Kept per client: one int64 row start (and, when the
    groups are not sorted, one int64 row number per training sample)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, **_: Any) -> None:
        if path is None:
            raise ValueError("dataset 'npz' needs path=<file.npz> with x_train, y_train, "
                             "x_test, y_test")
        self.path = os.fspath(path)
        arrays = npz_members(self.path)
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test", "groups")
                   if k not in arrays]
        if missing:
            raise ValueError(f"data.population = 'on_demand' reads an npz file's clients by "
                             f"their groups, but {self.path!r} lacks {missing[0]!r}: set "
                             "data.population = 'memory'")
        self.x, self.y = arrays["x_train"], arrays["y_train"]
        self.x_test, self.y_test = arrays["x_test"], arrays["y_test"]
        groups = arrays["groups"]
        n = len(self.x)
        if self.x.ndim < 2 or self.x_test.shape[1:] != self.x.shape[1:]:
            raise ValueError(f"{self.path!r}: x_train and x_test must have shape "
                             f"[n, *input_shape] alike, got {self.x.shape} and "
                             f"{self.x_test.shape}")
        for key, a, rows in (("y_train", self.y, n), ("groups", groups, n),
                             ("y_test", self.y_test, len(self.x_test))):
            if a.ndim != 1 or len(a) != rows or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"{self.path!r}: {key} must be 1-D integers with {rows} "
                                 f"entries, got {a.dtype} {a.shape}")
        low = min(int(self.y.min()), int(self.y_test.min()) if len(self.y_test) else 0)
        if low < 0:
            raise ValueError(f"{self.path!r}: labels must be non-negative, found {low}")
        seen = max(int(self.y.max()), int(self.y_test.max()) if len(self.y_test) else 0) + 1
        nc = arrays.get("num_classes")
        self.num_classes = seen if nc is None else int(nc)
        if self.num_classes < seen:
            raise ValueError(f"num_classes is {self.num_classes} but the labels go up to "
                             f"{seen - 1}")
        self.input_shape = tuple(int(s) for s in self.x.shape[1:])
        self.x_dtype = np.dtype(np.float32)
        if np.all(groups[1:] >= groups[:-1]):
            self.order: np.ndarray | None = None
            ordered = groups
        else:
            self.order = np.argsort(groups, kind="stable").astype(np.int64)
            ordered = groups[self.order]
        cuts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
        self.starts = np.concatenate([[0], cuts, [n]]).astype(np.int64)
        self.num_clients = len(self.starts) - 1

    def _rows(self, x: np.ndarray, y: np.ndarray, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        xs = np.ascontiguousarray(x[rows], dtype=np.float32)
        if not np.isfinite(xs).all():
            raise ValueError(f"{self.path!r}: x contains NaN or infinite values")
        return xs, np.array(y[rows], dtype=np.int64)

    def train(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = int(self.starts[i]), int(self.starts[i + 1])
        rows = slice(lo, hi) if self.order is None else self.order[lo:hi]
        return self._rows(self.x, self.y, rows)

    def test_sample(self, limit: int) -> tuple[np.ndarray, np.ndarray]:
        return self._rows(self.x_test, self.y_test, slice(0, limit))


def npz_members(path: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file mapped read-only in memory (scalars read), without
    reading them; an array saved compressed cannot be mapped and is refused."""
    out: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
            for info in zf.infolist():
                name = info.filename.removesuffix(".npy")
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"data.population = 'on_demand' maps an npz file's "
                                     f"arrays, but {path!r} stores {name!r} compressed: save "
                                     "it with np.savez (not savez_compressed) or set "
                                     "data.population = 'memory'")
                f.seek(info.header_offset)
                local = f.read(30)
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                f.seek(info.header_offset + 30 + name_len + extra_len)
                version = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read(f)
                if dtype.hasobject:
                    raise ValueError(f"{path!r}: {name!r} holds Python objects")
                if not shape or 0 in shape:
                    out[name] = np.load(zf.open(info), allow_pickle=False)
                    continue
                out[name] = np.memmap(path, dtype=dtype, mode="r", offset=f.tell(),
                                      shape=shape, order="F" if fortran else "C")
    except (OSError, zipfile.BadZipFile, struct.error) as exc:
        raise ValueError(f"cannot read {path!r} as an .npz file of plain arrays: {exc}") from exc
    return out


def make_source(dataset: str, *, seed: int, test_fraction: float,
                options: Mapping[str, Any]) -> ClientSource:
    """The :class:`ClientSource` of ``dataset`` (one of :data:`ON_DEMAND_DATASETS`)."""
    if dataset == "synthetic":
        return SyntheticSource(seed=seed, test_fraction=test_fraction, **options)
    if dataset == "npz":
        return NpzSource(**options)
    if dataset in ("femnist", "sent140", "shakespeare"):
        from simulations.leaf import LeafIndex

        return LeafIndex(dataset, **options)
    raise ValueError(f"data.population = 'on_demand' cannot make clients of dataset "
                     f"{dataset!r} one by one (it can for {', '.join(ON_DEMAND_DATASETS)}): "
                     "set data.population = 'memory'")


def resolve_population(data: Mapping[str, Any], clients: int) -> str:
    """``"memory"`` or ``"on_demand"`` for a ``[data]`` table and a client count; raises
    when on demand is asked for what cannot be made client by client."""
    mode = data.get("population", "auto")
    if mode not in POPULATIONS:
        raise ValueError(f"data.population {mode!r} is unknown; choose one of: "
                         f"{', '.join(POPULATIONS)}")
    natural = data.get("partitioner") == "natural"
    if mode == "on_demand":
        if not natural:
            raise ValueError(f"data.population = 'on_demand' makes each client from its own "
                             f"records, which needs data.partitioner = 'natural', but "
                             f"data.partitioner = {data.get('partitioner')!r} splits the "
                             "pooled data: set data.partitioner = 'natural' or "
                             "data.population = 'memory'")
        if data.get("dataset") not in ON_DEMAND_DATASETS:
            make_source(data.get("dataset", ""), seed=0, test_fraction=0.5, options={})
        return mode
    if mode == "memory" or not natural or clients <= AUTO_CLIENTS:
        return "memory"
    if data.get("dataset") not in ON_DEMAND_DATASETS:
        return "memory"
    if data.get("dataset") == "npz":
        try:
            NpzSource(**data.get("options", {}))
        except ValueError:
            return "memory"  # no groups, compressed: the loader says what is wrong
    return "on_demand"


class OnDemandPopulation:
    """Clients of a :class:`ClientSource` made when asked for, the recently used ones kept
    in an LRU cache of at most ``cache_bytes``; a fixed central test sample."""

    def __init__(self, source: ClientSource, *, cache_bytes: int,
                 test_sample: int = TEST_SAMPLE) -> None:
        self.source = source
        self.num_clients = int(source.num_clients)
        self.num_classes = int(source.num_classes)
        self.input_shape = tuple(source.input_shape)
        self.x_dtype = np.dtype(source.x_dtype)
        self.cache_bytes = int(cache_bytes)
        self._test_limit = int(test_sample)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.cached_bytes = 0
        self.hits = self.misses = 0
        self._test: tuple[np.ndarray, np.ndarray] | None = None
        self._scale: float | None = None
        self._lock = threading.Lock()  # nodes of a concurrent engine ask from threads

    def client(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``i``'s training records ``(x, y)`` (its natural partition); the arrays
        are shared with the cache: copy before changing them."""
        if not 0 <= i < self.num_clients:
            raise ValueError(f"partition-id {i} is out of range: the population has "
                             f"{self.num_clients} clients (0..{self.num_clients - 1})")
        with self._lock:
            hit = self._cache.get(i)
            if hit is not None:
                self._cache.move_to_end(i)
                self.hits += 1
                return hit
            self.misses += 1
        x, y = self.source.train(i)
        for a in (x, y):
            a.flags.writeable = False
        size = x.nbytes + y.nbytes
        with self._lock:
            if size <= self.cache_bytes and i not in self._cache:
                self._cache[i] = (x, y)
                self.cached_bytes += size
                while self.cached_bytes > self.cache_bytes:
                    _, (ox, oy) = self._cache.popitem(last=False)
                    self.cached_bytes -= ox.nbytes + oy.nbytes
        return x, y

    def test_sample(self) -> tuple[np.ndarray, np.ndarray]:
        """The central test sample: at most ``test_sample`` held-out examples, made once."""
        if self._test is None:
            held_out = getattr(self.source, "held_out", None)
            if held_out is not None:
                x, y = held_out_sample(held_out, self.num_clients, self._test_limit,
                                       self.input_shape, self.x_dtype)
            else:
                x, y = self.source.test_sample(self._test_limit)
            self._test = (np.ascontiguousarray(x), np.ascontiguousarray(y, dtype=np.int64))
        return self._test

    def input_scale(self) -> float:
        """The standard deviation of the training inputs of clients 0, 1, 2, ... up to
        ``test_sample`` examples: the unit of a feature shift's brightness."""
        if self._scale is None:
            xs, n = [], 0
            for i in range(min(self.num_clients, self._test_limit)):
                if n >= self._test_limit:
                    break
                x = self.source.train(i)[0]
                xs.append(x)
                n += len(x)
            self._scale = float(np.std(np.concatenate(xs), dtype=np.float64))
        return self._scale
