"""Client side of secure aggregation (SecAgg+) over Flower messages.

One round is four message round trips, all answered by the same ClientApp:

- ``train.secagg``: the model, the usual training config and, in the "secagg" record,
  the SETUP message and the quantization settings. The client trains, clips each
  coordinate of its delta to ``clip-range``, weights it by min(num_examples,
  ``max-weight``) (or 1), quantizes it (the weight is an extra coordinate, followed
  by the stat words: how many values it clipped, its example count and its
  example-weighted training loss, ``privacy.secagg.quantize.StatWords``, so the
  server learns only their totals) and answers ADVERTISE_KEYS with nothing else: no
  loss or example count in the clear;
- ``query.secagg`` with PUBLIC_KEYS -> SHARE_KEYS, with FORWARDED_SHARES -> MASKED_INPUT
  (the masked vector, in an ArrayRecord of bytes), with UNMASK_REQUEST -> UNMASK_RESPONSE.
  In the merged flow (``privacy.secagg.params.MERGED``, the default of sessions whose
  masked-input stage is not a ring) one round trip fewer: PUBLIC_KEYS -> SHARES_AND_INPUT
  (the shares and the masked vector, in the ArrayRecord), then the forwarded shares ride
  on the next message (SHARES_AND_CHECK or SHARES_AND_UNMASK); FORWARDED_SHARES ->
  MASKED_INPUT runs only as the fallback, when some client sent no shares.

Keys advertised a round ahead (``privacy.secagg.ahead``, SETUP's ``advertise_ahead``): the
UNMASK_RESPONSE of a sync round also carries the client's key advertisement for the next
round, whose secrets the node keeps in ``Context.state`` (``fedring.secagg.ahead``, the
state of :meth:`SecAggClient.carry_over`). When the next round's ``train.secagg`` brings
SETUP with PUBLIC_KEYS (SETUP_AND_KEYS) the client checks SETUP with those keys (before
training), trains and answers PUBLIC_KEYS at once: SHARES_AND_INPUT is its training reply.
A fresh SETUP discards the kept keys; one that uses them records the round, and a fresh
SETUP for that round is then refused.

A secure evaluation session (``federation.secure_evaluation``) starts with
``evaluate.secagg``: the model, the evaluate config and a SETUP whose settings give the
evaluation words' layout. The client checks the session against its policy exactly as
for training, evaluates the model on its held-out split (the injected evaluation
function, the same figures a plain evaluate reply carries) and keeps as its input only
its totals (``privacy.secagg.eval_words.EvalWords``: examples, examples * accuracy,
examples * loss, the same for its own model where it has one, and how many figures it
clipped); the later stages are the training session's.

Secure FedBuff splits the first step in two: ``train.secagg_hold`` trains and keeps the
delta in the state, answering only "ready"; once the server has a buffer of ready
clients, ``query.secagg`` with SETUP (and the staleness factor s(tau) in ``factor``)
starts that buffer's session on the held delta, which is scaled by s(tau) on the client.

With top-k on a shared pattern (``[compression] kind = "topk"``, ``shared_pattern``) the
SETUP record adds the compression request (``ConfigKey.COMPRESSION``): the
client quantizes and masks only the round's ``k`` coordinates (plus the weight), and
keeps the rest in its error-feedback residual.

With differential privacy the SETUP record adds ``dp-clip`` (central DP: the server
noises the sum for that L2 norm C) or ``dp-plan`` (distributed DP: the client sends
:func:`encode_distributed`'s noisy integer vector instead of the quantized one, so the
server only ever decodes a noisy sum). Under central DP the client clips its delta below
C by the rounding's worst case (``privacy.secagg.quantize.contribution_clip``), so what
its words decode to, rounding included, stays within C on every path that quantizes here:
plain quantization, secure QSGD (stochastic rounding at the modulus ``compression.bits``
asks for) and top-k on a shared pattern (k coordinates); a SETUP whose scale leaves no
room is refused. Its stochastic rounding then draws from the operating system's entropy,
never from the run seed, which the server knows; without DP the rounding stays seeded
from (run seed, round, partition), so simulations replay exactly.

Between messages the session (private keys included) and the quantized input live
only in the node's ``Context.state``, so the client also works where every message
starts a fresh process (Flower deployment). Small protocol messages travel as bytes
in a ConfigRecord; the masked vector as one uint8 Array, which Flower serialises in
chunks without protobuf-encoding the payload. On the in-process engine the quantized
input and the masked vector stay in reused buffers (``privacy.secagg.buffers``) that the
state and the reply share instead of copying.

Every client checks the session it is sent against its own secure-aggregation policy
(``privacy.secagg.policy``): a SETUP with k < 3 (not the full graph), a disconnected
graph, t <= k/2 or fewer participants than ``min_survivors`` is refused before the client
trains, and so is an unmask request listing fewer than ``min_survivors`` survivors. The
refusal is an error reply naming the rule; the server counts it as a dropout and stores
the reason. The minimums are the policy's defaults, raised (never lowered) by the node
config ``secagg-min-neighbors`` and ``secagg-min-survivors`` (integers); nothing the
server sends changes them.

Against a server that lies (``[secagg] security = "malicious"``: the SETUP says so) a
client signs with its SecAgg+ identity and checks its peers' signatures, the derived
graph and the consistency check (``privacy.secagg.malicious``). The identity comes from
the ``identity`` argument of :class:`SecureClient` (default: the node config, read by
``client.secagg_identity``); a node without one refuses a malicious SETUP. The node config
``secagg-security = "malicious"`` makes a node refuse a semi-honest SETUP.

A large update is quantized, and its masks expanded, on ``mask-threads`` threads (node
config, an integer >= 1; default 1). A SuperNode with cores to spare sets it
(``flower-supernode --node-config "mask-threads=4"``); the in-process engine, which runs
one client at a time, gives its nodes the machine's cores. The masked vector is the same
either way.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.compression import select_shared
from client.protocol.compression import CompressionRequest
from client.protocol.errors import WireError
from client.protocol.evaluation import ClientEvaluation
from client.protocol.keys import ConfigKey, MetricKey, NodeConfigKey, RecordName
from client.protocol.npy import NPY_STYPE, npy_array, npy_view
from client.protocol.secagg import (
    EVAL_SETUP_SETTINGS,
    REPLY_STAGE,
    SETUP_SETTINGS,
    SecAggAction,
    SecAggKey,
    SecAggRecord,
    dropout_stage,
    eval_words,
)
from client.secagg_identity import IDENTITY as IDENTITY_KEY
from client.secagg_identity import TRUSTED as TRUSTED_KEYS
from client.secagg_identity import secagg_identity
from privacy.dp import DistributedDPPlan, clip_l2, distributed_encode
from privacy.dp.distributed import clip_l2_exact
from privacy.secagg import (
    DEFAULT_POLICY,
    SECURITY_MODES,
    SEMI_HONEST,
    ProtocolError,
    SecAggClient,
    SecAggPolicy,
    Stage,
)
from privacy.secagg.buffers import POOL
from privacy.secagg.identity import Identity, TrustedKeys
from privacy.secagg.messages import decode_setup, read_header, unbundle
from privacy.secagg.params import word_dtype
from privacy.secagg.quantize import (
    StatWords,
    contribution_clip,
    max_level,
    quantize_counting_into,
)
from privacy.secagg.stages import MsgType

#: The stage of the reply to each server message, the merged flow's included.
_REPLY_STAGE = {**REPLY_STAGE, MsgType.SHARES_AND_CHECK: Stage.CONSISTENCY_CHECK,
                MsgType.SHARES_AND_UNMASK: Stage.UNMASKING}
HELD = "fedring.secagg.held"  # Context.state: the held delta until its buffer's SETUP
STATE = "fedring.secagg"  # Context.state: the session and its settings
INPUT = "fedring.secagg.input"  # Context.state: the quantized input until it is masked
AHEAD = "fedring.secagg.ahead"  # Context.state: keys advertised ahead, the round that used some

class InjectedDropout(RuntimeError):
    """A simulated client vanishing (``[secagg] dropout``): the server sees an error reply."""


class HasDelta(Protocol):
    delta: np.ndarray
    metrics: MetricRecord


LocalUpdateFn = Callable[[Message, Context], HasDelta]
#: A node's SecAgg+ identity and the keys it trusts, or None (no malicious-mode sessions).
IdentityFn = Callable[[Context], tuple[Identity, TrustedKeys] | None]
#: The client's figures for the model of an evaluate message, on its held-out split.
EvaluationFn = Callable[[Message, Context], ClientEvaluation]


@dataclass
class _Held:
    """A held delta (secure FedBuff) in the shape of a local update."""

    delta: np.ndarray
    metrics: MetricRecord


def quantize_into(delta: np.ndarray, weight: float, *, clip_range: float, scale: float,
                  max_weight: float, rounding: str, out: np.ndarray,
                  rng: np.random.Generator | None = None, factor: float = 1.0,
                  threads: int = 1) -> int:
    """The encoding of ``privacy.secagg.quantize_weighted``, chunk by chunk, into ``out``
    (:func:`privacy.secagg.quantize.quantize_counting_into`); returns how many coordinates
    of ``delta`` lie outside [-clip_range, clip_range], counted in the same pass.

    ``out`` gets d+1 words: round(scale * (weight * clip(x) + max_weight * clip_range))
    per coordinate, then round(scale * weight). ``factor`` in (0, 1] scales the clipped
    coordinates only (secure FedBuff's s(tau)): the sum then decodes to
    sum(weight * factor * clip(x)) and sum(weight). ``threads``: as for the masks.
    """
    return quantize_counting_into(delta, weight, clip_range=clip_range, scale=scale,
                                  max_weight=max_weight, rounding=rounding,  # type: ignore[arg-type]
                                  rng=rng, factor=factor, out=out, threads=threads)


NPY_MAGIC = b"\x93NUMPY"


def _input_words(dim: int, bits: int) -> np.ndarray:
    """Writable words for a quantized input, in a reused .npy buffer (``POOL``): a fresh one
    costs its page faults each round."""
    dtype = word_dtype(bits)
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": (dim,)})
    head = out.getvalue()
    buf = POOL.take(len(head) + dim * dtype.itemsize)
    buf[:len(head)] = head
    return np.frombuffer(buf, dtype, count=dim, offset=len(head))


def _input_record(words: np.ndarray, context: Context) -> ArrayRecord:
    """The quantized input as the state keeps it until masking: in-process, the .npy buffer
    of :func:`_input_words` itself (copied there first if ``words`` lies elsewhere); else
    .npy bytes."""
    if not context.node_config.get(NodeConfigKey.IN_PROCESS):
        return ArrayRecord({"input": npy_array(words)})
    base = words.base
    if not (isinstance(base, memoryview) and isinstance(base.obj, bytearray)
            and base[:6] == NPY_MAGIC and len(base) > words.nbytes):
        pooled = _input_words(words.size, 8 * words.dtype.itemsize)
        np.copyto(pooled, words, casting="unsafe")
        words, base = pooled, pooled.base
    return _record("input", base, context, dtype=str(words.dtype), shape=words.shape,
                   stype=NPY_STYPE)


def _record(name: str, data: bytes | memoryview, context: Context, *, dtype: str,
            shape: tuple[int, ...], stype: str) -> ArrayRecord:
    """A one-Array record over ``data``: shared in-process, where it never leaves the
    process (no copy of d words), else copied into the ``bytes`` a transport needs."""
    record = ArrayRecord()
    if not context.node_config.get(NodeConfigKey.IN_PROCESS) or isinstance(data, bytes):
        record[name] = Array(dtype=dtype, shape=shape, stype=stype, data=bytes(data))
        return record
    arr = Array(dtype=dtype, shape=shape, stype=stype, data=b"")
    arr.data = data  # type: ignore[assignment]  # Array checks for bytes only when made
    record[name] = arr  # (ArrayRecord({...}) would remake the Array, checking again)
    return record


def _settings(record: ConfigRecord,
              kinds: dict[str, type] = SETUP_SETTINGS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, kind in kinds.items():
        value = record.get(key)
        accepted = (int, float) if kind is float else (kind,)
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise ProtocolError(f"secagg setting '{key}' is missing or not a {kind.__name__}")
        out[key] = kind(value)
    return out


def dp_settings(record: ConfigRecord) -> tuple[tuple[DistributedDPPlan, int] | None,
                                                float | None]:
    """The round's DP settings in a SETUP record: (distributed DP plan and rotation seed, or
    None; central DP's clip norm, or None)."""
    raw, clip = record.get(SecAggKey.DP_PLAN), record.get(SecAggKey.DP_CLIP)
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float)
                             or not clip > 0):
        raise ProtocolError(f"secagg setting '{SecAggKey.DP_CLIP}' must be a number > 0, "
                            f"got {clip!r}")
    if raw is None:
        return None, None if clip is None else float(clip)
    try:
        values = json.loads(raw) if isinstance(raw, str) else None
        seed = values.pop(SecAggKey.ROTATION_SEED) if isinstance(values, dict) else None
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"'{SecAggKey.ROTATION_SEED}' must be an integer >= 0")
        plan = DistributedDPPlan.from_dict(values)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"secagg setting '{SecAggKey.DP_PLAN}' is malformed: {exc}") from None
    return (plan, seed), None


