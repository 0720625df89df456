"""Privacy accountant and budget stop, checked against dp_accounting called directly.

The neighbouring relation and the multiplier dp_accounting gets are derived HERE, from the
sensitivity of a sum of C-clipped updates, not read from the code under test:

- fixed-size sampling (m of N without replacement): dp_accounting only analyses it under
  REPLACE_ONE. Replacing one client's update u by u' moves the sum by ||u - u'|| <= 2C, so
  a noise std of z C is a multiplier of z C / (2C) = z / 2 against that sensitivity.
- Poisson sampling: ADD_OR_REMOVE_ONE; adding or removing u moves the sum by ||u|| <= C,
  multiplier z.
- no amplification (the adversary knows who took part): each round an unsampled
  Gaussian, add/remove, multiplier z.
"""

import math

import dp_accounting as dpa
import numpy as np
import pytest

from privacy.dp import BudgetExceeded, PrivacyAccountant, check_budget, would_exceed_budget

REPLACE_ONE = dpa.NeighboringRelation.REPLACE_ONE
ADD_OR_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
CLIP = 1.0


def sensitivity(sampling: str) -> float:
    """Largest move of a sum of CLIP-clipped updates between neighbouring datasets."""
    u = np.array([CLIP, 0.0])  # a client's clipped update
    if sampling == "fixed":  # replace u by the clipped update pointing the other way
        return float(np.linalg.norm(u - (-u)))
    return float(np.linalg.norm(u))  # add or remove u


def direct(sampling, kind, z, rounds, delta, q=None, population=None, cohort=None):
    multiplier = z * CLIP / sensitivity(sampling)
    gaussian = dpa.GaussianDpEvent(multiplier)
    if sampling == "fixed":
        assert kind == "rdp"
        acc = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
        event = dpa.SampledWithoutReplacementDpEvent(population, cohort, gaussian)
    else:
        acc = (dpa.rdp.RdpAccountant(neighboring_relation=ADD_OR_REMOVE) if kind == "rdp"
               else dpa.pld.PLDAccountant(neighboring_relation=ADD_OR_REMOVE))
        event = gaussian if sampling == "none" else dpa.PoissonSampledDpEvent(q, gaussian)
    acc.compose(event, rounds)
    return acc.get_epsilon(delta)


def test_the_derived_sensitivities():
    assert sensitivity("fixed") == 2 * CLIP and sensitivity("poisson") == CLIP


TABLE = [
    # sampling, kind, sampling (q or (N, m)), z, rounds, delta
    ("fixed", "rdp", (20, 5), 1.1, 10, 1e-5),  # finding 1: 24.96
    ("fixed", "rdp", (20, 10), 1.0, 5, 1e-5),
    ("fixed", "rdp", (1000, 10), 1.0, 200, 1e-5),
    ("fixed", "rdp", (100, 20), 1.5, 30, 1e-6),
    ("fixed", "rdp", (500, 500), 3.0, 4, 1e-5),
    ("fixed", "rdp", (50, 1), 0.7, 100, 1e-7),
    ("poisson", "rdp", 0.01, 1.0, 100, 1e-5),
    ("poisson", "rdp", 0.1, 0.8, 37, 1e-6),
    ("poisson", "rdp", 1.0, 2.0, 5, 1e-5),
    ("poisson", "rdp", 0.003, 1.3, 2500, 1e-7),
    ("poisson", "rdp", 0.25, 1.1, 10, 1e-5),
    ("poisson", "pld", 0.01, 1.0, 100, 1e-5),
    ("poisson", "pld", 0.05, 1.0, 20, 1e-6),
    ("poisson", "pld", 1.0, 2.0, 5, 1e-5),
    ("none", "rdp", None, 1.0, 5, 1e-5),  # finding 2: 12.30
    ("none", "rdp", None, 0.8, 40, 1e-6),
    ("none", "pld", None, 1.0, 5, 1e-5),
    ("none", "pld", None, 2.5, 100, 1e-7),
]


