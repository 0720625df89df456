"""Old names of the message contract, now in ``client.protocol``; kept for the server's
round drivers until they import ``client.protocol`` themselves."""

from __future__ import annotations

from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey, MetricKey
from client.protocol.updates import model_record, read_delta

REPLY_KEY = ConfigKey.REPLY
VERSION_KEY = ConfigKey.VERSION
TASK_KEY = ConfigKey.TASK
SEED_KEY = ConfigKey.SEED
NUM_EXAMPLES = MetricKey.NUM_EXAMPLES

__all__ = ["NUM_EXAMPLES", "REPLY_KEY", "SEED_KEY", "TASK_KEY", "VERSION_KEY", "WireError",
           "model_record", "read_delta"]
