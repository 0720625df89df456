"""Secure sync rounds with keys advertised a round ahead against the usual flow, in process.

Both run ``server.secagg_session`` with ``client.secure_client`` on fedring's in-process
engine (synthetic clients of ``benchmarks/secagg.py``: a fixed float32 delta of d
coordinates), at k = 3, in each security mode. "usual": ``secagg.advertise_ahead =
false`` (3 exchanges semi-honest, 4 malicious); "ahead": the round after one that
advertised the cohort's keys (2 and 2: the malicious mode pre-signs the survivor set,
``secagg.presign``, the default; 2 and 3 without it). The two alternate within each repetition, so
they see the same load. In process an exchange costs no transport, so this measures what
the flow costs in computation (the next round's keys made during this one); a
deployment saves an exchange's round trip besides. Prints one JSON line: per mode and
flow the round wall times, their medians and ahead / usual; the sums must be equal.
Figures are ratios measured on whatever machine runs it (note its load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from flwr.app import ConfigRecord
from secagg import CLIP, Timed, fedring_client_app, make_inputs, make_pki, model

from client.protocol.keys import ConfigKey
from privacy.secagg.ahead import PendingAdverts
from server.secagg_config import SecAggScenarioConfig
from server.secagg_session import SecAggSession, TrainStart
from simulations.inprocess import InProcessGrid

MODES = ("semi_honest", "malicious")


class Rounds:
    """Secure rounds of one run over one in-process Grid per mode."""

    def __init__(self, n: int, d: int) -> None:
        app = Timed(fedring_client_app(make_inputs(n, d)))
        self.grids = {"semi_honest": InProcessGrid(app, n),
                      "malicious": InProcessGrid(app, n, pki=make_pki(n))}
        self.nodes, self.d, self.rnd = list(range(1, n + 1)), d, 0
        self.arrays = model(d)[1]

    def one(self, security: str, pending: PendingAdverts | None) -> tuple[float, Any]:
        """One round: (wall seconds, outcome); ``pending`` None: the usual flow."""
        self.rnd += 1
        settings = SecAggScenarioConfig(enabled=True, neighbors=3, clip_range=CLIP,
                                        security=security, advertise_ahead=pending is not None)
        session = SecAggSession(self.grids[security], settings, "examples", 1, 3600.0, 0.001)
        config = ConfigRecord({ConfigKey.SEED: 0, "server-round": self.rnd})
        started = time.perf_counter()
        out = session.run(self.nodes, self.rnd, TrainStart(self.arrays, config, self.d),
                          pending=pending)
        wall = time.perf_counter() - started
        if out.status != "completed":
            raise RuntimeError(f"secure round aborted: {out.abort_reason}")
        return wall, out


def measure(n: int, d: int, reps: int) -> dict[str, Any]:
    rounds = Rounds(n, d)
    row: dict[str, Any] = {"N": n, "d": d, "k": 3}
    for security in MODES:
        rounds.one(security, PendingAdverts())  # untimed: buffers allocated, caches warm
        walls: dict[str, list[float]] = {"usual": [], "ahead": []}
        sums = {}
        for rep in range(reps):
            for flow in ("usual", "ahead") if rep % 2 == 0 else ("ahead", "usual"):
                pending = None
                if flow == "ahead":
                    pending = PendingAdverts()
                    rounds.one(security, pending)  # advertises the next round's keys
                wall, out = rounds.one(security, pending)
                if flow == "ahead" and len(pending or ()) != n:  # and this one's again
                    raise RuntimeError("the ahead round did not advertise every client")
                walls[flow].append(wall)
                sums[flow] = out.weighted_sum
        if not np.array_equal(sums["usual"], sums["ahead"]):
            raise RuntimeError("the two flows gave different sums")
        median = {flow: statistics.median(w) for flow, w in walls.items()}
        row[security] = {"round_s": walls, "median_s": median,
                         "ahead_over_usual": median["ahead"] / median["usual"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 6, d = 1000, 2 repetitions")
    parser.add_argument("--sizes", default="100x1000000", help="e.g. '10x100000,100x1000000'")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each flow")
    args = parser.parse_args()
    sizes = [(6, 1000)] if args.quick else [
        tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    reps = 2 if args.quick else args.reps
    before = os.getloadavg()
    results = [measure(n, d, reps) for n, d in sizes]
    print(json.dumps({"benchmark": "secagg_ahead", "quick": args.quick,
                      "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                      "loadavg_before": before, "loadavg_after": os.getloadavg(),
                      "reps": reps, "results": results}))


if __name__ == "__main__":
    main()
