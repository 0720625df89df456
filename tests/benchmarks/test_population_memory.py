"""benchmarks/population_memory.py --quick: memory and on-demand populations side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_population_memory_quick() -> None:
    out = subprocess.run([sys.executable, "population_memory.py", "--quick"], cwd=BENCH,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["quick"] is True and result["cohort"] == 20
    rows = {(r["mode"], r["population"]): r for r in result["rows"]}
    assert set(rows) == {("memory", 1000), ("on_demand", 1000), ("on_demand", 100000)}
    memory, on_demand = rows["memory", 1000], rows["on_demand", 1000]
    assert not memory["on_demand"] and on_demand["on_demand"]
    assert memory["cohort_samples"] == on_demand["cohort_samples"]  # the same clients' data
    assert on_demand["test_samples"] == 10_000 < memory["test_samples"]
    for row in rows.values():
        assert row["peak_growth"] > 0 and row["build_check_s"] >= 0
