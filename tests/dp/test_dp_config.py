"""The [dp] scenario section."""

import math

import pytest

from privacy.dp import DPConfig, split_noise_multiplier


def test_defaults_and_round_trip():
    cfg = DPConfig()
    assert not cfg.enabled and cfg.mechanism == "gaussian"
    full = {
        "mode": "central", "clip": 1, "noise_multiplier": 1.2, "delta": 1e-6,
        "epsilon_budget": 8, "accountant": "pld",
    }
    cfg = DPConfig.from_dict(full)
    assert cfg.enabled and cfg.clip == 1.0 and isinstance(cfg.clip, float)
    assert DPConfig.from_dict(cfg.to_dict()) == cfg


def test_mechanism_defaults_per_mode():
    assert DPConfig(mode="distributed").mechanism == "discrete_gaussian"
    assert DPConfig(mode="distributed", mechanism="skellam").mechanism == "skellam"
    assert DPConfig(mode="local").mechanism == "gaussian"


def test_adaptive_clipping_noise_split():
    cfg = DPConfig.from_dict({"mode": "central", "clip": "adaptive", "noise_multiplier": 1.0})
    assert cfg.adaptive and cfg.count_stddev(100) == 5.0
    assert cfg.update_noise_multiplier(100) == pytest.approx(split_noise_multiplier(1.0, 5.0))
    assert cfg.update_noise_multiplier(100) == pytest.approx(1 / math.sqrt(0.99))
    assert DPConfig(mode="central", clip=2.0).update_noise_multiplier(100) == 1.0
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        DPConfig(mode="central", clip="adaptive", noise_multiplier=1.0).update_noise_multiplier(10)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"mode": "secret"}, "dp.mode must be one of off, central, local, distributed"),
        ({"clip": -1.0}, "dp.clip must be > 0"),
        ({"clip": "auto"}, "dp.clip must be a number > 0 or 'adaptive'"),
        ({"clip": True}, "dp.clip must be a number"),
        ({"noise_multiplier": -0.5}, "dp.noise_multiplier must be >= 0"),
        ({"delta": 0}, r"dp.delta must be in \(0, 1\)"),
        ({"delta": 1.0}, r"dp.delta must be in \(0, 1\)"),
        ({"target_quantile": 1.2}, "dp.target_quantile"),
        ({"clip_learning_rate": 0}, "dp.clip_learning_rate must be > 0"),
        ({"clipped_count_stddev": -1}, "dp.clipped_count_stddev must be >= 0"),
        ({"epsilon_budget": 0}, "dp.epsilon_budget must be > 0"),
        ({"accountant": "moments"}, "dp.accountant must be one of rdp, pld"),
        ({"mechanism": "laplace"}, "dp.mechanism must be one of"),
        ({"mode": "distributed", "mechanism": "gaussian"}, "discrete_gaussian or skellam"),
        ({"mode": "central", "mechanism": "skellam"}, "only for mode='distributed'"),
        ({"mode": "local", "clip": "adaptive"}, "use a numeric dp.clip with mode='local'"),
        ({"mode": "central", "clip": "adaptive", "noise_multiplier": 2.0,
          "clipped_count_stddev": 0.5}, "raise clipped_count_stddev"),
        ({"mode": "central", "noise_multiplier": 0, "epsilon_budget": 3}, "noise_multiplier > 0"),
        ({"rotation": "yes"}, "dp.rotation must be true or false"),
        ({"reproducible_cohorts": 1}, "dp.reproducible_cohorts must be true or false"),
        ({"k_stddevs": -2}, "dp.k_stddevs must be > 0"),
        ({"noise_mult": 1.0}, "unknown key 'noise_mult' in \\[dp\\]; known keys: mode, clip"),
    ],
)
def test_validation_messages(section, match):
    with pytest.raises(ValueError, match=match):
        DPConfig.from_dict(section)


def test_from_dict_needs_a_table():
    with pytest.raises(ValueError, match=r"\[dp\] must be a table"):
        DPConfig.from_dict(["mode", "central"])
