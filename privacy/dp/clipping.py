"""L2 clipping: fixed (``clip_l2``) and adaptive (Andrew et al., NeurIPS 2021).

Adaptive clipping tracks a target quantile of the clients' update norms with the
geometric rule ``C <- C * exp(-eta * (b_bar - gamma))``, where ``b_bar`` is the
noised fraction of clients whose norm was at most ``C`` (released as a centred count,
so its sensitivity is 1/2 under add/remove and 1 under replace-one). The count noise
costs privacy too; :func:`split_noise_multiplier` gives the update noise multiplier
that keeps the combined cost equal to a Gaussian with the configured total.
"""

from __future__ import annotations

import math

import numpy as np

from privacy.dp import _checks


def l2_norm(x: np.ndarray) -> float:
    """L2 norm of all elements, accumulated in float64 (float32 sums drift on large vectors)."""
    flat = np.ravel(x)
    return math.sqrt(float(np.einsum("i,i->", flat, flat, dtype=np.float64)))


def clip_l2(delta: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """Scale ``delta`` into the L2 ball of radius ``clip``; return ``(clipped, norm_before)``.

    The result is float32. When ``delta`` is already a float32 array inside the ball it is
    returned itself, not a copy; otherwise a new array is returned and ``delta`` is left
    untouched. The clipped norm equals ``clip`` up to float32 rounding (relative 1e-7).
    """
    clip = _checks.positive("clip", clip)
    x = np.asarray(delta, dtype=np.float32)
    norm = l2_norm(x)
    if not math.isfinite(norm):
        raise ValueError("delta contains NaN or inf; reject the update before clipping it")
    if norm <= clip:
        return x, norm
    return x * np.float32(clip / norm), norm


def split_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """Noise multiplier for the clipped updates when adaptive clipping also spends privacy.

    Andrew et al. 2021: ``z_delta = (z**-2 - (2 * sigma_b)**-2) ** -0.5``, the inverse of
    :func:`combined_noise_multiplier` (see there for why it holds under both neighbouring
    relations).
    """
    z = _checks.non_negative("noise_multiplier", noise_multiplier)
    sigma_b = _checks.non_negative("clipped_count_stddev", clipped_count_stddev)
    if z == 0.0:
        return 0.0
    if 2.0 * sigma_b <= z:
        raise ValueError(
            f"clipped_count_stddev={sigma_b} is too small for noise_multiplier={z}: it must "
            f"exceed noise_multiplier / 2 = {z / 2}; raise clipped_count_stddev "
            "(the paper uses clients_per_round / 20) or lower noise_multiplier"
        )
    return (z**-2 - (2.0 * sigma_b) ** -2) ** -0.5


def combined_noise_multiplier(update_noise_multiplier: float, clipped_count_stddev: float) -> float:
    """The single Gaussian multiplier that costs the same as noising the updates with
    ``update_noise_multiplier`` and the count with ``clipped_count_stddev``, as an add/remove
    multiplier like every one :class:`privacy.dp.accountant.PrivacyAccountant` takes. Either
    being 0 means no privacy (returns 0). Inverse of :func:`split_noise_multiplier`.

    Two Gaussian releases with multipliers ``a`` and ``b`` (noise std / sensitivity) on the
    same data cost one Gaussian with ``(a**-2 + b**-2) ** -0.5``. The count released is the
    centred one, ``sum_i (b_i - 1/2)`` over the clients that reported (see
    :meth:`AdaptiveClip.update`), as in Andrew et al. 2021, Sec. 3. Its sensitivity:

    - add/remove one client: the sum of clipped updates moves by at most C (multiplier
      ``z_delta``); the centred count gains or loses one term ``+-1/2`` (multiplier
      ``2 sigma_b``; the uncentred count would move by 1). Combined:
      ``z**-2 = z_delta**-2 + (2 sigma_b)**-2``, the paper's formula.
    - replace one client: the sum moves by at most 2C (multiplier ``z_delta / 2``); one
      indicator flips, so the count moves by at most 1 (multiplier ``sigma_b``). Combined:
      ``4 z_delta**-2 + sigma_b**-2 = 4 z**-2``, i.e. ``z / 2``: the same factor 2 the
      accountant applies to every multiplier under replace-one, so one ``z`` serves both.
    """
    z_delta = _checks.non_negative("update_noise_multiplier", update_noise_multiplier)
    sigma_b = _checks.non_negative("clipped_count_stddev", clipped_count_stddev)
    if z_delta == 0.0 or sigma_b == 0.0:
        return 0.0
    return (z_delta**-2 + (2.0 * sigma_b) ** -2) ** -0.5


class AdaptiveClip:
    """Clip norm that follows a target quantile of the update norms (geometric update).

    ``clipped_count_stddev`` is sigma_b, the std of the Gaussian noise added to the count of
    clients whose norm was at most the clip. It should be fixed from the expected (public)
    number of clients per round, e.g. ``clients_per_round / 20`` as in the paper.
    """

    def __init__(
        self,
        initial: float,
        target_quantile: float,
        learning_rate: float = 0.2,
        clipped_count_stddev: float = 0.0,
    ) -> None:
        self._clip = _checks.positive("initial clip", initial)
        self.target_quantile = _checks.open_unit("target_quantile", target_quantile)
        self.learning_rate = _checks.positive("clip_learning_rate", learning_rate)
        self.clipped_count_stddev = _checks.non_negative(
            "clipped_count_stddev", clipped_count_stddev
        )
        self._rounds = 0

    @property
    def clip(self) -> float:
        """The clip norm to use this round."""
        return self._clip

    @property
    def rounds(self) -> int:
        """How many updates have been applied."""
        return self._rounds

    def below(self, norm: float) -> float:
        """A client's indicator: 1.0 if its (unclipped) norm is at most the clip, else 0.0."""
        return 1.0 if norm <= self._clip else 0.0

    def update(
        self, below_count: float, num_clients: int, rng: np.random.Generator | None = None,
        reported: int | None = None,
    ) -> float:
        """Apply one round: ``below_count`` of the ``reported`` clients had norm <= clip.

        ``num_clients`` should be the expected number of clients per round (public), as in
        the paper; ``reported`` (default ``num_clients``) is how many indicators
        ``below_count`` sums. The count released is centred, ``below_count - reported / 2``
        plus N(0, clipped_count_stddev^2), so that adding or removing a client moves it by
        1/2 (see :func:`combined_noise_multiplier`); the fraction is then
        ``released / num_clients + 1/2``. Returns the new clip.
        """
        count = _checks.non_negative("below_count", below_count)
        m = _checks.integer("num_clients", num_clients, 1)
        n = m if reported is None else _checks.integer("reported", reported, 0)
        centred = count - n / 2.0
        if self.clipped_count_stddev > 0.0:
            if rng is None:
                raise ValueError("pass rng: clipped_count_stddev > 0 needs a random generator")
            centred += float(rng.normal(0.0, self.clipped_count_stddev))
        fraction = centred / m + 0.5
        self._clip *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        self._rounds += 1
        return self._clip

    def update_from_norms(
        self,
        norms: np.ndarray,
        rng: np.random.Generator | None = None,
        num_clients: int | None = None,
    ) -> float:
        """:meth:`update` from the clients' unclipped norms (``num_clients`` defaults to their
        number)."""
        norms = np.asarray(norms, dtype=np.float64)
        count = float(np.count_nonzero(norms <= self._clip))
        return self.update(count, norms.size if num_clients is None else num_clients, rng,
                           reported=norms.size)

    def state_dict(self) -> dict[str, float | int]:
        return {"clip": self._clip, "rounds": self._rounds}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self._clip = _checks.positive("state clip", state["clip"])
        self._rounds = _checks.integer("state rounds", state["rounds"], 0)
