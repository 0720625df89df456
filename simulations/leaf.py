"""LEAF benchmark data (FEMNIST, Shakespeare, Sent140) from its JSON files, read offline.

LEAF (Caldas et al. 2018, https://github.com/TalwalkarLab/leaf) builds its data sets with
``preprocess.sh`` in ``data/<name>/``; the result is ``data/<name>/data/train/*.json`` and
``data/<name>/data/test/*.json``. Point ``data.options.path`` at the folder holding ``train``
and ``test``. Every file is ``{"users": [...], "num_samples": [...], "user_data": {user:
{"x": [...], "y": [...]}}}``; a user's samples may be spread over several files.

Every LEAF user is one client: the training samples' ``groups`` number the users in order of
their first appearance (files read in name order), so ``partitioner = "natural"`` gives each
user's own data to one client. ``max_users`` keeps only the first that many users (train and
test alike). The test files' samples of the kept users form the server's held-out set.

Inputs:

- ``femnist``: ``x`` 784 floats (a 28x28 image) -> float32 ``[n, 1, 28, 28]``; ``y`` one of
  62 classes.
- ``shakespeare``: ``x`` a string of 80 characters -> int64 ``[n, 80]`` indices into LEAF's
  ``ALL_LETTERS`` (80 characters; any other character is mapped to the space, as none occurs
  in LEAF's own preprocessing of the plays); ``y`` the next character, as its index.
- ``sent140``: ``x`` a tweet ``[id, date, query, user, text]`` -> a hashed bag of words:
  the text is lower-cased, split into tokens of letters, digits, apostrophes, ``@`` and
  ``#``, each token counted at ``crc32(token) % features`` (``features``: 1024 by default),
  float32 ``[n, features]``; ``y`` 0 (negative) or 1 (positive).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["ALL_LETTERS", "LEAF_NAMES", "LEAF_URL", "LeafIndex", "load_leaf", "text_to_indices"]

LEAF_URL = "https://github.com/TalwalkarLab/leaf"
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_SPACE = ALL_LETTERS.index(" ")
_LETTER_INDEX = np.full(256, _SPACE, dtype=np.int64)  # Latin-1 code -> index
for _i, _c in enumerate(ALL_LETTERS):
    _LETTER_INDEX[ord(_c)] = _i
SEQ_LEN = 80
FEMNIST_CLASSES = 62
SENT140_FEATURES = 1024
_TOKEN = re.compile(r"[a-z0-9'@#]+")
LEAF_NAMES = ("femnist", "sent140", "shakespeare")


def text_to_indices(text: str) -> np.ndarray:
    """int64 indices of ``text``'s characters in :data:`ALL_LETTERS` (others: the space)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    out = np.full(len(codes), _SPACE, dtype=np.int64)
    latin1 = codes < 256
    out[latin1] = _LETTER_INDEX[codes[latin1]]
    return out


def _hint(name: str) -> str:
    return (f"build the {name} data with LEAF's preprocess.sh ({LEAF_URL}, data/{name}/) and "
            f"set data.options.path to data/{name}/data, the folder holding train/ and test/")


def _json_files(folder: str, split: str, name: str) -> list[str]:
    sub = os.path.join(folder, split)
    if not os.path.isdir(sub):
        raise ValueError(f"{name}: {sub!r} not found; {_hint(name)}")
    files = sorted(f for f in os.listdir(sub) if f.endswith(".json"))
    if not files:
        raise ValueError(f"{name}: no .json files in {sub!r}; {_hint(name)}")
    return [os.path.join(sub, f) for f in files]


