"""Batched training of a cohort: train many clients' copies of one model as one computation.

``train_cohort`` runs what ``client.training.train`` runs for each client (the same seeded
batch order, cross-entropy, SGD with momentum and weight decay, or Adam, as torch's
optimizers compute them), for K clients at once: the parameters and optimizer state are
stacked along a new first dimension and one ``torch.func.vmap`` of
``grad(functional_call(model))`` computes every client's gradient per step. Clients
have different data sizes: batches are padded and masked (a padded example weighs
nothing in its batch's mean), and a client with fewer steps keeps its parameters and
state once its own steps are done. The result matches sequential training within float
rounding (batched kernels sum in another order).

``unsupported`` says why a task or model cannot be vectorized (the caller then trains
sequentially): buffers (batch norm), DP-SGD, FedProx, or a task with its own train().
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence

from client.task import ClientTask
from client.training import TrainConfig, resolve_device

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults, as make_optimizer


@dataclass(frozen=True)
class CohortClient:
    """One client of a cohort: its data and its training seed."""

    x: torch.Tensor
    y: torch.Tensor
    seed: int


def unsupported(module: torch.nn.Module, cfg: TrainConfig, task: ClientTask) -> str | None:
    """Why clients of this task cannot be trained as one batched computation, or None."""
    if task.trainer is not None:
        return "the task brings its own train()"
    if resolve_device(cfg.device).type != "cpu":
        return f"vectorized cohorts train on the CPU, and train.device is {cfg.device}"
    if cfg.dp_sgd:
        return "DP-SGD clips per-sample gradients with Opacus"
    if cfg.proximal_mu > 0:
        return "FedProx (train.proximal_mu > 0) is not vectorized"
    if cfg.optimizer not in ("sgd", "adam"):
        return f"optimizer '{cfg.optimizer}' is not vectorized"
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        return f"the model has buffers ({', '.join(buffers[:3])}): batch statistics"
    return None


def batch_plan(clients: Sequence[CohortClient], cfg: TrainConfig
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index, mask, steps): ``index[k, s]`` the examples of client k's step s (padded with
    0 up to the largest batch any client has and the longest client's step count),
    ``mask`` 1 on real examples, ``steps[k]`` client k's step count. Orders come from each
    client's seeded generator exactly as ``client.training.train`` draws them."""
    b = cfg.batch_size
    per_client: list[list[torch.Tensor]] = []
    for c in clients:
        gen = torch.Generator().manual_seed(c.seed)
        n = len(c.x)
        batches = []
        for _ in range(cfg.local_epochs):
            order = torch.randperm(n, generator=gen)
            batches += [order[i:i + b] for i in range(0, n, b)]
        per_client.append(batches)
    steps = torch.tensor([len(p) for p in per_client])
    k, s = len(clients), int(steps.max()) if len(clients) else 0
    flat = [idx for batches in per_client for idx in batches]
    lengths = torch.tensor([len(idx) for idx in flat])
    width = int(lengths.max()) if len(flat) else 1
    padded = pad_sequence(flat, batch_first=True) if flat else torch.zeros(0, 1, dtype=torch.long)
    real = (torch.arange(width) < lengths[:, None]).to(torch.float32)
    # row r of ``padded`` is step (r - first[k]) of the client k it belongs to
    owner = torch.repeat_interleave(torch.arange(k), steps)
    first = torch.cumsum(steps, 0) - steps
    step_of = torch.arange(len(flat)) - first[owner]
    index = torch.zeros(k, s, width, dtype=torch.long)
    mask = torch.zeros(k, s, width)
    index[owner, step_of] = padded
    mask[owner, step_of] = real
    return index, mask, steps


def stack_data(clients: Sequence[CohortClient]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's inputs and labels padded to the largest client: [K, n_max, ...]."""
    n_max = max(len(c.x) for c in clients)
    x = clients[0].x.new_zeros((len(clients), n_max, *clients[0].x.shape[1:]))
    y = clients[0].y.new_zeros((len(clients), n_max))
    for i, c in enumerate(clients):
        x[i, :len(c.x)] = c.x
        y[i, :len(c.y)] = c.y
    return x, y


def train_cohort(module: torch.nn.Module, start: dict[str, torch.Tensor],
                 clients: Sequence[CohortClient], cfg: TrainConfig,
                 data: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train every client from the parameters ``start`` (name -> tensor); returns each
    client's final parameters stacked along dimension 0 and each client's mean loss.
    ``data``: ``stack_data(clients)`` when the caller keeps it from round to round."""
    names = list(start)
    k = len(clients)
    index, mask, steps = batch_plan(clients, cfg)
    x_all, y_all = stack_data(clients) if data is None else data
    params = {n: start[n].detach().unsqueeze(0).repeat(k, *([1] * start[n].dim()))
              for n in names}
    module.train()

    def loss_of(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                m: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(functional_call(module, p, (x,)), y, reduction="none")
        return (losses * m).sum() / m.sum().clamp(min=1.0)

    grads_of = vmap(grad_and_value(loss_of))
    rows = torch.arange(k)
    state: dict[str, dict[str, torch.Tensor]] = {}
    loss_sum = torch.zeros(k)
    for s in range(index.shape[1]):
        active = steps > s  # clients whose own steps are not done yet
        idx = index[:, s]
        x = x_all[rows[:, None], idx]
        y = y_all[rows[:, None], idx]
        grads, loss = grads_of(params, x, y, mask[:, s])
        everyone = bool(active.all())
        loss_sum += loss.detach() if everyone else torch.where(active, loss.detach(), 0.0)
        params = _step(params, grads, state, None if everyone else active, cfg, s + 1)
    losses = (loss_sum / steps.clamp(min=1)).tolist()
    return params, losses


def _step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
          state: dict[str, dict[str, torch.Tensor]], active: torch.Tensor | None,
          cfg: TrainConfig, t: int) -> dict[str, torch.Tensor]:
    """One optimizer step for every active client (the others keep params and state;
    ``active`` None: every client), as ``torch.optim.SGD`` / ``Adam`` compute it."""
    out = {}
    for name, p in params.items():
        g = grads[name]
        keep = None if active is None else active.view(-1, *([1] * (p.dim() - 1)))

        def where(new: torch.Tensor, old: torch.Tensor | None,
                  keep: torch.Tensor | None = keep) -> torch.Tensor:
            return new if keep is None or old is None else torch.where(keep, new, old)

        if cfg.weight_decay:
            g = g + cfg.weight_decay * p
        st = state.setdefault(name, {})
        if cfg.optimizer == "adam":
            b1, b2 = ADAM_BETAS
            m = st.get("m", torch.zeros_like(p)) * b1 + g * (1 - b1)
            v = st.get("v", torch.zeros_like(p)) * b2 + g * g * (1 - b2)
            st["m"], st["v"] = where(m, st.get("m")), where(v, st.get("v"))
            step_size = cfg.lr / (1 - b1 ** t)
            denom = v.sqrt() / math.sqrt(1 - b2 ** t) + ADAM_EPS
            new = p - step_size * (m / denom)
        elif cfg.momentum:
            buf = g if "buf" not in st else st["buf"] * cfg.momentum + g
            st["buf"] = where(buf, st.get("buf"))
            new = p - cfg.lr * buf
        elif keep is None:  # plain SGD for every client: in place, no temporaries
            out[name] = p.add_(g, alpha=-cfg.lr)
            continue
        else:
            new = p - cfg.lr * g
        out[name] = where(new, p)
    return out
