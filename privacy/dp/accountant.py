"""Privacy accountant for user-level DP: each round is a (sampled) Gaussian mechanism.

Epsilons come from Google's ``dp_accounting``: the RDP accountant, or privacy loss
distributions (PLD). Every multiplier given to this class is ``z`` = noise std / C, where
C bounds one client's contribution to the sum (its clip, or distributed DP's norm bound):
the sensitivity of the sum under ADD/REMOVE one client. The neighbouring relation and the
sensitivity go together, so each sampling mode hands dp_accounting the multiplier for its
own relation:

- ``sampling="fixed"`` (a fixed-size cohort of ``m`` of ``N`` drawn without replacement):
  ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))`` under REPLACE_ONE
  (the only relation dp_accounting supports for it). Replacing one client's data moves a
  sum of C-bounded updates by up to 2C, so the multiplier against that sensitivity is
  ``z / 2``. RDP only: dp_accounting's PLD accountant has no such event.
- ``sampling="poisson"`` (each client independently with probability ``q``):
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under ADD_OR_REMOVE_ONE.
- ``sampling="none"`` (no amplification: the adversary knows who took part, e.g. the
  server that picks the cohort, or anyone who can replay a seeded draw): every round is
  ``GaussianDpEvent(z)`` under ADD_OR_REMOVE_ONE, charged to every client as if it took
  part in every round.

Amplification by sampling holds only while the draw is secret from the adversary the
epsilon is stated against; choosing ``sampling="none"`` when it is not is the caller's job
(``server.dp`` does it per mode).

The sampling the accountant assumes must be the sampling that happened: :meth:`step`
takes each fixed-size round's actual population and cohort size (default: the
constructor's), and rounds are stored as runs of ``(z, count)``, plus ``(population,
cohort)`` for fixed sampling, so that a per-round z (adaptive clipping, distributed DP
with dropouts) or cohort is accounted exactly and the state survives a restart. With
adaptive clipping pass the TOTAL z (update noise and count noise together, see
:func:`privacy.dp.clipping.combined_noise_multiplier`); for distributed DP pass the
plan's ``effective_noise_multiplier``. Both are add/remove multipliers like ``z``.

Every accountant states one neighbouring relation (:attr:`PrivacyAccountant.relation`),
by default its sampling's natural one (above). ``relation="replace-one"`` asks for the
replace-one figure under any sampling: fixed as above; Poisson through dp_accounting's PLD
accountant under REPLACE_ONE, whose Gaussian shifts each record by +-sensitivity (so
``GaussianDpEvent(z)`` there already means the sum moves by 2C); unsampled as
``GaussianDpEvent(z / 2)``. ``relation="zero-out"`` (one client's contribution replaced by
zero, its participation known: what a server that sees who replied faces) exists only
unsampled, where it is ``GaussianDpEvent(z)``: numerically the add/remove figure.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from privacy.dp import _checks
from privacy.dp.relations import ADD_REMOVE, RELATIONS, REPLACE_ONE, ZERO_OUT, relation

SAMPLINGS = ("poisson", "fixed", "none")
ACCOUNTANTS = ("rdp", "pld")
PLD_DISCRETIZATION = 1e-4  # dp_accounting's PLDAccountant default
_NEIGHBOURS = dp_accounting.NeighboringRelation
REPLACE_ONE_FACTOR = 2.0  # replacing one client moves the sum twice as far as removing it

# One run of rounds: (z, rounds, population, cohort); population and cohort are None
# unless sampling is "fixed".
Run = tuple[float, int, int | None, int | None]


class PrivacyAccountant:
    """Tracks rounds of a (sampled) Gaussian mechanism and reports (epsilon, delta)."""

    def __init__(
        self,
        noise_multiplier: float,
        *,
        delta: float,
        sampling_rate: float | None = None,
        clients_per_round: int | None = None,
        population: int | None = None,
        sampling: str = "poisson",
        accountant: str = "rdp",
        relation: str | None = None,
    ) -> None:
        self.noise_multiplier = _checks.non_negative("noise_multiplier", noise_multiplier)
        self.delta = _checks.open_unit("delta", delta)
        self.sampling = _checks.choice("sampling", sampling, SAMPLINGS)
        self.accountant = _checks.choice("accountant", accountant, ACCOUNTANTS)
        self._relation = _relation_for(self.sampling, self.accountant, relation)
        self.population: int | None = None
        self.clients_per_round: int | None = None
        if self.sampling == "fixed":
            if self.accountant == "pld":
                raise ValueError(
                    "accountant='pld' cannot account sampling='fixed' (dp_accounting's PLD "
                    "accountant has no sampling without replacement); use accountant='rdp' "
                    "or sampling='poisson'"
                )
            if sampling_rate is not None or clients_per_round is None or population is None:
                raise ValueError(
                    "sampling='fixed' needs clients_per_round and population (not sampling_rate)"
                )
            self.population, self.clients_per_round = _cohort(population, clients_per_round)
            self.sampling_rate = self.clients_per_round / self.population
        elif self.sampling == "none":
            if sampling_rate is not None or clients_per_round is not None \
                    or population is not None:
                raise ValueError("sampling='none' (no amplification) takes no sampling_rate, "
                                 "clients_per_round or population")
            self.sampling_rate = 1.0
        else:
            if sampling_rate is not None:
                if clients_per_round is not None or population is not None:
                    raise ValueError(
                        "give either sampling_rate or clients_per_round and population, not both"
                    )
                self.sampling_rate = _checks.real("sampling_rate", sampling_rate)
            elif clients_per_round is not None and population is not None:
                self.population = _checks.integer("population", population, 1)
                self.clients_per_round = _checks.integer("clients_per_round", clients_per_round, 1)
                self.sampling_rate = self.clients_per_round / self.population
            else:
                raise ValueError(
                    "sampling='poisson' needs sampling_rate, or clients_per_round and population"
                )
            if not 0.0 <= self.sampling_rate <= 1.0:
                raise ValueError(
                    f"sampling rate must be in [0, 1], got {self.sampling_rate}; "
                    "check clients_per_round <= population"
                )
        self._history: list[Run] = []

    @property
    def relation(self) -> str:
        """The neighbouring relation this accountant's epsilon is stated for."""
        return self._relation

    @property
    def dp_relation(self) -> dp_accounting.NeighboringRelation:
        """The relation to compose :meth:`dp_event` under in dp_accounting."""
        return _dp_relation(self.sampling, self._relation)

    # -- rounds -------------------------------------------------------------------------

    @property
    def rounds(self) -> int:
        """Rounds accounted so far."""
        return sum(run[1] for run in self._history)

    @property
    def history(self) -> list[tuple]:
        """Runs of ``(noise_multiplier, rounds)`` in order; with fixed sampling
        ``(noise_multiplier, rounds, population, cohort)``."""
        if self.sampling == "fixed":
            return list(self._history)
        return [(z, n) for z, n, _, _ in self._history]

    def step(self, rounds: int = 1, noise_multiplier: float | None = None, *,
             population: int | None = None, cohort: int | None = None) -> None:
        """Account ``rounds`` more rounds at ``noise_multiplier`` (default: the constructor's).

        With fixed sampling, ``population`` and ``cohort`` are what those rounds actually
        drew from and drew (default: the constructor's); other samplings refuse them.
        """
        rounds = _checks.integer("rounds", rounds, 0)
        self._history = _extend(self._history, self._run(noise_multiplier, rounds,
                                                         population, cohort))

    # -- queries ------------------------------------------------------------------------

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the constructor's)."""
        return self._epsilon(tuple(self._history), self._delta(delta))

    def epsilon_after(
        self, rounds: int, noise_multiplier: float | None = None, delta: float | None = None
    ) -> float:
        """What-if: epsilon if ``rounds`` MORE rounds ran from the current state (with the
        constructor's sampling)."""
        rounds = _checks.integer("rounds", rounds, 0)
        extended = _extend(self._history, self._run(noise_multiplier, rounds))
        return self._epsilon(tuple(extended), self._delta(delta))

    def rounds_within(
        self,
        epsilon_budget: float,
        noise_multiplier: float | None = None,
        delta: float | None = None,
        limit: int = 10**6,
    ) -> int:
        """How many MORE rounds keep epsilon <= ``epsilon_budget`` (0 if not even one;
        at most ``limit``). Exact: a search over :meth:`epsilon_after`."""
        budget = _checks.positive("epsilon_budget", epsilon_budget)
        limit = _checks.integer("limit", limit, 1)
        z = self._z(noise_multiplier)
        d = self._delta(delta)

        def fits(extra: int) -> bool:
            return self.epsilon_after(extra, z, d) <= budget

        if not fits(1):
            return 0
        return _largest_fitting(fits, self._guess(budget, z, d, limit), limit)

    def _guess(self, budget: float, z: float, delta: float, limit: int) -> int:
        """A cheap starting point for the search; only its speed depends on it."""
        if self.accountant == "rdp":
            return 1
        # RDP has no Poisson replace-one event: the add/remove curve only seeds the search
        guide = ADD_REMOVE if self.sampling == "poisson" else self._relation
        rdp_key = ("rdp", self.sampling, self.sampling_rate, guide)

        def rdp_fits(extra: int) -> bool:
            history = tuple(_extend(self._history, self._run(z, extra)))
            return _cached_epsilon(rdp_key, history, delta) <= budget

        guess = _largest_fitting(rdp_fits, 1, limit) if rdp_fits(1) else 1
        # Refine with one PLD evaluation: epsilon grows roughly like sqrt(rounds).
        eps = self.epsilon_after(guess, z, delta)
        if 0.0 < eps < math.inf:
            total = self.rounds + guess
            guess = int(total * (budget / eps) ** 2) - self.rounds
        return min(max(guess, 1), limit)

    def dp_event(self) -> dp_accounting.DpEvent:
        """The composed DpEvent of all rounds so far (for a ledger); compose it under
        :attr:`dp_relation`."""
        return dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(_round_event(self.sampling, self.sampling_rate,
                                                            z, population, cohort,
                                                            self._relation), n)
             for z, n, population, cohort in self._history]
        )

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        return {
            "history": [list(run) if self.sampling == "fixed" else [run[0], run[1]]
                        for run in self._history],
            "rounds": self.rounds,
            "noise_multiplier": self.noise_multiplier,
            "sampling": self.sampling,
            "sampling_rate": self.sampling_rate,
            "accountant": self.accountant,
            "relation": self._relation,
            "delta": self.delta,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore the rounds; refuses a state saved under a different sampling. A fixed
        sampling's runs saved as ``[z, n]`` (older states) take the constructor's cohort.
        A state saved without a relation was saved under its sampling's natural one."""
        saved_relation = state.get("relation", relation(str(state.get("sampling"))))
        if saved_relation != self._relation:
            raise ValueError(f"saved accountant state is stated for {saved_relation!r}, but "
                             f"this accountant is for {self._relation!r}")
        if state.get("sampling") != self.sampling or not math.isclose(
            float(state.get("sampling_rate", -1.0)), self.sampling_rate, rel_tol=1e-12
        ):
            raise ValueError(
                "saved accountant state has sampling "
                f"{state.get('sampling')!r} at rate {state.get('sampling_rate')}, but this "
                f"accountant uses {self.sampling!r} at rate {self.sampling_rate}"
            )
        history: list[Run] = []
        for saved in state["history"]:  # type: ignore[union-attr]
            z, n, *cohort = saved
            population, size = cohort if len(cohort) == 2 else (None, None)
            history = _extend(history, self._run(z, n, population, size))
        self._history = history

    # -- internals ----------------------------------------------------------------------

    def _run(self, noise_multiplier: float | None, rounds: int,
             population: int | None = None, cohort: int | None = None) -> Run:
        z = self._z(noise_multiplier)
        n = _checks.integer("rounds", rounds, 0)
        if self.sampling != "fixed":
            if population is not None or cohort is not None:
                raise ValueError(f"sampling={self.sampling!r} takes no population or cohort "
                                 "per round")
            return (z, n, None, None)
        if population is None and cohort is None:
            return (z, n, self.population, self.clients_per_round)
        if population is None or cohort is None:
            raise ValueError("give both population and cohort for a fixed-size round")
        return (z, n, *_cohort(population, cohort))

    def _z(self, noise_multiplier: float | None) -> float:
        if noise_multiplier is None:
            return self.noise_multiplier
        return _checks.non_negative("noise_multiplier", noise_multiplier)

    def _delta(self, delta: float | None) -> float:
        return self.delta if delta is None else _checks.open_unit("delta", delta)

    def _epsilon(self, history: tuple[Run, ...], delta: float) -> float:
        return _cached_epsilon(self._key(), history, delta)

    def _key(self) -> tuple[object, ...]:
        return (self.accountant, self.sampling, self.sampling_rate, self._relation)


def _relation_for(sampling: str, accountant: str, asked: str | None) -> str:
    """The relation an accountant states: ``asked``, or its sampling's natural one;
    ValueError for a pair dp_accounting cannot account."""
    natural = relation(sampling)
    chosen = natural if asked is None else _checks.choice("relation", asked, RELATIONS)
    if sampling == "fixed" and chosen != REPLACE_ONE:
        raise ValueError("sampling='fixed' (without replacement) is accounted under "
                         "replace-one only")
    if chosen == ZERO_OUT and sampling != "none":
        raise ValueError("relation='zero-out' (participation known) takes sampling='none'")
    if sampling == "poisson" and chosen == REPLACE_ONE and accountant != "pld":
        raise ValueError("Poisson sampling under replace-one needs accountant='pld' "
                         "(dp_accounting's RDP accountant has no such event)")
    return chosen


def _dp_relation(sampling: str, chosen: str) -> dp_accounting.NeighboringRelation:
    """dp_accounting's relation for a round event of :func:`_round_event`: REPLACE_ONE
    where the event itself is replace-one (fixed; Poisson), else add/remove (an unsampled
    replace-one round is the add/remove Gaussian at z / 2)."""
    if sampling == "fixed" or (sampling == "poisson" and chosen == REPLACE_ONE):
        return _NEIGHBOURS.REPLACE_ONE
    return _NEIGHBOURS.ADD_OR_REMOVE_ONE


def _cohort(population: object, cohort: object) -> tuple[int, int]:
    n = _checks.integer("population", population, 1)
    m = _checks.integer("clients_per_round", cohort, 1)
    if m > n:
        raise ValueError(f"clients_per_round={m} exceeds population={n}")
    return n, m


def _round_event(sampling: str, rate: float, z: float, population: int | None,
                 cohort: int | None, chosen: str) -> dp_accounting.DpEvent:
    """One round's DpEvent, with the multiplier for its relation (see the module
    docstring), to compose under :func:`_dp_relation`."""
    if sampling == "fixed":
        gaussian = dp_accounting.GaussianDpEvent(z / REPLACE_ONE_FACTOR)
        return dp_accounting.SampledWithoutReplacementDpEvent(population, cohort, gaussian)
    if sampling == "none":
        factor = REPLACE_ONE_FACTOR if chosen == REPLACE_ONE else 1.0
        return dp_accounting.GaussianDpEvent(z / factor)
    return dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z))


