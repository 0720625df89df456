"""Whom each epsilon protects against: the run's DPController, against dp_accounting.

Derived here, not read from the code: central DP is stated against the released model and
amplified by a secret cohort draw; local and distributed DP against the server, which
drew the cohort (no amplification), with a second, amplified figure for the released
model. Fixed-size sampling is replace-one (the sum moves by 2C: multiplier z / 2),
everything else add/remove (multiplier z).
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest

from privacy.dp import AdaptiveClip, DPConfig, combined_noise_multiplier, split_noise_multiplier
from server.config import FederationConfig
from server.dp import DPController, dp_controller, figure_relations

REPLACE_ONE = dpa.NeighboringRelation.REPLACE_ONE
Z, DELTA, N, M = 1.0, 1e-5, 20, 5


def controller(mode: str, *, sampling: str = "fixed", reproducible: bool = False,
               **config) -> DPController:
    cfg = DPConfig(mode=mode, clip=1.0, noise_multiplier=Z, delta=DELTA,
                   reproducible_cohorts=reproducible, **config)
    return DPController(cfg, clients=N, clients_per_round=M, sampling=sampling)


def unamplified(rounds: int, z: float = Z) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.GaussianDpEvent(z), rounds)  # add/remove: the sum moves by C
    return acc.get_epsilon(DELTA)


def fixed(rounds: int, population: int = N, cohort: int = M, z: float = Z) -> float:
    acc = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    event = dpa.SampledWithoutReplacementDpEvent(population, cohort, dpa.GaussianDpEvent(z / 2))
    acc.compose(event, rounds)  # replace-one: the sum moves by 2C
    return acc.get_epsilon(DELTA)


def poisson(rounds: int, q: float, z: float = Z) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds)
    return acc.get_epsilon(DELTA)


def run_rounds(dp: DPController, rounds: int) -> None:
    for _ in range(rounds):
        dp.note_cohort(N, M)
        dp.end_round(released=True)


def test_central_dp_protects_against_the_released_model_with_amplification():
    dp = controller("central")
    assert dp.secret_cohorts
    run_rounds(dp, 3)
    assert dp.epsilon() == pytest.approx(fixed(3), rel=1e-9)
    assert dp.epsilon_model() is None
    summary = dp.summary()
    assert summary["protects_against"] == "released model"
    assert summary["relation"] == "replace-one" and "epsilon_model" not in summary


def test_central_dp_with_reproducible_cohorts_claims_no_amplification():
    dp = controller("central", reproducible=True)
    assert not dp.secret_cohorts
    run_rounds(dp, 3)
    assert dp.epsilon() == pytest.approx(unamplified(3), rel=1e-9)
    assert dp.summary()["relation"] == "add/remove-one"


@pytest.mark.parametrize("mode", ["distributed", "local"])
def test_server_side_modes_are_not_amplified_and_report_the_model_figure(mode):
    dp = controller(mode)
    run_rounds(dp, 4)
    assert dp.epsilon() == pytest.approx(unamplified(4), rel=1e-9)
    assert dp.epsilon_model() == pytest.approx(fixed(4), rel=1e-9)
    summary = dp.summary()
    assert summary["protects_against"] == "server" and summary["relation"] == "add/remove-one"
    assert summary["epsilon_model"] == dp.epsilon_model()
    assert summary["relation_model"] == "replace-one"
    spent = dp.end_round(released=False)
    assert spent.protects_against == "server" and spent.epsilon_model == dp.epsilon_model()


@pytest.mark.parametrize("mode", ["distributed", "local"])
def test_server_side_modes_with_reproducible_cohorts_have_one_figure(mode):
    dp = controller(mode, reproducible=True)
    run_rounds(dp, 2)
    assert dp.epsilon() == pytest.approx(unamplified(2), rel=1e-9)
    assert dp.epsilon_model() is None and "epsilon_model" not in dp.summary()


def test_poisson_model_figure_uses_the_configured_rate():
    cfg = DPConfig(mode="distributed", clip=1.0, noise_multiplier=Z, delta=DELTA)
    dp = DPController(cfg, clients=N, clients_per_round=7, sampling="poisson",
                      sampling_rate=0.33)  # 6.6 clients expected, rounded to 7 for the count
    dp.end_round(released=True)
    dp.end_round(released=True)
    assert dp.epsilon_model() == pytest.approx(poisson(2, 0.33), rel=1e-9)
    assert dp.epsilon() == pytest.approx(unamplified(2), rel=1e-9)


def test_the_budget_caps_the_server_figure_not_the_amplified_one():
    cfg = DPConfig(mode="distributed", clip=1.0, noise_multiplier=Z, delta=DELTA,
                   epsilon_budget=(poisson(1, 0.1) + unamplified(1)) / 2)
    dp = DPController(cfg, clients=N, clients_per_round=2, sampling="poisson")
    assert poisson(1, 0.1) < cfg.epsilon_budget < unamplified(1)
    assert dp.next_round_exceeds_budget() == pytest.approx(unamplified(1), rel=1e-9)


def test_fixed_rounds_are_charged_the_cohort_noted_by_the_driver():
    dp = controller("central")
    dp.note_cohort(12, 5)
    dp.end_round(released=True)
    dp.note_cohort(20, 3)
    dp.end_round(released=True)
    ref = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    for population, cohort in [(12, 5), (20, 3)]:
        ref.compose(dpa.SampledWithoutReplacementDpEvent(population, cohort,
                                                         dpa.GaussianDpEvent(Z / 2)))
    assert dp.epsilon() == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    dp.end_round(released=True)  # no cohort noted: the planned one
    ref.compose(dpa.SampledWithoutReplacementDpEvent(N, M, dpa.GaussianDpEvent(Z / 2)))
    assert dp.epsilon() == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)


def test_state_roundtrip_and_a_state_saved_with_one_accountant():
    dp = controller("distributed")
    run_rounds(dp, 2)
    restored = controller("distributed")
    restored.load_state_dict(dp.state_dict())
    assert (restored.epsilon(), restored.epsilon_model()) == (dp.epsilon(), dp.epsilon_model())
    old = {"accountant": {"history": [[Z, 2]], "rounds": 2, "noise_multiplier": Z,
                          "sampling": "fixed", "sampling_rate": M / N, "accountant": "rdp",
                          "delta": DELTA}}  # distributed DP's state before the split
    legacy = controller("distributed")
    legacy.load_state_dict(old)
    assert legacy.epsilon() == pytest.approx(unamplified(2), rel=1e-9)
    assert legacy.epsilon_model() == pytest.approx(fixed(2), rel=1e-9)
    central = controller("central")
    central.load_state_dict(old)
    assert central.epsilon() == pytest.approx(fixed(2), rel=1e-9)


# ---- adaptive clipping: the noised count's sensitivity under each relation

def test_combined_multiplier_is_one_gaussian_under_both_relations():
    z_delta, sigma_b = 1.3, 0.9
    z = combined_noise_multiplier(z_delta, sigma_b)
    assert split_noise_multiplier(z, sigma_b) == pytest.approx(z_delta)

    def eps(events, relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE):
        acc = dpa.rdp.RdpAccountant(neighboring_relation=relation)
        acc.compose(dpa.ComposedDpEvent(events), 7)
        return acc.get_epsilon(DELTA)

    # add/remove: the update sum moves by C, the centred count by 1/2
    two = [dpa.GaussianDpEvent(z_delta * 1.0 / 1.0), dpa.GaussianDpEvent(sigma_b / 0.5)]
    assert eps(two) == pytest.approx(eps([dpa.GaussianDpEvent(z)]), rel=1e-9)
    # replace-one: the update sum moves by 2C, the count by 1; the same z, halved
    two = [dpa.GaussianDpEvent(z_delta / 2.0), dpa.GaussianDpEvent(sigma_b / 1.0)]
    assert eps(two, REPLACE_ONE) == pytest.approx(
        eps([dpa.GaussianDpEvent(z / 2)], REPLACE_ONE), rel=1e-9)


def released_count(norms: list[float], m: int, reported: int | None = None) -> float:
    """The (noise-free) centred count an AdaptiveClip releases, read back from its update."""
    ac = AdaptiveClip(1.0, target_quantile=0.5, learning_rate=0.5)
    below = float(sum(n <= 1.0 for n in norms))
    new = ac.update(below, m, reported=len(norms) if reported is None else reported)
    fraction = 0.5 - math.log(new) / 0.5
    return (fraction - 0.5) * m


def test_the_centred_count_moves_by_a_half_when_a_client_is_added_and_one_when_replaced():
    base = [0.3, 2.0, 0.7, 5.0, 0.1]
    m = 5
    c = released_count(base, m)
    assert released_count([*base, 0.2], m) - c == pytest.approx(0.5)  # add one below
    assert released_count([*base, 9.0], m) - c == pytest.approx(-0.5)  # add one above
    assert released_count(base[1:], m) - c == pytest.approx(-0.5)  # remove one below
    assert released_count([9.0, *base[1:]], m) - c == pytest.approx(-1.0)  # replace one
    # with every expected client reporting, the fraction is the plain one
    assert released_count(base, m) / m + 0.5 == pytest.approx(3 / 5)


def test_the_controller_releases_the_count_of_the_clients_that_reported():
    cfg = DPConfig(mode="central", clip="adaptive", initial_clip=1.0, target_quantile=0.5,
                   clip_learning_rate=0.5, noise_multiplier=0.0, clipped_count_stddev=0.0)
    dp = DPController(cfg, clients=N, clients_per_round=M, sampling="poisson")
    for norm in (0.2, 0.4, 3.0):  # 3 of the 5 expected clients reported, 2 below the clip
        dp.observe(norm)
    dp.end_round(released=True)
    fraction = (2 - 3 / 2) / M + 0.5
    assert dp.clip == pytest.approx(math.exp(-0.5 * (fraction - 0.5)))


def test_the_run_controller_charges_poisson_the_configured_fraction():
    fed = FederationConfig(clients=N, sample_fraction=0.33, sampling="poisson")
    dp = dp_controller(DPConfig(mode="distributed", clip=1.0, noise_multiplier=Z,
                                delta=DELTA), fed)
    assert dp.clients_per_round == 7  # the public count central noise divides by
    dp.end_round(released=True)
    assert dp.epsilon_model() == pytest.approx(poisson(1, 0.33), rel=1e-9)


@pytest.mark.parametrize("mode", ["central", "local", "distributed"])
@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
@pytest.mark.parametrize("reproducible", [False, True])
def test_the_stated_relations_are_the_accountants(mode, sampling, reproducible):
    dp = controller(mode, sampling=sampling, reproducible=reproducible)
    assert figure_relations(dp.config, sampling) == (dp.relation, dp.model_relation)
    expected_model = None if mode == "central" or reproducible else (
        "replace-one" if sampling == "fixed" else "add/remove-one")
    assert dp.model_relation == expected_model


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_every_client_every_round_is_the_plain_gaussian_under_add_remove(mode):
    """Nothing is sampled when every client takes part in every round: the sum over all
    clients moves by C when one is added or removed, with or without a secret draw."""
    cfg = DPConfig(mode=mode, clip=1.0, noise_multiplier=Z, delta=DELTA)
    dp = DPController(cfg, clients=N, clients_per_round=N, sampling="fixed")
    for _ in range(4):
        dp.note_cohort(N, N)
        dp.end_round(released=True)
    assert dp.epsilon() == pytest.approx(unamplified(4), rel=1e-9)
    assert dp.relation == "add/remove-one" and dp.epsilon_model() is None
    assert dp.epsilon() < fixed(4, cohort=N)  # replace-one at z / 2 reads higher
