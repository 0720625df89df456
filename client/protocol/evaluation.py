"""The evaluate message: what the server sends and what a client replies.

A federated evaluation round sends the current model (Flower's "arrays" record) and an
evaluate config; each client evaluates it on its own held-out split (never trained on)
and replies, like a Flower quickstart client, with a MetricRecord of "num-examples",
"eval_loss" and "eval_acc". A client whose own state changes the model it uses (FedBN's
batch-norm layers) also measures that model and adds "eval_loss_personal" and
"eval_acc_personal". A stock Flower client's reply ("loss"/"accuracy" are accepted for
"eval_loss"/"eval_acc") is read the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import ConfigRecord, MetricRecord

from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.names import Names


class EvalKey(Names):
    """Keys of an evaluate reply's MetricRecord (beside ``MetricKey.NUM_EXAMPLES``)."""

    LOSS = "eval_loss"  # the global model on the client's held-out split
    ACCURACY = "eval_acc"
    LOSS_PERSONAL = "eval_loss_personal"  # the model the client uses (its own batch norm)
    ACCURACY_PERSONAL = "eval_acc_personal"


# Other names a stock Flower ClientApp may reply with, for each key.
ALIASES = {EvalKey.LOSS: ("loss",), EvalKey.ACCURACY: ("accuracy", "acc")}


@dataclass(frozen=True)
class ClientEvaluation:
    """One client's figures: the global model's, and its own model's where it differs."""

    num_examples: int
    loss: float
    accuracy: float
    loss_personal: float | None = None
    accuracy_personal: float | None = None

    @property
    def personal(self) -> bool:
        return self.accuracy_personal is not None


def evaluate_config(server_round: int, version: int, task_json: str, seed: int, *,
                    local_buffers: bool = False) -> ConfigRecord:
    """The config of an evaluate message: the round, the model version sent, the task's
    JSON and the run seed, and FedBN's flag (the client then also measures its own
    batch-norm layers)."""
    config = ConfigRecord({ConfigKey.SERVER_ROUND: server_round, ConfigKey.VERSION: version,
                           ConfigKey.TASK: task_json, ConfigKey.SEED: seed})
    if local_buffers:
        config[ConfigKey.LOCAL_BUFFERS] = True
    return config


def evaluation_metrics(evaluation: ClientEvaluation) -> MetricRecord:
    """The reply's MetricRecord of ``evaluation``."""
    values: dict[str, int | float] = {MetricKey.NUM_EXAMPLES: int(evaluation.num_examples),
                                      EvalKey.LOSS: float(evaluation.loss),
                                      EvalKey.ACCURACY: float(evaluation.accuracy)}
    if evaluation.personal:
        values[EvalKey.LOSS_PERSONAL] = float(evaluation.loss_personal or 0.0)
        values[EvalKey.ACCURACY_PERSONAL] = float(evaluation.accuracy_personal or 0.0)
    return MetricRecord(values)


def _figure(metrics: MetricRecord, key: str, *, required: bool,
            accuracy: bool) -> float | None:
    names = (key, *ALIASES.get(key, ()))
    name = next((n for n in names if n in metrics), None)
    if name is None:
        if required:
            raise WireError(f"evaluate reply has no '{key}' metric")
        return None
    value = metrics[name]
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise WireError(f"evaluate reply's '{name}' must be a finite number, got {value!r}")
    if accuracy and not 0.0 <= value <= 1.0:
        raise WireError(f"evaluate reply's '{name}' must be in [0, 1], got {value!r}")
    if not accuracy and value < 0:
        raise WireError(f"evaluate reply's '{name}' must be >= 0, got {value!r}")
    return float(value)


def read_evaluation(metrics: MetricRecord) -> ClientEvaluation:
    """A client's evaluate reply, checked; WireError naming what is wrong."""
    count = metrics.get(MetricKey.NUM_EXAMPLES)
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise WireError(f"evaluate reply's '{MetricKey.NUM_EXAMPLES}' must be an integer "
                        f">= 1, got {count!r}")
    loss = _figure(metrics, EvalKey.LOSS, required=True, accuracy=False)
    accuracy = _figure(metrics, EvalKey.ACCURACY, required=True, accuracy=True)
    loss_p = _figure(metrics, EvalKey.LOSS_PERSONAL, required=False, accuracy=False)
    acc_p = _figure(metrics, EvalKey.ACCURACY_PERSONAL, required=False, accuracy=True)
    if (loss_p is None) != (acc_p is None):
        raise WireError(f"evaluate reply gives one of '{EvalKey.LOSS_PERSONAL}' and "
                        f"'{EvalKey.ACCURACY_PERSONAL}' without the other")
    return ClientEvaluation(num_examples=count, loss=loss or 0.0, accuracy=accuracy or 0.0,
                            loss_personal=loss_p, accuracy_personal=acc_p)
