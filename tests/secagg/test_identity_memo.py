"""Parsed identity keys and trusted sets are remembered by their exact text, and only when
the text is valid: a node reads its node config on every message of a round."""

from __future__ import annotations

import re

import pytest

from privacy.secagg import identity as ident
from privacy.secagg.identity import Identity, TrustedKeys


def test_the_same_text_gives_the_same_parsed_object_and_other_text_another() -> None:
    a, b = Identity.generate(), Identity.generate()
    text = TrustedKeys([a.public, b.public]).to_text()
    first = TrustedKeys.from_text(text)
    assert TrustedKeys.from_text(text) is first and first.keys == {a.public, b.public}
    other = TrustedKeys.from_text(TrustedKeys([a.public]).to_text())
    assert other is not first and other.keys == {a.public}
    pem = a.to_pem()
    assert Identity.from_pem(pem) is Identity.from_pem(pem)
    assert Identity.from_pem(pem).public == a.public
    assert Identity.from_pem(b.to_pem()).public == b.public


def test_a_bad_text_fails_every_time_naming_its_source() -> None:
    bad = "00ff\n"
    for source in ("node config 'secagg-trusted-keys' (a.txt)", "b.txt"):
        with pytest.raises(ValueError, match=re.escape(f"{source}, line 1: not a 32-byte")):
            TrustedKeys.from_text(bad, source=source)
    for source in ("key one", "key two"):
        with pytest.raises(ValueError, match=f"{source}: not an unencrypted PEM"):
            Identity.from_pem(b"not a key", source=source)


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ident, "_MAX_PARSED", 8)
    for _ in range(ident._MAX_PARSED + 5):
        TrustedKeys.from_text(TrustedKeys([Identity.generate().public]).to_text())
    assert len(ident._PARSED) <= ident._MAX_PARSED


def test_the_advertisement_encoding_is_the_generic_signed_bytes() -> None:
    """The one-pack encoding of a key advertisement is the bytes ``signed_bytes`` makes:
    the signatures of earlier clients still verify."""
    from privacy.secagg import malicious as mal
    from privacy.secagg.identity import signed_bytes
    from privacy.secagg.stages import Stage

    keys = [bytes([i]) * 32 for i in range(4)]
    for run_id, round_id, node in ((0, 0, 1), (2**64 - 1, 7, 2**40)):
        assert mal.advert_message(run_id, round_id, node, *keys) == signed_bytes(
            "advertise", run_id, round_id, int(Stage.ADVERTISE_KEYS), node, *keys)
    short = [b"\x01" * 31, *keys[1:]]  # other lengths take the generic path
    assert mal.advert_message(1, 2, 3, *short) == signed_bytes(
        "advertise", 1, 2, int(Stage.ADVERTISE_KEYS), 3, *short)


def test_the_memo_keeps_its_bound_when_it_already_holds_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries parsed before the bound shrank (earlier runs in the process) are let go."""
    for _ in range(12):
        TrustedKeys.from_text(TrustedKeys([Identity.generate().public]).to_text())
    assert len(ident._PARSED) >= 12
    monkeypatch.setattr(ident, "_MAX_PARSED", 8)
    TrustedKeys.from_text(TrustedKeys([Identity.generate().public]).to_text())
    assert len(ident._PARSED) <= 8