def _users(path: str, name: str) -> Iterator[tuple[str, list[Any], list[Any]]]:
    """``(user, xs, ys)`` of one LEAF file, checked against its ``users``/``num_samples``."""
    try:
        with open(path, encoding="utf-8") as f:
            blob = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: cannot read {path!r} as JSON ({exc}); {_hint(name)}") from exc
    if not isinstance(blob, dict) or not all(k in blob for k in ("users", "user_data")):
        raise ValueError(f"{name}: {path!r} is not a LEAF file: it needs 'users', "
                         "'num_samples' and 'user_data'")
    users, data = blob["users"], blob["user_data"]
    counts = blob.get("num_samples", [None] * len(users))
    if not isinstance(users, list) or not isinstance(data, dict) or len(counts) != len(users):
        raise ValueError(f"{name}: {path!r}: 'users' and 'num_samples' must be lists of equal "
                         "length and 'user_data' an object")
    for user, count in zip(users, counts, strict=True):
        entry = data.get(user)
        if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
            raise ValueError(f"{name}: {path!r}: user {user!r} has no x and y in 'user_data'")
        xs, ys = entry["x"], entry["y"]
        if len(xs) != len(ys) or (count is not None and count != len(ys)):
            raise ValueError(f"{name}: {path!r}: user {user!r} has {len(xs)} x, {len(ys)} y "
                             f"and num_samples {count}")
        yield str(user), xs, ys


def _femnist_x(xs: list[Any], where: str) -> np.ndarray:
    x = np.asarray(xs, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != 784:
        raise ValueError(f"femnist: {where}: x must be rows of 784 pixels, got shape {x.shape}")
    return x.reshape(-1, 1, 28, 28)


def _shakespeare_x(xs: list[Any], where: str) -> np.ndarray:
    if not all(isinstance(s, str) and len(s) == SEQ_LEN for s in xs):
        raise ValueError(f"shakespeare: {where}: x must be strings of {SEQ_LEN} characters")
    return text_to_indices("".join(xs)).reshape(-1, SEQ_LEN)


def _shakespeare_y(ys: list[Any], where: str) -> np.ndarray:
    if not all(isinstance(c, str) and len(c) == 1 for c in ys):
        raise ValueError(f"shakespeare: {where}: y must be single characters")
    return text_to_indices("".join(ys))


def _sent140_x(features: int) -> Callable[[list[Any], str], np.ndarray]:
    def encode(xs: list[Any], where: str) -> np.ndarray:
        out = np.zeros((len(xs), features), dtype=np.float32)
        for row, tweet in enumerate(xs):
            if not isinstance(tweet, list) or len(tweet) != 5 or not isinstance(tweet[4], str):
                raise ValueError(f"sent140: {where}: x must be tweets [id, date, query, user, "
                                 f"text], got {str(tweet)[:80]}")
            for token in _TOKEN.findall(tweet[4].lower()):
                out[row, zlib.crc32(token.encode("utf-8")) % features] += 1.0
        return out
    return encode


def _int_labels(num_classes: int, name: str) -> Callable[[list[Any], str], np.ndarray]:
    def labels(ys: list[Any], where: str) -> np.ndarray:
        y = np.asarray(ys)
        if len(y) and not (np.issubdtype(y.dtype, np.number) and (y == np.round(y)).all()):
            raise ValueError(f"{name}: {where}: y must be integer class labels")
        y = y.astype(np.int64)
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{name}: {where}: y must lie in [0, {num_classes}), found "
                             f"{y.min()}..{y.max()}")
        return y
    return labels


def _check(name: str, path: str | os.PathLike[str] | None, max_users: int | None,
           features: int) -> tuple[str, Callable[[list[Any], str], np.ndarray],
                                   Callable[[list[Any], str], np.ndarray], int,
                                   tuple[int, ...]]:
    """The checked folder, then the encoders, class count and input shape of ``name``."""
    if path is None or not os.fspath(path):
        raise ValueError(f"dataset {name!r} reads LEAF JSON files from disk: set "
                         f"data.options.path (e.g. --set data.options.path=leaf/data/{name}/data)"
                         f"; {_hint(name)}")
    if max_users is not None and (isinstance(max_users, bool) or not isinstance(max_users, int)
                                  or max_users < 1):
        raise ValueError(f"{name}: max_users must be an integer >= 1, got {max_users!r}")
    if isinstance(features, bool) or not isinstance(features, int) or features < 1:
        raise ValueError(f"{name}: features must be an integer >= 1, got {features!r}")
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"{name}: data.options.path {folder!r} is not a folder; {_hint(name)}")
    encode_x, encode_y, num_classes, shape = {
        "femnist": (_femnist_x, _int_labels(FEMNIST_CLASSES, name), FEMNIST_CLASSES, (1, 28, 28)),
        "shakespeare": (_shakespeare_x, _shakespeare_y, len(ALL_LETTERS), (SEQ_LEN,)),
        "sent140": (_sent140_x(features), _int_labels(2, name), 2, (features,)),
    }[name]
    return folder, encode_x, encode_y, num_classes, shape


