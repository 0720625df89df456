"""Miniatures of the published data files, written here in exactly their formats.

CIFAR python batches: pickled dicts with bytes keys (as Python 2's cPickle wrote them and
``pickle.load(encoding="bytes")`` reads them back), ``data`` a uint8 array of rows of 3072
values and the labels a list of ints. LEAF: ``train/`` and ``test/`` folders of JSON files
with ``users``, ``num_samples`` and ``user_data``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np

CIFAR10_TRAIN_ROWS = 12  # per data_batch_i
CIFAR_TEST_ROWS = 10


def write_pickle(path: Path, obj: Any) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def cifar_batch(rng: np.random.Generator, rows: int, labels: dict[bytes, list[int]],
                label: bytes) -> dict[bytes, Any]:
    return {b"batch_label": label, **labels,
            b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8),
            b"filenames": [f"img_{i}.png".encode() for i in range(rows)]}


def write_cifar10(folder: Path, seed: int = 0, train_rows: int = CIFAR10_TRAIN_ROWS,
                  test_rows: int = CIFAR_TEST_ROWS) -> Path:
    """``folder/cifar-10-batches-py`` with data_batch_1..5, test_batch and batches.meta."""
    rng = np.random.default_rng(seed)
    out = folder / "cifar-10-batches-py"
    out.mkdir(parents=True)
    for i in range(1, 6):
        labels = rng.integers(0, 10, train_rows).tolist()
        write_pickle(out / f"data_batch_{i}",
                     cifar_batch(rng, train_rows, {b"labels": labels},
                                 f"training batch {i} of 5".encode()))
    write_pickle(out / "test_batch", cifar_batch(
        rng, test_rows, {b"labels": rng.integers(0, 10, test_rows).tolist()},
        b"testing batch 1 of 1"))
    write_pickle(out / "batches.meta", {b"num_cases_per_batch": train_rows,
                                        b"label_names": [b"airplane"] * 10, b"num_vis": 3072})
    return out


def write_cifar100(folder: Path, seed: int = 0, train_rows: int = 30,
                   test_rows: int = CIFAR_TEST_ROWS) -> Path:
    """``folder/cifar-100-python`` with train, test and meta; coarse labels differ from fine."""
    rng = np.random.default_rng(seed)
    out = folder / "cifar-100-python"
    out.mkdir(parents=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        fine = rng.integers(20, 100, rows).tolist()
        coarse = [f % 20 for f in fine]
        write_pickle(out / name, cifar_batch(rng, rows, {b"fine_labels": fine,
                                                          b"coarse_labels": coarse},
                                             name.encode()))
    write_pickle(out / "meta", {b"fine_label_names": [b"apple"] * 100,
                                b"coarse_label_names": [b"fish"] * 20})
    return out


def write_leaf(folder: Path, split_users: dict[str, list[dict[str, dict[str, list]]]]) -> Path:
    """``folder/train`` and ``folder/test``: one JSON file per dict of ``{user: {x, y}}``."""
    for split, files in split_users.items():
        (folder / split).mkdir(parents=True)
        for i, users in enumerate(files):
            blob = {"users": list(users), "hierarchies": [],
                    "num_samples": [len(u["y"]) for u in users.values()],
                    "user_data": users}
            name = f"all_data_{i}_niid_0_keep_0_{split}_9.json"
            (folder / split / name).write_text(json.dumps(blob))
    return folder


LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def shakespeare_user(rng: np.random.Generator, n: int) -> dict[str, list]:
    """n windows of 80 characters and the character after each, from one random text."""
    text = "".join(rng.choice(list(LETTERS), n + 80))
    return {"x": [text[i:i + 80] for i in range(n)], "y": [text[i + 80] for i in range(n)]}


def femnist_user(rng: np.random.Generator, n: int) -> dict[str, list]:
    return {"x": rng.random((n, 784)).round(4).tolist(), "y": rng.integers(0, 62, n).tolist()}


TWEET_WORDS = ["good", "bad", "day", "@friend", "#fun", "don't", "love", "hate", "the", "a"]


def sent140_user(rng: np.random.Generator, n: int, user: str) -> dict[str, list]:
    xs = [[str(rng.integers(10**9)), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user,
           " ".join(rng.choice(TWEET_WORDS, 6)).upper()] for _ in range(n)]
    return {"x": xs, "y": rng.integers(0, 2, n).tolist()}


def leaf_users(kind: str, rng: np.random.Generator, sizes: dict[str, int]) -> dict[str, dict]:
    make = {"femnist": lambda u, n: femnist_user(rng, n),
            "shakespeare": lambda u, n: shakespeare_user(rng, n),
            "sent140": lambda u, n: sent140_user(rng, n, u)}[kind]
    return {user: make(user, n) for user, n in sizes.items()}


def write_leaf_set(folder: Path, kind: str, seed: int = 0, users: int = 4) -> Path:
    """A LEAF miniature: ``users`` users over two train files, their test data in one file."""
    rng = np.random.default_rng(seed)
    names = [f"{kind[:3]}_user_{k}" for k in range(users)]
    half = users // 2
    train = [leaf_users(kind, rng, {u: 6 + 2 * k for k, u in enumerate(names[:half])}),
             leaf_users(kind, rng, {u: 6 + 2 * k for k, u in enumerate(names[half:], half)})]
    test = [leaf_users(kind, rng, {u: 3 for u in reversed(names)})]
    return write_leaf(folder / kind / "data", {"train": train, "test": test})
