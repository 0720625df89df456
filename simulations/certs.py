"""Development TLS certificates and SuperNode authentication keys, made with ``cryptography``.

``fedring certs --out DIR --nodes N`` writes, for a federation on one machine or a LAN:

- ``ca.pem``/``ca.key``: a self-signed development CA (keep ``ca.key`` private);
- ``server.pem``/``server.key``: the SuperLink's certificate for ``--hosts``
  (``flower-superlink --ssl-ca-certfile ca.pem --ssl-certfile server.pem
  --ssl-keyfile server.key``; SuperNodes and ``flwr`` verify it with ``ca.pem``);
- ``node-I.pem``/``node-I.key``: a certificate per SuperNode machine, for the SuperNode's
  own Runtime API where its ClientApp executor connects (``flower-supernode
  --ssl-certfile node-I.pem --ssl-keyfile node-I.key --ssl-ca-certfile ca.pem``);
- ``node-I.auth``/``node-I.auth.pub``: the SuperNode's authentication key pair (ECDSA
  P-384, OpenSSH format): ``flower-supernode --auth-supernode-private-key node-I.auth``
  on the node, ``flwr supernode register node-I.auth.pub <federation>`` by the operator
  of a SuperLink started with ``--enable-supernode-auth``;
- ``node-I.secagg``: the node's SecAgg+ identity key (Ed25519, PEM; node config
  ``secagg-identity-key``), which signs its key advertisements against a server that lies;
- ``secagg-trusted-keys.txt``: every node's identity public key, one hex per line (node
  config ``secagg-trusted-keys``), which the operator gives to every node.

Development only: the CA key sits next to the certificates and nothing is revoked.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from privacy.secagg.identity import Identity, TrustedKeys

DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")
VALID_DAYS = 365
TRUSTED_KEYS_FILE = "secagg-trusted-keys.txt"


@dataclass(frozen=True)
class Material:
    """Paths of what :func:`write_all` produced."""

    ca: Path
    server_cert: Path
    server_key: Path
    node_certs: list[tuple[Path, Path]]
    auth_keys: list[tuple[Path, Path]]
    secagg_keys: list[Path]  # node-I.secagg, the SecAgg+ identity keys
    secagg_trusted: Path | None  # secagg-trusted-keys.txt (None without nodes)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedring development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC)
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)


def make_ca(common_name: str = "fedring development CA", days: int = VALID_DAYS
            ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA key and certificate (ECDSA P-256)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str,
          hosts: Sequence[str], days: int = VALID_DAYS
          ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A key and a CA-signed TLS certificate for ``hosts`` (server and client use)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    cert = (x509.CertificateBuilder()
            .subject_name(_name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def make_auth_key() -> ec.EllipticCurvePrivateKey:
    """A SuperNode authentication key (Flower accepts NIST EC curves; P-384 here)."""
    return ec.generate_private_key(ec.SECP384R1())


def _write(path: Path, data: bytes, *, private: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_auth_key(out: Path, name: str) -> tuple[Path, Path]:
    """Write ``name`` (OpenSSH private key) and ``name.pub``; returns both paths."""
    key = make_auth_key()
    private = _write(out / name, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption()), private=True)
    public = _write(out / f"{name}.pub", key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    return private, public


def public_key_pem(public_key_path: Path) -> bytes:
    """A SuperNode's OpenSSH public key file as the PEM bytes Flower registers."""
    key = serialization.load_ssh_public_key(public_key_path.read_bytes())
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(f"{public_key_path} is not an EC public key")
    return key.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def write_secagg_keys(out: Path, nodes: int) -> tuple[list[Path], Path | None]:
    """Write ``node-I.secagg`` per node and, with nodes, ``secagg-trusted-keys.txt``
    listing all their public keys; returns the paths."""
    identities = [Identity.generate() for _ in range(nodes)]
    keys = [_write(out / f"node-{i}.secagg", identity.to_pem(), private=True)
            for i, identity in enumerate(identities)]
    if not identities:
        return keys, None
    trusted = TrustedKeys(identity.public for identity in identities)
    return keys, _write(out / TRUSTED_KEYS_FILE, trusted.to_text().encode())


def write_all(out: Path, *, nodes: int, hosts: Sequence[str] = DEFAULT_HOSTS,
              node_hosts: Sequence[str] = DEFAULT_HOSTS, days: int = VALID_DAYS) -> Material:
    """Write the CA, the SuperLink certificate, per-node certificates, auth keys and
    SecAgg+ identity keys, and the trusted-keys file."""
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, got {nodes}")
    out = Path(out)
    ca_key, ca_cert = make_ca(days=days)
    _write(out / "ca.key", _pem_key(ca_key), private=True)
    ca = _write(out / "ca.pem", _pem_cert(ca_cert))
    key, cert = issue(ca_key, ca_cert, "fedring SuperLink", hosts, days)
    server_key = _write(out / "server.key", _pem_key(key), private=True)
    server_cert = _write(out / "server.pem", _pem_cert(cert))
    node_certs, auth_keys = [], []
    for i in range(nodes):
        key, cert = issue(ca_key, ca_cert, f"fedring SuperNode {i}", node_hosts, days)
        node_certs.append((_write(out / f"node-{i}.pem", _pem_cert(cert)),
                           _write(out / f"node-{i}.key", _pem_key(key), private=True)))
        auth_keys.append(write_auth_key(out, f"node-{i}.auth"))
    secagg_keys, secagg_trusted = write_secagg_keys(out, nodes)
    return Material(ca=ca, server_cert=server_cert, server_key=server_key,
                    node_certs=node_certs, auth_keys=auth_keys, secagg_keys=secagg_keys,
                    secagg_trusted=secagg_trusted)
