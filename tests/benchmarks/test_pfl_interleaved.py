"""The pfl workload's interleaved timing: fedring and the bare loop round by round, the
checkpoint of each of fedring's rounds written while fedring runs, never during a bare
round, and both ending on the same model."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pfl_workload


@pytest.mark.slow
def test_interleaved_rounds_keep_checkpoints_off_the_bare_rounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import server.store.repository as repository

    torch.set_num_threads(1)
    rounds = 3
    # 1M parameters: above the store's size for writing checkpoints on its thread
    config = pfl_workload.scenario(4, pfl_workload.PFL_SIZES["1m"], rounds)
    sealed: list[tuple[float, float]] = []  # when each checkpoint was sealed
    seal = repository.seal

    def timed_seal(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return seal(*args, **kwargs)
        finally:
            sealed.append((start, time.perf_counter()))

    monkeypatch.setattr(repository, "seal", timed_seal)
    bare_rounds: list[tuple[float, float]] = []

    class Bare(pfl_workload.PflStyleBare):
        def round(self, rnd: int) -> None:
            start = time.perf_counter()
            time.sleep(0.05)  # a checkpoint let through would be sealed meanwhile
            super().round(rnd)
            bare_rounds.append((start, time.perf_counter()))

    bare = Bare(config)
    (wall, cpu), final, paired = pfl_workload.run_fedring(config, str(tmp_path), bare)
    assert paired is not None
    assert len(wall) == len(cpu) == len(paired[0]) == len(paired[1]) == rounds
    assert len(bare_rounds) == rounds
    assert len(sealed) == rounds  # every round's checkpoint was written
    for s0, s1 in sealed:
        for b0, b1 in bare_rounds:
            assert s1 <= b0 or s0 >= b1, "a checkpoint was written during a bare round"
    np.testing.assert_allclose(final, bare.global_w.numpy(), rtol=0, atol=1e-6)
    assert len(pfl_workload.paired_ratios(wall, paired[0])) == rounds - 1


def test_paired_ratios_drop_the_first_round() -> None:
    assert pfl_workload.paired_ratios([9.0, 2.0, 3.0], [1.0, 1.0, 2.0]) == [2.0, 1.5]
    spread = pfl_workload.spread_of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert spread["median"] == 3.0 and spread["min"] == 1.0 and spread["max"] == 5.0
    assert spread["q1"] <= spread["median"] <= spread["q3"]