@pytest.mark.parametrize("sampling, kind, how, z, rounds, delta", TABLE)
def test_epsilon_equals_dp_accounting(sampling, kind, how, z, rounds, delta):
    if sampling == "fixed":
        population, cohort = how
        acc = PrivacyAccountant(z, delta=delta, sampling="fixed", population=population,
                                clients_per_round=cohort, accountant=kind)
        expected = direct("fixed", kind, z, rounds, delta, population=population,
                          cohort=cohort)
    elif sampling == "poisson":
        acc = PrivacyAccountant(z, delta=delta, sampling_rate=how, accountant=kind)
        expected = direct("poisson", kind, z, rounds, delta, q=how)
    else:
        acc = PrivacyAccountant(z, delta=delta, sampling="none", accountant=kind)
        expected = direct("none", kind, z, rounds, delta)
    acc.step(rounds)
    assert acc.rounds == rounds
    assert acc.epsilon() == pytest.approx(expected, rel=1e-6 if kind == "pld" else 1e-9)


def test_the_issue_figures():
    fixed = PrivacyAccountant(1.1, delta=1e-5, sampling="fixed", population=20,
                              clients_per_round=5)
    fixed.step(10)
    assert fixed.epsilon() == pytest.approx(24.96, rel=1e-3)
    server = PrivacyAccountant(1.0, delta=1e-5, sampling="none")
    server.step(5)
    assert server.epsilon() == pytest.approx(12.30, rel=1e-3)


def test_relations_are_named():
    assert PrivacyAccountant(1.0, delta=1e-5, sampling="fixed", population=4,
                             clients_per_round=2).relation == "replace-one"
    assert PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.5).relation == "add/remove-one"
    assert PrivacyAccountant(1.0, delta=1e-5, sampling="none").relation == "add/remove-one"


def replace_one_move() -> float:
    """Replacing a client's clipped update u by the one pointing the other way."""
    u = np.array([CLIP, 0.0])
    return float(np.linalg.norm(u - (-u)))


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize("chosen", ["add/remove-one", "zero-out", "replace-one"])
def test_unsampled_figures_under_each_relation(kind, chosen):
    """Unsampled: zero-out and add/remove move the sum by C, replace-one by 2C."""
    move = replace_one_move() if chosen == "replace-one" else CLIP
    acc = PrivacyAccountant(1.3, delta=1e-5, sampling="none", accountant=kind,
                            relation=chosen)
    acc.step(4)
    ref = (dpa.rdp.RdpAccountant() if kind == "rdp"
           else dpa.pld.PLDAccountant(neighboring_relation=ADD_OR_REMOVE))
    ref.compose(dpa.GaussianDpEvent(1.3 * CLIP / move), 4)
    assert acc.relation == chosen
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=1e-6)
    assert acc.state_dict()["relation"] == chosen


def test_poisson_replace_one_is_dp_accountings_replace_one_pld():
    """dp_accounting's REPLACE_ONE shifts each side by +-sensitivity (the pair
    (1-q)N(0)+qN(+C) against (1-q)N(0)+qN(-C), checked by integration in
    test_dp_adversary), so its sensitivity is a client's own bound C."""
    acc = PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.3, accountant="pld",
                            relation="replace-one")
    acc.step(3)
    ref = dpa.pld.PLDAccountant(neighboring_relation=REPLACE_ONE)
    ref.compose(dpa.PoissonSampledDpEvent(0.3, dpa.GaussianDpEvent(1.0 * CLIP / CLIP)), 3)
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=1e-6)
    assert acc.rounds_within(acc.epsilon() * 2) > 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(sampling="fixed", population=4, clients_per_round=2, relation="add/remove-one"),
     "replace-one only"),
    (dict(sampling_rate=0.5, relation="zero-out"), "zero-out"),
    (dict(sampling_rate=0.5, relation="replace-one"), "accountant='pld'"),
    (dict(sampling="none", relation="swap"), "relation"),
])
def test_relations_dp_accounting_cannot_account_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyAccountant(1.0, delta=1e-5, **kwargs)


def test_a_state_saved_under_another_relation_is_refused():
    saved = PrivacyAccountant(1.0, delta=1e-5, sampling="none", relation="zero-out")
    saved.step(2)
    other = PrivacyAccountant(1.0, delta=1e-5, sampling="none", relation="replace-one")
    with pytest.raises(ValueError, match="zero-out"):
        other.load_state_dict(saved.state_dict())
    older = saved.state_dict()
    del older["relation"]  # saved before relations were: its sampling's natural one
    plain = PrivacyAccountant(1.0, delta=1e-5, sampling="none")
    plain.load_state_dict(older)
    assert plain.epsilon() == saved.epsilon()