def load_leaf(name: str, *, path: str | os.PathLike[str] | None = None,
              max_users: int | None = None, features: int = SENT140_FEATURES) -> dict[str, Any]:
    """The fields of a :class:`~simulations.datasets.Dataset` read from a LEAF data folder."""
    folder, encode_x, encode_y, num_classes, shape = _check(name, path, max_users, features)
    user_ids: dict[str, int] = {}
    splits: dict[str, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]] = {}
    for split in ("train", "test"):
        xs_, ys_, gs_ = [], [], []
        for file in _json_files(folder, split, name):
            for user, xs, ys in _users(file, name):
                if split == "train" and user not in user_ids and len(ys) and (
                        max_users is None or len(user_ids) < max_users):
                    user_ids[user] = len(user_ids)
                if user not in user_ids or not len(ys):
                    continue
                where = f"{file!r} user {user!r}"
                xs_.append(encode_x(xs, where))
                ys_.append(encode_y(ys, where))
                gs_.append(np.full(len(ys), user_ids[user], dtype=np.int64))
        if not xs_:
            raise ValueError(f"{name}: no samples in {os.path.join(folder, split)!r}"
                             + ("" if split == "train" else " for the training users"))
        splits[split] = (xs_, ys_, gs_)
    (trx, try_, trg), (tex, tey, _) = splits["train"], splits["test"]
    return {"x_train": np.concatenate(trx), "y_train": np.concatenate(try_),
            "x_test": np.concatenate(tex), "y_test": np.concatenate(tey),
            "num_classes": num_classes, "input_shape": shape, "groups": np.concatenate(trg)}


_WS = re.compile(r"[ \t\n\r]*")


def _spans(path: str, name: str) -> tuple[list[str], dict[str, tuple[int, int, int]]]:
    """``(users, {user: (start, end, samples)})`` of one LEAF file: the byte span of each
    user's ``{"x": ..., "y": ...}`` in ``user_data``, found by one pass of the JSON decoder
    over the file read as Latin-1 (one character per byte, so positions are byte offsets;
    the records are decoded as UTF-8 when they are read)."""
    decoder = json.JSONDecoder()
    try:
        with open(path, "rb") as f:
            text = f.read().decode("latin-1")

        def at(pos: int, char: str) -> int:
            pos = _WS.match(text, pos).end()
            if text[pos:pos + 1] != char:
                raise ValueError(f"expected {char!r} at byte {pos}")
            return pos + 1

        users: Any = None
        counts: Any = None
        spans: dict[str, tuple[int, int, int]] | None = None
        pos = at(0, "{")
        while text[_WS.match(text, pos).end()] != "}":
            key, pos = json.decoder.scanstring(text, at(pos, '"'))
            pos = _WS.match(text, at(pos, ":")).end()
            if key == "user_data":
                spans, pos = {}, at(pos, "{")
                while text[_WS.match(text, pos).end()] != "}":
                    user, pos = json.decoder.scanstring(text, at(pos, '"'))
                    start = _WS.match(text, at(pos, ":")).end()
                    entry, pos = decoder.raw_decode(text, start)
                    if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
                        raise _NotLeaf(f"user {user!r} has no x and y in 'user_data'")
                    if len(entry["x"]) != len(entry["y"]):
                        raise _NotLeaf(f"user {user!r} has {len(entry['x'])} x, "
                                       f"{len(entry['y'])} y")
                    spans[user] = (start, pos, len(entry["y"]))
                    pos = _WS.match(text, pos).end()
                    pos += text[pos] == ","
                pos = at(pos, "}")
            else:
                value, pos = decoder.raw_decode(text, pos)
                users, counts = ((value, counts) if key == "users"
                                 else (users, value) if key == "num_samples" else (users, counts))
            pos = _WS.match(text, pos).end()
            pos += text[pos] == ","
    except _NotLeaf as exc:
        raise ValueError(f"{name}: {path!r}: {exc}") from None
    except (OSError, ValueError, IndexError) as exc:
        raise ValueError(f"{name}: cannot read {path!r} as JSON ({exc}); {_hint(name)}") from exc
    if users is None or spans is None:
        raise ValueError(f"{name}: {path!r} is not a LEAF file: it needs 'users', "
                         "'num_samples' and 'user_data'")
    if counts is None:
        counts = [None] * len(users)
    if not isinstance(users, list) or not isinstance(counts, list) or len(counts) != len(users):
        raise ValueError(f"{name}: {path!r}: 'users' and 'num_samples' must be lists of equal "
                         "length and 'user_data' an object")
    for user, count in zip(users, counts, strict=True):
        if str(user) not in spans:
            raise ValueError(f"{name}: {path!r}: user {user!r} has no x and y in 'user_data'")
        if count is not None and count != spans[str(user)][2]:
            raise ValueError(f"{name}: {path!r}: user {user!r} has {spans[str(user)][2]} "
                             f"samples and num_samples {count}")
    return [str(u) for u in users], spans


