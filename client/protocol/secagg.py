"""Secure aggregation (SecAgg+) over Flower messages: actions, records, settings, stages.

One round starts with ``train.secagg`` (the model, the train config and, in the
``SecAggRecord.PROTOCOL`` record, the SETUP message and the settings below); then come
``query.secagg`` messages, one per later stage (PUBLIC_KEYS, SHARES_AND_UNMASK in the
merged flow; see ``privacy.secagg.client``). Protocol messages travel as bytes under
``SecAggKey.MSG``; a message holding a masked vector comes back as one uint8 Array
(``SecAggKey.VECTOR``) in the ``SecAggRecord.VECTOR`` ArrayRecord on the in-process
engine and above 4 MiB, else as protocol bytes too (:func:`protocol_payload` reads
either). Secure
FedBuff first sends ``train.secagg_hold`` (train and hold the delta, answer
``SecAggKey.READY``), then the buffer's SETUP in a ``query.secagg`` with
``SecAggKey.FACTOR``.

A client's quantized vector is its coordinates, its weight, then (unless distributed DP
is on) ``privacy.secagg.quantize.STAT_WORDS`` stat words whose sums give the round's
totals: values clipped, examples and example-weighted training loss. No per-client
figure travels in the clear.

A secure evaluation session (``federation.secure_evaluation``) runs the same stages, but
its first message is ``evaluate.secagg`` (the model, the evaluate config and a SETUP
with :data:`EVAL_SETUP_SETTINGS`) and a client's vector is only its evaluation totals
(``privacy.secagg.eval_words.EvalWords``: examples, examples * accuracy, examples *
loss, the same for its own model where it has one, and how many figures it clipped).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from client.protocol.names import Names
from privacy.secagg import ProtocolError, Stage
from privacy.secagg.eval_words import EvalWords
from privacy.secagg.stages import MsgType


class SecAggAction(Names):
    """Message-type suffixes: ``train.secagg``, ``query.secagg``, ``train.secagg_hold``,
    ``evaluate.secagg`` (a secure evaluation session's first message)."""

    SECAGG = "secagg"
    HOLD = "secagg_hold"  # train, hold the delta, answer READY


class SecAggRecord(Names):
    """Records of secure-aggregation messages."""

    PROTOCOL = "secagg"  # ConfigRecord of protocol bytes (first message: and settings)
    VECTOR = "secagg-vector"  # ArrayRecord holding a message with a masked vector


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
    # A secure evaluation's SETUP: every word of its vector lies in [0, EVAL_LEVEL]
    # (with MAX_EXAMPLES and LOSS_RANGE, the EvalWords layout).
    EVAL_LEVEL = "eval-level"


#: The settings every SETUP record carries, with their types.
SETUP_SETTINGS: dict[str, type] = {
    SecAggKey.RUN: int, SecAggKey.ROUND: int, SecAggKey.SCALE: float, SecAggKey.CLIP: float,
    SecAggKey.MAX_WEIGHT: float, SecAggKey.WEIGHT_BY: str, SecAggKey.ROUNDING: str,
    SecAggKey.DROPOUT: float, SecAggKey.DROPOUT_STAGE: str}

#: The settings a secure evaluation's SETUP record carries, with their types.
EVAL_SETUP_SETTINGS: dict[str, type] = {
    SecAggKey.RUN: int, SecAggKey.ROUND: int, SecAggKey.DROPOUT: float,
    SecAggKey.DROPOUT_STAGE: str, SecAggKey.EVAL_LEVEL: int, SecAggKey.MAX_EXAMPLES: int,
    SecAggKey.LOSS_RANGE: float}


def protocol_payload(content: RecordDict) -> bytes | memoryview:
    """The protocol message that ``content`` carries: the masked vector's Array when there
    is one, else the protocol record's bytes; b"" when it holds neither."""
    vector = content.get(SecAggRecord.VECTOR)
    if isinstance(vector, ArrayRecord) and SecAggKey.VECTOR in vector:
        return vector[SecAggKey.VECTOR].data
    record = content.get(SecAggRecord.PROTOCOL)
    value = record.get(SecAggKey.MSG) if isinstance(record, ConfigRecord) else None
    return value if isinstance(value, bytes) else b""


def eval_setup(words: EvalWords) -> dict[str, Any]:
    """The SETUP record entries that tell a client the evaluation words' layout."""
    return {SecAggKey.EVAL_LEVEL: words.level, SecAggKey.MAX_EXAMPLES: words.max_examples,
            SecAggKey.LOSS_RANGE: float(words.loss_range)}


def eval_words(settings: dict[str, Any]) -> EvalWords:
    """The evaluation words' layout from a checked SETUP record's settings;
    ProtocolError when they make none."""
    try:
        return EvalWords(level=settings[SecAggKey.EVAL_LEVEL],
                         max_examples=settings[SecAggKey.MAX_EXAMPLES],
                         loss_range=settings[SecAggKey.LOSS_RANGE])
    except ValueError as exc:
        raise ProtocolError(f"secure evaluation settings: {exc}") from None


STAGE_NAMES = ("advertise_keys", "share_keys", "masked_input", "unmasking")
#: The stage a client's reply to each server message belongs to.
REPLY_STAGE = {MsgType.SETUP: Stage.ADVERTISE_KEYS, MsgType.PUBLIC_KEYS: Stage.SHARE_KEYS,
               MsgType.FORWARDED_SHARES: Stage.MASKED_INPUT,
               MsgType.CONSISTENCY_CHECK: Stage.CONSISTENCY_CHECK,  # malicious mode only
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
