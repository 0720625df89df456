"""Peak memory of loading FedProx Synthetic for large populations, per client count.

Each count loads ``synthetic`` with ``num_users`` = the client count (one user per client,
the natural partition) in a fresh interpreter, which reports its resident set before the
load and its peak (``VmHWM``: unlike ``ru_maxrss`` it is not inherited from the parent
that spawned it) after it, beside the bytes of the loaded arrays. The
loader's target: the peak growth under twice the data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from harness import log


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(users: int) -> None:
    """In a fresh interpreter: load, partition, print the figures."""
    from simulations.datasets import load_dataset
    from simulations.partitioners import partition

    before = _rss_bytes()
    ds = load_dataset("synthetic", seed=0, test_fraction=0.2, alpha=1.0, beta=1.0,
                      num_users=users)
    parts = partition(ds.y_train, users, kind="natural", seed=0, groups=ds.groups)
    peak = _peak_rss_bytes()
    data = sum(a.nbytes for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.groups))
    print(json.dumps({"users": users, "samples": len(ds.y_train) + len(ds.y_test),
                      "partitions": len(parts), "data_bytes": data, "rss_before": before,
                      "peak_rss": peak}), flush=True)


def measure(counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for users in counts:
        out = subprocess.run([sys.executable, __file__, str(users)], capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise RuntimeError(f"synthetic load of {users} users failed:\n{out.stderr[-2000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["peak_growth_over_data"] = round((row["peak_rss"] - row["rss_before"])
                                             / row["data_bytes"], 3)
        rows.append(row)
        log(f"synthetic, {users:>6} users: {row['data_bytes'] / 2**20:8.1f} MiB of data, peak "
            f"RSS {row['peak_rss'] / 2**20:8.1f} MiB ({row['rss_before'] / 2**20:.1f} before "
            f"loading): growth {row['peak_growth_over_data']}x the data")
    return rows


if __name__ == "__main__":
    child(int(sys.argv[1]))
