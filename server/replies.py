"""Turn Flower reply messages into fedring Updates (or a reason to reject them)."""

from __future__ import annotations

import math

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from aggregation import Layout, Update
from aggregation.compression import RoundCodec
from client.protocol.errors import WireError
from client.protocol.flower_compat import record_entries
from client.protocol.keys import MetricKey, RecordName
from client.protocol.npy import npy_view
from client.protocol.updates import read_delta, read_model

_INT64_MAX = 2**63 - 1


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(f"num-examples must be a positive integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise WireError(f"num-examples must be a positive integer, got {value!r}")
    if value <= 0:
        raise WireError(f"num-examples must be a positive integer, got {value!r}")
    if value > _INT64_MAX:
        raise WireError(f"num-examples {value!r} does not fit an int64")
    return int(value)


def _scalar_metrics(metrics: MetricRecord) -> dict[str, float]:
    """The reply's scalar metrics as floats; one that is not a finite number is refused
    (it could not be stored, nor averaged)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        try:
            number = float(value)
        except OverflowError:  # an int beyond float64
            number = math.inf
        if not math.isfinite(number):
            raise WireError(f"metric '{key}' is not a finite number: {repr(value)[:40]}")
        out[key] = number
    return out


def decode_compressed(record: object, codec: RoundCodec | None) -> np.ndarray:
    """The dense delta of a "compressed" reply record, checked against the round's codec."""
    if codec is None:
        raise WireError("reply is compressed, but this run does not compress updates")
    if not isinstance(record, ArrayRecord):
        raise WireError(f"'{RecordName.COMPRESSED}' is a {type(record).__name__}, expected an "
                        "ArrayRecord")
    if set(record.keys()) != set(codec.names):
        raise WireError(f"compressed reply has arrays {sorted(record.keys())}, expected "
                        f"{sorted(codec.names)} ({codec.config.kind})")
    arrays = {name: npy_view(record[name]) for name in codec.names}
    try:
        return codec.decode(arrays)
    except ValueError as exc:
        raise WireError(f"malformed compressed update: {exc}") from exc


def _plain_delta_reply(reply: Message, client_id: str, version: int) -> Update | None:
    """What ``decode_train_reply`` makes of the usual reply, a "train" reply of a dense
    delta and one metric record of plain numbers (exact ``int`` within int64, finite
    ``float``) whose count and base version are right, found without the checks that
    each word a reason; None for any other reply, which the full decoding then accepts
    or refuses with its reason. The delta is read and checked as ever (``read_delta``)."""
    if reply.has_error() or reply.metadata.message_type != "train":
        return None
    records = record_entries(reply.content)
    if type(records) is not dict or len(records) != 2:
        return None
    dense = records.get(RecordName.DELTA)
    metrics = next((v for k, v in records.items() if k != RecordName.DELTA), None)
    values = record_entries(metrics) if type(metrics) is MetricRecord else None
    if type(dense) is not ArrayRecord or type(values) is not dict:
        return None
    count, base = values.get(MetricKey.NUM_EXAMPLES), values.get(MetricKey.BASE_VERSION)
    if not (type(count) is int and 0 < count <= _INT64_MAX and type(base) is int
            and base == version):
        return None
    extra = {}
    for key, value in values.items():
        if type(value) is int and -_INT64_MAX <= value <= _INT64_MAX:
            extra[key] = float(value)
        elif type(value) is float and math.isfinite(value):
            extra[key] = value
        else:
            return None
        if type(key) is not str:
            return None
    return Update(client_id=client_id, delta=read_delta(dense), num_examples=count,
                  base_version=base, metrics=extra)


def decode_train_reply(reply: Message, *, client_id: str, layout: Layout,
                       base_params: np.ndarray, version: int,
                       codec: RoundCodec | None = None) -> Update:
    """A fedring delta reply, or a stock Flower reply of full weights turned into a delta.

    ``version`` is the model version this client was sent; a delta reply must say it
    trained from that version. ``codec``: the round's compression, when the server asked
    for compressed deltas (a dense delta is accepted too). Raises ``WireError`` with
    the reason when the reply cannot be decoded.
    """
    plain = _plain_delta_reply(reply, client_id, version)
    if plain is not None:
        return plain
    return _decode(reply, client_id=client_id, layout=layout, base_params=base_params,
                   version=version, codec=codec)


def _decode(reply: Message, *, client_id: str, layout: Layout, base_params: np.ndarray,
            version: int, codec: RoundCodec | None) -> Update:
    """``decode_train_reply`` of any reply, every check wording its reason."""
    if reply.has_error():
        raise WireError(f"client error {reply.error.code}: {reply.error.reason}")
    kind = reply.metadata.message_type
    if kind.split(".")[0] != "train":
        raise WireError(f"reply has message type {kind!r}, expected a 'train' reply")
    content = reply.content
    metric_records = [v for v in content.values() if isinstance(v, MetricRecord)]
    if len(metric_records) != 1:
        raise WireError(f"reply has {len(metric_records)} metric records, expected 1")
    metrics = metric_records[0]
    if MetricKey.NUM_EXAMPLES not in metrics:
        raise WireError("reply metrics lack 'num-examples'")
    num_examples = _count(metrics[MetricKey.NUM_EXAMPLES])
    extra = _scalar_metrics(metrics)
    dense, compressed = RecordName.DELTA, RecordName.COMPRESSED
    if dense in content or compressed in content:
        name = dense if dense in content else compressed
        unexpected = sorted(k for k, v in content.items() if k != name and v is not metrics)
        if unexpected:
            raise WireError(f"{name} reply has unexpected records {unexpected}")
        delta = (read_delta(content[dense]) if name == dense
                 else decode_compressed(content[compressed], codec))
        base = metrics.get(MetricKey.BASE_VERSION)
        if not isinstance(base, int) or isinstance(base, bool):
            raise WireError("delta reply lacks an integer 'fedring.base-version'")
        if base != version:
            raise WireError(f"reply says it trained from model version {base}, but the "
                            f"client was sent version {version}")
        return Update(client_id=client_id, delta=delta, num_examples=num_examples,
                      base_version=base, metrics=extra)
    array_records = [v for v in content.values() if isinstance(v, ArrayRecord)]
    if len(array_records) != 1:
        raise WireError(f"reply has {len(array_records)} array records, expected 1 "
                        "(full weights) or a 'delta'")
    try:
        weights = read_model(array_records[0], layout, out=np.empty(layout.dim, np.float32))
    except WireError as exc:
        raise WireError(f"full weights do not fit the server's model (it comes from [model] "
                        f"or [task] module): {exc}") from exc
    weights -= base_params
    return Update(client_id=client_id, delta=weights, num_examples=num_examples,
                  base_version=version, metrics=extra)
