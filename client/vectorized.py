"""The in-process engine's cohort hook: train a round's clients first, reply one by one.

The in-process Grid hands this hook every message it is about to deliver at once. Train
messages that carry the same global model (the very record the server sent to all) for
the same task form a cohort, trained before any reply is made: with ``engine.vectorize``
as one batched computation (``client.batched_training``), else back to back, one client after the
other, exactly as the ClientApp would train each (the same code, seeds and start, so the
same result to the bit). Back to back, training is not interleaved with message
handling, which leaves torch's working set in the caches: measured here, a 10k-parameter
client's training took 0.32 ms between messages and 0.20 ms back to back. Each result
waits on its worker under the message's id, and the ClientApp, when it handles that
message, takes it instead of training again. Everything after training (local DP,
simulated attacks, compression, secure masking, the reply) runs per client as before.
Back to back takes the cohorts vectorizing could take (``client.batched_training.unsupported``).
A cohort that can be neither is left to the ClientApp; one that cannot be vectorized
when asked to be says why in one log line per reason. Models of ``IN_PLACE_MIN_DIM``
parameters or more train one by one when not vectorized: their training dwarfs the
message handling, and the ClientApp then makes their delta in place.

A cohort is cut into batches whose stacked parameters (or held results) fit
``STACK_BUDGET``, and a batch is trained only when the ClientApp first asks for one of its
results: replies are produced batch by batch, so the results held at once are one
batch's, not the cohort's. ``"auto"`` vectorizes a cohort only when it fits one batch and
its model has at most ``AUTO_MAX_DIM`` parameters: past that, one client at a time is
faster here even for a cohort of two.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from client import app
from client.app import _WORKERS, FedringClient, record_of, training_seed
from client.batched_training import CohortClient, stack_data, train_cohort, unsupported
from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey, NodeConfigKey, RecordName

log = logging.getLogger("fedring")
# Bytes of one stacked tensor (a parameter vector per client of a batch): batches of
# larger models are cut to fit, as stacked tensors past the cache and the allocator's
# reuse threshold cost more in page faults and memory traffic than they save (measured
# here: a 1M-parameter MLP is fastest with 2-4 clients per batch, a 10k one with all).
STACK_BUDGET = 8 * 2**20
# Parameters per client above which "auto" trains one by one whatever the cohort's size:
# measured here (one torch thread, an MLP on digits-sized clients, vectorized time over
# back to back for the same clients), 0.45-0.53 at 10k-19k parameters, 0.84 at 29k,
# 0.91-0.99 at 38k, 1.25 at 85k and 2.1 at 1M (batches of 2): a small cohort of a large
# model fits one batch and is still slower vectorized.
AUTO_MAX_DIM = 1 << 15
MODES = ("auto", True, False)  # False: back to back (small models), never vectorized
# Messages in one hand-over from which the process's objects are moved out of the cyclic
# collector's way once (gc.freeze, after one collection): a round of thousands of clients
# keeps tens of thousands of objects alive, and each full collection then also traverses
# everything the process already held (torch, Flower, the data: about 400,000 objects),
# measured here at 41 us a client with 10,000 clients a round, 3 us once frozen.
FREEZE_MIN_MESSAGES = 1000


Result = tuple[np.ndarray, float]  # a client's trained flat parameters and mean loss


class CohortResults:
    """Results by message id, each batch trained when one of its results is first taken
    (``pop``, as the ClientApp takes them); a batch that fails leaves its clients to
    train one by one."""

    def __init__(self, on_error: Callable[[Exception], None]) -> None:
        self._batch_of: dict[str, tuple[list[str], Callable[[], list[Result]]]] = {}
        self._ready: dict[str, Result] = {}
        self._on_error = on_error

    def add(self, ids: list[str], train: Callable[[], list[Result]]) -> None:
        for msg_id in ids:
            self._batch_of[msg_id] = (ids, train)

    def clear(self) -> None:
        self._batch_of.clear()
        self._ready.clear()

    def pop(self, msg_id: str, default: Result | None = None) -> Result | None:
        if msg_id not in self._ready:
            batch = self._batch_of.get(msg_id)
            if batch is None:
                return default
            ids, train = batch
            for other in ids:
                self._batch_of.pop(other, None)
            self._ready.clear()  # an earlier batch's results nobody took are dropped
            try:
                self._ready.update(zip(ids, train(), strict=True))
            except Exception as exc:  # never fail a client here: it trains alone instead
                self._on_error(exc)
                return default
        return self._ready.pop(msg_id, default)


class CohortHook:
    """``hook(batch)`` with batch the (message, context) pairs about to be delivered;
    ``mode``: ``engine.vectorize``."""

    def __init__(self, client: FedringClient, mode: Any, *,
                 stack_budget: int = STACK_BUDGET) -> None:
        if not any(mode is m or mode == m for m in MODES if type(m) is type(mode)):
            raise ValueError(f"vectorize mode must be 'auto', True or False, got {mode!r}")
        self._client = client
        self._mode = mode
        self._budget = stack_budget
        self._stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._stack_owner: Any = None
        self._said: set[str] = set()
        self.trained = 0  # clients trained vectorized so far (for tests and benchmarks)
        self.back_to_back = 0  # clients trained back to back so far
        self.froze = False  # whether this hook moved the process's objects (gc.freeze)

    def __call__(self, batch: list[tuple[Message, Context]]) -> None:
        if not self.froze and len(batch) >= FREEZE_MIN_MESSAGES:
            gc.collect()  # garbage is not frozen with the rest
            gc.freeze()
            self.froze = True
        for worker in _WORKERS.values():  # results nobody took (a cohort cut short) go
            worker.pretrained.clear()
        groups: dict[tuple[Any, ...], list[tuple[Message, Context]]] = {}
        for msg, context in batch:
            if (msg.metadata.message_type.split(".")[0] != "train"
                    or not context.node_config.get(NodeConfigKey.IN_PROCESS)):
                continue
            try:
                config = record_of(msg.content, ConfigRecord, RecordName.CONFIG)
                record = record_of(msg.content, ArrayRecord, RecordName.ARRAYS)
            except WireError:
                continue  # no model in it (a secure-aggregation stage): nothing to train
            key = (config.get(ConfigKey.TASK), id(record), config.get(ConfigKey.SERVER_ROUND))
            groups.setdefault(key, []).append((msg, context))
        for members in groups.values():
            try:
                self._train(members)
            except WireError:
                pass  # the ClientApp meets the same problem and replies with it
            except Exception as exc:  # never fail a round here: the clients train one by one
                self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self._say(f"training a cohort failed ({type(exc).__name__}: {exc}); the ClientApp "
                  "trains each of its clients", warn=True)

    def _say(self, text: str, warn: bool) -> None:
        if text not in self._said:
            self._said.add(text)
            (log.warning if warn else log.info)("%s", text)

    def _train(self, members: list[tuple[Message, Context]]) -> None:
        client = self._client
        msg0, ctx0 = members[0]
        config = record_of(msg0.content, ConfigRecord, RecordName.CONFIG)
        record = record_of(msg0.content, ArrayRecord, RecordName.ARRAYS)
        worker = client._worker(config, ctx0)
        if not isinstance(worker.pretrained, CohortResults):
            worker.pretrained = CohortResults(self._failed)
        if self._mode is not True and len(members) < 2:
            return
        cfg, layout = worker.task.train_config, worker.model.layout
        reason = unsupported(worker.model.module, cfg, worker.task)
        if reason is not None:
            if self._mode is not False:
                self._say(f"engine.vectorize: training clients one by one: {reason}",
                          warn=self._mode is True)
            return
        chunk = max(1, self._budget // (4 * layout.dim))
        vectorize = self._mode is True or (self._mode == "auto" and chunk >= len(members)
                                           and layout.dim <= AUTO_MAX_DIM)
        if self._mode == "auto" and not vectorize:
            self._say(f"engine.vectorize: not vectorized: {len(members)} clients x "
                      f"{layout.dim:,} parameters do not fit one batch (measured here: "
                      "batches of larger models are slower than one client at a time)"
                      if chunk < len(members) else
                      f"engine.vectorize: not vectorized: {layout.dim:,} parameters per "
                      f"client, over the {AUTO_MAX_DIM:,} that \"auto\" vectorizes (measured "
                      "here: larger models train faster one client at a time)", warn=False)
        if not vectorize and layout.dim >= app.IN_PLACE_MIN_DIM:  # (read here: one setting)
            return  # trained one by one by the ClientApp, each delta made in place
        _, base_flat = worker.global_model(record)
        start = base_flat.copy()  # batches train later: keep this round's model
        rnd = config.get(ConfigKey.SERVER_ROUND, 0)
        clients, pids = [], []
        for _, context in members:
            pid = client._partition_id(context)
            x, y = client._data(worker, pid)
            clients.append(CohortClient(x, y, training_seed(worker.task.seed, int(rnd), pid)))
            pids.append(pid)
        for lo in range(0, len(members), chunk):
            ids = [msg.metadata.message_id for msg, _ in members[lo:lo + chunk]]
            part = clients[lo:lo + chunk]
            worker.pretrained.add(ids, self._batch(worker, start, part, pids[lo:lo + chunk])
                                  if vectorize else self._back_to_back(worker, start, part))

    def _back_to_back(self, worker: Any, start: np.ndarray, part: list[CohortClient]
                      ) -> Callable[[], list[Result]]:
        """What trains one batch's clients one after the other, as the ClientApp would."""

        def train() -> list[Result]:
            model = worker.writable_model()
            results = []
            for c in part:
                np.copyto(model.flat_np, start)
                loss = worker.train_one(c.x, c.y, c.seed)
                results.append((model.flat_np.copy(), loss))
            self.back_to_back += len(part)
            return results

        return train

    def _batch(self, worker: Any, start: np.ndarray, part: list[CohortClient],
               pids: list[int]) -> Callable[[], list[Result]]:
        """What trains one batch vectorized and returns each client's result, in order."""

        def train() -> list[Result]:
            cfg, layout = worker.task.train_config, worker.model.layout
            flat = torch.from_numpy(start)
            views = {name: flat[off:off + size].view(shape) for name, off, size, shape in
                     zip(layout.names, layout.offsets, layout.sizes, layout.shapes, strict=True)}
            params, losses = train_cohort(worker.model.module, views, part, cfg,
                                          data=self._data(worker, pids, part))
            rows = torch.cat([params[n].reshape(len(part), -1) for n in layout.names], dim=1)
            self.trained += len(part)
            return [(rows[i].numpy(), losses[i]) for i in range(len(part))]

        return train

    def _data(self, worker: Any, pids: list[int], part: list[CohortClient]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's stacked data, kept while the same clients come back together
        (every round, when all clients take part)."""
        if worker is not self._stack_owner or len(self._stacked) >= 64:
            self._stacked.clear()
            self._stack_owner = worker  # held: its identity cannot pass to another worker
        key = tuple(pids)
        if key not in self._stacked:
            self._stacked[key] = stack_data(part)
        return self._stacked[key]
