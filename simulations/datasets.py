"""Datasets for simulations: scikit-learn digits, FedProx Synthetic(alpha, beta), user .npz
files, CIFAR-10/100 python batches and LEAF JSON (FEMNIST, Shakespeare, Sent140).

Every loader returns a :class:`Dataset` with inputs shaped ``[n, *input_shape]`` (float32, or
int64 token indices for text read as characters: ``shakespeare``) and int64 labels in
``[0, num_classes)``. Nothing here downloads anything: ``digits`` ships with scikit-learn,
``synthetic`` is generated, and the others read files the user fetched themselves.

scikit-learn is imported only when ``digits`` is loaded, so importing this module stays cheap.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Dataset", "dataset_names", "load_dataset"]


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split ready for partitioning.

    ``groups`` (int64, one entry per training sample) is the natural client of each training
    sample when the data has one (``synthetic``: the generating user; the LEAF sets: the
    LEAF user), else ``None``. Inputs are float32, or int64 token indices (``shakespeare``).

    Equality and hashing are by identity (``eq=False``): field-wise ``==`` on numpy arrays is
    ambiguous.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.input_shape)
        object.__setattr__(self, "input_shape", shape)
        if self.num_classes < 1:
            raise ValueError(f"dataset {self.name!r}: num_classes must be >= 1")
        for split in ("train", "test"):
            x = getattr(self, f"x_{split}")
            y = getattr(self, f"y_{split}")
            if x.dtype not in (np.float32, np.int64):
                raise ValueError(f"dataset {self.name!r}: x_{split} must be float32 (or int64 "
                                 f"token indices), got {x.dtype}")
            if y.dtype != np.int64 or y.ndim != 1:
                raise ValueError(f"dataset {self.name!r}: y_{split} must be 1-D int64")
            if x.shape[1:] != shape:
                raise ValueError(
                    f"dataset {self.name!r}: x_{split} has per-sample shape {x.shape[1:]}, "
                    f"expected input_shape {shape}"
                )
            if len(x) != len(y):
                raise ValueError(
                    f"dataset {self.name!r}: x_{split} has {len(x)} rows but y_{split} {len(y)}"
                )
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise ValueError(
                    f"dataset {self.name!r}: y_{split} labels must lie in [0, {self.num_classes})"
                )
        if self.groups is not None and (
            self.groups.dtype != np.int64
            or self.groups.ndim != 1
            or len(self.groups) != len(self.y_train)
        ):
            raise ValueError(
                f"dataset {self.name!r}: groups must be 1-D int64 with one entry per "
                "training sample"
            )

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    @property
    def num_test(self) -> int:
        return len(self.y_test)


# --------------------------------------------------------------------------------------------
# registry


def dataset_names() -> list[str]:
    """Names accepted by :func:`load_dataset`, sorted."""
    return sorted(_LOADERS)


def load_dataset(name: str, *, seed: int, test_fraction: float = 0.2, **params: Any) -> Dataset:
    """Load dataset ``name``; ``seed`` fixes every random choice (split, generation).

    Params per dataset:

    - ``digits``: none. 1797 8x8 images, pixels / 16 in [0, 1], shape ``[n, 1, 8, 8]``,
      stratified train/test split.
    - ``synthetic``: ``alpha``, ``beta`` (default 1.0 each), ``num_users`` (30), ``iid``
      (False), ``max_samples_per_user`` (None: uncapped); see :func:`generate_synthetic`.
    - ``npz``: ``path`` (required); ``test_fraction`` is not used, the file holds the split.
    - ``cifar10``, ``cifar100``: ``path`` (required), the unpacked python-version folder; the
      files hold the split. See :mod:`simulations.cifar`.
    - ``femnist``, ``shakespeare``, ``sent140``: ``path`` (required), the LEAF folder holding
      ``train/`` and ``test/``; ``max_users`` (all); ``features`` (sent140 only, 1024). The
      files hold the split; ``groups`` is the LEAF user. See :mod:`simulations.leaf`.
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(dataset_names())}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not _is_real(test_fraction) or not (0.0 < float(test_fraction) < 1.0):
        raise ValueError(f"test_fraction must be strictly between 0 and 1, got {test_fraction!r}")
    loader, allowed = _LOADERS[name]
    unknown = sorted(set(params) - allowed)
    if unknown:
        accepted = ", ".join(sorted(allowed)) or "none"
        raise ValueError(
            f"unknown parameter {unknown[0]!r} for dataset {name!r}; accepted: {accepted}"
        )
    return loader(seed=seed, test_fraction=float(test_fraction), **params)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


# --------------------------------------------------------------------------------------------
# digits


