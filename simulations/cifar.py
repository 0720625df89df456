"""CIFAR-10 and CIFAR-100 from their "python version" batches, read offline.

The files come from https://www.cs.toronto.edu/~kriz/cifar.html (``cifar-10-python.tar.gz``,
``cifar-100-python.tar.gz``); unpack them and point ``data.options.path`` at the folder
(``cifar-10-batches-py`` or ``cifar-100-python``). Each file is a pickled dict:
``data`` is a uint8 array of N rows of 3072 values (1024 red, then green, then blue, each a
32x32 image row by row) and ``labels`` (CIFAR-10) or ``fine_labels`` (CIFAR-100) a list of N
ints. CIFAR-10 has ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``; CIFAR-100 has
``train`` and ``test`` (``meta`` holds label names, not needed here).

Images become float32 ``[n, 3, 32, 32]``, scaled to [0, 1] and normalised per channel with
the usual training-set mean and standard deviation of each data set (fixed constants, so that
a subset of the files is normalised the same way).

The pickles are read with an unpickler that admits only what a numpy array needs, so a file
that tries to call anything else fails as malformed instead of running code.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["CIFAR_NAMES", "CIFAR_URL", "load_cifar"]

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
ROW = 3 * 32 * 32


class _Spec:
    def __init__(self, folder: str, train: tuple[str, ...], test: str, label_key: str,
                 num_classes: int, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.folder, self.train, self.test = folder, train, test
        self.label_key, self.num_classes = label_key, num_classes
        self.mean = np.asarray(mean, dtype=np.float32).reshape(1, 3, 1, 1)
        self.std = np.asarray(std, dtype=np.float32).reshape(1, 3, 1, 1)


_SPECS: Mapping[str, _Spec] = {
    "cifar10": _Spec("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)),
                     "test_batch", "labels", 10, (0.4914, 0.4822, 0.4465),
                     (0.2470, 0.2435, 0.2616)),
    "cifar100": _Spec("cifar-100-python", ("train",), "test", "fine_labels", 100,
                      (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
CIFAR_NAMES = tuple(_SPECS)

# What unpickling a numpy array needs (Python 2 pickles name numpy.core, numpy 2 numpy._core).
_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module == "numpy.core.multiarray":
            module = "numpy._core.multiarray"
        return super().find_class(module, name)


def _source_hint(name: str) -> str:
    return (f"the files are the unpacked {_SPECS[name].folder} folder of the CIFAR python "
            f"version from {CIFAR_URL}")


def _read_batch(path: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(rows uint8 [n, 3072], labels int64 [n])`` of one batch file, or a ValueError."""
    spec = _SPECS[name]
    if not os.path.isfile(path):
        raise ValueError(f"{name}: file {path!r} not found; {_source_hint(name)}")
    try:
        with open(path, "rb") as f:
            raw = _ArrayUnpickler(io.BytesIO(f.read()), encoding="bytes").load()
    except Exception as exc:  # truncated, not a pickle, refused global
        raise ValueError(f"{name}: {path!r} is not a CIFAR python batch ({exc}); "
                         f"{_source_hint(name)}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: {path!r} holds a {type(raw).__name__}, not a CIFAR batch dict")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in raw.items()}
    for key in ("data", spec.label_key):
        if key not in batch:
            raise ValueError(f"{name}: {path!r} lacks key {key!r} (has "
                             f"{', '.join(sorted(map(str, batch)))}); {_source_hint(name)}")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != ROW:
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise ValueError(f"{name}: {path!r} 'data' must be uint8 rows of {ROW} values, got "
                         f"{dtype} of shape {shape}")
    labels = np.asarray(batch[spec.label_key])
    if labels.ndim != 1 or len(labels) != len(data) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{name}: {path!r} {spec.label_key!r} must be {len(data)} integers, got "
                         f"{labels.dtype} of shape {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise ValueError(f"{name}: {path!r} {spec.label_key!r} must lie in "
                         f"[0, {spec.num_classes}), found {labels.min()}..{labels.max()}")
    return data, labels.astype(np.int64)


def _images(rows: np.ndarray, spec: _Spec) -> np.ndarray:
    x = rows.reshape(-1, 3, 32, 32).astype(np.float32) / np.float32(255.0)
    x -= spec.mean
    x /= spec.std
    return x


def load_cifar(name: str, *, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The fields of a :class:`~simulations.datasets.Dataset` read from ``path``."""
    spec = _SPECS[name]
    if path is None or not os.fspath(path):
        raise ValueError(f"dataset {name!r} reads the CIFAR python batches from disk: set "
                         f"data.options.path to their folder (e.g. --set "
                         f"data.options.path=/data/{spec.folder}); {_source_hint(name)}")
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"{name}: data.options.path {folder!r} is not a folder; "
                         f"{_source_hint(name)}")
    train = [_read_batch(os.path.join(folder, f), name) for f in spec.train]
    test_rows, y_test = _read_batch(os.path.join(folder, spec.test), name)
    return {
        "x_train": _images(np.concatenate([rows for rows, _ in train]), spec),
        "y_train": np.concatenate([labels for _, labels in train]),
        "x_test": _images(test_rows, spec),
        "y_test": y_test,
        "num_classes": spec.num_classes,
        "input_shape": (3, 32, 32),
    }
