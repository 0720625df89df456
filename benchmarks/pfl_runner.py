"""pfl-research on the simulation_overhead workload, run in pfl's own interpreter.

``simulation_overhead.py --pfl-python PATH`` writes the workload (every client's inputs
and labels, the test set, the initial flat weights) to an .npz file and runs this script
with that interpreter, which needs ``pfl[pytorch]==0.6.0``, torch and numpy. It imports
nothing from fedring, so pfl's pins never meet fedring's.

pfl's usual set-up: ``FederatedAveraging`` over a ``FederatedDataset`` of per-user
``Dataset`` slices sampled with ``MinimizeReuseUserSampler`` (a cohort of every user visits
each one once per round), a ``PyTorchModel`` with a local SGD optimizer and a central SGD
of learning rate 1 (the FedAvg step), ``SimulatedBackend``, and a
``CentralEvaluationCallback`` after every round. A last callback records the wall time
between rounds, evaluation included.

    python pfl_runner.py WORKLOAD.npz --rounds R --hidden 128 --lr 0.05 --batch 32

Prints one JSON line: {"round_s": [...], "round_cpu_s": [...] (the process's CPU time),
"accuracy": final central accuracy}.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel
from torch.nn import functional as F


class MLP(torch.nn.Module):
    """fedring's MLP (Flatten, Linear, ReLU, ..., Linear) with pfl's ``loss`` and
    ``metrics``."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Flatten()]
        for i in range(len(sizes) - 1):
            layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:
        self.eval() if eval else self.train()
        logits = self(x)
        n = len(x)
        return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n)}


class RoundTimer(TrainingProcessCallback):
    """Wall time from the start of training, then from each round's end to the next."""

    def __init__(self) -> None:
        self.mark = (0.0, 0.0)
        self.round_s: list[float] = []
        self.round_cpu_s: list[float] = []

    def on_train_begin(self, *, model) -> Metrics:
        self.mark = (time.perf_counter(), time.process_time())
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        now = (time.perf_counter(), time.process_time())
        self.round_s.append(now[0] - self.mark[0])
        self.round_cpu_s.append(now[1] - self.mark[1])
        self.mark = now
        return False, Metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--hidden", type=int, nargs="+", required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data = np.load(args.workload)
    n = int(data["clients"])
    x_test, y_test = data["x_test"], data["y_test"]
    sizes = [int(np.prod(x_test.shape[1:])), *args.hidden, int(data["num_classes"])]
    module = MLP(sizes)
    with torch.no_grad():  # the same initial weights as the other systems
        flat, off = torch.from_numpy(data["w0"]), 0
        for p in module.parameters():
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
    users = {i: [torch.from_numpy(data[f"x{i}"]), torch.from_numpy(data[f"y{i}"])]
             for i in range(n)}
    train_data = FederatedDataset(lambda uid: Dataset(users[uid], user_id=uid),
                                  get_user_sampler("minimize_reuse", list(range(n))))
    test = Dataset([torch.from_numpy(x_test), torch.from_numpy(y_test)])
    model = PyTorchModel(module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    eval_params = NNEvalHyperParams(local_batch_size=1024)
    timer = RoundTimer()
    central = CentralEvaluationCallback(test, model_eval_params=eval_params)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds,
                                           evaluation_frequency=args.rounds + 1,
                                           train_cohort_size=n, val_cohort_size=0),
        backend=SimulatedBackend(training_data=train_data, val_data=None),
        model=model,
        model_train_params=NNTrainHyperParams(local_num_epochs=1, local_learning_rate=args.lr,
                                              local_batch_size=args.batch),
        model_eval_params=eval_params,
        callbacks=[central, timer], send_metrics_to_platform=False)
    metrics = module.metrics(torch.from_numpy(x_test), torch.from_numpy(y_test))
    print(json.dumps({"round_s": timer.round_s, "round_cpu_s": timer.round_cpu_s,
                      "accuracy": metrics["accuracy"].overall_value}), flush=True)


if __name__ == "__main__":
    main()
