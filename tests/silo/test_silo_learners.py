"""Learners with synchronous model averaging inside a silo, against a loop written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord
from silo_helpers import ROOT
from sma_reference import reference_sma
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from client.protocol.learners import LearnerKey, LearnerSpec
from client.silo.learners import LearnerState, check_correction, check_learners, train_learners
from client.training import TrainConfig
from server.cross_silo_config import SiloConfig

WORKER = Path(__file__).parent / "sma_worker.py"
# 101 examples in batches of 10: 11 batches, dealt 4 (or 2 x 2) a step, the last step short
CASES = {
    "plain": (TrainConfig(local_epochs=2, batch_size=10, lr=0.1, momentum=0.0), 0.2, 0.5),
    "momentum_decay": (TrainConfig(local_epochs=2, batch_size=10, lr=0.1, momentum=0.9,
                                   weight_decay=0.01), 0.1, 0.9),
}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(101, 8, generator=gen), torch.randint(0, 3, (101,), generator=gen)


class Wrapped(torch.nn.Module):
    """The same network, not an ``nn.Sequential``: its learners run through ``vmap``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("case, kind", [(c, "sequential") for c in sorted(CASES)]
                         + [("momentum_decay", "vmap")])
def test_one_process_follows_the_plain_loop_step_by_step(case: str, kind: str) -> None:
    cfg, alpha, mu = CASES[case]
    x, y = data()
    model = build_model() if kind == "sequential" else Wrapped()
    start = parameters_to_vector(model.parameters()).detach().clone()
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    train_learners(model, x, y, cfg, LearnerSpec(4, momentum=mu, correction=alpha), seed=5,
                   on_step=lambda s, w, z: steps.append((w.clone(), z.clone())))
    expected = reference_sma(build_model(), x, y, epochs=cfg.local_epochs,
                             batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum,
                             weight_decay=cfg.weight_decay, alpha=alpha, mu=mu, seed=5, total=4)
    assert len(steps) == len(expected) == 6  # 22 batches, 4 a step
    for (w, z), (w_ref, z_ref) in zip(steps, expected, strict=True):
        assert (w - w_ref).abs().max() < 1e-6
        assert (z - z_ref).abs().max() < 1e-6
    final = parameters_to_vector(model.parameters()).detach()
    assert torch.equal(final, steps[-1][1])  # the module holds the average model
    assert (final - start).abs().max() > 1e-2  # and training moved it
    assert (steps[-1][0][0] - steps[-1][0][1]).abs().max() > 1e-4  # learners differ


@pytest.mark.parametrize("kind", ["sequential", "vmap"])
def test_learners_persist_across_two_rounds_as_one_loop_does(kind: str) -> None:
    """Round 2 starts from another model (the federation's mean): each learner at that
    model plus its offset from round 1's average model, with its SGD momentum and the
    average model's last step, as the plain loop carried across both rounds."""
    cfg, alpha, mu = CASES["momentum_decay"]
    x, y = data()
    model = build_model() if kind == "sequential" else Wrapped()
    spec, state = LearnerSpec(4, momentum=mu, correction=alpha), LearnerState()
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    train_learners(model, x, y, cfg, spec, seed=5, state=state,
                   on_step=lambda s, w, z: steps.append((w.clone(), z.clone())))
    shift = 0.01 * torch.randn(sum(p.numel() for p in model.parameters()),
                               generator=torch.Generator().manual_seed(2))
    second = parameters_to_vector(model.parameters()).detach() + shift  # the new global
    vector_to_parameters(second.clone(), model.parameters())  # (the module's views of it)
    train_learners(model, x, y, cfg, spec, seed=6, state=state,
                   on_step=lambda s, w, z: steps.append((w.clone(), z.clone())))
    carry: dict = {}
    ref = build_model()
    kw = dict(epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
              momentum=cfg.momentum, weight_decay=cfg.weight_decay, alpha=alpha, mu=mu,
              total=4, carry=carry)
    expected = reference_sma(ref, x, y, seed=5, **kw)
    vector_to_parameters(second.clone(), ref.parameters())
    expected += reference_sma(ref, x, y, seed=6, **kw)
    assert len(steps) == len(expected) == 12
    for (w, z), (w_ref, z_ref) in zip(steps, expected, strict=True):
        assert (w - w_ref).abs().max() < 1e-6
        assert (z - z_ref).abs().max() < 1e-6
    assert torch.equal(parameters_to_vector(model.parameters()).detach(), steps[-1][1])
    fresh = build_model() if kind == "sequential" else Wrapped()
    vector_to_parameters(second.clone(), fresh.parameters())
    train_learners(fresh, x, y, cfg, spec, seed=6)  # no state: every learner at the model
    assert (parameters_to_vector(fresh.parameters()).detach() - steps[-1][1]).abs().max() > 1e-4


def test_a_state_of_other_learners_or_another_model_is_not_carried() -> None:
    x, y = data()
    cfg, alpha, mu = CASES["plain"]
    state = LearnerState(offsets=torch.ones(3, 8), drift=torch.ones(8))
    model, again = build_model(), build_model()
    train_learners(model, x, y, cfg, LearnerSpec(4, momentum=mu, correction=alpha), seed=5,
                   state=state)
    train_learners(again, x, y, cfg, LearnerSpec(4, momentum=mu, correction=alpha), seed=5)
    assert torch.equal(parameters_to_vector(model.parameters()),
                       parameters_to_vector(again.parameters()))
    assert state.offsets is not None and tuple(state.offsets.shape) == (4, 195)