def encode_distributed(delta: np.ndarray, plan: DistributedDPPlan, rotation_seed: int, *,
                       factor: float = 1.0) -> np.ndarray:
    """Distributed DP on the client: clip to the plan's L2 norm (times ``factor``), rotate,
    scale, round, add this client's share of discrete Gaussian or Skellam noise, and
    reduce mod 2^bits into SecAgg words. The rounding and the noise draw from the
    operating system's entropy, never from a seed the server knows."""
    if factor != 1.0:  # factor * clip(delta): still within the clip norm
        delta = clip_l2_exact(delta, plan.clip)[0] * factor
    encoded, _ = distributed_encode(delta, plan, np.random.default_rng(), rotation_seed)
    return np.mod(encoded, 1 << plan.bits).astype(word_dtype(plan.bits))


def stat_bounds(record: ConfigRecord) -> tuple[float, float] | None:
    """The stat words' bounds in a SETUP record (``max-examples``, ``loss-range``), or None
    when it asks for no stat words (distributed DP)."""
    values = [record.get(key) for key in (SecAggKey.MAX_EXAMPLES, SecAggKey.LOSS_RANGE)]
    if values == [None, None]:
        return None
    if any(isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 for v in values):
        raise ProtocolError(f"secagg settings '{SecAggKey.MAX_EXAMPLES}' and "
                            f"'{SecAggKey.LOSS_RANGE}' must both be numbers > 0, got {values}")
    return float(values[0]), float(values[1])  # type: ignore[arg-type]


