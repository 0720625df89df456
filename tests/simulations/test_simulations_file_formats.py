"""CIFAR python batches and LEAF JSON, read from miniatures written in exactly their formats."""

from __future__ import annotations

import itertools
import json
import pickle
import zlib

import numpy as np
import pytest
from miniature_files import (
    CIFAR10_TRAIN_ROWS,
    CIFAR_TEST_ROWS,
    LETTERS,
    write_cifar10,
    write_cifar100,
    write_leaf,
    write_leaf_set,
    write_pickle,
)

from simulations.datasets import load_dataset
from simulations.partitioners import partition

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def chained(lists) -> list:
    return list(itertools.chain.from_iterable(lists))


def read_raw(path):
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def expected_images(rows: np.ndarray, mean, std) -> np.ndarray:
    """Pixel (c, h, w) of a row is value c*1024 + h*32 + w, scaled and normalised."""
    out = np.empty((len(rows), 3, 32, 32))
    for c in range(3):
        for h in range(32):
            pixels = rows[:, c * 1024 + h * 32: c * 1024 + h * 32 + 32] / 255.0
            out[:, c, h, :] = (pixels - mean[c]) / std[c]
    return out


# ------------------------------------------------------------------------------------ CIFAR


def test_cifar10_reads_every_batch_in_order(tmp_path):
    folder = write_cifar10(tmp_path)
    d = load_dataset("cifar10", seed=0, path=str(folder))
    assert d.name == "cifar10" and d.num_classes == 10 and d.input_shape == (3, 32, 32)
    assert d.x_train.dtype == np.float32 and d.groups is None
    assert d.num_train == 5 * CIFAR10_TRAIN_ROWS and d.num_test == CIFAR_TEST_ROWS
    batches = [read_raw(folder / f"data_batch_{i}") for i in range(1, 6)]
    rows = np.concatenate([b[b"data"] for b in batches])
    labels = chained(b[b"labels"] for b in batches)
    assert d.y_train.tolist() == labels
    np.testing.assert_allclose(d.x_train, expected_images(rows, CIFAR10_MEAN, CIFAR10_STD),
                               rtol=1e-5, atol=1e-5)
    test = read_raw(folder / "test_batch")
    assert d.y_test.tolist() == test[b"labels"]
    np.testing.assert_allclose(d.x_test, expected_images(test[b"data"], CIFAR10_MEAN,
                                                         CIFAR10_STD), rtol=1e-5, atol=1e-5)


def test_cifar100_uses_fine_labels(tmp_path):
    folder = write_cifar100(tmp_path)
    d = load_dataset("cifar100", seed=0, path=str(folder))
    train, test = read_raw(folder / "train"), read_raw(folder / "test")
    assert d.num_classes == 100
    assert d.y_train.tolist() == train[b"fine_labels"] != train[b"coarse_labels"]
    assert d.y_test.tolist() == test[b"fine_labels"]
    np.testing.assert_allclose(d.x_test, expected_images(test[b"data"], CIFAR100_MEAN,
                                                         CIFAR100_STD), rtol=1e-5, atol=1e-5)


def test_cifar_str_keys_are_accepted_too(tmp_path):
    """A batch re-pickled under Python 3 has str keys; the content is the same."""
    folder = write_cifar10(tmp_path)
    raw = read_raw(folder / "test_batch")
    write_pickle(folder / "test_batch", {k.decode(): v for k, v in raw.items()})
    d = load_dataset("cifar10", seed=0, path=str(folder))
    assert d.y_test.tolist() == raw[b"labels"]


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_without_path_says_to_set_it(name):
    with pytest.raises(ValueError) as info:
        load_dataset(name, seed=0)
    msg = str(info.value)
    assert "set data.options.path" in msg and "https://www.cs.toronto.edu/~kriz/cifar.html" in msg


