"""Who takes part in a round: the cohort drawn from the eligible nodes.

With DP on, the draw is secret (operating-system entropy) unless the run opts into
``dp.reproducible_cohorts``: sampling amplification holds only while nobody who sees the
released model can replay who took part (see ``server.dp``). Otherwise cohorts derive
from (seed, round), so a simulation replays them.

The node ids may be a ``range`` (the in-process engine's population of millions): draws
index it and never list it, so a round costs memory in the cohort, not the population,
and gives the cohort a sorted list would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from server.config import FederationConfig

if TYPE_CHECKING:
    from server.dp import DPController


def cohort_rng(seed: int, rnd: int, *, secret: bool, stream: int = 0) -> np.random.Generator:
    """The generator that draws round ``rnd``'s cohort: from operating-system entropy when
    the draw must stay secret, else from (seed, round, stream)."""
    if secret:
        return np.random.default_rng()
    return np.random.default_rng([seed, rnd] + ([stream] if stream else []))


#: Poisson draws take the generator's numbers this many at a time (the same stream).
POISSON_CHUNK = 1 << 16


def ascending(node_ids: Iterable[int]) -> Sequence[int]:
    """``node_ids`` in ascending order: an ascending ``range`` as it is, else sorted."""
    if isinstance(node_ids, range) and node_ids.step > 0:
        return node_ids
    return sorted(node_ids)


def sample_nodes(node_ids: Iterable[int], fed: FederationConfig,
                 rng: np.random.Generator) -> list[int]:
    """Nodes taking part in a round, drawn from ``node_ids`` with ``rng``."""
    available = ascending(node_ids)
    if fed.sampling == "poisson":
        return poisson_draw(available, fed.sample_fraction, rng)
    return draw_fixed(available, fed.clients_per_round(len(available)), rng)


def poisson_draw(available: Sequence[int], fraction: float,
                 rng: np.random.Generator) -> list[int]:
    """Each of ``available`` in with probability ``fraction``: one uniform number per node
    in order, drawn in chunks (the numbers one draw of ``len(available)`` would give)."""
    picked: list[int] = []
    for start in range(0, len(available), POISSON_CHUNK):
        hits = np.flatnonzero(rng.random(min(POISSON_CHUNK, len(available) - start))
                              < fraction)
        picked.extend(available[start + int(i)] for i in hits)
    return picked


def draw_fixed(node_ids: Iterable[int], k: int, rng: np.random.Generator) -> list[int]:
    """A uniform draw of ``k`` of ``node_ids`` without replacement, sorted."""
    available = ascending(node_ids)
    # Sample positions, not ids: Flower's node ids are uint64 and numpy would round them.
    return sorted(available[int(i)] for i in rng.choice(len(available), size=k, replace=False))


def evaluation_cohort_size(nodes: int, fraction: float) -> int:
    """How many of ``nodes`` a federated evaluation round asks: ``max(1, round(fraction *
    nodes))``, at most ``nodes``."""
    return min(nodes, max(1, round(fraction * nodes)))


def evaluation_cohort(node_ids: Iterable[int], *, fraction: float, seed: int, rnd: int,
                      dp: DPController | None) -> list[int]:
    """Round ``rnd``'s federated evaluation cohort: ``max(1, round(fraction * n))`` of the
    ``n`` nodes, drawn in secret under DP like training cohorts, else from the seed (a
    stream of its own, so it does not repeat the training cohort's draw)."""
    available = ascending(node_ids)
    if not available:
        return []
    k = evaluation_cohort_size(len(available), fraction)
    secret = dp is not None and dp.secret_cohorts
    return draw_fixed(available, k, cohort_rng(seed, rnd, secret=secret, stream=3))


def draw_cohort(eligible: Sequence[int], *, fed: FederationConfig, concurrency: int, seed: int,
                rnd: int, dp: DPController | None, shuffle: bool = False) -> list[int]:
    """Round ``rnd``'s cohort among ``eligible``, capped at ``concurrency`` (0: no cap), and
    charged to the accountant as drawn; ``shuffle``: in a random order (a ring's)."""
    secret = dp is not None and dp.secret_cohorts
    sampled = sample_nodes(eligible, fed, cohort_rng(seed, rnd, secret=secret))
    rng = cohort_rng(seed, rnd, secret=secret, stream=2 if shuffle else 1)
    if concurrency and len(sampled) > concurrency:
        sampled = sorted(sampled[int(i)] for i in rng.choice(len(sampled), concurrency,
                                                               replace=False))
    if dp is not None:  # a uniform fixed-size draw of len(sampled) from the eligible
        dp.note_cohort(len(eligible), len(sampled))
    if shuffle:
        return [sampled[int(i)] for i in rng.permutation(len(sampled))]
    return sampled
