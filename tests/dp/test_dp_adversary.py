"""Whom each epsilon protects against, under which relation: the run's DPController,
against dp_accounting and a direct computation.

Derived here, not read from the code. Central DP is stated against the released model,
amplified by a secret cohort draw. Local and distributed DP are stated against the
server, which drew the cohort and sees who replied: a client's contribution moves between
its value and zero while its participation stays known (zero-out), so the sum moves by C
and nothing is amplified. Replacing one client's data by another's moves the sum by 2C
(replace-one): an unsampled round is then the Gaussian at z / 2, fixed-size sampling is
dp_accounting's sampling without replacement at z / 2, and Poisson sampling is the pair
of mixtures (1-q) N(0, z^2) + q N(+1, z^2) against (1-q) N(0, z^2) + q N(-1, z^2) in units
of C, computed below by integration.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
from scipy import integrate, optimize
from scipy.stats import norm as normal

from privacy.dp import AdaptiveClip, DPConfig, combined_noise_multiplier, split_noise_multiplier
from server.config import FederationConfig
from server.dp import DPController, dp_controller

REPLACE_ONE = dpa.NeighboringRelation.REPLACE_ONE
Z, DELTA, N, M = 1.0, 1e-5, 20, 5


def controller(mode: str, *, sampling: str = "fixed", reproducible: bool = False,
               cohort: int = M, **config) -> DPController:
    cfg = DPConfig(mode=mode, clip=1.0, noise_multiplier=Z, delta=DELTA,
                   reproducible_cohorts=reproducible, **config)
    return DPController(cfg, clients=N, clients_per_round=cohort, sampling=sampling)


def unamplified(rounds: int, z: float = Z) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.GaussianDpEvent(z), rounds)  # the sum moves by C
    return acc.get_epsilon(DELTA)


def unamplified_replace_one(rounds: int, z: float = Z) -> float:
    return unamplified(rounds, z / 2)  # the sum moves by 2C


def fixed(rounds: int, population: int = N, cohort: int = M, z: float = Z) -> float:
    acc = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    event = dpa.SampledWithoutReplacementDpEvent(population, cohort, dpa.GaussianDpEvent(z / 2))
    acc.compose(event, rounds)  # replace-one: the sum moves by 2C
    return acc.get_epsilon(DELTA)


def poisson(rounds: int, q: float, z: float = Z) -> float:
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds)
    return acc.get_epsilon(DELTA)


def poisson_replace_one_by_integration(q: float, z: float, delta: float) -> float:
    """One round of Poisson sampling under replace-one, from the hockey-stick divergence
    of the two mixtures (the replaced client's update is +C or -C along one axis)."""
    def p(x):
        return (1 - q) * normal.pdf(x, 0, z) + q * normal.pdf(x, 1, z)

    def r(x):
        return (1 - q) * normal.pdf(x, 0, z) + q * normal.pdf(x, -1, z)

    def divergence(eps: float) -> float:  # symmetric pair: one direction suffices
        return integrate.quad(lambda x: max(p(x) - math.exp(eps) * r(x), 0.0),
                              -40 * z, 40 * z, limit=400, points=[0.0])[0]

    return optimize.brentq(lambda e: divergence(e) - delta, 1e-6, 60.0, xtol=1e-9)


def run_rounds(dp: DPController, rounds: int, cohort: int = M) -> None:
    for _ in range(rounds):
        dp.note_cohort(N, cohort)
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
    assert "epsilon_replace_one" not in summary  # epsilon is replace-one already
    assert summary["budget_relation"] == "replace-one"


def test_central_dp_with_reproducible_cohorts_claims_no_amplification():
    dp = controller("central", reproducible=True)
    assert not dp.secret_cohorts
    run_rounds(dp, 3)
    assert dp.epsilon() == pytest.approx(unamplified(3), rel=1e-9)
    summary = dp.summary()
    assert summary["relation"] == "add/remove-one"
    assert summary["epsilon_replace_one"] == pytest.approx(unamplified_replace_one(3), rel=1e-9)


def test_central_poisson_replace_one_is_the_pair_of_mixtures():
    q = 0.3
    dp = controller("central", sampling="poisson", cohort=6)  # 6 / 20 = 0.3
    dp.end_round(released=True)
    direct = poisson_replace_one_by_integration(q, Z, DELTA)
    # dp_accounting's PLD is pessimistic by its discretisation (1e-4 in the loss)
    assert dp.figures()["epsilon_replace_one"] == pytest.approx(direct, abs=2e-3)
    assert dp.epsilon() == pytest.approx(poisson(1, q), rel=1e-9)
    assert dp.relation == "add/remove-one"
    for _ in range(3):
        dp.end_round(released=True)
    pld = dpa.pld.PLDAccountant(REPLACE_ONE)  # its Gaussian shifts each side by +-1
    pld.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(Z)), 4)
    assert dp.figures()["epsilon_replace_one"] == pytest.approx(pld.get_epsilon(DELTA),
                                                                rel=1e-6)