def test_cifar_missing_folder_and_file_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"is not a folder.*kriz/cifar.html"):
        load_dataset("cifar10", seed=0, path=str(tmp_path / "nowhere"))
    folder = write_cifar10(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(ValueError, match=r"data_batch_3' not found.*kriz/cifar\.html"):
        load_dataset("cifar10", seed=0, path=str(folder))


def corrupt(folder, file, how):
    path = folder / file
    raw = read_raw(path)
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
        return "is not a CIFAR python batch"
    if how == "no_labels":
        del raw[b"labels"]
        write_pickle(path, raw)
        return "lacks key 'labels'"
    if how == "float_data":
        raw[b"data"] = raw[b"data"].astype(np.float32)
        write_pickle(path, raw)
        return "'data' must be uint8 rows of 3072 values, got float32"
    if how == "short_rows":
        raw[b"data"] = raw[b"data"][:, :3071]
        write_pickle(path, raw)
        return "'data' must be uint8 rows of 3072"
    if how == "label_count":
        raw[b"labels"] = raw[b"labels"][:-1]
        write_pickle(path, raw)
        return "'labels' must be"
    if how == "label_range":
        raw[b"labels"][0] = 10
        write_pickle(path, raw)
        return r"'labels' must lie in \[0, 10\)"
    if how == "not_dict":
        write_pickle(path, [1, 2, 3])
        return "holds a list, not a CIFAR batch dict"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "no_labels", "float_data", "short_rows",
                                 "label_count", "label_range", "not_dict"])
def test_cifar_malformed_file_is_named(tmp_path, how):
    folder = write_cifar10(tmp_path)
    expected = corrupt(folder, "data_batch_2", how)
    with pytest.raises(ValueError, match=expected) as info:
        load_dataset("cifar10", seed=0, path=str(folder))
    assert "data_batch_2" in str(info.value)


