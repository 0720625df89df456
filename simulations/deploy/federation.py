"""The deployment's entry in Flower's own configuration, and SuperNode key registration."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from simulations.deploy.processes import DeployError


def flwr_config_path() -> Path:
    from client.protocol import flower_compat as flower  # Flower loads on first use

    return flower.flwr_home() / "config.toml"


@contextmanager
def flwr_home(path: str | None) -> Iterator[None]:
    """Flower's home as recorded by ``up`` (``$FLWR_HOME`` then; empty: the default)."""
    before = os.environ.get("FLWR_HOME")
    if path:
        os.environ["FLWR_HOME"] = path
    try:
        yield
    finally:
        if path and before is None:
            del os.environ["FLWR_HOME"]
        elif path:
            os.environ["FLWR_HOME"] = before or ""


def remove_federation(name: str) -> bool:
    """Remove ``[superlink.<name>]`` (what ``write_federation`` wrote) from Flower's config;
    True if it was there."""
    from client.protocol import flower_compat as flower

    if not flwr_config_path().exists():
        return False
    config = flower.read_flower_config()
    links = config.get("superlink", {})
    if name not in links:
        return False
    del links[name]
    if links.get("default") == name:
        del links["default"]
    flower.write_flower_config(config)
    return True


def write_federation(name: str, address: str, ca: Path | None) -> str:
    """Write ``[superlink.<name>]`` to Flower's config; returns the TOML text of the entry."""
    from client.protocol import flower_compat as flower

    flower.write_superlink_connection(name, address,
                                      root_certificates=None if ca is None else str(ca))
    body = "insecure = true" if ca is None else f"root-certificates = {json.dumps(str(ca))}"
    return f'[superlink.{name}]\naddress = "{address}"\n{body}\n'


def register_supernode(federation: str, public_key: Path) -> int:
    """What ``flwr supernode register <public_key> <federation>`` does; the new node id."""
    from client.protocol import flower_compat as flower
    from simulations.certs import public_key_pem

    node_id = flower.register_node(federation, public_key_pem(public_key))
    if not node_id:
        raise DeployError(f"the SuperLink did not register {public_key}")
    return node_id