def _load_digits(*, seed: int, test_fraction: float) -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (np.asarray(bunch.images, dtype=np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Dataset(
        name="digits",
        x_train=np.ascontiguousarray(x_train),
        y_train=np.ascontiguousarray(y_train),
        x_test=np.ascontiguousarray(x_test),
        y_test=np.ascontiguousarray(y_test),
        num_classes=10,
        input_shape=(1, 8, 8),
    )


# --------------------------------------------------------------------------------------------
# FedProx synthetic

SYNTHETIC_DIM = 60
SYNTHETIC_CLASSES = 10
_SIGMA_SQRT = np.sqrt(np.power(np.arange(1, SYNTHETIC_DIM + 1, dtype=np.float64), -1.2))


@dataclass(frozen=True)
class SyntheticSpec:
    """Checked parameters of Synthetic(alpha, beta); user ``k``'s data depends on them and
    on ``k`` only (:meth:`user`), so any user can be made alone, in any order."""

    seed: int
    alpha: float = 1.0
    beta: float = 1.0
    num_users: int = 30
    iid: bool = False
    max_samples_per_user: int | None = None

    def __post_init__(self) -> None:
        nu, cap = self.num_users, self.max_samples_per_user
        if isinstance(nu, bool) or not isinstance(nu, (int, np.integer)) or nu < 1:
            raise ValueError(f"synthetic: num_users must be an integer >= 1, got {nu!r}")
        for pname in ("alpha", "beta"):
            value = getattr(self, pname)
            if not _is_real(value) or not np.isfinite(float(value)) or float(value) < 0:
                raise ValueError(f"synthetic: {pname} must be a finite number >= 0, got "
                                 f"{value!r}")
        if not isinstance(self.iid, (bool, np.bool_)):
            raise ValueError(f"synthetic: iid must be true or false, got {self.iid!r}")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer))
                                or cap < 1):
            raise ValueError("synthetic: max_samples_per_user must be an integer >= 1 or "
                             f"omitted, got {cap!r}")

    def _stream(self, *key: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(int(self.seed), spawn_key=key))

    def count(self, k: int) -> int:
        """User ``k``'s sample count: ``lognormal(4, 2)`` truncated, + 50, capped."""
        n = int(self._stream(0, k, 0).lognormal(4, 2)) + 50
        cap = self.max_samples_per_user
        return n if cap is None else min(n, int(cap))

    def user(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """User ``k``'s float64 ``x`` and int64 ``y`` (see :func:`generate_synthetic`)."""
        dim, ncls = SYNTHETIC_DIM, SYNTHETIC_CLASSES
        rng = self._stream(0, k, 0)
        n = int(rng.lognormal(4, 2)) + 50
        if self.max_samples_per_user is not None:
            n = min(n, int(self.max_samples_per_user))
        if self.iid:
            shared = self._stream(1)
            mean = np.zeros(dim)
            w, b = shared.normal(0, 1, (dim, ncls)), shared.normal(0, 1, ncls)
        else:
            u = rng.normal(0, float(self.alpha))
            big_b = rng.normal(0, float(self.beta))
            mean = rng.normal(big_b, 1, dim)
            w, b = rng.normal(u, 1, (dim, ncls)), rng.normal(u, 1, ncls)
        x = mean + _SIGMA_SQRT * rng.standard_normal((n, dim))
        return x, np.argmax(x @ w + b, axis=1).astype(np.int64)

    def split(self, k: int, test_fraction: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """User ``k``'s float32 ``(x_train, y_train, x_test, y_test)``: ``round(test_fraction
        * n)`` of its ``n`` samples (at most ``n - 1``) held out by a permutation from the
        user's own split stream, both parts in generation order."""
        x, y = self.user(k)
        n_test = min(round(test_fraction * len(y)), len(y) - 1)
        perm = self._stream(0, k, 1).permutation(len(y))
        test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
        return (x[train].astype(np.float32), y[train], x[test].astype(np.float32), y[test])


def generate_synthetic(
    *,
    seed: int,
    alpha: float = 1.0,
    beta: float = 1.0,
    num_users: int = 30,
    iid: bool = False,
    max_samples_per_user: int | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-user ``(x, y)`` of Synthetic(alpha, beta), Li et al. 2020 (FedProx), float64 x.

    The formulas of the reference generator (litian96/FedProx,
    data/synthetic_*/generate_synthetic.py and data/synthetic_iid/generate_iid.py), for
    user k (dimension 60, 10 classes):

    - ``n_k = lognormal(4, 2)`` truncated to an integer, ``+ 50``, then capped at
      ``max_samples_per_user`` if given;
    - non-iid: ``u_k ~ N(0, alpha)`` (alpha is the standard deviation, as in the
      reference), ``B_k ~ N(0, beta)``, ``v_k ~ N(B_k, 1)^60``, ``W_k ~ N(u_k, 1)^(60x10)``,
      ``b_k ~ N(u_k, 1)^10``; iid: ``v_k = 0`` and one ``W ~ N(0, 1)``, ``b ~ N(0, 1)``
      shared by all users (alpha and beta unused, as in the reference);
    - ``x = v_k + sqrt(diag(Sigma)) * N(0, 1)^(n_k x 60)`` with ``Sigma_jj = j^-1.2``
      (j = 1..60), ``y = argmax(x @ W_k + b_k)`` (= argmax of the softmax, without its
      overflow).

    The draw order differs from the reference script, which draws every user's count, then
    every ``u``, ``B``, ``v`` from one stream: here each user has its own stream, seeded by
    (``seed``, k) only (``SeedSequence(seed, spawn_key=(0, k, 0))``), drawing ``n_k, u_k, B_k,
    v_k, W_k, b_k, x`` in that order; the iid ``W, b`` come from ``spawn_key=(1,)``. So user k
    can be made alone, the same every time, whether the population is held in memory or
    made on demand (:mod:`simulations.population`).

    Note, inherent to the published formulas: ``W_k = u_k + Z`` and ``b_k = u_k + z`` shift
    every class logit by the same ``u_k * (sum(x) + 1)``, so ``alpha`` cannot change any label;
    heterogeneity comes from the independent per-user ``Z`` (model skew) and from ``beta``
    (feature-mean skew, which also skews per-user label distributions).
    """
    _, users = synthetic_users(seed=seed, alpha=alpha, beta=beta, num_users=num_users,
                               iid=iid, max_samples_per_user=max_samples_per_user)
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for x, y in users:
        xs.append(x)
        ys.append(y)
    return xs, ys


def synthetic_users(*, seed: int, alpha: float, beta: float, num_users: int, iid: bool,
                    max_samples_per_user: int | None
                    ) -> tuple[np.ndarray, Iterator[tuple[np.ndarray, np.ndarray]]]:
    """(each user's sample count, an iterator over the users' (x, y)): the draws of
    :func:`generate_synthetic` (checked arguments), one user at a time, so that a loader
    keeps only one user's float64 samples besides what it stores."""
    spec = SyntheticSpec(seed=seed, alpha=alpha, beta=beta, num_users=num_users, iid=iid,
                         max_samples_per_user=max_samples_per_user)
    counts = np.array([spec.count(k) for k in range(int(num_users))], dtype=np.int64)
    return counts, (spec.user(k) for k in range(int(num_users)))


def _load_synthetic(
    *,
    seed: int,
    test_fraction: float,
    alpha: float = 1.0,
    beta: float = 1.0,
    num_users: int = 30,
    iid: bool = False,
    max_samples_per_user: int | None = None,
) -> Dataset:
    """Every user's :meth:`SyntheticSpec.split`, concatenated in user order. The outputs are
    allocated once, in float32, and filled user by user: the peak is the data plus one
    user's samples."""
    spec = SyntheticSpec(seed=seed, alpha=alpha, beta=beta, num_users=num_users, iid=iid,
                         max_samples_per_user=max_samples_per_user)
    counts = np.array([spec.count(k) for k in range(int(num_users))], dtype=np.int64)
    n_test = np.minimum(np.round(test_fraction * counts).astype(np.int64), counts - 1)
    n_train = counts - n_test
    dim = SYNTHETIC_DIM
    x_train = np.empty((int(n_train.sum()), dim), np.float32)
    y_train = np.empty(len(x_train), np.int64)
    x_test = np.empty((int(n_test.sum()), dim), np.float32)
    y_test = np.empty(len(x_test), np.int64)
    groups = np.repeat(np.arange(len(counts), dtype=np.int64), n_train)
    tr = te = 0
    for k in range(len(counts)):
        xtr, ytr, xte, yte = spec.split(k, test_fraction)
        x_train[tr:tr + len(ytr)], y_train[tr:tr + len(ytr)] = xtr, ytr
        x_test[te:te + len(yte)], y_test[te:te + len(yte)] = xte, yte
        tr, te = tr + len(ytr), te + len(yte)
    return Dataset(
        name="synthetic",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=SYNTHETIC_CLASSES,
        input_shape=(SYNTHETIC_DIM,),
        groups=groups,
    )


# --------------------------------------------------------------------------------------------
# npz

_NPZ_REQUIRED = ("x_train", "y_train", "x_test", "y_test")
_NPZ_OPTIONAL = ("num_classes", "groups")


def _load_npz(
    *, seed: int, test_fraction: float, path: str | os.PathLike[str] | None = None
) -> Dataset:
    """Read ``x_train, y_train, x_test, y_test`` (+ optional ``num_classes``, ``groups``).

    Inputs are cast to float32 as they are (no scaling); labels must be non-negative integers.
    ``seed`` and ``test_fraction`` are unused: the file already holds the split.
    """
    del seed, test_fraction
    if path is None:
        raise ValueError(
            "dataset 'npz' needs path=<file.npz> with x_train, y_train, x_test, y_test"
        )
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"npz file not found: {path!r}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except Exception as exc:  # zipfile.BadZipFile, pickled object arrays, truncated members
        raise ValueError(f"cannot read {path!r} as an .npz file of plain arrays: {exc}") from exc

    missing = [k for k in _NPZ_REQUIRED if k not in arrays]
    if missing:
        raise ValueError(
            f"{path!r} lacks array {missing[0]!r}; an npz dataset needs "
            f"{', '.join(_NPZ_REQUIRED)} (optional: {', '.join(_NPZ_OPTIONAL)})"
        )
    extra = sorted(set(arrays) - set(_NPZ_REQUIRED) - set(_NPZ_OPTIONAL))
    if extra:
        raise ValueError(
            f"{path!r} holds unexpected array {extra[0]!r}; allowed: "
            f"{', '.join(_NPZ_REQUIRED + _NPZ_OPTIONAL)}"
        )

    def as_x(key: str) -> np.ndarray:
        a = arrays[key]
        if a.ndim < 2:
            raise ValueError(f"{key} must have shape [n, *input_shape], got shape {a.shape}")
        if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_) or np.iscomplexobj(a):
            raise ValueError(f"{key} must be real numbers, got dtype {a.dtype}")
        a = np.ascontiguousarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise ValueError(f"{key} contains NaN or infinite values (or overflows float32)")
        return a

    def as_labels(key: str, n: int, what: str) -> np.ndarray:
        a = arrays[key]
        if a.ndim != 1:
            raise ValueError(f"{key} must be 1-D, got shape {a.shape}")
        if len(a) != n:
            raise ValueError(f"{key} has {len(a)} entries but {what} has {n} rows")
        integral = np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_
        if not integral and np.issubdtype(a.dtype, np.floating):
            integral = bool(np.isfinite(a).all() and (a == np.round(a)).all())
        if not integral:
            raise ValueError(f"{key} must hold integers, got dtype {a.dtype}")
        out = a.astype(np.int64)
        if len(out) and out.min() < 0:
            raise ValueError(f"{key} must be non-negative, found {out.min()}")
        return out

    x_train, x_test = as_x("x_train"), as_x("x_test")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(
            f"x_test per-sample shape {x_test.shape[1:]} differs from x_train's {x_train.shape[1:]}"
        )
    if len(x_train) == 0:
        raise ValueError("x_train is empty")
    y_train = as_labels("y_train", len(x_train), "x_train")
    y_test = as_labels("y_test", len(x_test), "x_test")
    groups = as_labels("groups", len(x_train), "x_train") if "groups" in arrays else None

    seen = int(max(y_train.max(), y_test.max() if len(y_test) else 0)) + 1
    if "num_classes" in arrays:
        nc = arrays["num_classes"]
        if nc.shape != () or not np.issubdtype(nc.dtype, np.integer):
            raise ValueError(f"num_classes must be a scalar integer, got {nc!r}")
        num_classes = int(nc)
        if num_classes < seen:
            raise ValueError(f"num_classes is {num_classes} but the labels go up to {seen - 1}")
    else:
        num_classes = seen

    return Dataset(
        name="npz",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        input_shape=tuple(x_train.shape[1:]),
        groups=groups,
    )


# --------------------------------------------------------------------------------------------
# files in their published formats (readers in simulations.cifar and simulations.leaf)


def _from_files(name: str) -> Callable[..., Dataset]:
    def load(*, seed: int, test_fraction: float, **params: Any) -> Dataset:
        del seed, test_fraction  # the files hold the split
        if name.startswith("cifar"):
            from simulations.cifar import load_cifar

            return Dataset(name=name, **load_cifar(name, **params))
        from simulations.leaf import load_leaf

        return Dataset(name=name, **load_leaf(name, **params))

    return load


_LOADERS: Mapping[str, tuple[Callable[..., Dataset], frozenset[str]]] = {
    "cifar10": (_from_files("cifar10"), frozenset({"path"})),
    "cifar100": (_from_files("cifar100"), frozenset({"path"})),
    "digits": (_load_digits, frozenset()),
    "femnist": (_from_files("femnist"), frozenset({"path", "max_users"})),
    "npz": (_load_npz, frozenset({"path"})),
    "sent140": (_from_files("sent140"), frozenset({"path", "max_users", "features"})),
    "shakespeare": (_from_files("shakespeare"), frozenset({"path", "max_users"})),
    "synthetic": (
        _load_synthetic,
        frozenset({"alpha", "beta", "num_users", "iid", "max_samples_per_user"}),
    ),
}