@pytest.mark.parametrize("mode", ["distributed", "local"])
def test_server_side_modes_are_zero_out_and_report_replace_one_and_the_model(mode):
    dp = controller(mode)
    run_rounds(dp, 4)
    assert dp.epsilon() == pytest.approx(unamplified(4), rel=1e-9)
    assert dp.epsilon_model() == pytest.approx(fixed(4), rel=1e-9)
    summary = dp.summary()
    assert summary["protects_against"] == "server" and summary["relation"] == "zero-out"
    assert summary["epsilon_replace_one"] == pytest.approx(unamplified_replace_one(4),
                                                           rel=1e-9)
    assert summary["epsilon_model"] == dp.epsilon_model()
    assert summary["relation_model"] == "replace-one"
    spent = dp.end_round(released=False)
    assert spent.protects_against == "server" and spent.epsilon_model == dp.epsilon_model()
    assert spent.relation == "zero-out" and spent.relation_model == "replace-one"


def test_the_issue_figure_local_all_clients_three_rounds():
    """Local DP, every client every round, 3 rounds, z = 1: zero-out 9.01, replace-one
    21.44."""
    dp = controller("local", cohort=N)
    run_rounds(dp, 3, cohort=N)
    assert dp.epsilon() == pytest.approx(9.01, abs=0.005)
    assert dp.figures()["epsilon_replace_one"] == pytest.approx(21.44, abs=0.005)


@pytest.mark.parametrize("mode", ["distributed", "local"])
def test_server_side_modes_with_reproducible_cohorts_have_no_model_figure(mode):
    dp = controller(mode, reproducible=True)
    run_rounds(dp, 2)
    assert dp.epsilon() == pytest.approx(unamplified(2), rel=1e-9)
    assert dp.epsilon_model() is None and "epsilon_model" not in dp.summary()


@pytest.mark.parametrize("mode", ["distributed", "local"])
def test_poisson_cohorts_claim_no_amplification_for_the_model_under_client_noise(mode):
    """Each client's own noise makes the model change's size reveal the cohort's size,
    so a Poisson draw is no secret: no amplified figure."""
    cfg = DPConfig(mode=mode, clip=1.0, noise_multiplier=Z, delta=DELTA)
    dp = DPController(cfg, clients=N, clients_per_round=7, sampling="poisson",
                      sampling_rate=0.33)
    dp.end_round(released=True)
    assert dp.epsilon_model() is None and dp.model_relation is None
    assert dp.epsilon() == pytest.approx(unamplified(1), rel=1e-9)


def test_the_budget_caps_the_replace_one_figure_by_default():
    cfg = DPConfig(mode="distributed", clip=1.0, noise_multiplier=Z, delta=DELTA,
                   epsilon_budget=(unamplified(1) + unamplified_replace_one(1)) / 2)
    dp = DPController(cfg, clients=N, clients_per_round=M, sampling="fixed")
    assert unamplified(1) < cfg.epsilon_budget < unamplified_replace_one(1)
    assert dp.next_round_exceeds_budget() == pytest.approx(unamplified_replace_one(1),
                                                           rel=1e-9)
    zero_out = DPController(DPConfig(mode="distributed", clip=1.0, noise_multiplier=Z,
                                     delta=DELTA, epsilon_budget=cfg.epsilon_budget,
                                     budget_relation="zero-out"),
                            clients=N, clients_per_round=M, sampling="fixed")
    assert zero_out.next_round_exceeds_budget() is None


@pytest.mark.parametrize("sampled", [True, False])
def test_the_budget_stops_secret_and_reproducible_cohorts_under_one_relation(sampled):
    """Replace-one caps both; a reproducible draw (no amplification) never runs longer,
    and with every client in every round (nothing to amplify) they stop together."""
    cohort = M if sampled else N
    budget = 25.0

    def rounds_run(reproducible: bool) -> int:
        dp = controller("central", reproducible=reproducible, cohort=cohort,
                        epsilon_budget=budget)
        rounds = 0
        while dp.next_round_exceeds_budget() is None and rounds < 20:
            run_rounds(dp, 1, cohort)
            rounds += 1
        assert dp.budget_epsilon() <= budget
        return rounds

    def last_within(event: dpa.DpEvent, relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE):
        acc, rounds = dpa.rdp.RdpAccountant(neighboring_relation=relation), 0
        while True:
            acc.compose(event)
            if acc.get_epsilon(DELTA) > budget:
                return rounds
            rounds += 1

    secret, reproducible = rounds_run(False), rounds_run(True)
    # derived: the last round whose replace-one figure stays within the budget
    assert reproducible == last_within(dpa.GaussianDpEvent(Z / 2)) == 3
    if sampled:
        wor = dpa.SampledWithoutReplacementDpEvent(N, M, dpa.GaussianDpEvent(Z / 2))
        assert secret == last_within(wor, REPLACE_ONE) == 7
        assert reproducible <= secret
    else:
        assert secret == reproducible


