"""The ring tests start their process groups with ``benchmarks/ring_launch.py``.

It is imported as the top-level module ``ring_launch`` (as ``benchmarks/allreduce.py``
does): ``benchmarks`` cannot be a package name, because several installed distributions
ship a top-level ``benchmarks`` package. Spawned ranks inherit this ``sys.path``.
"""

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
