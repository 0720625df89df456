"""Each secure round's clip range (``secagg.clip_range``), from public figures only, and
the run's one warning when clients clip.

Every coordinate of a client's delta is clipped to [-r, r] before it is quantized, and
the sum's fixed-point scale is the largest that cannot wrap for r (the headroom check
is redone for every round's r). With ``clip_range = "auto"`` r is:

- under central DP, the DP clip C: a coordinate of a delta clipped to L2 norm C is never
  above C, so nothing is clipped per coordinate;
- in the first round, :data:`server.secagg_config.AUTO_START_RANGE` (secure QSGD, whose
  few levels need a tight range: :data:`QSGD_START_RANGE`);
- after a round that applied an aggregate, :data:`MARGIN` times the largest absolute
  coordinate of that round's weighted mean update (the aggregate, which the server
  holds anyway), but not below half the range before (it shrinks gently), and at least
  twice the range before when clients clipped in that round (the count comes out of the
  secure sum, like the aggregate).

The margin is wide because one client's delta can exceed the mean of many by several
times on skewed data; a wider range costs only resolution, which 32-bit words have to
spare. A resumed run starts again from the first round's range.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from server.secagg_config import SecAggScenarioConfig

if TYPE_CHECKING:
    from server.reporter import Reporter
    from server.secure_outcome import SecureRoundOutcome

log = logging.getLogger(__name__)

MARGIN = 64.0  # the next range over the previous aggregate's largest coordinate
SHRINK = 0.5  # the next range is at least this share of the one before
GROW = 2.0  # after a round that clipped, the next range is at least this times larger
QSGD_START_RANGE = 1.0  # secure QSGD's first range: 2^compression.bits levels span it


class ClipRange:
    """The clip range of each secure round of one run, and its clipping warning."""

    def __init__(self, settings: SecAggScenarioConfig, *, qsgd: bool = False) -> None:
        self.settings = settings
        self.current = QSGD_START_RANGE if qsgd and settings.auto_range else \
            settings.start_range
        self.warned = False

    def for_round(self, dp_clip: float | None = None) -> SecAggScenarioConfig:
        """The settings of the next round, with its range fixed (``dp_clip``: central DP's
        clip norm, which bounds every coordinate)."""
        if not self.settings.auto_range:
            return self.settings
        return self.settings.with_range(dp_clip if dp_clip is not None else self.current)

    def observe(self, outcome: SecureRoundOutcome, reporter: Reporter | None = None) -> None:
        """After a round: warn (once per run) if clients clipped, and set the next range."""
        clipped = outcome.clipped or 0
        if clipped and not self.warned:
            self.warned = True
            text = (f"secure aggregation: clients clipped {clipped} values in round "
                    f"{outcome.round} (coordinates beyond secagg.clip_range = "
                    f"{outcome.clip_range:g}, or a loss or example count beyond its bound); "
                    "the model differs from a plain run's: raise secagg.clip_range or set it "
                    "to \"auto\"")
            log.warning(text)
            if reporter is not None:
                reporter.message(text)
        if not self.settings.auto_range or outcome.weighted_sum is None or \
                outcome.total_weight <= 0 or outcome.clip_range <= 0:
            return
        peak = float(np.max(np.abs(outcome.weighted_sum), initial=0.0)) / outcome.total_weight
        if not np.isfinite(peak):
            return
        nxt = max(MARGIN * peak, SHRINK * outcome.clip_range)
        if clipped:
            nxt = max(nxt, GROW * outcome.clip_range)
        self.current = nxt