def _loss(metrics: MetricRecord) -> float | None:
    loss = metrics.get("train_loss")
    return float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) \
        else None


def shared_request(record: ConfigRecord) -> CompressionRequest | None:
    """The shared-pattern top-k request in a SETUP record (``COMPRESSION_KEY``), or None."""
    try:
        request = CompressionRequest.from_config(record)
    except WireError as exc:
        raise ProtocolError(str(exc)) from None
    if request is not None and not (request.config.kind == "topk"
                                    and request.config.shared_pattern):
        raise ProtocolError(f"secure rounds compress only with top-k on a shared pattern, got "
                            f"kind '{request.config.kind}'")
    return request


def _payload(msg: Message) -> bytes:
    record = msg.content.get(SecAggRecord.PROTOCOL)
    value = record.get(SecAggKey.MSG) if isinstance(record, ConfigRecord) else None
    if not isinstance(value, bytes):
        raise ProtocolError("message has no secure-aggregation payload")
    return value


#: Outside the in-process engine a masked vector up to this size travels as the protocol
#: record's bytes: three Flower objects to push and pull (message, record dict, record)
#: instead of five (an Array and its one chunk besides). A larger one goes as an Array,
#: which Flower cuts into chunks of 5 MB.
ONE_OBJECT_BYTES = 4 << 20


