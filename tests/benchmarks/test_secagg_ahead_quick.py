"""The keys-advertised-ahead benchmark runs in its quick mode and ends with a JSON line."""

from __future__ import annotations

import math

from test_benchmarks_quick import run_quick


def test_secagg_ahead_quick() -> None:
    result = run_quick("secagg_ahead.py", timeout=180)
    assert result["benchmark"] == "secagg_ahead" and result["quick"] is True
    assert len(result["loadavg_before"]) == 3 and len(result["loadavg_after"]) == 3
    [row] = result["results"]
    assert (row["N"], row["d"], row["k"]) == (6, 1000, 3)
    for mode in ("semi_honest", "malicious"):
        walls = row[mode]["round_s"]
        assert len(walls["usual"]) == len(walls["ahead"]) == result["reps"] == 2
        assert all(w > 0 for flow in walls.values() for w in flow)
        assert math.isfinite(row[mode]["ahead_over_usual"])
