"""A secure evaluation's input: one client's evaluation totals as words of a masked sum.

A client that evaluates the global model on its held-out split sends no figure in the
clear; it sends these words, and the server learns only their sums over the survivors:

    clipped    figures this client had to clip (see below)
    examples   e = min(num_examples, max_examples)
    correct    round(e * accuracy / STEP), the accuracy clipped to [0, 1]
    loss       round(e * loss / STEP), the loss clipped to [0, R] (R = ``loss_range``)
    personal   1 if the client also measured its own model (FedBN), else 0
    correct_p  as correct, for its own model (0 without)
    loss_p     as loss, for its own model (0 without)

with STEP = :data:`privacy.secagg.quantize.LOSS_STEP` (2^-16). A loss above R (or one
that is not finite), an accuracy outside [0, 1] (or not finite) and an example count
above ``max_examples`` are clipped and each adds one to ``clipped``, so the total says
how many figures the sum holds clipped, as a training round counts its clipped
coordinates. Each number is an exact integer written in base-(L+1) digits with
L = ``level``, every word in [0, L]; with L = floor((2^bits - 1) / n) the sum of n
clients' words cannot wrap modulo 2^bits, and it decodes to the exact integer sums:
the decoded totals are exact but for each client's rounding of its two products, at
most STEP / 2 each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privacy.secagg.quantize import LOSS_RANGE, LOSS_STEP, digit_count

STEP = LOSS_STEP
MAX_EXAMPLES = 2**32 - 1  # a client's held-out examples counted, at most
FIELDS = ("clipped", "examples", "correct", "loss", "personal", "correct_personal",
          "loss_personal")
MAX_CLIPPED = 5  # examples, accuracy, loss, accuracy_personal, loss_personal


@dataclass(frozen=True)
class EvalTotals:
    """The survivors' evaluation totals, decoded from the sum of their words."""

    clipped: int  # figures clipped to their range, over all survivors
    examples: float
    correct: float  # sum of examples * accuracy
    loss_sum: float  # sum of examples * loss
    personal: int  # survivors that measured their own model too
    correct_personal: float
    loss_sum_personal: float


@dataclass(frozen=True)
class EvalWords:
    """The word layout of a secure evaluation session (both sides build the same one)."""

    level: int  # every word lies in [0, level]
    max_examples: int = MAX_EXAMPLES
    loss_range: float = LOSS_RANGE

    def __post_init__(self) -> None:
        if self.level < 1 or self.max_examples < 1 or not self.loss_range > 0:
            raise ValueError(f"evaluation words need level >= 1, max_examples >= 1 and "
                             f"loss_range > 0, got {self.level}, {self.max_examples}, "
                             f"{self.loss_range}")

    @classmethod
    def for_sum(cls, clients: int, bits: int, **kwargs: float) -> EvalWords:
        """The layout whose sum over ``clients`` cannot wrap modulo 2^``bits``."""
        return cls(level=((1 << bits) - 1) // max(clients, 1), **kwargs)  # type: ignore[arg-type]

    @property
    def _tops(self) -> tuple[int, ...]:
        e = self.max_examples
        return (MAX_CLIPPED, e, e * round(1 / STEP), e * round(self.loss_range / STEP),
                1, e * round(1 / STEP), e * round(self.loss_range / STEP))

    @property
    def words(self) -> int:
        return sum(digit_count(top, self.level + 1) for top in self._tops)

    @staticmethod
    def _clip(value: float | None, high: float, bad: float) -> tuple[float, int]:
        """``value`` clipped to [0, high] (``bad`` if not finite; 0 if None) and whether
        it was clipped."""
        if value is None:
            return 0.0, 0
        if not math.isfinite(value):
            return bad, 1
        kept = min(max(value, 0.0), high)
        return kept, int(kept != value)

    def encode(self, examples: float, accuracy: float, loss: float,
               accuracy_personal: float | None = None,
               loss_personal: float | None = None) -> np.ndarray:
        """One client's words (uint64); its own model's figures where it has them."""
        clipped = 0
        e = min(max(round(examples), 0), self.max_examples) if math.isfinite(examples) else 0
        clipped += int(not math.isfinite(examples) or examples > self.max_examples)
        r = self.loss_range  # a loss that is not finite counts as R, an accuracy as 0
        acc, c1 = self._clip(accuracy, 1.0, 0.0)
        los, c2 = self._clip(loss, r, r)
        personal = accuracy_personal is not None and loss_personal is not None
        acc_p, c3 = self._clip(accuracy_personal if personal else None, 1.0, 0.0)
        los_p, c4 = self._clip(loss_personal if personal else None, r, r)
        clipped += c1 + c2 + c3 + c4
        numbers = (clipped, e, round(e * acc / STEP), round(e * los / STEP), int(personal),
                   round(e * acc_p / STEP), round(e * los_p / STEP))
        base, out = self.level + 1, []
        for number, top in zip(numbers, self._tops, strict=True):
            number = min(number, top)
            for _ in range(digit_count(top, base)):
                number, digit = divmod(number, base)
                out.append(digit)
        return np.array(out, dtype=np.uint64)

    def decode(self, total: np.ndarray) -> EvalTotals:
        """The totals from the sum of the survivors' words (exact integers, then scaled)."""
        sums = [int(w) for w in np.asarray(total).reshape(-1)]
        if len(sums) != self.words:
            raise ValueError(f"expected {self.words} evaluation words, got {len(sums)}")
        base, values, at = self.level + 1, [], 0
        for top in self._tops:
            count = digit_count(top, base)
            values.append(sum(d * base**i for i, d in enumerate(sums[at:at + count])))
            at += count
        clipped, examples, correct, loss, personal, correct_p, loss_p = values
        return EvalTotals(clipped=clipped, examples=float(examples), correct=correct * STEP,
                          loss_sum=loss * STEP, personal=personal,
                          correct_personal=correct_p * STEP, loss_sum_personal=loss_p * STEP)
