"""Data-parallel training inside a silo: two processes under torchrun follow one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from silo_helpers import check_ddp_results, run_ddp_worker

pytestmark = pytest.mark.slow


def test_ddp_over_two_processes_gives_the_single_process_model(tmp_path: Path) -> None:
    check_ddp_results(run_ddp_worker(tmp_path / "ddp.json", 2, "cpu"), tolerance=1e-5)