def _extend(history: list[Run], run: Run) -> list[Run]:
    out = list(history)
    z, rounds, population, cohort = run
    if rounds == 0:
        return out
    if out and (out[-1][0], out[-1][2], out[-1][3]) == (z, population, cohort):
        out[-1] = (z, out[-1][1] + rounds, population, cohort)
    else:
        out.append(run)
    return out


def _largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """Largest n in [1, limit] with fits(n), for a monotone ``fits`` with fits(1) true:
    gallop from ``start`` to a bracket, then bisect."""
    step = max(1, start // 64)
    if fits(start):
        lo, hi = start, None
        while hi is None:
            if lo >= limit:
                return limit
            nxt = min(lo + step, limit)
            if fits(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
    else:
        lo, hi = None, start
        while lo is None:
            nxt = max(hi - step, 1)
            if nxt == 1 or fits(nxt):
                lo = nxt
            else:
                hi, step = nxt, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=4096)
def _cached_epsilon(key: tuple, history: tuple[Run, ...], delta: float) -> float:
    if not history:
        return 0.0
    accountant, sampling, rate, chosen = key
    if accountant == "pld":
        replace = chosen == REPLACE_ONE
        if sampling == "none":  # unsampled replace-one: the add/remove Gaussian at z / 2
            factor = REPLACE_ONE_FACTOR if replace else 1.0
            history = tuple((z / factor, *rest) for z, *rest in history)
            return _pld_epsilon(1.0, history, delta, False)
        return _pld_epsilon(rate, history, delta, replace)
    orders = None
    total = None
    for z, n, population, cohort in history:
        orders, per_round = _rdp_round(sampling, rate, z, population, cohort, chosen)
        total = n * per_round if total is None else total + n * per_round
    return float(rdp_lib.compute_epsilon(orders, total, delta)[0])


@functools.lru_cache(maxsize=256)
def _rdp_round(sampling: str, rate: float, z: float, population: int | None,
               cohort: int | None, chosen: str) -> tuple[np.ndarray, np.ndarray]:
    """RDP curve of one round, from dp_accounting's RdpAccountant and the round's DpEvent.
    ``n`` rounds cost ``n`` times it, which is how RdpAccountant composes a count."""
    rdp = rdp_lib.RdpAccountant(neighboring_relation=_dp_relation(sampling, chosen))
    rdp.compose(_round_event(sampling, rate, z, population, cohort, chosen))
    return rdp.orders, rdp.rdp


def _pld_epsilon(rate: float, history: tuple[Run, ...], delta: float,
                 replace: bool) -> float:
    """PLD of Poisson-sampled Gaussian rounds (rate 1: unsampled), built exactly as
    dp_accounting's PLDAccountant builds it for ``PoissonSampledDpEvent(rate,
    GaussianDpEvent(z))`` composed ``n`` times (under REPLACE_ONE with ``replace``), with
    the one-round PLD cached so that what-if queries cost one self-composition."""
    if rate == 0.0:
        return 0.0
    if any(z == 0.0 for z, *_ in history):
        return math.inf
    total = pld_lib.identity(value_discretization_interval=PLD_DISCRETIZATION)
    for z, n, _, _ in history:
        total = total.compose(_pld_round(rate, z, replace).self_compose(n))
    return float(total.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=64)
def _pld_round(rate: float, z: float, replace: bool) -> pld_lib.PrivacyLossDistribution:
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=z,
        value_discretization_interval=PLD_DISCRETIZATION,
        sampling_prob=rate,
        neighboring_relation=(_NEIGHBOURS.REPLACE_ONE if replace
                              else _NEIGHBOURS.ADD_OR_REMOVE_ONE),
    )
