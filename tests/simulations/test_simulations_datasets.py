"""simulations.datasets: digits, FedProx synthetic, npz."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.datasets import Dataset, dataset_names, load_dataset
from simulations.partitioners import partition


def test_names_and_unknown():
    assert dataset_names() == ["cifar10", "cifar100", "digits", "femnist", "npz", "sent140",
                             "shakespeare", "synthetic"]
    with pytest.raises(ValueError) as info:
        load_dataset("mnist", seed=0)
    assert str(info.value).startswith("unknown dataset 'mnist'; choose one of: cifar10, ")


@pytest.mark.parametrize(
    ("name", "params", "bad"),
    [
        ("digits", {"scale": 2}, "scale"),
        ("synthetic", {"gamma": 1.0}, "gamma"),
        ("npz", {"file": "x.npz"}, "file"),
    ],
)
def test_unknown_params_are_named(name, params, bad):
    with pytest.raises(ValueError, match=f"unknown parameter '{bad}' for dataset '{name}'"):
        load_dataset(name, seed=0, **params)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, True])
def test_bad_test_fraction(fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("digits", seed=0, test_fraction=fraction)


@pytest.mark.parametrize("seed", [None, -1, 1.5])
def test_bad_seed(seed):
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        load_dataset("digits", seed=seed)


# ------------------------------------------------------------------------------------ digits


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits", seed=0)


def test_digits_shapes_dtypes_ranges(digits):
    d = digits
    assert d.name == "digits" and d.num_classes == 10 and d.input_shape == (1, 8, 8)
    assert d.groups is None
    assert d.num_train + d.num_test == 1797
    assert d.num_test == 360  # ceil(0.2 * 1797), as scikit-learn rounds the test size up
    for x, y in ((d.x_train, d.y_train), (d.x_test, d.y_test)):
        assert x.dtype == np.float32 and x.shape[1:] == (1, 8, 8)
        assert y.dtype == np.int64 and y.shape == (len(x),)
        assert x.min() == 0.0 and x.max() == 1.0
        assert set(np.unique(y)) == set(range(10))
        # pixels were integers 0..16 scaled by 1/16
        assert np.allclose(x * 16, np.round(x * 16))


def test_digits_is_the_sklearn_set(digits):
    from sklearn.datasets import load_digits

    raw = load_digits()
    ours = np.concatenate([digits.x_train, digits.x_test]).reshape(-1, 64) * 16
    ours_y = np.concatenate([digits.y_train, digits.y_test])
    key = lambda x, y: sorted(zip(map(bytes, x.astype(np.uint8)), y.tolist(), strict=True))  # noqa: E731
    assert key(ours, ours_y) == key(raw.data, raw.target)


def test_digits_split_is_stratified(digits):
    total = np.bincount(np.concatenate([digits.y_train, digits.y_test]), minlength=10)
    test = np.bincount(digits.y_test, minlength=10)
    assert np.all(np.abs(test - 0.2 * total) <= 1)


def test_digits_split_follows_seed_and_fraction(digits):
    same = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    assert np.array_equal(same.x_train, digits.x_train)
    assert np.array_equal(same.y_test, digits.y_test)
    assert not np.array_equal(other.x_train, digits.x_train)
    half = load_dataset("digits", seed=0, test_fraction=0.5)
    assert half.num_test == 899


# --------------------------------------------------------------------------------- synthetic

SIGMA_SQRT = np.sqrt(np.arange(1, 61, dtype=np.float64) ** -1.2)


def _stream(seed, *key):
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def regenerate(seed, alpha, beta, num_users, cap, iid=False):
    """Synthetic(alpha, beta) written out from the documented formulas, independently: each
    user k from its own stream (seed, k), the iid model from the shared stream."""
    n, models, xs, ys = [], [], [], []
    for k in range(num_users):
        rng = _stream(seed, 0, k, 0)
        n.append(min(int(np.floor(rng.lognormal(4, 2))) + 50, cap))
        if iid:
            shared = _stream(seed, 1)
            v = np.zeros(60)
            w, b = shared.normal(0, 1, (60, 10)), shared.normal(0, 1, 10)
        else:
            u = rng.normal(0, alpha)
            big_b = rng.normal(0, beta)
            v = rng.normal(big_b, 1, 60)
            w = rng.normal(u, 1, (60, 10))
            b = rng.normal(u, 1, 10)
        models.append((w, b))
        x = v + SIGMA_SQRT * rng.standard_normal((n[k], 60))
        logits = x @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        xs.append(x)
        ys.append(np.argmax(p, axis=1))
    return np.array(n), xs, ys, models


@pytest.mark.parametrize("iid", [False, True])
def test_synthetic_labels_are_argmax_of_generating_model(iid):
    seed, num_users, cap = 11, 4, 25
    d = load_dataset(
        "synthetic",
        seed=seed,
        alpha=0.5,
        beta=0.5,
        num_users=num_users,
        max_samples_per_user=cap,
        iid=iid,
    )
    n, xs, ys, models = regenerate(seed, 0.5, 0.5, num_users, cap, iid=iid)
    assert np.bincount(d.groups).tolist() == [k - round(0.2 * k) for k in n]
    assert d.num_train + d.num_test == n.sum()

    # Every training row of user k is one of user k's generated rows, with its label, and the
    # label is the argmax of softmax(W_k x + b_k).
    for k in range(num_users):
        table = {bytes(x.astype(np.float32)): (y, x) for x, y in zip(xs[k], ys[k], strict=True)}
        rows = d.x_train[d.groups == k]
        labels = d.y_train[d.groups == k]
        assert len({bytes(r) for r in rows}) == len(rows)
        for row, label in zip(rows, labels, strict=True):
            y, x64 = table[bytes(row)]
            assert label == y
            w, b = models[k]
            assert label == np.argmax(x64 @ w + b)
    # Test rows come from the same users, each used once, disjoint from the training rows.
    everything = {}
    for k in range(num_users):
        for x, y in zip(xs[k], ys[k], strict=True):
            everything[bytes(x.astype(np.float32))] = y
    train_keys = {bytes(r) for r in d.x_train}
    test_keys = [bytes(r) for r in d.x_test]
    assert len(set(test_keys)) == len(test_keys) and not train_keys & set(test_keys)
    assert [everything[key] for key in test_keys] == d.y_test.tolist()


def test_synthetic_shapes_and_determinism():
    a = load_dataset("synthetic", seed=3, max_samples_per_user=80)
    b = load_dataset("synthetic", seed=3, max_samples_per_user=80)
    c = load_dataset("synthetic", seed=4, max_samples_per_user=80)
    assert a.name == "synthetic" and a.input_shape == (60,) and a.num_classes == 10
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int64
    assert a.groups is not None and a.groups.dtype == np.int64
    assert sorted(set(a.groups.tolist())) == list(range(30))
    for field in ("x_train", "y_train", "x_test", "y_test", "groups"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.x_train[:50], c.x_train[:50])
    assert np.bincount(a.groups).max() <= 80
    # natural partition recovers the users
    parts = partition(a.y_train, 30, kind="natural", groups=a.groups)
    assert [len(p) for p in parts] == np.bincount(a.groups).tolist()


def test_synthetic_uncapped_counts_follow_reference():
    d = load_dataset("synthetic", seed=5, num_users=6, test_fraction=0.1)
    n, *_ = regenerate(5, 1.0, 1.0, 6, np.iinfo(np.int64).max)
    assert (n >= 50).all()
    assert d.num_train + d.num_test == n.sum()
    assert np.bincount(d.groups).tolist() == [k - round(0.1 * k) for k in n]


def _mean_user_label_entropy(d: Dataset) -> float:
    ents = []
    for k in np.unique(d.groups):
        c = np.bincount(d.y_train[d.groups == k]).astype(float)
        c = c[c > 0] / c.sum()
        ents.append(-(c * np.log(c)).sum())
    return float(np.mean(ents))


def _spread_of_user_means(d: Dataset) -> float:
    means = np.stack([d.x_train[d.groups == k].mean(axis=0) for k in np.unique(d.groups)])
    return float(means.mean(axis=1).std())


def test_synthetic_beta_and_iid_change_heterogeneity():
    for seed in range(3):
        kw = dict(seed=seed, max_samples_per_user=100)
        iid = load_dataset("synthetic", iid=True, **kw)
        b0 = load_dataset("synthetic", alpha=0.0, beta=0.0, **kw)
        b5 = load_dataset("synthetic", alpha=0.0, beta=5.0, **kw)
        # beta spreads the users' feature means (B_k ~ N(0, beta)) ...
        assert _spread_of_user_means(iid) < 0.05 < _spread_of_user_means(b0) < 1.0
        assert _spread_of_user_means(b5) > 3.0
        # ... and that concentrates each user's labels on fewer classes.
        assert _mean_user_label_entropy(iid) > 1.4
        assert _mean_user_label_entropy(b0) < 0.8
        assert _mean_user_label_entropy(b5) < 0.9 * _mean_user_label_entropy(b0)


def test_synthetic_alpha_cannot_change_labels():
    # W_k ~ N(u_k, 1), b_k ~ N(u_k, 1) add the same u_k * (sum(x) + 1) to every class logit,
    # so with the same seed the data is the same whatever alpha is (up to rounding at ties).
    a0 = load_dataset("synthetic", seed=2, alpha=0.0, beta=1.0, max_samples_per_user=100)
    a5 = load_dataset("synthetic", seed=2, alpha=5.0, beta=1.0, max_samples_per_user=100)
    assert np.array_equal(a0.x_train, a5.x_train)
    assert np.mean(a0.y_train == a5.y_train) > 0.999


@pytest.mark.parametrize(
    ("params", "pattern"),
    [
        ({"num_users": 0}, "num_users must be an integer >= 1"),
        ({"num_users": 2.5}, "num_users must be an integer >= 1"),
        ({"alpha": -1.0}, "alpha must be a finite number >= 0"),
        ({"beta": float("nan")}, "beta must be a finite number >= 0"),
        ({"iid": "yes"}, "iid must be true or false"),
        ({"max_samples_per_user": 0}, "max_samples_per_user must be an integer >= 1"),
    ],
)
def test_synthetic_bad_params(params, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_dataset("synthetic", seed=0, **params)


def test_synthetic_tiny_users_keep_a_training_sample():
    d = load_dataset("synthetic", seed=0, num_users=5, max_samples_per_user=1, test_fraction=0.9)
    assert np.bincount(d.groups).tolist() == [1] * 5
    assert d.num_test == 0


# --------------------------------------------------------------------------------------- npz


def _arrays(**over):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (12, 3, 4, 4), dtype=np.uint8),
        "y_train": np.arange(12, dtype=np.int32) % 5,
        "x_test": rng.integers(0, 256, (6, 3, 4, 4), dtype=np.uint8),
        "y_test": np.arange(6, dtype=np.int32) % 5,
    }
    arrays.update(over)
    return {k: v for k, v in arrays.items() if v is not None}


def _write(tmp_path, **arrays):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return path


def test_npz_round_trip(tmp_path):
    arrays = _arrays(num_classes=np.int64(7), groups=np.arange(12) % 3)
    d = load_dataset("npz", seed=0, path=_write(tmp_path, **arrays))
    assert d.name == "npz" and d.input_shape == (3, 4, 4) and d.num_classes == 7
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    np.testing.assert_array_equal(d.x_train, arrays["x_train"].astype(np.float32))
    np.testing.assert_array_equal(d.x_test, arrays["x_test"].astype(np.float32))
    np.testing.assert_array_equal(d.y_train, arrays["y_train"])
    np.testing.assert_array_equal(d.y_test, arrays["y_test"])
    np.testing.assert_array_equal(d.groups, arrays["groups"])
    # num_classes defaults to max label + 1; float labels holding integers are accepted
    d2 = load_dataset(
        "npz",
        seed=0,
        path=str(_write(tmp_path, **_arrays(y_test=np.array([0, 1, 2, 8, 0, 0.0])))),
    )
    assert d2.num_classes == 9 and d2.groups is None


@pytest.mark.parametrize(
    ("over", "pattern"),
    [
        ({"y_test": None}, "lacks array 'y_test'"),
        ({"x_train": None}, "lacks array 'x_train'"),
        ({"y_train": np.zeros(11, dtype=int)}, "y_train has 11 entries but x_train has 12 rows"),
        ({"y_test": np.zeros(7, dtype=int)}, "y_test has 7 entries but x_test has 6 rows"),
        ({"groups": np.zeros(3, dtype=int)}, "groups has 3 entries"),
        ({"x_test": np.zeros((6, 3, 4, 5))}, "x_test per-sample shape"),
        ({"x_train": np.zeros(12)}, r"x_train must have shape \[n, \*input_shape\]"),
        ({"x_train": np.full((12, 2), np.nan)}, "x_train contains NaN"),
        ({"x_test": np.array([["a", "b"]] * 6)}, "x_test must be real numbers"),
        ({"y_train": np.full(12, 0.5)}, "y_train must hold integers"),
        ({"y_train": -np.ones(12, dtype=int)}, "y_train must be non-negative"),
        ({"y_train": np.zeros((12, 1), dtype=int)}, "y_train must be 1-D"),
        ({"num_classes": np.int64(3)}, "num_classes is 3 but the labels go up to 4"),
        ({"num_classes": np.array([5, 5])}, "num_classes must be a scalar integer"),
        ({"X_train": np.zeros((2, 2))}, "unexpected array 'X_train'"),
    ],
)
def test_npz_bad_files_name_the_key(tmp_path, over, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_dataset("npz", seed=0, path=_write(tmp_path, **_arrays(**over)))


def test_npz_unreadable(tmp_path):
    with pytest.raises(ValueError, match="needs path="):
        load_dataset("npz", seed=0)
    with pytest.raises(ValueError, match="npz file not found"):
        load_dataset("npz", seed=0, path=tmp_path / "missing.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not a zip file")
    with pytest.raises(ValueError, match="cannot read"):
        load_dataset("npz", seed=0, path=junk)
    objects = np.empty(12, dtype=object)
    objects[:] = [[i] for i in range(12)]
    with pytest.raises(ValueError, match="cannot read"):
        load_dataset("npz", seed=0, path=_write(tmp_path, **_arrays(y_train=objects)))


def test_dataset_validates_fields():
    x = np.zeros((4, 2), dtype=np.float32)
    y = np.zeros(4, dtype=np.int64)
    ok = Dataset("t", x, y, x, y, num_classes=2, input_shape=(2,))
    assert ok.num_train == 4 and ok.input_shape == (2,)
    with pytest.raises(ValueError, match="float32"):
        Dataset("t", x.astype(np.float64), y, x, y, num_classes=2, input_shape=(2,))
    with pytest.raises(ValueError, match="input_shape"):
        Dataset("t", x, y, x, y, num_classes=2, input_shape=(3,))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        Dataset("t", x, y + 2, x, y, num_classes=2, input_shape=(2,))
    with pytest.raises(ValueError, match="groups"):
        Dataset("t", x, y, x, y, num_classes=2, input_shape=(2,), groups=np.zeros(3, np.int64))


def test_synthetic_loader_fills_float32_outputs_with_a_peak_under_twice_the_data() -> None:
    """The loader writes each user's samples straight into float32 outputs: the same split
    as holding every user in float64 and concatenating, at a fraction of the memory."""
    import tracemalloc

    from simulations.datasets import generate_synthetic, load_dataset

    kwargs = {"alpha": 0.5, "beta": 0.5, "num_users": 300}
    tracemalloc.start()
    try:
        ds = load_dataset("synthetic", seed=3, test_fraction=0.25, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    data = sum(a.nbytes for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test, ds.groups))
    assert ds.x_train.dtype == ds.x_test.dtype == np.float32
    assert peak < 2 * data, (peak, data)
    # the reference: every user in float64, split by the same child stream, concatenated
    xs, ys = generate_synthetic(seed=3, **kwargs)
    tr_x, tr_y, te_x, groups = [], [], [], []
    for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
        n_test = min(round(0.25 * len(y)), len(y) - 1)
        perm = _stream(3, 0, k, 1).permutation(len(y))
        tr, te = np.sort(perm[n_test:]), np.sort(perm[:n_test])
        tr_x.append(x[tr])
        tr_y.append(y[tr])
        te_x.append(x[te])
        groups.append(np.full(len(tr), k))
    np.testing.assert_array_equal(ds.x_train, np.concatenate(tr_x).astype(np.float32))
    np.testing.assert_array_equal(ds.y_train, np.concatenate(tr_y))
    np.testing.assert_array_equal(ds.x_test, np.concatenate(te_x).astype(np.float32))
    np.testing.assert_array_equal(ds.groups, np.concatenate(groups))


def test_synthetic_user_is_made_alone_the_same_as_in_the_loaded_set():
    """User k depends on (seed, k) only: made alone, in any order, it is the loader's rows."""
    from simulations.datasets import SyntheticSpec

    d = load_dataset("synthetic", seed=7, num_users=9, test_fraction=0.3,
                     max_samples_per_user=300)
    spec = SyntheticSpec(seed=7, num_users=9, max_samples_per_user=300)
    test_at = np.cumsum([0] + [len(spec.split(k, 0.3)[3]) for k in range(9)])
    for k in (8, 3, 0, 3):
        xtr, ytr, xte, yte = spec.split(k, 0.3)
        np.testing.assert_array_equal(xtr, d.x_train[d.groups == k])
        np.testing.assert_array_equal(ytr, d.y_train[d.groups == k])
        np.testing.assert_array_equal(xte, d.x_test[test_at[k]:test_at[k + 1]])
        np.testing.assert_array_equal(yte, d.y_test[test_at[k]:test_at[k + 1]])
    # more users leave the first ones as they were
    more = load_dataset("synthetic", seed=7, num_users=12, test_fraction=0.3,
                        max_samples_per_user=300)
    np.testing.assert_array_equal(more.x_train[more.groups < 9], d.x_train)
