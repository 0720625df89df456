"""The malicious-server mode's cost: one SecAgg+ round against the semi-honest round.

Both modes run through :func:`privacy.secagg.run_secagg_round` (server and clients in one
process, byte messages, no transport), on the same inputs, alternated ``--reps`` times so
both see the same machine load; identities are made before timing. Reports each round's
wall time, the server's time per stage, the clients' summed time, and the ratio of the
median malicious round to the median semi-honest one. In one process the clients share
a cache of verified signatures (:func:`privacy.secagg.malicious.verify`); with
``--per-client`` they do not, so each client pays every Ed25519 verification it would
pay on its own machine (k neighbours' advertisements and a quorum of consistency
signatures). Prints one JSON object.

    .venv/bin/python benchmarks/secagg_malicious.py               # N = 100, d = 1M
    .venv/bin/python benchmarks/secagg_malicious.py --quick       # N = 20, d = 10k
    .venv/bin/python benchmarks/secagg_malicious.py --per-client  # no shared cache
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from privacy.secagg import malicious, run_secagg_round
from privacy.secagg.identity import Identity, TrustedKeys

MODES = ("semi_honest", "malicious")


def one_round(inputs: list[np.ndarray], mode: str, identities: dict[int, Identity],
              trusted: TrustedKeys) -> dict[str, object]:
    gc.collect()
    seconds: dict[int, float] = {}
    started = time.perf_counter()
    total, server = run_secagg_round(inputs, security=mode, identities=identities,
                                     trusted=trusted, client_seconds=seconds)
    wall = time.perf_counter() - started
    if total is None:
        raise RuntimeError(f"{mode} round aborted: {server.abort_reason}")
    return {"wall_s": round(wall, 3), "clients_s": round(sum(seconds.values()), 3),
            "server_s": {s.name.lower(): round(v, 3) for s, v in server.seconds.items()},
            "k": server.config.k, "t": server.config.t}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--d", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="N = 20, d = 10k")
    parser.add_argument("--per-client", action="store_true",
                        help="no signature cache shared by the clients")
    args = parser.parse_args()
    if args.per_client:
        malicious.verify = lambda trusted, public, signature, message: trusted.verify(
            public, signature, message)
    n, d = (20, 10_000) if args.quick else (args.n, args.d)
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 1 << 32, d, dtype=np.uint64).astype(np.uint32) for _ in range(n)]
    identities = {c: Identity.generate() for c in range(1, n + 1)}
    trusted = TrustedKeys(i.public for i in identities.values())
    rows: dict[str, list[dict[str, object]]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            rows[mode].append(one_round(inputs, mode, identities, trusted))
            print(f"rep {rep} {mode}: {rows[mode][-1]['wall_s']} s", file=sys.stderr)
    median = {m: statistics.median(r["wall_s"] for r in rows[m]) for m in MODES}  # type: ignore[misc]
    print(json.dumps({
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}, "
                   f"Python {platform.python_version()}",
        "n": n, "d": d, "reps": args.reps, "shared_signature_cache": not args.per_client,
        "rounds": rows, "median_wall_s": median,
        "ratio": round(median["malicious"] / median["semi_honest"], 3),
        "target_ratio": 1.3,
    }, indent=1))


if __name__ == "__main__":
    main()
