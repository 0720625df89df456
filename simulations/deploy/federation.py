"""The deployment's entry in Flower's own configuration, and SuperNode key registration."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from simulations.deploy.processes import DeployError


def flwr_config_path() -> Path:
    from flwr.supercore.utils import get_flwr_home

    return Path(get_flwr_home()) / "config.toml"


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
    from flwr.cli.flower_config import read_flower_config, write_flower_config

    if not flwr_config_path().exists():
        return False
    config, _ = read_flower_config()
    links = config.get("superlink", {})
    if name not in links:
        return False
    del links[name]
    if links.get("default") == name:
        del links["default"]
    write_flower_config(config)
    return True


def write_federation(name: str, address: str, ca: Path | None) -> str:
    """Write ``[superlink.<name>]`` to Flower's config; returns the TOML text of the entry."""
    from flwr.cli.flower_config import write_superlink_connection
    from flwr.cli.typing import SuperLinkConnection

    if ca is None:
        conn = SuperLinkConnection(name=name, address=address, insecure=True)
        body = "insecure = true"
    else:
        conn = SuperLinkConnection(name=name, address=address, root_certificates=str(ca))
        body = f"root-certificates = {json.dumps(str(ca))}"
    write_superlink_connection(conn)
    return f'[superlink.{name}]\naddress = "{address}"\n{body}\n'


def register_supernode(federation: str, public_key: Path) -> int:
    """What ``flwr supernode register <public_key> <federation>`` does; the new node id."""
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.utils import init_http_client_from_connection
    from flwr.proto.control_pb2 import RegisterNodeRequest

    from simulations.certs import public_key_pem

    client = init_http_client_from_connection(read_superlink_connection(federation))
    try:
        res = client.RegisterNode(RegisterNodeRequest(public_key=public_key_pem(public_key)))
    finally:
        client.close()
    if not res.node_id:
        raise DeployError(f"the SuperLink did not register {public_key}")
    return int(res.node_id)