def _protocol_content(message: bytes | memoryview) -> RecordDict:
    """A reply carrying one protocol message."""
    return RecordDict({SecAggRecord.PROTOCOL: ConfigRecord({SecAggKey.MSG: bytes(message)})})


def mask_threads(context: Context) -> int:
    """The threads this node quantizes and masks with: node config ``mask-threads``, else 1."""
    value = context.node_config.get(NodeConfigKey.MASK_THREADS, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"node config '{NodeConfigKey.MASK_THREADS}' must be an integer >= 1, "
                         f"got {value!r}")
    return value


MIN_NEIGHBORS_KEY = "secagg-min-neighbors"  # node config: raise the policy's minimum k
MIN_SURVIVORS_KEY = "secagg-min-survivors"  # node config: raise the policy's min_survivors


def client_policy(context: Context) -> SecAggPolicy:
    """This node's secure-aggregation policy: the default, with the minimums its node config
    raises (``secagg-min-neighbors``, ``secagg-min-survivors``); ValueError for a value
    below the default, which a node can never lower."""
    raised = {}
    for key, name in ((MIN_NEIGHBORS_KEY, "min_neighbors"), (MIN_SURVIVORS_KEY, "min_survivors")):
        if key in context.node_config:
            raised[name] = context.node_config[key]
    if not raised:
        return DEFAULT_POLICY
    try:
        return DEFAULT_POLICY.raised(**raised)
    except ValueError as exc:
        raise ValueError(f"node config {MIN_NEIGHBORS_KEY} / {MIN_SURVIVORS_KEY}: {exc}") \
            from None


