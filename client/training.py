"""Local training and evaluation loops on in-memory tensors (no DataLoader overhead)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from client import optim_step

OPTIMIZERS = ("sgd", "adam")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    """The ``[train]`` section: local epochs, batch size, optimizer, FedProx's mu, DP-SGD
    and the device clients train on (``auto``: CUDA where present, else the CPU)."""

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0
    dp_sgd_noise_multiplier: float = 0.0
    dp_sgd_max_grad_norm: float = 1.0
    dp_sgd_delta: float = 1e-5
    dp_sgd_epsilon_budget: float | None = None  # composed over each client's rounds
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"train.device must be one of {', '.join(DEVICES)}, got "
                             f"'{self.device}'")
        if self.local_epochs < 1:
            raise ValueError(f"train.local_epochs must be >= 1, got {self.local_epochs}")
        if self.batch_size < 1:
            raise ValueError(f"train.batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, "
                             f"got '{self.optimizer}'")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"train.momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0 or self.proximal_mu < 0:
            raise ValueError("train.weight_decay and train.proximal_mu must be >= 0")
        if self.dp_sgd_noise_multiplier < 0 or not self.dp_sgd_max_grad_norm > 0:
            raise ValueError("train.dp_sgd_noise_multiplier must be >= 0 (0 turns DP-SGD off) "
                             "and train.dp_sgd_max_grad_norm > 0")
        if not 0 < self.dp_sgd_delta < 1:
            raise ValueError(f"train.dp_sgd_delta must be in (0, 1), got {self.dp_sgd_delta}")
        self._check_dp_sgd_budget()
        if self.dp_sgd and self.proximal_mu > 0:
            raise ValueError("DP-SGD clips per-sample gradients of the loss; the FedProx term "
                             "is not per-sample: set train.proximal_mu = 0 with DP-SGD")

    def _check_dp_sgd_budget(self) -> None:
        budget = self.dp_sgd_epsilon_budget
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int | float) \
                or not math.isfinite(budget) or budget <= 0:
            raise ValueError(f"train.dp_sgd_epsilon_budget must be a number > 0, got {budget!r}")
        if not self.dp_sgd:
            raise ValueError("train.dp_sgd_epsilon_budget caps DP-SGD's epsilon, but DP-SGD is "
                             "off: set train.dp_sgd_noise_multiplier > 0, or remove "
                             "train.dp_sgd_epsilon_budget")

    @property
    def dp_sgd(self) -> bool:
        """Sample-level DP inside local training (Opacus DP-SGD)."""
        return self.dp_sgd_noise_multiplier > 0


def resolve_device(name: str) -> torch.device:
    """The torch device ``train.device`` names here: ``auto`` is CUDA where present."""
    if name not in DEVICES:
        raise ValueError(f"train.device must be one of {', '.join(DEVICES)}, got '{name}'")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device = 'cuda' but CUDA is not available on this machine "
                         "(torch.cuda.is_available() is False): set train.device = 'auto' "
                         "(CUDA where present, else the CPU) or 'cpu'")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def batch_norm_layers(module: torch.nn.Module) -> list[str]:
    """Names of the batch-norm layers in ``module``."""
    return [name or type(module).__name__ for name, sub in module.named_modules()
            if isinstance(sub, _BatchNorm)]


def has_batch_norm(module: torch.nn.Module) -> bool:
    return any(isinstance(sub, _BatchNorm) for sub in module.modules())


def check_model(module: torch.nn.Module, cfg: TrainConfig) -> None:
    """Fail at start on a model that local training with ``cfg`` cannot train: DP-SGD's
    per-sample gradients are undefined under batch norm, which mixes the samples of a batch."""
    if not cfg.dp_sgd:
        return
    norms = batch_norm_layers(module)
    if norms:
        raise ValueError(f"DP-SGD (train.dp_sgd_noise_multiplier > 0) cannot train a model "
                         f"with batch norm (layers {', '.join(norms[:5])}): batch norm mixes "
                         "the samples of a batch, so per-sample gradients are undefined. "
                         "Replace it with torch.nn.GroupNorm (or LayerNorm), or set "
                         "train.dp_sgd_noise_multiplier = 0")


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The local optimizer ``cfg`` names, over ``params``."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay)


def reset_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` as a freshly made one: its per-parameter state (momentum buffers, Adam's
    moments and step counts) dropped, so a worker reuses one optimizer for every client
    instead of building one per client. Torch creates that state on the first step."""
    opt.state.clear()  # (gradients left by the last client are cleared before each step)
    return opt


def dp_sgd_sample_rate(n: int, cfg: TrainConfig) -> float:
    """The Poisson sampling rate of each DP-SGD step on ``n`` examples."""
    return min(1.0, cfg.batch_size / n)


def dp_sgd_round_steps(n: int, cfg: TrainConfig) -> int:
    """Steps of one call of ``train_dp_sgd`` on ``n`` examples: an expected epoch's batches
    (``round(1 / q)``, at least one) for each local epoch."""
    return cfg.local_epochs * max(1, round(1 / dp_sgd_sample_rate(n, cfg)))


