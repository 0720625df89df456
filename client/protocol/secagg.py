"""Secure aggregation (SecAgg+) over Flower messages: actions, records, settings, stages.

One round is four round trips: ``train.secagg`` (the model, the train config and, in
the ``SecAggRecord.PROTOCOL`` record, the SETUP message and the settings below), then
``query.secagg`` with PUBLIC_KEYS, FORWARDED_SHARES and UNMASK_REQUEST. Protocol
messages travel as bytes under ``SecAggKey.MSG``; the masked vector comes back as one
uint8 Array (``SecAggKey.VECTOR``) in the ``SecAggRecord.VECTOR`` ArrayRecord. Secure
FedBuff first sends ``train.secagg_hold`` (train and hold the delta, answer
``SecAggKey.READY``), then the buffer's SETUP in a ``query.secagg`` with
``SecAggKey.FACTOR``.

A client's quantized vector is its coordinates, its weight, then (unless distributed DP
is on) ``privacy.secagg.quantize.STAT_WORDS`` stat words whose sums give the round's
totals: values clipped, examples and example-weighted training loss. No per-client
figure travels in the clear.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from client.protocol.names import Names
from privacy.secagg import Stage
from privacy.secagg.stages import MsgType


class SecAggAction(Names):
    """Message-type suffixes: ``train.secagg``, ``query.secagg``, ``train.secagg_hold``."""

    SECAGG = "secagg"
    HOLD = "secagg_hold"  # train, hold the delta, answer READY


class SecAggRecord(Names):
    """Records of secure-aggregation messages."""

    PROTOCOL = "secagg"  # ConfigRecord of protocol bytes (first message: and settings)
    VECTOR = "secagg-vector"  # ArrayRecord holding the MASKED_INPUT message


class SecAggKey(Names):
    """Keys of the secure-aggregation records."""

    MSG = "msg"  # a protocol message's bytes
    VECTOR = "masked"  # the MASKED_INPUT message, a uint8 Array
    READY = "ready"  # the hold reply: the model version the client trained from
    FACTOR = "factor"  # SETUP of a held delta: the staleness factor s(tau) in (0, 1]
    # Settings in the first message's record (types in SETUP_SETTINGS).
    RUN = "run"
    ROUND = "round"
    SCALE = "scale"
    CLIP = "clip-range"
    MAX_WEIGHT = "max-weight"
    WEIGHT_BY = "weight-by"
    ROUNDING = "rounding"
    DROPOUT = "dropout"
    DROPOUT_STAGE = "dropout-stage"
    # Optional DP settings: central DP's clip norm (the client clips, the server noises the
    # sum), or distributed DP's round plan as JSON (privacy.dp.DistributedDPPlan plus the
    # rotation seed under ROTATION_SEED).
    DP_CLIP = "dp-clip"
    DP_PLAN = "dp-plan"
    ROTATION_SEED = "rotation_seed"
    # The stat words' bounds (absent under distributed DP, which sends no stat words):
    # examples count up to MAX_EXAMPLES, the training loss is clipped to +-LOSS_RANGE.
    MAX_EXAMPLES = "max-examples"
    LOSS_RANGE = "loss-range"


#: The settings every SETUP record carries, with their types.
SETUP_SETTINGS: dict[str, type] = {
    SecAggKey.RUN: int, SecAggKey.ROUND: int, SecAggKey.SCALE: float, SecAggKey.CLIP: float,
    SecAggKey.MAX_WEIGHT: float, SecAggKey.WEIGHT_BY: str, SecAggKey.ROUNDING: str,
    SecAggKey.DROPOUT: float, SecAggKey.DROPOUT_STAGE: str}

STAGE_NAMES = ("advertise_keys", "share_keys", "masked_input", "unmasking")
#: The stage a client's reply to each server message belongs to.
REPLY_STAGE = {MsgType.SETUP: Stage.ADVERTISE_KEYS, MsgType.PUBLIC_KEYS: Stage.SHARE_KEYS,
               MsgType.FORWARDED_SHARES: Stage.MASKED_INPUT,
               MsgType.UNMASK_REQUEST: Stage.UNMASKING}


def stage_of(name: str) -> Stage:
    """The protocol stage named ``name`` (one of :data:`STAGE_NAMES`)."""
    return Stage[name.upper()]


def dropout_stage(seed: int, rnd: int, partition_id: int, dropout: float, stage: str,
                  num_partitions: int | None = None) -> Stage | None:
    """The stage from which a client vanishes in round ``rnd`` (None: it stays).

    Deterministic in (seed, round, partition id), so every engine injects the same
    dropouts. With ``num_partitions`` (the federation's clients) a fraction ``dropout`` of
    them vanishes in each round: :func:`dropping_partitions`. Without it each client
    vanishes independently with probability ``dropout``. It vanishes at ``stage``, or,
    when that is "random", at a stage drawn uniformly from :data:`STAGE_NAMES`.
    """
    if dropout <= 0:
        return None
    digest = hashlib.sha256(f"fedring-secagg-dropout:{seed}:{rnd}:{partition_id}".encode())
    raw = digest.digest()
    if num_partitions:
        if partition_id not in dropping_partitions(seed, rnd, dropout, num_partitions):
            return None
    elif int.from_bytes(raw[:8], "little") / 2.0**64 >= dropout:
        return None
    if stage != "random":
        return stage_of(stage)
    return stage_of(STAGE_NAMES[int.from_bytes(raw[8:16], "little") % len(STAGE_NAMES)])


@functools.lru_cache(maxsize=64)
def dropping_partitions(seed: int, rnd: int, dropout: float, num_partitions: int) -> frozenset:
    """The partitions that vanish in round ``rnd``: floor(dropout * n) of the n, plus one
    more with probability the fractional part (so ``dropout * n`` on average), drawn
    from (seed, round)."""
    digest = hashlib.sha256(f"fedring-secagg-dropouts:{seed}:{rnd}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    exact = dropout * num_partitions
    count = min(num_partitions, int(exact) + int(rng.random() < exact - int(exact)))
    return frozenset(int(i) for i in rng.permutation(num_partitions)[:count])