def test_fixed_rounds_are_charged_the_cohort_that_was_drawn():
    acc = PrivacyAccountant(1.0, delta=1e-5, sampling="fixed", population=20,
                            clients_per_round=5)
    acc.step()  # the planned 5 of 20
    acc.step(2, population=12, cohort=5)  # 8 clients were not eligible
    acc.step(population=12, cohort=2, noise_multiplier=1.5)
    assert acc.history == [(1.0, 1, 20, 5), (1.0, 2, 12, 5), (1.5, 1, 12, 2)]
    ref = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    for n, population, cohort, z in [(1, 20, 5, 1.0), (2, 12, 5, 1.0), (1, 12, 2, 1.5)]:
        ref.compose(dpa.SampledWithoutReplacementDpEvent(
            population, cohort, dpa.GaussianDpEvent(z * CLIP / sensitivity("fixed"))), n)
    assert acc.epsilon() == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    ledger = dpa.rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    ledger.compose(acc.dp_event())
    assert ledger.get_epsilon(1e-5) == pytest.approx(acc.epsilon(), rel=1e-9)
    # a smaller eligible population is a larger sampling rate: more epsilon
    planned = PrivacyAccountant(1.0, delta=1e-5, sampling="fixed", population=20,
                                clients_per_round=5)
    planned.step(3)
    assert acc.epsilon() > planned.epsilon()
    with pytest.raises(ValueError, match="exceeds population"):
        acc.step(population=3, cohort=5)
    with pytest.raises(ValueError, match="both population and cohort"):
        acc.step(population=3)
    with pytest.raises(ValueError, match="no population or cohort"):
        PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.1).step(population=10, cohort=1)


def test_changing_noise_multiplier_is_composed_per_round():
    acc = PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.05)
    acc.step(30)
    acc.step(20, noise_multiplier=1.7)
    acc.step(5, noise_multiplier=1.7)
    assert acc.history == [(1.0, 30), (1.7, 25)]
    direct_acc = dpa.rdp.RdpAccountant()
    direct_acc.compose(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.0)), 30)
    direct_acc.compose(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.7)), 25)
    assert acc.epsilon() == pytest.approx(direct_acc.get_epsilon(1e-5), rel=1e-9)
    ledger = dpa.rdp.RdpAccountant()
    ledger.compose(acc.dp_event())
    assert ledger.get_epsilon(1e-5) == pytest.approx(acc.epsilon(), rel=1e-9)


def test_clients_per_round_and_population_give_the_poisson_rate():
    acc = PrivacyAccountant(1.0, delta=1e-5, clients_per_round=10, population=1000)
    acc.step(50)
    assert acc.epsilon() == pytest.approx(direct("poisson", "rdp", 1.0, 50, 1e-5, q=0.01),
                                          rel=1e-9)
    assert acc.epsilon(delta=1e-3) < acc.epsilon()


def test_epsilon_after_is_a_what_if():
    acc = PrivacyAccountant(1.1, delta=1e-5, sampling_rate=0.02)
    acc.step(40)
    before = acc.epsilon()
    assert acc.epsilon_after(60) == pytest.approx(
        direct("poisson", "rdp", 1.1, 100, 1e-5, q=0.02), rel=1e-9)
    assert acc.epsilon() == before and acc.rounds == 40
    assert acc.epsilon_after(0) == before


def test_state_roundtrip_and_mismatch():
    acc = PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.05)
    acc.step(10)
    acc.step(3, noise_multiplier=2.0)
    restored = PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.05)
    restored.load_state_dict(acc.state_dict())
    assert restored.history == acc.history and restored.epsilon() == acc.epsilon()
    other = PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.1)
    with pytest.raises(ValueError, match="sampling"):
        other.load_state_dict(acc.state_dict())


