"""fedring's SQL run store: runs, rounds, per-update fates and checkpoints.

    from server.store import Store, UpdateRecord

    store = Store("sqlite:///runs/fedring.db")   # or postgresql+psycopg://user:pw@host/db
    run_id = store.create_run(config=scenario, seed=0, name="digits-fedavg")
    store.record_round(run_id, round=1, model_version=1, num_sampled=10, num_replies=9,
                       num_accepted=8, num_rejected=1, metrics={"accuracy": 0.91},
                       wall_s=1.2, updates=[UpdateRecord("c3", "rejected", reason="NaN")])
    store.save_checkpoint(run_id, round=1, model_version=1, params=w, state=opt_state)
    store.finish_run(run_id, status="completed", summary={"accuracy": 0.91})

Modules, each importing only those listed before it: ``models`` (the tables),
``serialize`` (the checkpoint payload format), ``errors``, ``records`` (what the store
accepts and returns), ``values`` (column checks; JSON and non-finite floats), ``engine``
(URL, SQLite/PostgreSQL set-up, schema), ``checkpoints`` (sealed payloads, the background
writer) and ``repository`` (``Store``: queries and writes, re-recording). ``migrations``
upgrades an existing database.
"""

from .engine import absolute_url, mask_url
from .errors import CorruptCheckpoint, StoreError, StoreUnavailable, UnknownRun
from .records import (
    FATES,
    ROUND_STATUSES,
    RUN_STATUSES,
    Checkpoint,
    EvalRecord,
    RoundInfo,
    RunInfo,
    UpdateRecord,
)
from .repository import Store
from .serialize import pack_state, unpack_state

__all__ = [
    "FATES",
    "ROUND_STATUSES",
    "RUN_STATUSES",
    "Checkpoint",
    "CorruptCheckpoint",
    "EvalRecord",
    "RoundInfo",
    "RunInfo",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "UnknownRun",
    "UpdateRecord",
    "absolute_url",
    "mask_url",
    "pack_state",
    "unpack_state",
]
