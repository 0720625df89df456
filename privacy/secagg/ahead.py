"""Keys advertised a round ahead: the server's pending advertisements between rounds.

In a session with ``SessionParams.advertise_ahead`` each client's last reply
(UNMASK_AND_ADVERTISE) carries a fresh key advertisement for the next round, bound to its
run and round like any ADVERTISE_KEYS (signed in the malicious mode). The next round's
session may use them only when every member of its cohort has one for exactly that round
(:meth:`PendingAdverts.take`): its SETUP then travels with PUBLIC_KEYS (SETUP_AND_KEYS)
and the round needs one exchange fewer. Otherwise, or after a restart (they live in
memory only), the round runs the usual flow. An advertisement is taken once: whatever the
round does, every pending one for that round or an earlier one is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from privacy.secagg import messages as msg
from privacy.secagg.errors import ProtocolError
from privacy.secagg.stages import MsgType


class PendingAdverts:
    """Advertisements for a later round of one protocol run, by node (in memory)."""

    def __init__(self) -> None:
        self._by_node: dict[int, tuple[int, int, bytes]] = {}  # node -> (run, round, msg)

    def __len__(self) -> int:
        return len(self._by_node)

    def offer(self, adverts: Mapping[int, bytes]) -> None:
        """Keep each node's ADVERTISE_KEYS message (one per node: the latest), if its
        header names that node; the rest is checked when a session takes it."""
        for node, payload in adverts.items():
            try:
                h = msg.read_header(payload)
            except ProtocolError:
                continue
            if h.kind is MsgType.ADVERTISE_KEYS and h.client_id == node:
                self._by_node[node] = (h.run_id, h.round_id, bytes(payload))

    def take(self, run_id: int, round_id: int, nodes: Iterable[int]) -> dict[int, bytes] | None:
        """Every node's advertisement for (``run_id``, ``round_id``) when each of ``nodes``
        has one, else None. Either way every advertisement for this round or an earlier
        one is dropped (used once, never later)."""
        wanted = sorted(set(nodes))
        found = {n: self._by_node[n][2] for n in wanted
                 if self._by_node.get(n, (None, None))[:2] == (run_id, round_id)}
        self._by_node = {n: v for n, v in self._by_node.items()
                         if v[0] == run_id and v[1] > round_id}
        return found if wanted and len(found) == len(wanted) else None