def test_fixed_state_keeps_the_cohorts_and_loads_older_states():
    def fixed():
        return PrivacyAccountant(1.0, delta=1e-5, sampling="fixed", population=20,
                                 clients_per_round=5)

    acc = fixed()
    acc.step(2)
    acc.step(population=10, cohort=5)
    restored = fixed()
    restored.load_state_dict(acc.state_dict())
    assert restored.history == acc.history and restored.epsilon() == acc.epsilon()
    old = {"history": [[1.0, 3]], "rounds": 3, "noise_multiplier": 1.0, "sampling": "fixed",
           "sampling_rate": 0.25, "accountant": "rdp", "delta": 1e-5}  # before cohorts
    legacy = fixed()
    legacy.load_state_dict(old)
    assert legacy.history == [(1.0, 3, 20, 5)]
    assert legacy.epsilon() == pytest.approx(
        direct("fixed", "rdp", 1.0, 3, 1e-5, population=20, cohort=5), rel=1e-9)


def test_degenerate_cases():
    assert PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.1).epsilon() == 0.0
    no_noise = PrivacyAccountant(0.0, delta=1e-5, sampling_rate=0.1)
    no_noise.step()
    assert math.isinf(no_noise.epsilon())
    never = PrivacyAccountant(1.0, delta=1e-5, sampling_rate=0.0, accountant="pld")
    never.step(10)
    assert never.epsilon() == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.5}, "delta"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"accountant": "moments"}, "accountant must be one of rdp, pld"),
        ({"sampling": "shuffle"}, "sampling must be one of poisson, fixed, none"),
        ({"sampling_rate": 1.5}, "sampling rate"),
        ({"sampling_rate": None}, "needs sampling_rate"),
        ({"sampling": "fixed"}, "clients_per_round and population"),
        ({"sampling": "none"}, "takes no sampling_rate"),
        ({"sampling": "fixed", "accountant": "pld", "sampling_rate": None,
          "clients_per_round": 5, "population": 50}, "use accountant='rdp'"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"noise_multiplier": 1.0, "delta": 1e-5, "sampling_rate": 0.1}
    args.update(kwargs)
    z = args.pop("noise_multiplier")
    with pytest.raises(ValueError, match=match):
        PrivacyAccountant(z, **args)


def run_until_budget(acc, budget):
    while not would_exceed_budget(acc, budget):
        check_budget(acc, budget)  # must not raise while the next round fits
        acc.step()
    return acc.rounds


@pytest.mark.parametrize("sampling, kind, q, z, budget", [
    ("poisson", "rdp", 0.1, 1.0, 4.0), ("poisson", "pld", 0.5, 2.0, 3.0),
    ("none", "rdp", None, 3.0, 3.0), ("fixed", "rdp", (40, 4), 2.0, 4.0)])
def test_budget_stop_triggers_at_exactly_the_right_round(sampling, kind, q, z, budget):
    if sampling == "fixed":
        acc = PrivacyAccountant(z, delta=1e-5, sampling="fixed", population=q[0],
                                clients_per_round=q[1])
        where = {"population": q[0], "cohort": q[1]}
    elif sampling == "none":
        acc = PrivacyAccountant(z, delta=1e-5, sampling="none", accountant=kind)
        where = {}
    else:
        acc = PrivacyAccountant(z, delta=1e-5, sampling_rate=q, accountant=kind)
        where = {"q": q}
    allowed = acc.rounds_within(budget)
    done = run_until_budget(acc, budget)
    assert done == allowed > 1
    # Independently: round `done` fits the budget and round `done + 1` does not.
    assert direct(sampling, kind, z, done, 1e-5, **where) <= budget
    assert direct(sampling, kind, z, done + 1, 1e-5, **where) > budget
    assert acc.epsilon_after(1) > budget >= acc.epsilon()
    with pytest.raises(BudgetExceeded) as info:
        check_budget(acc, budget)
    assert info.value.rounds_done == done and info.value.epsilon_after > budget
    assert acc.rounds_within(budget) == 0


def test_rounds_within_from_a_started_run_and_limit():
    acc = PrivacyAccountant(0.9, delta=1e-5, sampling_rate=0.01)
    acc.step(200)
    more = acc.rounds_within(3.0)
    assert acc.epsilon_after(more) <= 3.0 < acc.epsilon_after(more + 1)
    assert PrivacyAccountant(5.0, delta=1e-5, sampling_rate=0.001).rounds_within(
        10.0, limit=500) == 500
