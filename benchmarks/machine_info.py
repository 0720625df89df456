"""What a benchmark ran on, and under which load: printed in every benchmark's JSON beside
its figures."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    import flwr
    import numpy as np
    import torch

    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "flwr": flwr.__version__, "numpy": np.__version__}


def shown_path(path: Path | None, root: Path) -> str | None:
    """A written file's path for the JSON: relative to the project when inside it."""
    if path is None:
        return None
    return str(path.relative_to(root) if path.is_relative_to(root) else path)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded for the JSON."""
    return [round(x, 2) for x in os.getloadavg()]
