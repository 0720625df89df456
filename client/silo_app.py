"""Old names of the cross-silo message contract, now in ``client.protocol.ring`` (the silo
ClientApp is ``client.silo.app``); kept for the server's round drivers until they import
``client.protocol`` themselves."""

from __future__ import annotations

from client.protocol.ring import CROSS_SILO_ACTION, RingKey, RingMetric, RingRecord, RingStatus

RING_RECORD, RESULT_RECORD, AGGREGATE_RECORD = RingRecord.SPEC, RingRecord.RESULT, \
    RingRecord.AGGREGATE
WEIGHT_BY_KEY, MAX_NORM_KEY, BITS_KEY, FAILED_KEY = RingKey.WEIGHT_BY, RingKey.MAX_NORM, \
    RingKey.BITS, RingKey.FAILED
WEIGHT_METRIC, NORM_METRIC = RingMetric.WEIGHT, RingMetric.NORM
STATUS_OK = RingStatus.OK

__all__ = ["AGGREGATE_RECORD", "BITS_KEY", "CROSS_SILO_ACTION", "FAILED_KEY", "MAX_NORM_KEY",
           "NORM_METRIC", "RESULT_RECORD", "RING_RECORD", "STATUS_OK", "WEIGHT_BY_KEY",
           "WEIGHT_METRIC"]
