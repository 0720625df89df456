"""A task from the user's own module: ``[task] module = "my_task"`` (or a ``.py`` path).

The module gives the model and the data; fedring does the rest::

    def build_model() -> torch.nn.Module                       # called with the run seed set
    def load_partition(partition_id: int, num_partitions: int) -> torch.utils.data.Dataset
    def load_client_test(partition_id: int, num_partitions: int) -> torch.utils.data.Dataset
                                                    # optional: the client's held-out split
    def load_test() -> torch.utils.data.Dataset                # optional: central evaluation
    def train(model, loader, config) -> dict[str, float]       # optional: own training loop
    def evaluate(model, loader) -> dict[str, float]            # optional: "loss", "accuracy"

Without ``train``/``evaluate`` a partition (and the test set) is materialised once into
an (inputs, labels) tensor pair, so fedring's in-memory loop (cross-entropy) trains it;
with them, the module's loop runs over a ``DataLoader`` of ``train.batch_size``. A
client's held-out split (federated evaluation; never trained on) is ``load_client_test``
or, without it, ``[task] client_test_fraction`` of the partition (a split seeded by the
run seed and the partition id; 0, the default: none), the rest being trained on. The
server and every client build :class:`ModuleTask` from the same JSON-able spec, so the
module must load the same way wherever the spec goes (see :func:`resolve_module_ref`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from aggregation import Layout
from client.flat_model import FlatModel
from client.training import TrainConfig, check_model, evaluate
from privacy.dp import DPConfig
from simulations.attacks import Attack
from simulations.partitioners import client_test_split

REQUIRED = ("build_model", "load_partition")
OPTIONAL = ("load_client_test", "load_test", "train", "evaluate")
RESERVED_METRICS = ("num-examples", "attacker")  # keys fedring's replies own
EVAL_BATCH = 1024


class TaskModuleError(ValueError):
    """The task module cannot be loaded, or a function of it misbehaves."""


class TaskCodeError(Exception):
    """A function of the task module (or the model it built) raised: ``str`` is one line,
    ``<module>.<function>: <ExceptionType>: <message>``; the error raised is its cause."""

    def __init__(self, module: str, function: str, cause: BaseException) -> None:
        self.module, self.function, self.cause = module, function, cause
        message = str(cause).strip().splitlines()
        super().__init__(f"{module}.{function}: {type(cause).__name__}"
                         + (f": {message[0]}" if message else ""))


def _innermost_frame_in(tb: TracebackType | None, filename: str | None) -> str | None:
    """The qualified name of the innermost function of ``filename`` on a traceback."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if filename is not None and code.co_filename == filename:
            found = code.co_qualname
        tb = tb.tb_next
    return found


def _in_model_call(tb: TracebackType | None) -> bool:
    """Whether a traceback passes through a ``torch.nn.Module`` call (the error arose in
    a model's forward, not in the loop that called it)."""
    calls = {fn.__code__ for name in ("_call_impl", "_wrapped_call_impl", "__call__")
             if hasattr(fn := getattr(torch.nn.Module, name, None), "__code__")}
    while tb is not None:
        if tb.tb_frame.f_code in calls:
            return True
        tb = tb.tb_next
    return False


def is_path_ref(ref: str) -> bool:
    """A ``.py`` file path (else an import name)."""
    return ref.endswith(".py") or "/" in ref or "\\" in ref


def resolve_module_ref(ref: str, base: Path) -> str:
    """``ref`` as sent to clients: an import name as is, a ``.py`` path made absolute
    against ``base`` (the scenario file's folder, or the working directory for ``--set``)."""
    if not is_path_ref(ref):
        return ref
    path = Path(ref).expanduser()
    path = path if path.is_absolute() else base / path
    path = path.resolve()
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"task.module '{ref}': no Python file at {path}; give a path to a "
                         ".py file or an importable module name")
    return str(path)


_MODULES: dict[str, ModuleType] = {}


