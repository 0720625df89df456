"""The compressed-upload request a server puts in the train config.

A fedring server that compresses uploads puts ``ConfigKey.COMPRESSION`` in the train
config: the JSON of its ``[compression]`` section plus "run", a number naming the run (it
seeds the shared pattern and binds the residual). The client then answers with the arrays
of ``aggregation.compression.RoundCodec.encode`` in a ``RecordName.COMPRESSED``
ArrayRecord instead of the dense delta. Under secure aggregation the same request rides
in the secure round's SETUP record (top-k on a shared pattern only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from flwr.app import ConfigRecord

from aggregation.compression import CompressionConfig, RoundCodec
from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey


@dataclass(frozen=True)
class CompressionRequest:
    """What the server asks for: its ``[compression]`` settings within one run."""

    config: CompressionConfig
    run: int

    def to_json(self) -> str:
        return json.dumps({**asdict(self.config), "run": self.run}, sort_keys=True)

    @classmethod
    def from_config(cls, config: ConfigRecord) -> CompressionRequest | None:
        """The request in a train config, None when there is none."""
        raw = config.get(ConfigKey.COMPRESSION)
        if raw is None:
            return None
        try:
            fields = json.loads(str(raw))
            run = fields.pop("run")
            if isinstance(run, bool) or not isinstance(run, int) or run < 0:
                raise ValueError(f"run must be a non-negative integer, got {run!r}")
            return cls(CompressionConfig(**fields), run)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise WireError(f"bad '{ConfigKey.COMPRESSION}' entry: {exc}") from exc

    def codec(self, dim: int, rnd: int) -> RoundCodec:
        return RoundCodec.for_round(self.config, dim, run=self.run, rnd=rnd)
