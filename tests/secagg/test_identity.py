"""privacy.secagg.identity: Ed25519 identities, domain-separated signatures, trusted keys."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from privacy.secagg.identity import (
    DOMAIN,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    TrustedKeys,
    signed_bytes,
)

RUN, ROUND = 7, 3
ADVERT = b"\x01" * 32 + b"\x02" * 32  # stands for a round's X25519 public keys


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def trusted(alice: Identity, bob: Identity) -> TrustedKeys:
    return TrustedKeys([alice.public, bob.public])


def test_a_signature_verifies_for_its_signer_and_message_only(alice, bob, trusted):
    message = signed_bytes("advertise", RUN, ROUND, ADVERT)
    signature = alice.sign(message)
    assert len(alice.public) == PUBLIC_KEY_BYTES and len(signature) == SIGNATURE_BYTES
    assert trusted.verify(alice.public, signature, message)
    assert not trusted.verify(bob.public, signature, message)  # claimed by another peer
    assert not trusted.verify(alice.public, signature, message + b"\x00")
    tampered = bytes([signature[0] ^ 1]) + signature[1:]
    assert not trusted.verify(alice.public, tampered, message)
    assert not trusted.verify(alice.public, signature[:-1], message)  # wrong length


def test_an_untrusted_key_is_refused_even_with_a_valid_signature(alice, trusted):
    mallory = Identity.generate()  # e.g. a key the server substituted
    message = signed_bytes("advertise", RUN, ROUND, ADVERT)
    signature = mallory.sign(message)
    Ed25519PublicKey.from_public_bytes(mallory.public).verify(signature, message)  # valid
    assert mallory.public not in trusted
    assert not trusted.verify(mallory.public, signature, message)


@pytest.mark.parametrize("other", [
    ("consistency", RUN, ROUND, ADVERT),  # another purpose
    ("advertise", RUN + 1, ROUND, ADVERT),  # another run
    ("advertise", RUN, ROUND + 1, ADVERT),  # another round (a replay)
    ("advertise", RUN, ROUND, ADVERT[:-1]),  # another content
    ("advertise", RUN, ROUND),  # a part dropped
], ids=["purpose", "run", "round", "content", "parts"])
def test_a_signature_binds_purpose_run_round_and_content(alice, trusted, other):
    signature = alice.sign(signed_bytes("advertise", RUN, ROUND, ADVERT))
    assert not trusted.verify(alice.public, signature, signed_bytes(*other))


def test_parts_are_length_prefixed(alice, trusted):
    ab_c, a_bc = signed_bytes("set", b"ab", b"c"), signed_bytes("set", b"a", b"bc")
    assert ab_c != a_bc
    assert not trusted.verify(alice.public, alice.sign(ab_c), a_bc)
    assert signed_bytes("set", b"", b"x") != signed_bytes("set", b"x", b"")
    assert signed_bytes("set", RUN, ROUND) != signed_bytes("set", ROUND, RUN)
    assert signed_bytes("ab", b"c") != signed_bytes("a", b"bc")  # the purpose too


def test_the_encoding_is_stable():
    """What clients sign must not change between versions: spelled out here."""
    assert signed_bytes("advertise", 1, b"xy") == (
        DOMAIN + b"advertise\x00" + b"\x08\x00\x00\x00" + b"\x01" + b"\x00" * 7
        + b"\x02\x00\x00\x00xy")
    assert DOMAIN == b"fedring-secagg/v1/"


def test_pem_round_trip(alice, trusted):
    again = Identity.from_pem(alice.to_pem())
    assert again.public == alice.public
    message = signed_bytes("advertise", RUN, ROUND, ADVERT)
    assert trusted.verify(alice.public, again.sign(message), message)
    assert alice.to_pem().startswith(b"-----BEGIN PRIVATE KEY-----")


def _pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.mark.parametrize("key", [ec.generate_private_key(ec.SECP256R1()),
                                 x25519.X25519PrivateKey.generate()],
                         ids=["ecdsa-p256", "x25519"])
def test_a_key_of_another_kind_is_refused(key):
    with pytest.raises(ValueError, match=r"node-0\.secagg: an Ed25519 key is needed"):
        Identity.from_pem(_pem(key), source="node-0.secagg")


def test_a_file_that_is_no_unencrypted_pem_key_is_refused(alice):
    with pytest.raises(ValueError, match="my key: not an unencrypted PEM private key"):
        Identity.from_pem(b"not a key", source="my key")
    encrypted = alice.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"))
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        Identity.from_pem(encrypted)
    public_pem = alice.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        Identity.from_pem(public_pem)  # the public half is no identity


def test_trusted_keys_file_round_trip(tmp_path, alice, bob, trusted):
    text = trusted.to_text()
    assert text.splitlines() == sorted([alice.public.hex(), bob.public.hex()])
    assert TrustedKeys.from_text(text).keys == trusted.keys
    path = tmp_path / "secagg-trusted-keys.txt"
    path.write_text(f"# the federation's nodes\n\n{alice.public.hex()}  # node-0\n"
                    f"  {bob.public.hex().upper()}\n")
    read = TrustedKeys.read(path)
    assert read.keys == trusted.keys and len(read) == 2
    assert alice.public in read and Identity.generate().public not in read


@pytest.mark.parametrize(("text", "error"), [
    ("", "no trusted key"),
    ("# only a comment\n\n", "no trusted key"),
    ("zz" * 32 + "\n", "line 1: not a 32-byte hex Ed25519 public key"),
    ("00" * 32 + "\n" + "00" * 31 + "\n", "line 2: not a 32-byte hex"),
    ("00" * 33 + "\n", "line 1: not a 32-byte hex"),
], ids=["empty", "comments-only", "not-hex", "short", "long"])
def test_a_malformed_trusted_keys_file_names_itself_and_the_line(tmp_path, text, error):
    path = tmp_path / "trusted.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=str(path)) as raised:
        TrustedKeys.read(path)
    assert error in str(raised.value)


def test_a_trusted_key_has_32_bytes():
    with pytest.raises(ValueError, match="32 raw bytes"):
        TrustedKeys([b"\x00" * 31])
