"""A node's SecAgg+ identity from its node config: its Ed25519 key and the keys it trusts.

A deployed SuperNode names two files, which ``fedring certs`` writes:
``--node-config 'secagg-identity-key="node-0.secagg"
secagg-trusted-keys="secagg-trusted-keys.txt"'`` (one line).
A simulated run's PKI (``simulations.secagg_pki``) gives the same material in memory, as
the files' text under the engine's keys ``fedring.secagg-identity-pem`` and
``fedring.secagg-trusted-text``. Either source gives both or neither; a node whose own key
is not in its trusted set is refused, since its peers, holding the same set, would refuse it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from client.protocol.keys import NodeConfigKey
from privacy.secagg.identity import Identity, TrustedKeys

IDENTITY, TRUSTED = NodeConfigKey.SECAGG_IDENTITY_KEY, NodeConfigKey.SECAGG_TRUSTED_KEYS
INLINE = {IDENTITY: NodeConfigKey.SECAGG_IDENTITY_PEM,
          TRUSTED: NodeConfigKey.SECAGG_TRUSTED_TEXT}


def _text(node_config: Mapping[str, Any], key: str) -> tuple[str, str] | None:
    """(where it came from, the text) of ``key``'s file, or of its in-memory twin."""
    inline, path = node_config.get(INLINE[key]), node_config.get(key)
    if inline is not None and path is not None:
        raise ValueError(f"node config sets both '{key}' and '{INLINE[key]}': keep one")
    if inline is not None:
        if not isinstance(inline, str):
            raise ValueError(f"node config '{INLINE[key]}' must be a string")
        return f"node config '{INLINE[key]}'", inline
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ValueError(f"node config '{key}' must be a file path in quotes "
                         f"(e.g. {key}=\"/etc/fedring/node-0.secagg\"), got {path!r}")
    try:
        return f"node config '{key}' ({path})", Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"node config '{key}': cannot read {path}: {reason}") from None


def secagg_identity(node_config: Mapping[str, Any]) -> tuple[Identity, TrustedKeys] | None:
    """The node's identity and trusted keys, or None when its node config names neither;
    ValueError naming the key when one is missing, unreadable or malformed."""
    identity_text, trusted_text = _text(node_config, IDENTITY), _text(node_config, TRUSTED)
    if identity_text is None and trusted_text is None:
        return None
    if identity_text is None or trusted_text is None:
        given, missing = (TRUSTED, IDENTITY) if identity_text is None else (IDENTITY, TRUSTED)
        raise ValueError(f"node config sets '{given}' but not '{missing}': a SecAgg+ "
                         f"identity needs both (fedring certs writes node-I.secagg and "
                         f"secagg-trusted-keys.txt)")
    source, text = identity_text
    identity = Identity.from_pem(text.encode(), source=source)
    source, text = trusted_text
    trusted = TrustedKeys.from_text(text, source=source)
    if identity.public not in trusted:
        raise ValueError(f"{identity_text[0]}: this node's identity key "
                         f"{identity.public.hex()} is not in {source}, so no peer would "
                         f"accept it: give every node the trusted-keys file of its federation")
    return identity, trusted