SECURITY_KEY = "secagg-security"  # node config: "malicious" refuses a semi-honest SETUP


def client_security(context: Context) -> str:
    """The least security this node accepts: node config ``secagg-security``."""
    value = context.node_config.get(SECURITY_KEY, SEMI_HONEST)
    if value not in SECURITY_MODES:
        raise ValueError(f"node config '{SECURITY_KEY}' must be one of "
                         f"{', '.join(SECURITY_MODES)}, got {value!r}")
    return str(value)


def node_identity(context: Context) -> tuple[Identity, TrustedKeys] | None:
    """The default :data:`IdentityFn`: the node config's (``client.secagg_identity``)."""
    return secagg_identity(context.node_config)


def _partition(context: Context) -> int:
    pid = context.node_config.get(NodeConfigKey.PARTITION_ID)
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else int(context.node_id)


def _num_partitions(context: Context) -> int | None:
    n = context.node_config.get(NodeConfigKey.NUM_PARTITIONS)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _seed(seed: int, rnd: int, pid: int) -> int:
    digest = hashlib.sha256(f"fedring-secagg-rounding:{seed}:{rnd}:{pid}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _rounded_clip(bound: float, dim: int, weight: float, s: dict[str, Any]) -> float:
    """Central DP: the L2 clip that keeps this client's decoded ``dim`` coordinates within
    ``bound`` after rounding at the SETUP's scale; ProtocolError if none can."""
    scale = s[SecAggKey.SCALE]
    level = max_level(s[SecAggKey.CLIP], scale, s[SecAggKey.MAX_WEIGHT])
    clip = contribution_clip(bound, dim=dim, scale=scale, rounding=s[SecAggKey.ROUNDING],
                             level=level, weight=weight)
    if not clip > 0:
        raise ProtocolError(f"central DP: rounding {dim} coordinates at scale {scale:g} "
                            f"can move an update by more than {SecAggKey.DP_CLIP} = {bound:g}")
    return clip


class SecureClient:
    """The ``train.secagg``, ``query.secagg`` and ``evaluate.secagg`` handlers around a
    local-update function and an evaluation function."""

    def __init__(self, local_update: LocalUpdateFn,
                 evaluation: EvaluationFn | None = None,
                 identity: IdentityFn = node_identity) -> None:
        self._local_update = local_update
        self._evaluation = evaluation
        self._identity = identity

    def _own(self, context: Context, malicious: bool = False) -> dict[str, Any]:
        """This node's own session settings: its policy, identity and least security
        (``malicious``: a malicious SETUP, refused, naming the node config keys to set,
        when the node has no identity)."""
        found = self._identity(context)
        if malicious and found is None:
            raise ProtocolError(
                "SETUP asks for malicious security; this client has no identity key: give "
                f"the node its SecAgg+ identity in its node config ('{IDENTITY_KEY}' and "
                f"'{TRUSTED_KEYS}', which fedring certs writes)")
        identity, trusted = found if found is not None else (None, None)
        return {"policy": client_policy(context), "identity": identity, "trusted": trusted,
                "security": client_security(context)}

    def train(self, msg: Message, context: Context) -> Message:
        """Train, quantize the weighted delta, keep it in the state; answer SETUP."""
        for key in (STATE, INPUT):  # a new round replaces any unfinished session
            context.state.pop(key, None)
        config = msg.content.get(RecordName.CONFIG)
        seed = int(config.get(ConfigKey.SEED, 0)) if isinstance(config, ConfigRecord) else 0
        return self._setup(msg, context, seed, lambda: self._local_update(msg, context))

    def evaluate(self, msg: Message, context: Context) -> Message:
        """A secure evaluation session: check the SETUP against this node's policy (as a
        training session's), evaluate the sent model on the held-out split, keep the
        evaluation words (``privacy.secagg.eval_words``) as the input; answer SETUP."""
        for key in (STATE, INPUT):  # a new session replaces any unfinished one
            context.state.pop(key, None)
        if self._evaluation is None:
            raise ProtocolError("this client cannot evaluate in a secure session")
        config = msg.content.get(RecordName.CONFIG)
        seed = int(config.get(ConfigKey.SEED, 0)) if isinstance(config, ConfigRecord) else 0
        payload = _payload(msg)
        s = _settings(msg.content[SecAggRecord.PROTOCOL], EVAL_SETUP_SETTINGS)
        words = eval_words(s)
        pid, rnd = _partition(context), s[SecAggKey.ROUND]
        drop = dropout_stage(seed, rnd, pid, s[SecAggKey.DROPOUT], s[SecAggKey.DROPOUT_STAGE],
                             _num_partitions(context))
        if drop is Stage.ADVERTISE_KEYS:
            raise InjectedDropout("simulated dropout at stage advertise_keys")
        setup = decode_setup(payload)[1]
        if setup.dim != words.words:
            raise ProtocolError(f"SETUP announces {setup.dim} words, a secure evaluation "
                                f"has {words.words}")
        if setup.n * words.level >= 1 << setup.bits:  # the sum must not wrap
            raise ProtocolError(f"{setup.n} clients' evaluation words up to {words.level} "
                                f"can wrap a {setup.bits}-bit sum")
        session = SecAggClient(int(context.node_id), run_id=s[SecAggKey.RUN], round_id=rnd,
                               **self._own(context, setup.malicious))
        reply = session.handle(payload)  # refuses a session below policy before evaluating
        figures = self._evaluation(msg, context)
        quantized = _input_words(setup.dim, setup.bits)
        quantized[:] = words.encode(figures.num_examples, figures.accuracy, figures.loss,
                                    figures.accuracy_personal, figures.loss_personal)
        context.state[INPUT] = _input_record(quantized, context)
        self._save(context, session, s, seed, pid, drop)
        return Message(_protocol_content(reply), reply_to=msg)

    def hold(self, msg: Message, context: Context) -> Message:
        """Secure FedBuff: train, keep the delta until the buffer's SETUP; answer READY."""
        for key in (STATE, INPUT, HELD):
            context.state.pop(key, None)
        update = self._local_update(msg, context)
        config = msg.content.get(RecordName.CONFIG)
        config = config if isinstance(config, ConfigRecord) else ConfigRecord()
        meta = np.array([int(update.metrics[MetricKey.NUM_EXAMPLES]),
                         int(config.get(ConfigKey.SEED, 0))], dtype=np.int64)
        loss = _loss(update.metrics)
        context.state[HELD] = ArrayRecord({
            "delta": npy_array(update.delta), "meta": npy_array(meta),
            "loss": npy_array(np.array([np.nan if loss is None else loss]))})
        ready = ConfigRecord({SecAggKey.READY: int(config.get(ConfigKey.VERSION, 0))})
        return Message(RecordDict({SecAggRecord.PROTOCOL: ready}), reply_to=msg)

    def _setup_held(self, msg: Message, context: Context) -> Message:
        """Secure FedBuff: answer the buffer's SETUP with the held delta times s(tau)."""
        held = context.state.get(HELD)
        if not isinstance(held, ArrayRecord):
            raise ProtocolError("SETUP for a held update, but this client holds none")
        for key in (STATE, INPUT, HELD):  # the held delta is used once
            context.state.pop(key, None)
        factor = msg.content[SecAggRecord.PROTOCOL].get(SecAggKey.FACTOR)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise ProtocolError(f"secagg setting '{SecAggKey.FACTOR}' must be in (0, 1], "
                                f"got {factor!r}")
        examples, seed = (int(x) for x in npy_view(held["meta"]))
        metrics = MetricRecord({MetricKey.NUM_EXAMPLES: examples})
        loss = float(npy_view(held["loss"])[0]) if "loss" in held else float("nan")
        if not np.isnan(loss):
            metrics["train_loss"] = loss
        update = _Held(npy_view(held["delta"]), metrics)
        return self._setup(msg, context, seed, lambda: update, float(factor))

    def _setup(self, msg: Message, context: Context, seed: int,
               local_update: Callable[[], HasDelta], factor: float = 1.0) -> Message:
        """Answer SETUP: quantize the weighted delta of ``local_update``, keep it, reply (with
        keys advertised ahead, SETUP_AND_KEYS: answer its PUBLIC_KEYS too)."""
        payload, keys = _payload(msg), None
        s = _settings(msg.content[SecAggRecord.PROTOCOL])
        pid = _partition(context)
        rnd = s[SecAggKey.ROUND]
        drop = dropout_stage(seed, rnd, pid, s[SecAggKey.DROPOUT], s[SecAggKey.DROPOUT_STAGE],
                             _num_partitions(context))
        if drop is Stage.ADVERTISE_KEYS:
            raise InjectedDropout("simulated dropout at stage advertise_keys")
        if read_header(payload).kind is MsgType.SETUP_AND_KEYS:
            _, payload, keys = unbundle(payload)
        setup = decode_setup(payload)[1]
        own = self._own(context, setup.malicious)
        session = SecAggClient(int(context.node_id), run_id=s[SecAggKey.RUN], round_id=rnd,
                               **own)
        carried = context.state.get(AHEAD)
        if isinstance(carried, ConfigRecord):
            session.inherit(SecAggClient.from_state(carried["state"], **own))
        reply = session.handle(payload)  # refuses a session below policy before training
        if session.carries_over:  # keys advertised ahead used now: the round is spent
            context.state[AHEAD] = ConfigRecord({"state": session.carry_over().export_state()})
        else:  # none, or discarded by a fresh SETUP
            context.state.pop(AHEAD, None)
        update = local_update()
        distributed, dp_clip = dp_settings(msg.content[SecAggRecord.PROTOCOL])
        sparse = shared_request(msg.content[SecAggRecord.PROTOCOL])
        if distributed is not None:  # distributed DP: integer noise, then masking
            if sparse is not None:
                raise ProtocolError("a shared top-k pattern does not combine with distributed DP")
            plan, rotation_seed = distributed
            if setup.dim != plan.padded_dim or setup.bits != plan.bits:
                raise ProtocolError(f"SETUP announces {setup.dim} words of {setup.bits} bits, "
                                    f"the DP plan {plan.padded_dim} of {plan.bits}")
            quantized = encode_distributed(update.delta, plan, rotation_seed, factor=factor)
        else:
            delta = update.delta
            bounds = stat_bounds(msg.content[SecAggRecord.PROTOCOL])
            if sparse is not None:  # top-k on the round's shared pattern: k values are masked
                delta = select_shared(delta, sparse, rnd, context.state, s[SecAggKey.CLIP])
            level = max_level(s[SecAggKey.CLIP], s[SecAggKey.SCALE], s[SecAggKey.MAX_WEIGHT])
            stats = None if bounds is None else StatWords(delta.size, level, *bounds)
            extra = 1 + (stats.words if stats is not None else 0)
            if setup.dim != delta.size + extra:
                raise ProtocolError(f"SETUP announces {setup.dim} words, the update has "
                                    f"{delta.size} coordinates plus {extra} (weight, stats)")
            examples = float(update.metrics[MetricKey.NUM_EXAMPLES])
            weight = (1.0 if s[SecAggKey.WEIGHT_BY] == "uniform"
                      else min(examples, s[SecAggKey.MAX_WEIGHT]))
            if dp_clip is not None:
                delta = clip_l2(delta, _rounded_clip(dp_clip, delta.size, weight, s))[0]
            quantized = _input_words(setup.dim, setup.bits)  # a reused .npy buffer
            rng = None  # rounding to nearest draws nothing
            if s[SecAggKey.ROUNDING] == "stochastic":  # under DP the server must not know the draws
                rng = (np.random.default_rng() if dp_clip is not None
                       else np.random.default_rng(_seed(seed, rnd, pid)))
            d = delta.size
            clipped = quantize_into(delta, weight, clip_range=s[SecAggKey.CLIP],
                                    scale=s[SecAggKey.SCALE], max_weight=s[SecAggKey.MAX_WEIGHT],
                                    rounding=s[SecAggKey.ROUNDING], out=quantized[:d + 1],
                                    rng=rng, factor=factor, threads=mask_threads(context))
            if stats is not None:  # the totals the server needs, inside the sum
                quantized[d + 1:] = stats.encode(clipped, examples, _loss(update.metrics))
        context.state[INPUT] = _input_record(quantized, context)
        if keys is None:
            self._save(context, session, s, seed, pid, drop)
            return Message(_protocol_content(reply), reply_to=msg)
        if drop is not None and drop <= Stage.SHARE_KEYS:  # the PUBLIC_KEYS reply's stage
            raise InjectedDropout(f"simulated dropout at stage {drop.name.lower()}")
        session.threads = mask_threads(context)
        content = self._answer(session, keys, MsgType.PUBLIC_KEYS, context, drop)
        self._save(context, session, s, seed, pid, drop)
        return Message(content, reply_to=msg)

    def query(self, msg: Message, context: Context) -> Message:
        """Answer PUBLIC_KEYS, FORWARDED_SHARES, CONSISTENCY_CHECK or UNMASK_REQUEST (in the
        merged flow the last two may carry the forwarded shares) from the stored session.
        In the merged flow the quantized input is masked with the PUBLIC_KEYS reply and
        kept until the next message: a fallback (FORWARDED_SHARES) masks it again."""
        payload = _payload(msg)
        kind = read_header(payload).kind
        if kind is MsgType.SETUP:  # secure FedBuff: a buffer's session for a held delta
            return self._setup_held(msg, context)
        stored = context.state.get(STATE)
        if not isinstance(stored, ConfigRecord) or kind not in _REPLY_STAGE:
            raise ProtocolError(f"no secure-aggregation session for a {kind.name} message")
        drop = stored.get(SecAggKey.DROPOUT_STAGE)
        stage = _REPLY_STAGE[kind]
        if isinstance(drop, int) and not isinstance(drop, bool) and 0 <= drop <= stage:
            raise InjectedDropout(f"simulated dropout at stage {Stage(drop).name.lower()}")
        session = SecAggClient.from_state(stored["state"], threads=mask_threads(context),
                                          **self._own(context))
        content = self._answer(session, payload, kind, context, drop)
        if kind in (MsgType.UNMASK_REQUEST, MsgType.SHARES_AND_UNMASK):
            del context.state[STATE]  # the session is over: its keys go with it
            if session.advertised_ahead is not None:  # but for those of the next round
                context.state[AHEAD] = ConfigRecord(
                    {"state": session.carry_over().export_state()})
        else:
            stored["state"] = session.export_state()
        return Message(content, reply_to=msg)

    @staticmethod
    def _answer(session: SecAggClient, payload: bytes, kind: MsgType, context: Context,
                drop: object) -> RecordDict:
        """``session``'s reply to ``payload`` (of type ``kind``) as a message's content,
        masking the round's quantized input where the message asks for it."""
        merged = session.config is not None and session.config.merged
        masks = kind is MsgType.FORWARDED_SHARES or (  # a client dropping at masking does not
            kind is MsgType.PUBLIC_KEYS and merged and drop != Stage.MASKED_INPUT)
        if masks:
            record = context.state.get(INPUT)
            if not isinstance(record, ArrayRecord) or "input" not in record:
                raise ProtocolError("the quantized input of this round is gone")
            session.set_input(npy_view(record["input"]))
        reply = session.handle(payload)
        if kind is not MsgType.PUBLIC_KEYS:  # masked for good, or the fallback's chance gone
            context.state.pop(INPUT, None)
        if isinstance(reply, memoryview) and (  # a masked vector: MASKED_INPUT, SHARES_AND_INPUT
                context.node_config.get(NodeConfigKey.IN_PROCESS)
                or len(reply) > ONE_OBJECT_BYTES):
            vector = _record(SecAggKey.VECTOR, reply, context, dtype="uint8", shape=(len(reply),),
                             stype="bytes")
            return RecordDict({SecAggRecord.VECTOR: vector})
        return _protocol_content(reply)

    @staticmethod
    def _save(context: Context, session: SecAggClient, s: dict[str, Any], seed: int, pid: int,
              drop: Stage | None) -> None:
        context.state[STATE] = ConfigRecord({
            "state": session.export_state(), SecAggKey.ROUND: s[SecAggKey.ROUND], "seed": seed,
            "partition": pid, SecAggKey.DROPOUT_STAGE: -1 if drop is None else int(drop)})


def register_secagg(app: ClientApp, local_update: LocalUpdateFn,
                    evaluation: EvaluationFn | None = None,
                    identity: IdentityFn = node_identity) -> SecureClient:
    """Route ``train.secagg``, ``train.secagg_hold``, ``query.secagg`` and (with
    ``evaluation``) ``evaluate.secagg`` messages of ``app`` to a SecureClient whose
    SecAgg+ identity comes from ``identity`` (default: the node config)."""
    client = SecureClient(local_update, evaluation, identity)
    app.train(SecAggAction.SECAGG)(client.train)
    app.train(SecAggAction.HOLD)(client.hold)
    app.query(SecAggAction.SECAGG)(client.query)
    if evaluation is not None:
        app.evaluate(SecAggAction.SECAGG)(client.evaluate)
    return client