def load_task_module(ref: str) -> ModuleType:
    """Import the task module ``ref`` names (once per process)."""
    if ref in _MODULES:
        return _MODULES[ref]
    try:
        if is_path_ref(ref):
            path = Path(ref)
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
            name = f"fedring_task_{path.stem}_{digest}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[name] = module  # for pickling and dataclasses defined in it
            try:
                spec.loader.exec_module(module)  # type: ignore[union-attr]
            except BaseException:
                del sys.modules[name]
                raise
        else:
            module = importlib.import_module(ref)
    except Exception as exc:
        raise TaskModuleError(f"task.module '{ref}' cannot be imported: "
                              f"{type(exc).__name__}: {exc}") from exc
    for fn in REQUIRED:
        if not callable(getattr(module, fn, None)):
            raise TaskModuleError(f"task module '{ref}' lacks the function {fn}() (a task "
                                  f"module gives {', '.join(REQUIRED)} and optionally "
                                  f"{', '.join(OPTIONAL)})")
    for fn in OPTIONAL:
        if hasattr(module, fn) and not callable(getattr(module, fn)):
            raise TaskModuleError(f"task module '{ref}': {fn} is not a function")
    _MODULES[ref] = module
    return module


def _is_dataset(obj: object) -> bool:
    """A map-style dataset: indexable with a length (torch Datasets, lists of pairs)."""
    return hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def dataset_tensors(ds: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a dataset of (input, label) items into an (inputs, labels) tensor pair.

    A ``TensorDataset`` of two tensors is used as it is; otherwise every item is read
    once (the whole partition is held in memory: give ``train``/``evaluate`` to stream
    data that does not fit). Floating inputs become float32, labels int64.
    """
    tensors = getattr(ds, "tensors", None)
    base = getattr(ds.dataset, "tensors", None) if isinstance(ds, Subset) else None
    if isinstance(tensors, tuple) and len(tensors) == 2:
        x, y = tensors
    elif isinstance(base, tuple) and len(base) == 2:  # a split of a TensorDataset
        idx = torch.as_tensor(list(ds.indices), dtype=torch.int64)
        x, y = base[0][idx], base[1][idx]
    else:
        items = [ds[i] for i in range(len(ds))]
        if not items:
            raise TaskModuleError(f"{where} is empty")
        if not all(isinstance(it, tuple | list) and len(it) == 2 for it in items):
            raise TaskModuleError(f"{where}: items must be (input, label) pairs for fedring's "
                                  f"training loop, got {type(items[0]).__name__}; give "
                                  "train() and evaluate() in the module for other items")
        try:
            x = torch.stack([torch.as_tensor(np.asarray(a) if not torch.is_tensor(a) else a)
                             for a, _ in items])
            y = torch.as_tensor(np.asarray([int(b) for _, b in items]))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TaskModuleError(f"{where}: cannot stack its items into tensors ({exc}); "
                                  "give train() and evaluate() in the module instead") from exc
    if len(x) == 0:
        raise TaskModuleError(f"{where} is empty")
    if x.is_floating_point():
        x = x.to(torch.float32)
    return x, y.to(torch.int64)


def _metrics(value: object, where: str) -> dict[str, float]:
    """A ``train``/``evaluate`` result checked to be dict[str, float]."""
    if not isinstance(value, Mapping):
        raise TaskModuleError(f"{where} returned {type(value).__name__}, expected "
                              "dict[str, float]")
    out = {}
    for key, v in value.items():
        number = None
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            number = float(v)
        elif torch.is_tensor(v) and v.numel() == 1 and not v.dtype.is_complex:
            number = float(v.detach())
        if not isinstance(key, str) or number is None or not math.isfinite(number):
            raise TaskModuleError(f"{where} returned {{{key!r}: {v!r}}}: expected "
                                  "dict[str, float] of finite numbers")
        if key in RESERVED_METRICS or key.startswith("fedring."):
            raise TaskModuleError(f"{where} returned the metric '{key}', which fedring's "
                                  "replies own: rename it")
        out[key] = number
    return out


def _takes(fn: Callable[..., Any], n: int) -> bool:
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume it does
        return True
    return True


class ModuleTask:
    """The task of ``[task] module``: the ``ClientTask`` and ``ServerTask`` of a run.

    Built from the spec :func:`simulations.task.task_spec` writes (``{"task": {"module":
    ...}, "seed", "clients", "train", "dp", "attack"}``).
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        missing = [k for k in ("task", "seed", "clients", "train") if k not in spec]
        if missing:
            raise ValueError(f"task spec lacks {missing}")
        self.spec = dict(spec)
        self.ref = str(spec["task"]["module"])
        self.client_test_fraction = float(spec["task"].get("client_test_fraction", 0.0))
        self.module = load_task_module(self.ref)
        self.seed = int(spec["seed"])
        self.clients = int(spec["clients"])
        self.train_config = TrainConfig(**spec["train"])
        dp = DPConfig.from_dict(spec.get("dp", {}))
        self.local_dp = ((float(dp.clip), dp.noise_multiplier) if dp.mode == "local" else None)
        self.attack = Attack.from_spec(spec.get("attack"), seed=self.seed, clients=self.clients)
        own_train = getattr(self.module, "train", None)
        own_eval = getattr(self.module, "evaluate", None)
        self.trainer = self._train_with_module if own_train is not None else None
        self.evaluator = self._evaluate_with_module if own_eval is not None else None
        self._datasets: dict[int, tuple[Any, Any]] = {}  # pid -> (training, held-out)
        self._test: Any = None
        self._test_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._eval_model: FlatModel | None = None
        self._initial_eval: tuple[np.ndarray, dict[str, float]] | None = None

    # ---- the module's functions, checked

    def _name(self, fn: str) -> str:
        return f"{self.ref}.{fn}()"

    def _call(self, fn: str, *args: Any) -> Any:
        """The module's function ``fn`` called with ``args``; what it raises comes out as a
        :class:`TaskCodeError` naming the innermost function of the module it went
        through."""
        try:
            return getattr(self.module, fn)(*args)
        except Exception as exc:
            raise self._code_error(fn, exc) from exc

    def _code_error(self, fn: str, exc: Exception) -> TaskCodeError:
        where = _innermost_frame_in(exc.__traceback__, getattr(self.module, "__file__", None))
        return TaskCodeError(self.ref, where or fn, exc)

    def _run_model(self, run: Callable[[], Any]) -> Any:
        """``run()``, a fedring loop over the module's model: an error raised inside the
        model's forward is a :class:`TaskCodeError` of ``build_model`` (or of the module's
        function it went through, e.g. ``Net.forward``); any other error, fedring's own,
        is raised as it is."""
        try:
            return run()
        except Exception as exc:
            if not _in_model_call(exc.__traceback__):
                raise
            raise self._code_error("build_model", exc) from exc

    def build_model(self) -> torch.nn.Module:
        """The module's model, built with torch seeded by the run seed (the same initial
        model on the server and on every client)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self._call("build_model")
        if not isinstance(model, torch.nn.Module):
            raise TaskModuleError(f"{self._name('build_model')} returned "
                                  f"{type(model).__name__}, expected a torch.nn.Module")
        return model

    def _parts(self, partition_id: int, num_partitions: int) -> tuple[Any, Any]:
        """Client ``partition_id``'s (training, held-out) datasets (held-out: None when it
        has none): ``load_client_test`` when the module gives it, else the partition split
        by ``client_test_fraction`` (cached for the module's own loops)."""
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition-id {partition_id} is out of range: the run has "
                             f"{num_partitions} clients (0..{num_partitions - 1})")
        if partition_id in self._datasets:
            return self._datasets[partition_id]
        ds = self._dataset("load_partition", partition_id, num_partitions)
        held: Any = None
        if hasattr(self.module, "load_client_test"):
            held = self._dataset("load_client_test", partition_id, num_partitions)
        elif self.client_test_fraction > 0:
            train_idx, held_idx = client_test_split(len(ds), self.client_test_fraction,
                                                    self.seed, partition_id)
            if len(held_idx):
                ds, held = Subset(ds, train_idx.tolist()), Subset(ds, held_idx.tolist())
        if self.trainer is not None or self.evaluator is not None:  # the loops' loaders
            self._datasets[partition_id] = (ds, held)  # (else the client keeps the tensors)
        return ds, held

    def _dataset(self, fn: str, partition_id: int, num_partitions: int) -> Any:
        ds = self._call(fn, partition_id, num_partitions)
        if not _is_dataset(ds):
            raise TaskModuleError(f"{self._name(fn)} returned {type(ds).__name__} for "
                                  f"partition {partition_id}, expected a "
                                  "torch.utils.data.Dataset")
        return ds

    def load_partition(self, partition_id: int, num_partitions: int) -> Any:
        """Client ``partition_id``'s training dataset: the module's partition, less its
        held-out split when ``client_test_fraction`` takes one."""
        return self._parts(partition_id, num_partitions)[0]

    def load_client_test(self, partition_id: int, num_partitions: int) -> Any | None:
        """Client ``partition_id``'s held-out dataset, or None when it has none."""
        return self._parts(partition_id, num_partitions)[1]

    def load_test(self) -> Any | None:
        """The module's held-out dataset, or None without ``load_test``."""
        if self._test is None and hasattr(self.module, "load_test"):
            ds = self._call("load_test")
            if not _is_dataset(ds):
                raise TaskModuleError(f"{self._name('load_test')} returned "
                                      f"{type(ds).__name__}, expected a "
                                      "torch.utils.data.Dataset")
            self._test = ds
        return self._test

    # ---- ClientTask

    def partition(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        # [attack] label_flip is refused with a module task (its classes are unknown)
        return dataset_tensors(self.load_partition(partition_id, self.clients),
                               f"{self._name('load_partition')} partition {partition_id}")

    def client_test(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Client ``partition_id``'s held-out split as tensors (None when it has none)."""
        held = self.load_client_test(partition_id, self.clients)
        if held is None or len(held) == 0:
            return None
        source = "load_client_test" if hasattr(self.module, "load_client_test") \
            else "load_partition"
        return dataset_tensors(held, f"{self._name(source)} held-out split of partition "
                                     f"{partition_id}")

    def tamper(self, partition_id: int, delta: np.ndarray, seed: int) -> bool:
        return self.attack is not None and self.attack.tamper(partition_id, delta, seed)

    def _train_with_module(self, module: torch.nn.Module, partition_id: int,
                           seed: int) -> tuple[int, dict[str, float]]:
        """The module's ``train`` over a shuffled DataLoader of the partition."""
        ds = self.load_partition(partition_id, self.clients)
        loader = DataLoader(ds, batch_size=self.train_config.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        config = {**dataclasses.asdict(self.train_config), "seed": seed,
                  "partition_id": partition_id, "device": str(_device_of(module))}
        module.train()
        out = self._call("train", module, loader, config)
        return len(ds), _metrics(out, self._name("train"))

    def _evaluate_with_module(self, module: torch.nn.Module,
                              partition_id: int) -> tuple[int, dict[str, float]]:
        """The module's ``evaluate`` on the client's held-out split; (0, {}) without one."""
        ds = self.load_client_test(partition_id, self.clients)
        if ds is None or len(ds) == 0:
            return 0, {}
        return len(ds), self._module_evaluate(module, ds)

    def _module_evaluate(self, module: torch.nn.Module, ds: Any) -> dict[str, float]:
        module.eval()
        loader = DataLoader(ds, batch_size=max(self.train_config.batch_size, 256))
        with torch.no_grad():
            out = self._call("evaluate", module, loader)
        return _metrics(out, self._name("evaluate"))

    def _check_logits(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """A batch of partition 0 through the model, as fedring's loop trains it: a forward
        that fails, or fewer outputs than the labels need, fails here, at start."""
        model.eval()
        with torch.no_grad():
            out = self._run_model(lambda: model(x))
        if y.dim() != 1 or not len(y):
            return
        shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        if not torch.is_tensor(out) or out.dim() != 2 or out.shape[1] <= int(y.max()):
            raise TaskModuleError(f"the model of {self._name('build_model')} gives "
                                  f"{shape} for a batch of {tuple(x.shape)} from partition 0, "
                                  f"whose labels go up to {int(y.max())}: fedring's training "
                                  "loop needs (batch, classes) logits with more classes than "
                                  "the largest label")

    # ---- ServerTask

    def initial_params(self) -> tuple[np.ndarray, Layout]:
        model = FlatModel(self.build_model())
        return model.vector().copy(), model.layout

    def evaluate(self, params: np.ndarray) -> dict[str, float]:
        """Central metrics on ``load_test()``; none without it."""
        if self._initial_eval is not None and np.array_equal(params, self._initial_eval[0]):
            return dict(self._initial_eval[1])  # computed by check()
        test = self.load_test()
        if test is None:
            return {}
        if self._eval_model is None:
            self._eval_model = FlatModel(self.build_model())
        self._eval_model.load(params)
        module = self._eval_model.module
        if self.evaluator is not None:
            return self._module_evaluate(module, test)
        if self._test_tensors is None:  # read once, like a client's partition
            self._test_tensors = dataset_tensors(test, self._name("load_test"))
        loss, acc = self._run_model(lambda: evaluate(module, *self._test_tensors,
                                                     batch_size=EVAL_BATCH))
        return {"loss": loss, "accuracy": acc}

    def task_spec(self) -> dict[str, Any]:
        return dict(self.spec)

    def check(self, config: Mapping[str, Any] | None = None) -> None:
        """Fail at start, naming the module and function, on what would fail in a round:
        the model, partition 0, the test set and ``evaluate``'s result; settings that the
        module's own ``train`` cannot honour."""
        own_train = self.trainer is not None
        cfg = self.train_config
        if own_train:
            train_fn = self.module.train
            if not _takes(train_fn, 3):
                raise TaskModuleError(f"{self._name('train')} must take (model, loader, "
                                      "config)")
            if cfg.dp_sgd:
                raise TaskModuleError(f"train.dp_sgd_noise_multiplier > 0 runs DP-SGD in "
                                      f"fedring's training loop, but {self._name('train')} "
                                      "replaces it: set it to 0, or remove train() from the "
                                      "module")
            if cfg.proximal_mu > 0:
                raise TaskModuleError(f"train.proximal_mu adds FedProx's term in fedring's "
                                      f"training loop, but {self._name('train')} replaces "
                                      "it: set it to 0 (or add the term in your train())")
        if self.evaluator is not None and not _takes(self.module.evaluate, 2):
            raise TaskModuleError(f"{self._name('evaluate')} must take (model, loader)")
        own_test = hasattr(self.module, "load_client_test")
        if own_test and not _takes(self.module.load_client_test, 2):
            raise TaskModuleError(f"{self._name('load_client_test')} must take "
                                  "(partition_id, num_partitions)")
        if own_test and self.client_test_fraction > 0:
            raise TaskModuleError(f"{self._name('load_client_test')} gives each client's "
                                  "held-out split, and task.client_test_fraction would split "
                                  "the partition too: set task.client_test_fraction = 0, or "
                                  "remove load_client_test() from the module")
        driver = dict((config or {}).get("driver") or {})
        if own_train and driver.get("kind") == "cross_silo":
            raise TaskModuleError(f"silos train with fedring's data-parallel loop, which "
                                  f"cannot run {self._name('train')}: remove train() from "
                                  "the module for driver.kind = 'cross_silo'")
        evaluates = float(dict((config or {}).get("federation") or {}).get(
            "evaluate_fraction", 0.0)) > 0 or driver.get("kind") == "gossip"
        if evaluates and not own_test and self.client_test_fraction <= 0:
            raise TaskModuleError(f"federated evaluation asks each client to evaluate on its "
                                  f"held-out split, but task module '{self.ref}' has no "
                                  "load_client_test() and task.client_test_fraction = 0: "
                                  "set task.client_test_fraction (e.g. 0.2), add "
                                  "load_client_test(partition_id, num_partitions) to the "
                                  "module, or set federation.evaluate_fraction = 0")
        central_target = bool(driver.get("target_accuracy", 0)) and \
            driver.get("target_on", "central") == "central"
        if central_target and not hasattr(self.module, "load_test"):
            raise TaskModuleError(f"driver.target_accuracy needs central evaluation, but "
                                  f"task module '{self.ref}' has no load_test()")
        model = self.build_model()
        check_model(model, cfg)  # DP-SGD refuses batch norm
        params, _ = self.initial_params()
        self.load_partition(0, self.clients)
        if not own_train or self.evaluator is None:  # fedring's loops read tensors
            x, y = self.partition(0)
            if not own_train:
                self._check_logits(model, x[:cfg.batch_size], y)
        if self.evaluator is None:
            self.client_test(0)
        if self.load_test() is not None:
            metrics = self.evaluate(params)
            if central_target and "accuracy" not in metrics:
                raise TaskModuleError(f"driver.target_accuracy needs an 'accuracy' metric, "
                                      f"but {self._name('evaluate')} returns "
                                      f"{sorted(metrics)}")
            self._initial_eval = (params, metrics)


def _device_of(module: torch.nn.Module) -> torch.device:
    """Where ``module`` lives (``train.device``): a module ``train()`` moves its batches
    there."""
    return next(module.parameters(), torch.empty(0)).device


def make_task(spec: Mapping[str, Any]) -> Any:
    """The task a spec describes: the user's module (``"task"``) or a built-in scenario."""
    if "task" in spec:
        return ModuleTask(spec)
    from simulations.task import ScenarioTask

    return ScenarioTask(spec)