class _NotLeaf(Exception):
    """A LEAF file's structure is not as LEAF writes it."""


class LeafIndex:
    """A LEAF folder indexed once, each user's records read when the user is asked for.

    One pass over the files (one file in memory at a time) keeps, per user and file it
    appears in, the file number and the byte span of its records: a few int64 per client,
    no user names. Users are numbered as :func:`load_leaf` numbers them (first appearance
    in the training files, ``max_users`` kept), so client ``i`` gets the same records in
    the same order either way.
    """

    def __init__(self, name: str, *, path: str | os.PathLike[str] | None = None,
                 max_users: int | None = None, features: int = SENT140_FEATURES) -> None:
        folder, self._encode_x, self._encode_y, self.num_classes, self.input_shape = _check(
            name, path, max_users, features)
        self.name = name
        self.x_dtype = np.dtype(np.int64 if name == "shakespeare" else np.float32)
        self.files: dict[str, list[str]] = {}
        self._index: dict[str, tuple[np.ndarray, ...]] = {}
        user_ids: dict[str, int] = {}
        for split in ("train", "test"):
            self.files[split] = _json_files(folder, split, name)
            ids: list[int] = []
            where: list[tuple[int, int, int]] = []
            for f, file in enumerate(self.files[split]):
                users, spans = _spans(file, name)
                for user in users:
                    start, end, count = spans[user]
                    if split == "train" and user not in user_ids and count and (
                            max_users is None or len(user_ids) < max_users):
                        user_ids[user] = len(user_ids)
                    if user in user_ids and count:
                        ids.append(user_ids[user])
                        where.append((f, start, end))
            if not ids:
                raise ValueError(f"{name}: no samples in {os.path.join(folder, split)!r}"
                                 + ("" if split == "train" else " for the training users"))
            order = np.argsort(np.asarray(ids, dtype=np.int64), kind="stable")
            spans_ = np.asarray(where, dtype=np.int64)[order]
            offsets = np.searchsorted(np.asarray(ids, dtype=np.int64)[order],
                                      np.arange(len(user_ids) + 1))
            self._index[split] = (offsets.astype(np.int64), spans_)
        self.num_clients = len(user_ids)

    def records(self, split: str, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``i``'s ``split`` records (``"train"`` or ``"test"``), encoded."""
        offsets, spans = self._index[split]
        xs, ys = [], []
        for f, start, end in spans[offsets[i]:offsets[i + 1]]:
            file = self.files[split][int(f)]
            with open(file, "rb") as fh:
                fh.seek(int(start))
                entry = json.loads(fh.read(int(end - start)))
            where = f"{file!r} client {i}"
            xs.append(self._encode_x(entry["x"], where))
            ys.append(self._encode_y(entry["y"], where))
        if not xs:
            return np.empty((0, *self.input_shape), self.x_dtype), np.empty(0, np.int64)
        return np.concatenate(xs), np.concatenate(ys)

    def train(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.records("train", i)

    def held_out(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.records("test", i)
