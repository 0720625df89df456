"""Imports point down: each layer, imported in a fresh interpreter, loads only what it may.

``aggregation`` and ``privacy`` load no Flower, SQLAlchemy, ``server``, ``client`` or
``simulations``; ``client.protocol`` (the message contract) loads no torch and nothing
else of ``client``; the server reaches ``client`` only through ``client.protocol`` and
loads no torch.
Each check imports every module of a package in turn and names the module that first
pulled in a forbidden one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Imports each of ``modules`` and, for a package, every module in it (found on disk, not by
# importing), one after another; prints, per module, the modules its import loaded first.
_PROBE = """
import importlib, json, pkgutil, sys
from pathlib import Path

def walk(name):
    yield name
    path = Path(name.replace(".", "/"))
    if (path / "__init__.py").is_file():
        for info in pkgutil.iter_modules([str(path)]):
            if info.name not in ("__main__", "migrations"):  # commands and alembic scripts
                yield from walk(name + "." + info.name)

loaded = {}
for name in [m for top in sys.argv[1:] for m in walk(top)]:
    before = set(sys.modules)
    importlib.import_module(name)
    loaded[name] = sorted(set(sys.modules) - before)
print(json.dumps(loaded))
"""


def loaded_by(*modules: str) -> dict[str, list[str]]:
    """For each module (and submodule) of ``modules``, imported in order in a fresh
    interpreter: the modules that its import loaded first."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PROBE, *modules], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offenders(loaded: dict[str, list[str]], forbidden: tuple[str, ...],
              allowed: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Per importing module, the forbidden modules it loaded: those within a ``forbidden``
    package, except ``allowed`` packages, their modules and their parent packages."""
    def ok(name: str) -> bool:
        return any(_within(name, a) or _within(a, name) for a in allowed)

    found = {}
    for importer, names in loaded.items():
        bad = [n for n in names if any(_within(n, f) for f in forbidden) and not ok(n)]
        if bad:
            found[importer] = bad[:5]
    return found


@pytest.mark.parametrize("package", ["aggregation", "aggregation.ring", "privacy",
                                     "privacy.dp", "privacy.secagg"])
def test_pure_layers_load_no_flower_sql_server_or_client(package: str) -> None:
    loaded = loaded_by(package)
    assert len(loaded) > 1, loaded  # the package and its modules were all imported
    assert offenders(loaded, ("flwr", "sqlalchemy", "server", "client", "simulations")) == {}


def test_message_contract_loads_no_torch_and_no_other_client_module() -> None:
    loaded = loaded_by("client.protocol")
    assert {"client.protocol.keys", "client.protocol.secagg", "client.protocol.ring"} <= set(
        loaded)
    assert offenders(loaded, ("torch", "client", "server", "sqlalchemy", "simulations"),
                     allowed=("client.protocol",)) == {}


def test_server_reaches_client_only_through_the_protocol() -> None:
    loaded = loaded_by("server")  # every module of the server, the cross-silo rounds too
    assert "server.cross_silo" in loaded and "server.app" in loaded
    assert offenders(loaded, ("client", "simulations"), allowed=("client.protocol",)) == {}
    assert offenders(loaded, ("torch",)) == {}  # the silos train; the server never needs it
