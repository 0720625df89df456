"""Feature shift: each client sees its inputs through its own fixed affine distortion.

FedBN (Li et al., ICLR 2021) targets clients whose inputs differ in distribution while
their labels do not (scanners, cameras, lighting). ``[data] feature_shift = s`` gives
client ``i`` a contrast ``a_i = exp(s * g_i)`` and a brightness ``b_i = s * h_i * sd``
(``g_i, h_i`` standard normal from (seed, i); ``sd`` the training inputs' standard
deviation) and hands it ``a_i * x + b_i`` for its training data and its held-out split
alike. The central test set is left as it is.
"""

from __future__ import annotations

import hashlib

import numpy as np


def client_distortion(strength: float, seed: int, partition_id: int) -> tuple[float, float]:
    """Client ``partition_id``'s (log contrast, brightness in standard deviations)."""
    digest = hashlib.sha256(f"feature-shift:{seed}:{partition_id}".encode()).digest()
    g, h = np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(2)
    return float(strength * g), float(strength * h)


def distort(x: np.ndarray, *, strength: float, seed: int, partition_id: int,
            scale: float) -> np.ndarray:
    """``x`` as client ``partition_id`` sees it (a new float32 array); ``scale``: the
    inputs' standard deviation, the unit of the brightness shift."""
    if strength <= 0:
        return x
    log_contrast, shift = client_distortion(strength, seed, partition_id)
    return (np.exp(log_contrast) * x + shift * scale).astype(np.float32)
