"""Record names and the keys of the train config, reply metrics and node config.

Models travel in Flower's convention (an ArrayRecord of per-layer Arrays under
"arrays"), so stock Flower ClientApps and strategies understand them. A fedring client
asked for a delta (config ``ConfigKey.REPLY`` = ``REPLY_DELTA``) answers with one flat
float32 Array under "delta" (or, when the server asks, "compressed"); otherwise it
answers like any Flower client, with full weights under "arrays" and "num-examples" in
its MetricRecord.
"""

from __future__ import annotations

from client.protocol.names import Names

REPLY_DELTA = "delta"  # the value of ConfigKey.REPLY that asks for a delta


class RecordName(Names):
    """Records of a message's RecordDict."""

    ARRAYS = "arrays"  # the model: one Array per named tensor (Flower's convention)
    CONFIG = "config"
    METRICS = "metrics"
    DELTA = "delta"  # a fedring reply: the flat float32 delta, one Array under "delta"
    COMPRESSED = "compressed"  # a compressed reply: the arrays of RoundCodec.encode


class ConfigKey(Names):
    """Keys of the train message's ConfigRecord."""

    SERVER_ROUND = "server-round"  # Flower's round number
    VERSION = "fedring.version"  # the server model version sent
    REPLY = "fedring.reply"  # REPLY_DELTA, or absent (full weights)
    TASK = "fedring.task"  # JSON of the data/model/train sections
    SEED = "fedring.seed"  # the run seed
    COMPRESSION = "fedring.compression"  # JSON of [compression] and "run" (compression.py)
    LOCAL_BUFFERS = "fedring.local-buffers"  # True: FedBN, batch norm stays on each client
    CENTER = "fedring.center"  # client-side centered clipping: the centre, float32 LE bytes
    CLIP_RADIUS = "fedring.clip-radius"  # and the radius to clip to around it (train.py)
    CLIENT_MOMENTUM = "fedring.client-momentum"  # beta: send momentum, not the delta
    DP_SGD_PRIOR_ROUNDS = "fedring.dp-sgd-prior-rounds"  # resumed run: DP-SGD rounds before


class MetricKey(Names):
    """Keys of a train reply's MetricRecord."""

    NUM_EXAMPLES = "num-examples"  # Flower's weighting key
    BASE_VERSION = "fedring.base-version"  # the model version the client trained from
    PARTITION = "fedring.partition-id"


class NodeConfigKey(Names):
    """Node config keys a fedring ClientApp reads (set by the engine or the operator)."""

    PARTITION_ID = "partition-id"  # Flower's convention: the node's data partition
    NUM_PARTITIONS = "num-partitions"  # and the number of partitions
    IN_PROCESS = "fedring.in-process"  # replies stay in this process (in-process engine)
    MASK_THREADS = "mask-threads"  # threads a secure client quantizes and masks with
    SECAGG_IDENTITY_KEY = "secagg-identity-key"  # path: the node's Ed25519 identity (PEM)
    SECAGG_TRUSTED_KEYS = "secagg-trusted-keys"  # path: the peers' identity keys, hex lines
    # A simulated run's PKI hands the same material over in memory (client.secagg_identity)
    SECAGG_IDENTITY_PEM = "fedring.secagg-identity-pem"  # the identity key's PEM text
    SECAGG_TRUSTED_TEXT = "fedring.secagg-trusted-text"  # the trusted-keys file's text
