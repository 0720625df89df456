"""What a benchmark ran on: printed in every benchmark's JSON beside its figures."""

from __future__ import annotations

import os
import platform
from typing import Any


def machine() -> dict[str, Any]:
    import flwr
    import numpy as np
    import torch

    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "flwr": flwr.__version__, "numpy": np.__version__}
