"""Protocol stages (Bonawitz et al. naming) and wire message types."""

from __future__ import annotations

from enum import IntEnum


class Stage(IntEnum):
    """Stages of one round; a client's reply to a server message belongs to the next stage."""

    SETUP = 0
    ADVERTISE_KEYS = 1
    SHARE_KEYS = 2
    MASKED_INPUT = 3
    CONSISTENCY_CHECK = 4  # the malicious mode only: survivors sign the survivor set
    UNMASKING = 5


class MsgType(IntEnum):
    """Type byte of every wire message (server -> client and client -> server)."""

    SETUP = 1  # server -> client: round configuration
    ADVERTISE_KEYS = 2  # client -> server: two X25519 public keys, commitment to b_u
    PUBLIC_KEYS = 3  # server -> client: the neighbours' public keys
    SHARE_KEYS = 4  # client -> server: encrypted shares, one per neighbour
    FORWARDED_SHARES = 5  # server -> client: the shares addressed to it
    MASKED_INPUT = 6  # client -> server: masked vector
    UNMASK_REQUEST = 7  # server -> client: surviving and dropped neighbours
    UNMASK_RESPONSE = 8  # client -> server: the requested shares
    CONSISTENCY_CHECK = 9  # server -> client: the survivor set (malicious mode)
    CONSISTENCY_SIGNATURE = 10  # client -> server: its signature of that set
    # the merged flow (SessionParams.flow "merged"): one exchange fewer
    SHARES_AND_INPUT = 11  # client -> server: SHARE_KEYS and the masked vector, in one
    SHARES_AND_CHECK = 12  # server -> client: its shares, then CONSISTENCY_CHECK
    SHARES_AND_UNMASK = 13  # server -> client: its shares, then UNMASK_REQUEST
    # keys advertised a round ahead (SessionParams.keys_ahead / advertise_ahead)
    SETUP_AND_KEYS = 14  # server -> client: SETUP, then PUBLIC_KEYS of the ahead keys
    UNMASK_AND_ADVERTISE = 15  # client -> server: UNMASK_RESPONSE, then the next round's
    #                            ADVERTISE_KEYS
    # a pre-signed survivor set (SessionParams.presign, malicious mode, keys ahead)
    PRESIGNED_INPUT = 16  # client -> server: its consistency signature on the whole
    #                       advertisement list, then SHARES_AND_INPUT's body


#: The client messages the server accepts while a stage is open.
REPLY_TYPE: dict[Stage, tuple[MsgType, ...]] = {
    Stage.ADVERTISE_KEYS: (MsgType.ADVERTISE_KEYS,),
    Stage.SHARE_KEYS: (MsgType.SHARE_KEYS, MsgType.SHARES_AND_INPUT, MsgType.PRESIGNED_INPUT),
    Stage.MASKED_INPUT: (MsgType.MASKED_INPUT,),
    Stage.CONSISTENCY_CHECK: (MsgType.CONSISTENCY_SIGNATURE,),
    Stage.UNMASKING: (MsgType.UNMASK_RESPONSE, MsgType.UNMASK_AND_ADVERTISE),
}
