"""SecAgg+ secure aggregation (Bell et al. 2020; k = n-1 is SecAgg, Bonawitz et al. 2017).

Two transport-agnostic state machines exchanging byte messages:
:class:`SecAggServer` (one round, server side) and :class:`SecAggClient`, plus
fixed-point quantization (:mod:`privacy.secagg.quantize`) and an in-process
driver :func:`run_secagg_round`. ``SessionParams.security`` picks the threat model:
"semi_honest" (the default) or "malicious" (:mod:`privacy.secagg.malicious`: signed key
advertisements with :mod:`privacy.secagg.identity`, a graph derived from them, a
consistency check before unmasking). ``SessionParams.flow`` picks the message flow:
"merged" (the default: the masked input rides on the share-keys reply, one exchange
fewer) or "classic".
"""

from privacy.secagg.client import SecAggClient
from privacy.secagg.driver import run_secagg_round
from privacy.secagg.errors import Aborted, ProtocolError
from privacy.secagg.params import (
    CLASSIC,
    FLOWS,
    MALICIOUS,
    MERGED,
    SECURITY_MODES,
    SEMI_HONEST,
    SessionParams,
    default_k,
    default_threshold,
)
from privacy.secagg.policy import DEFAULT_POLICY, MECHANICS_ONLY, SecAggPolicy
from privacy.secagg.quantize import (
    check_headroom,
    dequantize,
    dequantize_weighted,
    max_scale,
    quantize,
    quantize_weighted,
)
from privacy.secagg.server import SecAggServer, Status
from privacy.secagg.stages import Stage

__all__ = [
    "CLASSIC",
    "DEFAULT_POLICY",
    "FLOWS",
    "MALICIOUS",
    "MECHANICS_ONLY",
    "MERGED",
    "SECURITY_MODES",
    "SEMI_HONEST",
    "Aborted",
    "ProtocolError",
    "SecAggClient",
    "SecAggPolicy",
    "SecAggServer",
    "SessionParams",
    "Stage",
    "Status",
    "check_headroom",
    "default_k",
    "default_threshold",
    "dequantize",
    "dequantize_weighted",
    "max_scale",
    "quantize",
    "quantize_weighted",
    "run_secagg_round",
]
