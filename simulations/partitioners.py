"""Split a training set's indices among simulated clients.

:func:`partition` returns one sorted int64 index array per client. Whatever the kind, the arrays
are pairwise disjoint, their union is exactly ``range(len(labels))``, every client gets at least
``min_size`` samples, and the result depends only on the arguments (``seed`` included).

Kinds:

- ``iid``: shuffle, then split into near-equal parts (sizes differ by at most one).
- ``dirichlet``: label skew as in Hsu et al. 2019 ("Measuring the effects of non-identical data
  distribution"): for every class, the class's samples are divided among the clients in
  proportions drawn from Dirichlet(alpha, ..., alpha). Small alpha: each client sees few
  classes; large alpha: close to iid. Proportions are redrawn until every client has at least
  ``min_size`` samples, at most ``DIRICHLET_MAX_TRIES`` times.
- ``shards``: McMahan et al. 2017: sort by label, cut into ``num_clients * shards_per_client``
  near-equal shards, give every client ``shards_per_client`` shards at random.
- ``natural``: one client per distinct value of ``groups`` (e.g. the generating user of
  Synthetic), in increasing order of the group value.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["DIRICHLET_MAX_TRIES", "client_test_split", "partition", "partitioner_names"]

DIRICHLET_MAX_TRIES = 1000

_KINDS = ("dirichlet", "iid", "natural", "shards")


def partitioner_names() -> list[str]:
    """Kinds accepted by :func:`partition`, sorted."""
    return list(_KINDS)


def client_test_split(n: int, fraction: float, seed: int, partition_id: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) positions in a client's partition of ``n`` examples: a seeded
    permutation (run seed, partition id), the first ``round(fraction * n)`` held out for
    federated evaluation and never trained on. With ``fraction`` > 0 a partition of
    ``n >= 2`` holds out at least one example and keeps at least one to train on; a single
    example is never held out. Both arrays are sorted."""
    if fraction <= 0 or n < 2:
        return np.arange(n, dtype=np.int64), np.empty(0, dtype=np.int64)
    perm = np.random.default_rng([seed, partition_id, 0x6055]).permutation(n)
    held = min(max(round(fraction * n), 1), n - 1)
    return np.sort(perm[held:]), np.sort(perm[:held])


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def partition(
    labels: np.ndarray,
    num_clients: int,
    *,
    kind: str = "iid",
    seed: int = 0,
    alpha: float = 0.5,
    shards_per_client: int = 2,
    min_size: int = 1,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Partition ``range(len(labels))`` into ``num_clients`` sorted int64 index arrays."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    n = len(labels)
    if kind not in _KINDS:
        raise ValueError(f"unknown partitioner {kind!r}; choose one of: {', '.join(_KINDS)}")
    if not _is_int(num_clients) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    num_clients = int(num_clients)
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if (
        not isinstance(alpha, numbers.Real)
        or isinstance(alpha, (bool, np.bool_))
        or not np.isfinite(float(alpha))
        or float(alpha) <= 0
    ):
        raise ValueError(f"alpha must be a finite number > 0 (e.g. 0.1 to 100), got {alpha!r}")
    if not _is_int(shards_per_client) or shards_per_client < 1:
        raise ValueError(f"shards_per_client must be an integer >= 1, got {shards_per_client!r}")
    if not _is_int(min_size) or min_size < 0:
        raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}")
    min_size = int(min_size)
    if num_clients > n or min_size * num_clients > n:
        need = (f"{num_clients} clients with at least {min_size} samples each need "
                f"{min_size * num_clients} samples" if min_size > 1
                else f"{num_clients} clients need at least one sample each")
        most = min(n, n // max(min_size, 1))
        if kind == "dirichlet":
            most = _dirichlet_limit(labels, most + 1, seed, float(alpha), min_size)
        raise ValueError(f"{need} but there are {n}; ask for at most {most} clients"
                         + (" or lower min_size" if min_size > 1 else ""))

    rng = np.random.default_rng(seed)
    if kind == "iid":
        parts = np.array_split(rng.permutation(n), num_clients)
    elif kind == "dirichlet":
        try:
            parts = _dirichlet(labels, num_clients, rng, float(alpha), min_size)
        except _DirichletFailed:
            most = _dirichlet_limit(labels, num_clients, seed, float(alpha), min_size)
            raise ValueError(
                f"dirichlet partition (alpha={float(alpha):g}) could not give each of "
                f"{num_clients} clients at least min_size={min_size} samples in "
                f"{DIRICHLET_MAX_TRIES} draws; with this seed it works for {most} clients: "
                "ask for at most that many, raise alpha or lower min_size"
            ) from None
    elif kind == "shards":
        parts = _shards(labels, num_clients, rng, int(shards_per_client))
    else:
        parts = _natural(n, num_clients, groups)

    out = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    smallest = min(len(p) for p in out)
    if smallest < min_size:  # iid and dirichlet cannot get here; shards and natural can
        hint = {
            "shards": "lower num_clients or shards_per_client, or min_size",
            "natural": "lower min_size or merge small groups",
        }.get(kind, "lower min_size")
        raise ValueError(
            f"{kind} partition gives a client only {smallest} samples, fewer than "
            f"min_size={min_size}; {hint}"
        )
    return out


def _dirichlet(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float, min_size: int
) -> list[np.ndarray]:
    _, inverse = np.unique(labels, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    class_sizes = np.bincount(inverse)
    class_indices = np.split(order, np.cumsum(class_sizes)[:-1])
    concentration = np.full(num_clients, alpha)

    for _ in range(DIRICHLET_MAX_TRIES):
        props = rng.dirichlet(concentration, size=len(class_sizes))  # [classes, clients]
        props = np.nan_to_num(props, nan=0.0)
        # Cut points per class; the last one is pinned to the class size so that rounding can
        # never lose a sample.
        cuts = np.floor(np.cumsum(props, axis=1) * class_sizes[:, None]).astype(np.int64)
        cuts = np.clip(cuts, 0, class_sizes[:, None])
        cuts = np.maximum.accumulate(cuts, axis=1)
        cuts[:, -1] = class_sizes
        sizes = np.diff(cuts, axis=1, prepend=0)
        if sizes.sum(axis=0).min() >= min_size:
            break
    else:
        raise _DirichletFailed

    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, idx in enumerate(class_indices):
        shuffled = rng.permutation(idx)
        for client, chunk in enumerate(np.split(shuffled, cuts[c, :-1])):
            if len(chunk):
                pieces[client].append(chunk)
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in pieces]


class _DirichletFailed(Exception):
    """No draw gave every client ``min_size`` samples."""


def _dirichlet_limit(labels: np.ndarray, failing: int, seed: int, alpha: float,
                     min_size: int) -> int:
    """A number of clients below ``failing`` that the Dirichlet partitioner splits
    ``labels`` among with this seed (by bisection: a count it was seen to accept)."""
    works, fails = 0, failing
    while fails - works > 1:
        mid = (works + fails) // 2
        try:
            _dirichlet(labels, mid, np.random.default_rng(seed), alpha, min_size)
            works = mid
        except _DirichletFailed:
            fails = mid
    return max(works, 1)


def _shards(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, shards_per_client: int
) -> list[np.ndarray]:
    n = len(labels)
    num_shards = num_clients * shards_per_client
    if num_shards > n:
        raise ValueError(
            f"shards partition needs num_clients * shards_per_client = {num_shards} shards "
            f"but there are only {n} samples; lower shards_per_client or num_clients"
        )
    by_label = np.argsort(labels, kind="stable")
    shards = np.array_split(by_label, num_shards)
    assignment = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.concatenate([shards[s] for s in row]) for row in assignment]


def _natural(n: int, num_clients: int, groups: np.ndarray | None) -> list[np.ndarray]:
    if groups is None:
        raise ValueError(
            "natural partition needs groups (one client id per sample); this dataset has none, "
            "choose iid, dirichlet or shards"
        )
    groups = np.asarray(groups)
    if groups.ndim != 1 or len(groups) != n:
        raise ValueError(
            f"groups must be 1-D with one entry per sample ({n}), got shape {groups.shape}"
        )
    _, inverse = np.unique(groups, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    if num_clients != num_groups:
        raise ValueError(
            f"natural partition makes one client per group: the data has {num_groups} "
            f"groups but {num_clients} clients were asked for; set federation.clients = "
            f"{num_groups} (for the synthetic dataset, data.options.num_users sets the groups)"
        )
    order = np.argsort(inverse, kind="stable")
    return np.split(order, np.cumsum(np.bincount(inverse, minlength=num_groups))[:-1])