def train_dp_sgd(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 cfg: TrainConfig) -> tuple[float, float]:
    """DP-SGD with Opacus (Abadi et al. 2016): ``dp_sgd_round_steps`` steps, each on a
    Poisson-sampled batch (expected size ``batch_size``) with per-sample gradients clipped
    to ``dp_sgd_max_grad_norm`` and Gaussian noise. Every step is taken, so the count of
    steps is fixed: an empty batch adds noise only.

    The batch draws and the noise come from operating-system entropy, never from the run
    seed: the sampled-batch guarantee needs both to stay secret from whoever knows the seed.
    Returns the mean loss (over non-empty batches) and the sample-level epsilon at
    ``dp_sgd_delta`` of this call alone (``client.dp_sgd`` composes a client's rounds).
    """
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from privacy.dp import PrivacyAccountant

    n = len(x)
    rate = dp_sgd_sample_rate(n, cfg)
    steps = dp_sgd_round_steps(n, cfg)
    params = [p for p in module.parameters() if p.requires_grad]
    check_model(module, cfg)
    device = x.device
    gsm = GradSampleModule(module)
    gen = torch.Generator().manual_seed(secrets.randbits(63))  # the batches
    noise = torch.Generator(device=device).manual_seed(secrets.randbits(63))
    opt = DPOptimizer(make_optimizer(params, cfg), noise_multiplier=cfg.dp_sgd_noise_multiplier,
                      max_grad_norm=cfg.dp_sgd_max_grad_norm,
                      expected_batch_size=max(1, round(rate * n)), generator=noise)
    total, batches = 0.0, 0
    try:
        gsm.train()
        for _ in range(steps):
            idx = torch.nonzero(torch.rand(n, generator=gen) < rate).flatten().to(device)
            opt.zero_grad(set_to_none=True)
            # (an empty batch's summed loss is 0: its per-sample gradients are empty)
            loss = F.cross_entropy(gsm(x[idx]), y[idx], reduction="mean" if len(idx) else "sum")
            loss.backward()
            opt.step()
            if len(idx):
                total += loss.item()
                batches += 1
    finally:
        gsm._close()  # removes Opacus' hooks so the cached module stays a plain module
    accountant = PrivacyAccountant(cfg.dp_sgd_noise_multiplier, delta=cfg.dp_sgd_delta,
                                   sampling_rate=rate)
    accountant.step(steps)
    return total / max(batches, 1), accountant.epsilon()


def train(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, *,
          seed: int, global_params: list[torch.Tensor] | None = None,
          optimizer: torch.optim.Optimizer | None = None,
          batch_norm: bool | None = None) -> float:
    """Train in place for ``cfg.local_epochs`` and return the mean training loss.

    With ``cfg.proximal_mu > 0`` the FedProx term (mu/2)||w - w_global||^2 is added
    (Li et al. 2020); ``global_params`` are the global model's tensors in parameter order
    (parameters only: buffers such as batch norm's statistics are not trained, they follow
    the batches). Training runs where ``module`` and ``x`` are; the batch order is drawn on
    the CPU from ``seed``, the same on every device. With batch norm a last batch of one
    sample is skipped: batch norm cannot normalise a single sample. ``optimizer``: one made
    by ``make_optimizer`` over this module's parameters, reused across calls (it is reset
    first, so the result is that of a fresh one). ``batch_norm``: whether ``module`` has
    batch norm, when the caller knows (else the module tree is walked to find out).
    """
    params = ([p for p in module.parameters() if p.requires_grad]
              if optimizer is None or cfg.proximal_mu > 0 else [])
    if cfg.proximal_mu > 0 and (global_params is None or len(global_params) != len(params)):
        raise ValueError("FedProx needs the global model's parameters")
    if not module.training:  # (a recursive walk over the modules: only when it changes)
        module.train()
    opt = make_optimizer(params, cfg) if optimizer is None else reset_optimizer(optimizer)
    gen = torch.Generator().manual_seed(seed)
    n = len(x)
    if batch_norm is None:
        batch_norm = has_batch_norm(module)
    smallest = 2 if batch_norm else 1
    total, steps = 0.0, 0
    for _ in range(cfg.local_epochs):
        order = torch.randperm(n, generator=gen)  # on the CPU: the same on every device
        if order.device != x.device:
            order = order.to(x.device)
        for start in range(0, n, cfg.batch_size):
            if min(cfg.batch_size, n - start) < smallest:  # the batch's size
                continue
            idx = order[start:start + cfg.batch_size]
            optim_step.zero_grad(opt)
            loss = F.cross_entropy(module(x[idx]), y[idx])
            if cfg.proximal_mu > 0:
                prox = sum(torch.sum((p - g) ** 2) for p, g in zip(params, global_params,
                                                                    strict=True))
                loss = loss + 0.5 * cfg.proximal_mu * prox
            loss.backward()
            optim_step.step(opt)
            total += loss.item()
            steps += 1
    return total / max(steps, 1)


@torch.no_grad()
def evaluate(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
             batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over (x, y)."""
    module.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        logits = module(x[start:start + batch_size])
        target = y[start:start + batch_size]
        loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(dim=1) == target).sum())
    n = max(len(x), 1)
    return loss_sum / n, correct / n
