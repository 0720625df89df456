"""The allreduce algorithms by name, importable without torch (configs and ring specs check
names; only running a collective needs torch)."""

from __future__ import annotations

from typing import Literal

Algorithm = Literal["ring", "master", "tree", "halving_doubling", "all_to_all", "round_robin",
                    "native"]

ALGORITHMS: tuple[str, ...] = (
    "ring", "master", "tree", "halving_doubling", "all_to_all", "round_robin", "native")
