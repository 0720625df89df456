"""What every process of a silo runs under ``torchrun`` (``fedring silo`` starts it).

It binds the scenario task to ``client.silo.job.run_silo``: rank 0 serves the silo ClientApp
to its SuperNode, the other ranks train with it data-parallel.
"""

from __future__ import annotations

import sys

from client.silo.job import run_silo
from simulations.apps import spec_from_run_config
from simulations.module_task import make_task


def main(argv: list[str] | None = None) -> int:
    return run_silo(argv, make_task, spec_from_run_config)


if __name__ == "__main__":
    sys.exit(main())
