"""DP-SGD's guarantee composed over all of one client's rounds, kept in its node state.

One round of DP-SGD on a partition of ``n`` examples is ``dp_sgd_round_steps(n, cfg)``
steps of the Poisson-sampled Gaussian mechanism at rate ``q = min(1, batch_size / n)`` and noise
multiplier ``z`` (``client.training.train_dp_sgd``: every step is taken, an empty batch
adds noise only), under add/remove-one training example of this client. The steps of every
round this client trained compose: its accountant (``privacy.dp.PrivacyAccountant``, each
of its "rounds" one step) lives in the node's ``Context.state`` across rounds, which every
engine keeps per node, and the figure the client reports is the composed one.

The client charges a round before it trains and refuses it (``DPSGDBudgetExceeded``) when
the composed epsilon would pass ``train.dp_sgd_epsilon_budget``. It reports
``dp_sgd_epsilon`` (composed, this round included), ``dp_sgd_epsilon_next`` (after one
more round: the steps and rate never change for a client, so the server's stop is exact),
``dp_sgd_rounds`` (the rounds composed), ``dp_sgd_sample_rate`` and ``dp_sgd_round_steps``.

A node whose state was lost (a resumed run restarts the in-process engine's clients) would
start from zero and under-report; the server therefore sends, on a resumed run, the rounds
any client may have trained before (``dp_sgd_prior_rounds``), and a client composes
``max(its own rounds, that)``: a server can raise a client's figure, never lower it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
from flwr.app import ConfigRecord, RecordDict

from client.training import (
    TrainConfig,
    dp_sgd_round_steps,
    dp_sgd_sample_rate,
    train_dp_sgd,
)

if TYPE_CHECKING:
    from privacy.dp import PrivacyAccountant

DP_SGD_STATE = "fedring.dp-sgd"  # Context.state: ConfigRecord of this node's accountant


class DPSGDBudgetExceeded(Exception):
    """The round asked for would take this client's DP-SGD epsilon past its budget."""


def load_accountant(state: RecordDict, n: int, cfg: TrainConfig) -> PrivacyAccountant:
    """This node's accountant over its steps so far (empty on its first round)."""
    from privacy.dp import PrivacyAccountant  # (dp_accounting: loaded on first use)

    accountant = PrivacyAccountant(cfg.dp_sgd_noise_multiplier, delta=cfg.dp_sgd_delta,
                                   sampling_rate=dp_sgd_sample_rate(n, cfg))
    saved = state.get(DP_SGD_STATE)
    if isinstance(saved, ConfigRecord) and isinstance(saved.get("accountant"), str):
        accountant.load_state_dict(json.loads(saved["accountant"]))
    return accountant


def dp_sgd_round(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 cfg: TrainConfig, state: RecordDict,
                 prior_rounds: int = 0) -> tuple[float, dict[str, float]]:
    """Train one round with DP-SGD, composed with this node's earlier rounds (at least
    ``prior_rounds`` of them); the mean loss and the figures to report. Raises
    ``DPSGDBudgetExceeded`` before training when the round would pass the budget."""
    n = len(x)
    steps = dp_sgd_round_steps(n, cfg)
    accountant = load_accountant(state, n, cfg)
    done = accountant.rounds // steps
    if prior_rounds > done:  # rounds this node may have trained but no longer remembers
        accountant.step(steps * (prior_rounds - done))
    after = accountant.epsilon_after(steps)
    budget = cfg.dp_sgd_epsilon_budget
    if budget is not None and after > budget:
        raise DPSGDBudgetExceeded(
            f"DP-SGD epsilon would reach {after:.4g} after this round, past "
            f"train.dp_sgd_epsilon_budget {budget:g} (spent {accountant.epsilon():.4g} over "
            f"{accountant.rounds // steps} rounds); this client trains no more")
    accountant.step(steps)  # charged before training: a failed round is never uncharged
    state[DP_SGD_STATE] = ConfigRecord({"accountant": json.dumps(accountant.state_dict())})
    loss, _ = train_dp_sgd(module, x, y, cfg)
    return loss, {"dp_sgd_epsilon": after, "dp_sgd_epsilon_next": accountant.epsilon_after(steps),
                  "dp_sgd_rounds": accountant.rounds // steps,
                  "dp_sgd_sample_rate": accountant.sampling_rate, "dp_sgd_round_steps": steps}