def test_cifar_pickle_that_calls_code_is_refused(tmp_path):
    folder = write_cifar10(tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    write_pickle(folder / "test_batch", {b"data": Evil(), b"labels": []})
    with pytest.raises(ValueError, match=r"test_batch.*refusing to load"):
        load_dataset("cifar10", seed=0, path=str(folder))
    assert not marker.exists()


# ------------------------------------------------------------------------------------- LEAF


def leaf_json(folder, split):
    """Every user's samples in ``folder/split``, in file order, read independently."""
    users: dict[str, tuple[list, list]] = {}
    for file in sorted((folder / split).glob("*.json")):
        blob = json.loads(file.read_text())
        for user in blob["users"]:
            xs, ys = users.setdefault(user, ([], []))
            xs += blob["user_data"][user]["x"]
            ys += blob["user_data"][user]["y"]
    return users


@pytest.mark.parametrize("kind", ["femnist", "shakespeare", "sent140"])
def test_leaf_users_become_natural_clients(tmp_path, kind):
    folder = write_leaf_set(tmp_path, kind, users=4)
    d = load_dataset(kind, seed=0, path=str(folder))
    train = leaf_json(folder, "train")
    assert list(train) == [f"{kind[:3]}_user_{k}" for k in range(4)]
    parts = partition(d.y_train, 4, kind="natural", groups=d.groups)
    for k, (user, (_, ys)) in enumerate(train.items()):
        assert len(parts[k]) == len(ys) == 6 + 2 * k, user
        assert np.array_equal(d.groups[parts[k]], np.full(len(ys), k))
    assert d.num_test == 4 * 3


def test_femnist_pixels_and_labels(tmp_path):
    folder = write_leaf_set(tmp_path, "femnist", users=2)
    d = load_dataset("femnist", seed=0, path=str(folder))
    assert d.num_classes == 62 and d.input_shape == (1, 28, 28) and d.x_train.dtype == np.float32
    train = leaf_json(folder, "train")
    xs = np.array(chained(x for x, _ in train.values()), dtype=np.float32)
    ys = chained(y for _, y in train.values())
    assert d.y_train.tolist() == ys
    # row-major 28x28: pixel (r, c) is entry 28 r + c
    assert d.x_train[3, 0, 5, 7] == xs[3, 28 * 5 + 7]
    assert np.array_equal(d.x_train.reshape(len(xs), -1), xs)
    test = leaf_json(folder, "test")
    assert d.y_test.tolist() == chained(y for _, y in test.values())


def test_shakespeare_characters_are_leaf_indices(tmp_path):
    folder = write_leaf_set(tmp_path, "shakespeare", users=2)
    d = load_dataset("shakespeare", seed=0, path=str(folder))
    assert d.num_classes == 80 == len(LETTERS) and d.input_shape == (80,)
    assert d.x_train.dtype == np.int64 and d.x_test.dtype == np.int64
    train = leaf_json(folder, "train")
    xs = chained(x for x, _ in train.values())
    ys = chained(y for _, y in train.values())
    assert d.x_train.tolist() == [[LETTERS.find(c) for c in s] for s in xs]
    assert d.y_train.tolist() == [LETTERS.find(c) for c in ys]


def test_shakespeare_unknown_character_becomes_space(tmp_path):
    text = "a|b" + "x" * 77
    write_leaf(tmp_path, {"train": [{"u": {"x": [text], "y": ["~"]}}],
                          "test": [{"u": {"x": [text], "y": ["\n"]}}]})
    d = load_dataset("shakespeare", seed=0, path=str(tmp_path))
    assert d.x_train[0, :3].tolist() == [LETTERS.find("a"), 1, LETTERS.find("b")]
    assert d.y_train.tolist() == [1] and d.y_test.tolist() == [0]


def test_sent140_hashed_bag_of_words(tmp_path):
    folder = write_leaf_set(tmp_path, "sent140", users=2)
    d = load_dataset("sent140", seed=0, path=str(folder), features=64)
    assert d.num_classes == 2 and d.input_shape == (64,) and d.x_train.dtype == np.float32
    train = leaf_json(folder, "train")
    tweets = chained(x for x, _ in train.values())
    for row, tweet in zip(d.x_train, tweets, strict=True):
        expected = np.zeros(64)
        for word in tweet[4].lower().split():
            expected[zlib.crc32(word.encode()) % 64] += 1
        assert np.array_equal(row, expected)
    assert d.y_train.tolist() == chained(y for _, y in train.values())


def test_leaf_max_users_keeps_the_first_users_train_and_test(tmp_path):
    folder = write_leaf_set(tmp_path, "femnist", users=4)
    d = load_dataset("femnist", seed=0, path=str(folder), max_users=3)
    assert np.bincount(d.groups).tolist() == [6, 8, 10]
    assert d.num_test == 3 * 3
    test = leaf_json(folder, "test")
    kept = [test[f"fem_user_{k}"][1] for k in range(3)]
    # the test file lists users in reverse order: samples follow the file
    assert d.y_test.tolist() == chained(reversed(kept))


@pytest.mark.parametrize("kind", ["femnist", "shakespeare", "sent140"])
def test_leaf_without_path_says_to_set_it(kind):
    with pytest.raises(ValueError, match=r"set data\.options\.path.*github.com/TalwalkarLab/leaf"):
        load_dataset(kind, seed=0)


def test_leaf_missing_split_and_bad_files_are_named(tmp_path):
    folder = write_leaf_set(tmp_path, "femnist", users=2)
    for file in (folder / "test").iterdir():
        file.unlink()
    with pytest.raises(ValueError, match=r"no .json files in .*test"):
        load_dataset("femnist", seed=0, path=str(folder))
    (folder / "test").rmdir()
    with pytest.raises(ValueError, match=r"test' not found.*preprocess.sh"):
        load_dataset("femnist", seed=0, path=str(folder))

    folder = write_leaf_set(tmp_path / "b", "femnist", users=2)
    file = sorted((folder / "train").glob("*.json"))[0]
    blob = json.loads(file.read_text())
    blob["num_samples"][0] += 1
    file.write_text(json.dumps(blob))
    with pytest.raises(ValueError, match=f"{file.name}.*user 'fem_user_0' has 6 x, 6 y and "
                                         "num_samples 7"):
        load_dataset("femnist", seed=0, path=str(folder))
    file.write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot read .*{file.name}.* as JSON"):
        load_dataset("femnist", seed=0, path=str(folder))
    file.write_text(json.dumps({"users": ["u"], "num_samples": [1],
                                "user_data": {"u": {"x": [[0.5] * 783], "y": [1]}}}))
    with pytest.raises(ValueError, match="x must be rows of 784 pixels"):
        load_dataset("femnist", seed=0, path=str(folder))
    file.write_text(json.dumps({"users": ["u"], "num_samples": [1],
                                "user_data": {"u": {"x": [[0.5] * 784], "y": [62]}}}))
    with pytest.raises(ValueError, match=r"y must lie in \[0, 62\)"):
        load_dataset("femnist", seed=0, path=str(folder))


def test_leaf_options_are_checked(tmp_path):
    folder = write_leaf_set(tmp_path, "sent140", users=2)
    with pytest.raises(ValueError, match="max_users must be an integer >= 1"):
        load_dataset("sent140", seed=0, path=str(folder), max_users=0)
    with pytest.raises(ValueError, match="features must be an integer >= 1"):
        load_dataset("sent140", seed=0, path=str(folder), features=0)
    with pytest.raises(ValueError, match="unknown parameter 'features' for dataset 'femnist'"):
        load_dataset("femnist", seed=0, path=str(folder), features=8)