def test_a_silo_process_keeps_learners_per_partition_for_the_current_run_only() -> None:
    from silo_helpers import scenario

    from client.silo.app import SiloWorker
    from simulations.task import ScenarioTask

    worker = SiloWorker.build(ScenarioTask.from_config(scenario(rounds=1)), torch.device("cpu"))
    first = worker.learner_state(1, 0)
    assert worker.learner_state(1, 0) is first  # the next round of the run: the same
    assert worker.learner_state(1, 2) is not first  # another partition: its own
    fresh = worker.learner_state(2, 0)  # a new run starts afresh and drops the old run's
    assert fresh is not first and set(worker.learners) == {(2, 0)}


def test_the_sum_of_the_silos_corrections_may_not_overshoot() -> None:
    check_correction(LearnerSpec(2, correction=0.25), 2)  # 4 learners, 4 * 0.25 = 1
    with pytest.raises(ValueError, match=r"silo\.sma_correction"):
        check_correction(LearnerSpec(2, correction=0.25), 3)
    with pytest.raises(ValueError, match=r"silo\.sma_correction"):
        LearnerSpec(4, correction=0.3)  # checked at start: alpha * L <= 1
    assert LearnerSpec(1, correction=1.0).correction == 1.0  # one learner: z is it


def test_auto_correction_is_one_over_the_silos_learners() -> None:
    spec = SiloConfig(learners=8, sma_momentum=0.5).learner_spec()  # the defaults
    assert spec.correction is None
    check_correction(spec, 3)  # 24 learners: "auto" never overshoots
    assert spec.alpha(1) == 1 / 8 and spec.alpha(3) == 1 / 24
    assert LearnerSpec(4, correction=0.2).alpha(3) == 0.2  # a set alpha stays as set
    assert LearnerKey.CORRECTION not in spec.config()  # "auto" rides as no key ...
    assert LearnerSpec.of(ConfigRecord(spec.config())) == spec  # ... and is read back
    with pytest.raises(ValueError, match=r"silo\.sma_correction"):
        SiloConfig(learners=2, sma_correction="half")


def test_auto_correction_trains_as_its_value_set_by_hand() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(96, 6), torch.randint(0, 3, (96,))
    cfg = TrainConfig(local_epochs=1, batch_size=8, lr=0.1, optimizer="sgd", momentum=0.9)
    models = []
    for correction in (None, 0.25):
        torch.manual_seed(1)  # the same start for both
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                    torch.nn.Linear(5, 3))
        train_learners(model, x, y, cfg, LearnerSpec(4, momentum=0.5, correction=correction),
                       seed=3)
        models.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(models[0], models[1])


def test_two_processes_follow_the_plain_loop_with_the_learners_split(tmp_path: Path) -> None:
    out = tmp_path / "sma.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(WORKER), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert set(results) == set(CASES)
    for case, r in results.items():
        assert r["steps"] == 6, case
        assert r["learners_diff"] < 1e-6 and r["z_diff"] < 1e-6, (case, r)
        assert r["ranks_equal"], f"{case}: the ranks' average models differ"
        assert r["moved"] > 1e-2, case


def test_the_learner_keys_ride_only_when_there_are_several_learners() -> None:
    assert LearnerSpec(1).config() == {}
    keys = LearnerSpec(3, momentum=0.5, correction=0.2).config()
    assert keys == {LearnerKey.LEARNERS: 3, LearnerKey.MOMENTUM: 0.5, LearnerKey.CORRECTION: 0.2}


@pytest.mark.parametrize("cfg, key", [
    (TrainConfig(optimizer="adam"), "train.optimizer"),
    (TrainConfig(proximal_mu=0.1), "train.proximal_mu"),
    (TrainConfig(dp_sgd_noise_multiplier=1.0), "train.dp_sgd_noise_multiplier"),
])
def test_settings_learners_cannot_honour_are_refused_naming_the_key(cfg: TrainConfig,
                                                                    key: str) -> None:
    with pytest.raises(ValueError, match=key):
        check_learners(build_model(), cfg)
    with pytest.raises(ValueError, match="buffers"):
        check_learners(torch.nn.BatchNorm1d(3), TrainConfig())


def test_a_silo_job_of_two_processes_trains_its_learners_together(tmp_path: Path) -> None:
    """The leader's command carries the learner spec; over two rounds (the second from
    another model) both ranks end with the average model of 2 x 2 learners, each rank
    keeping its own learners between rounds, which one process with 4 learners reaches."""
    import numpy as np
    from silo_helpers import scenario

    from client.app import training_seed
    from client.flat_model import FlatModel
    from simulations.task import ScenarioTask

    config = scenario(rounds=1)
    out = tmp_path / "job.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(Path(__file__).parent /
                                                        "silo_job_worker.py"),
                           str(out), json.dumps(config)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    leader, follower = (np.array(m, dtype=np.float32) for m in result["models"])
    task = ScenarioTask.from_config(config)
    model = FlatModel(task.build_model())
    initial = model.flat_np.copy()
    x, y = task.partition(0)
    spec, state = LearnerSpec(4, momentum=0.5, correction=0.2), LearnerState()
    train_learners(model.module, x, y, task.train_config, spec,
                   seed=training_seed(task.seed, 1, 0), state=state)
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(0.01)
    loss = train_learners(model.module, x, y, task.train_config, spec,
                          seed=training_seed(task.seed, 2, 0), state=state)
    model.to_host()
    np.testing.assert_array_equal(leader, follower)
    assert np.abs(leader - initial).max() > 1e-2
    np.testing.assert_allclose(leader, model.flat_np, atol=1e-5)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
