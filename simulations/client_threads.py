"""How many intra-op threads the in-process engine gives a client's training.

torch runs an operation on several threads only when its tensors are large (its grain
size is 32,768 elements); for a small model every operation is below it, and the extra
threads only wait on each other at each operation's barrier. On a busy machine that wait
grows with every time slice another process takes (a round of 1,000 logistic-regression
clients ran 10 to 30 times slower beside one CPU-bound process). So a client whose model
has fewer than :data:`SMALL_MODEL` parameters trains on one thread; a larger one keeps
the process's setting. This is ``engine.threads = "auto"``, the default; ``0`` keeps the
process's setting for every client. One thread also makes a small model's result the
same on machines with any number of cores.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from flwr.app import ArrayRecord, RecordDict

#: Models below this many parameters train on one thread (three grain sizes of torch's
#: parallel loops: below it no layer's operation is split between threads, or barely).
SMALL_MODEL = 100_000


def model_size(content: RecordDict) -> int | None:
    """Parameters in a message's model (its ``arrays`` record), None if it carries none."""
    arrays = content.get("arrays")
    if not isinstance(arrays, ArrayRecord):
        return None
    return sum(math.prod(array.shape) for array in arrays.values())


def client_threads(content: RecordDict, setting: int | str = 0) -> int | None:
    """The intra-op threads for a client handling ``content`` under ``engine.threads``:
    a number > 0 as it is; ``"auto"``: 1 for a model under :data:`SMALL_MODEL`
    parameters; else None (leave the process's setting)."""
    if setting == "auto":
        size = model_size(content)
        return 1 if size is not None and size < SMALL_MODEL else None
    return setting if isinstance(setting, int) and setting > 0 else None


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block on ``threads`` intra-op threads (None: unchanged), then restore the
    process's setting."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