def test_a_budget_relation_the_run_has_no_figure_for_fails_at_start():
    cfg = DPConfig(mode="central", clip=1.0, noise_multiplier=Z, delta=DELTA,
                   epsilon_budget=5.0, budget_relation="add/remove-one")
    with pytest.raises(ValueError, match=r"dp\.budget_relation"):
        DPController(cfg, clients=N, clients_per_round=M, sampling="fixed")
    with pytest.raises(ValueError, match=r"dp\.budget_relation"):
        DPConfig(mode="central", budget_relation="add-remove")


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


def test_state_roundtrip_and_states_saved_by_earlier_versions():
    dp = controller("distributed")
    run_rounds(dp, 2)
    restored = controller("distributed")
    restored.load_state_dict(dp.state_dict())
    assert restored.figures() == dp.figures()
    old = {"accountant": {"history": [[Z, 2]], "rounds": 2, "noise_multiplier": Z,
                          "sampling": "fixed", "sampling_rate": M / N, "accountant": "rdp",
                          "delta": DELTA}}  # distributed DP's state before the split
    legacy = controller("distributed")
    legacy.load_state_dict(old)
    assert legacy.epsilon() == pytest.approx(unamplified(2), rel=1e-9)
    assert legacy.figures()["epsilon_replace_one"] == pytest.approx(
        unamplified_replace_one(2), rel=1e-9)
    assert legacy.epsilon_model() == pytest.approx(fixed(2), rel=1e-9)
    central = controller("central")
    central.load_state_dict(old)
    assert central.epsilon() == pytest.approx(fixed(2), rel=1e-9)
    split = {"accountant": {"history": [[Z, 3]]},  # one accountant per adversary
             "model_accountant": {"history": [[Z, 3, 12, 4]]}}
    two = controller("local")
    two.load_state_dict(split)
    assert two.epsilon() == pytest.approx(unamplified(3), rel=1e-9)
    assert two.epsilon_model() == pytest.approx(fixed(3, 12, 4), rel=1e-9)


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
    dp = dp_controller(DPConfig(mode="central", clip=1.0, noise_multiplier=Z,
                                delta=DELTA), fed)
    assert dp.clients_per_round == 7  # the public count central noise divides by
    dp.end_round(released=True)
    assert dp.epsilon() == pytest.approx(poisson(1, 0.33), rel=1e-9)


@pytest.mark.parametrize("mode", ["central", "local", "distributed"])
@pytest.mark.parametrize("sampling", ["fixed", "poisson", "all"])
@pytest.mark.parametrize("reproducible", [False, True])
def test_every_figure_names_its_party_and_relation(mode, sampling, reproducible):
    """The relations derived here, mode by mode, against what the controller states in
    its summary and each round's entry."""
    how = "fixed" if sampling == "all" else sampling
    dp = controller(mode, sampling=how, reproducible=reproducible,
                    cohort=N if sampling == "all" else M)
    amplified = sampling != "all" and not reproducible
    if mode == "central":
        relation = "replace-one" if amplified and how == "fixed" else "add/remove-one"
        model = None
    else:
        relation = "zero-out"
        model = "replace-one" if amplified and how == "fixed" else None
    spent = dp.end_round(released=True)
    summary = dp.summary()
    assert (summary["relation"], summary.get("relation_model")) == (relation, model)
    assert (spent.relation, spent.relation_model) == (relation, model)
    assert ("epsilon_replace_one" in summary) == (relation != "replace-one")
    assert (spent.epsilon_replace_one is None) == (relation == "replace-one")
    labels = dp.figure_labels()
    assert labels["epsilon"].endswith(relation)
    assert summary["protects_against"] == ("released model" if mode == "central"
                                           else "server")


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_every_client_every_round_is_the_plain_gaussian(mode):
    """Nothing is sampled when every client takes part in every round: the sum over all
    clients moves by C when one is added, removed or zeroed, 2C when one is replaced."""
    cfg = DPConfig(mode=mode, clip=1.0, noise_multiplier=Z, delta=DELTA)
    dp = DPController(cfg, clients=N, clients_per_round=N, sampling="fixed")
    run_rounds(dp, 4, cohort=N)
    assert dp.epsilon() == pytest.approx(unamplified(4), rel=1e-9)
    assert dp.figures()["epsilon_replace_one"] == pytest.approx(unamplified_replace_one(4),
                                                                rel=1e-9)
    assert dp.epsilon_model() is None
    assert dp.epsilon() < fixed(4, cohort=N)  # replace-one at z / 2 reads higher
