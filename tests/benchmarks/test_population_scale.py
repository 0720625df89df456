"""benchmarks/population_scale.py runs in its quick mode and ends with a well-formed JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_population_scale_quick() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "population_scale.py"),
                          "--quick"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "population_scale" and result["quick"] is True
    rows = result["rows"]
    assert [r["population"] for r in rows] == [2_000, 200_000]
    for row in rows:
        assert row["peak_rss_bytes"] > 0 and row["first_round_s"] > 0
        assert len(row["round_s"]) == result["rounds"] - 1 and row["cohort"] == 20
    assert result["largest_peak_rss_gb"] > 0 and "plot" not in result
