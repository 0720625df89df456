"""The alpha-beta model of ``benchmarks/allreduce.py``: its fit recovers a known machine and
is least squares on the relative error."""

from __future__ import annotations

import allreduce as bench
import numpy as np
import pytest

CORES = 2
TRUE_GAMMAS = (1.4, 0.8)


def truth(algorithm: str) -> dict[str, float]:
    k = bench.ALGORITHMS.index(algorithm) + 1
    return {"alpha_s": 40e-6 * k, "beta_s_per_byte": 1 / (1.5e9 + 1e8 * k),
            "sharing_gamma_alpha": TRUE_GAMMAS[0], "sharing_gamma_beta": TRUE_GAMMAS[1]}


def cells(noise: float = 0.0) -> list[dict[str, object]]:
    """Every algorithm at n = 2, 4, 8 and 1, 16, 64 MiB, timed by the true model, with a
    fixed pattern of relative errors up to ``noise``."""
    wobble = np.random.default_rng(0).uniform(-noise, noise, 9 * len(bench.ALGORITHMS))
    rows = []
    for algorithm in bench.ALGORITHMS:
        for n in (2, 4, 8):
            for size in (1 << 20, 16 << 20, 64 << 20):
                t = bench.predict(truth(algorithm), algorithm, n, size, CORES)
                rows.append({"algorithm": algorithm, "n": n, "size_bytes": size,
                             "best_s": t * (1 + wobble[len(rows)])})
    return rows


def test_the_fit_recovers_the_machine_that_made_the_times():
    rows = cells()
    assert bench.fit_sharing(rows, CORES) == TRUE_GAMMAS
    for algorithm in bench.ALGORITHMS:
        model = bench.fit_alpha_beta(rows, algorithm, CORES, TRUE_GAMMAS)
        assert model["alpha_s"] == pytest.approx(truth(algorithm)["alpha_s"], rel=1e-4)
        assert model["beta_s_per_byte"] == pytest.approx(truth(algorithm)["beta_s_per_byte"],
                                                         rel=1e-4)
        assert model["max_rel_error"] < 1e-4
    # one rank per core or fewer: no slow-down, whatever the exponents
    model = truth("ring")
    assert bench.predict(model, "ring", 2, 1 << 20, CORES) == pytest.approx(
        model["alpha_s"] * 2 + model["beta_s_per_byte"] * (1 << 20))


def test_the_fit_is_least_squares_on_the_relative_error():
    rows = cells(noise=0.1)
    for algorithm in bench.ALGORITHMS:
        model = bench.fit_alpha_beta(rows, algorithm, CORES, TRUE_GAMMAS)
        pts = [r for r in rows if r["algorithm"] == algorithm]
        a = np.array([bench.design(algorithm, r["n"], r["size_bytes"], CORES, TRUE_GAMMAS)
                      for r in pts]) / np.array([r["best_s"] for r in pts])[:, None]
        coef = np.array([model["alpha_s"], model["beta_s_per_byte"]])
        rel = a @ coef - 1
        assert model["sum_sq_rel_error"] == pytest.approx((rel ** 2).sum(), rel=1e-9)
        assert model["max_rel_error"] == pytest.approx(np.abs(rel).max(), rel=1e-9)
        # the normal equations: the errors are orthogonal to both (weighted) terms
        np.testing.assert_allclose(a.T @ rel, 0.0, atol=1e-9 * np.abs(a).sum())
        assert np.abs(rel).max() <= 0.1 * 1.2  # near the true model, within 10% of all
