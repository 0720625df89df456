"""Imports point down: each layer, imported in a fresh interpreter, loads only what it may.

``aggregation`` and ``privacy`` load no Flower, SQLAlchemy, ``server``, ``client`` or
``simulations``; ``client.protocol`` (the message contract) loads no torch and nothing
else of ``client``; the server reaches ``client`` only through ``client.protocol`` and
loads no torch.
Each check imports every module of a package in turn and names the module that first
pulled in a forbidden one.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Collection
from itertools import pairwise
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


# -- No import cycle, type-only ones included ---------------------------------------------

PACKAGES = ("server", "client", "simulations", "aggregation", "privacy")


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package) for every ``.py`` file of ``packages``."""
    found = {}
    for top in packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imported(node: ast.Import | ast.ImportFrom, package: str, known: Collection[str]
              ) -> list[str]:
    """The modules an import statement names (``from m import x``: ``m.x`` when that is a
    module, else ``m``), relative imports resolved against ``package``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line}, over every import statement in the file:
    module level, inside functions and under ``if TYPE_CHECKING:`` alike (an import of
    ``a.b`` is an edge to ``a.b``, not to its parent packages)."""
    modules = _modules(root, packages)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(node, package, modules):
                    while target not in modules and "." in target:
                        target = target.rpartition(".")[0]
                    if target in modules and target != name:
                        edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _cycle_through(graph: dict[str, dict[str, int]], start: str) -> list[str] | None:
    """A shortest cycle from ``start`` back to it (breadth first), or None."""
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                todo.append(nxt)
    return None


def import_cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each cycle once, as ``a (line 3) -> b (line 9) -> a``: the line of each import."""
    seen: set[frozenset[str]] = set()
    out = []
    for start in sorted(graph):
        cycle = _cycle_through(graph, start)
        if cycle and frozenset(cycle) not in seen:
            seen.add(frozenset(cycle))
            out.append(" -> ".join(f"{a} (line {graph[a][b]})"
                                   for a, b in pairwise(cycle))
                       + f" -> {cycle[-1]}")
    return out


def test_no_import_cycle_type_only_imports_included() -> None:
    graph = import_graph(ROOT)
    assert {"server.rounds", "aggregation.robust", "privacy.secagg.policy"} <= set(graph)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (each import's line in its module):\n" + "\n".join(cycles)


def test_cycle_check_sees_imports_under_type_checking_and_in_functions(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == [
        "pkg.a (line 3) -> pkg.b (line 2) -> pkg.c (line 1) -> pkg.a"]


# Flower's internals: only ``client.protocol.flower_compat`` may name them --------------

FLOWER_COMPAT = "client/protocol/flower_compat.py"
# Flower's public API: these modules, and of ``flwr.common`` only its exported names.
FLOWER_PUBLIC = ("flwr.app", "flwr.serverapp", "flwr.serverapp.strategy", "flwr.clientapp",
                 "flwr.clientapp.mod", "flwr.common")
# Private attributes of Flower objects that code reaches through ``__dict__``.
FLOWER_PRIVATE_STRINGS = ("_data", "_message_id", "_run_id", "_src_node_id",
                          "_reply_to_message_id", "_is_dirty")
# Files that still import a Flower internal the compat module already offers: the list
# may only shrink (a test fails when an entry is no longer needed).
FLOWER_PENDING: dict[str, list[str]] = {}


def _flower_common_names() -> set[str]:
    import flwr.common

    return set(flwr.common.__all__)


def flower_internals(source: str, common: set[str]) -> list[str]:
    """Each use in ``source`` of a Flower internal module or private name, as
    "line N: what"."""
    import ast

    found = []

    def bad_import(module: str, names: list[str]) -> str | None:
        if module != "flwr" and not module.startswith("flwr."):
            return None
        if module not in FLOWER_PUBLIC:
            return f"Flower internal module {module}"
        private = [n for n in names if n.startswith("_")
                   or (module == "flwr.common" and n != "*" and n not in common)]
        return f"private names {private} from {module}" if private else None

    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Import):
            what = next(filter(None, (bad_import(a.name, []) for a in node.names)), None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            what = bad_import(node.module, [a.name for a in node.names])
            if what and node.module not in FLOWER_PUBLIC:
                what += f" ({', '.join(a.name for a in node.names)})"
        elif isinstance(node, ast.Constant) and node.value in FLOWER_PRIVATE_STRINGS:
            what = f"the private attribute name {node.value!r}"
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "__dict__":
            what = "__dict__[...]"
        if what:
            found.append(f"line {node.lineno}: {what}")
    return found


def _flower_offenders() -> dict[str, list[str]]:
    common = _flower_common_names()
    found = {}
    for top in ("server", "client", "simulations", "aggregation", "privacy"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != FLOWER_COMPAT and (uses := flower_internals(path.read_text(), common)):
                found[rel] = uses
    return found


def _without_lines(uses: list[str]) -> list[str]:
    return [use.split(": ", 1)[1] for use in uses]


def test_flower_internals_only_in_the_compat_module() -> None:
    found = {path: uses for path, uses in _flower_offenders().items()
             if _without_lines(uses) != FLOWER_PENDING.get(path)}
    assert found == {}, (
        "use client.protocol.flower_compat (add a named function there, with its test in "
        "tests/architecture/test_flower_compat.py) instead of Flower's internals")


def test_pending_flower_internals_are_still_there() -> None:
    """An entry of FLOWER_PENDING whose file no longer needs it must be removed."""
    found = _flower_offenders()
    for path, uses in FLOWER_PENDING.items():
        assert _without_lines(found.get(path, [])) == uses, f"update FLOWER_PENDING[{path!r}]"


@pytest.mark.parametrize(("source", "expected"), [
    ("from flwr.supercore.run import Run\n", "Flower internal module flwr.supercore.run"),
    ("import flwr.simulation.run_simulation\n", "Flower internal module"),
    ("from flwr.simulation.run_simulation import _run_simulation\n", "_run_simulation"),
    ("from flwr.app import _secret\n", "private names ['_secret']"),
    ("from flwr.common import log\nfrom flwr.common import serde\n", "private names ['serde']"),
    ("def f(m):\n    m.metadata.__dict__['message_id'] = 1\n", "__dict__[...]"),
    ("def f(r):\n    return r.__dict__.get('_data')\n", "'_data'"),
    ("ID = '_message_id'\n", "'_message_id'"),
])
def test_flower_internals_rule_catches(source: str, expected: str) -> None:
    found = flower_internals(source, _flower_common_names())
    assert len(found) == 1 and expected in found[0], found


def test_flower_internals_rule_allows_the_public_api() -> None:
    source = ("from flwr.app import ArrayRecord, Message\nfrom flwr.serverapp import Grid\n"
              "from flwr.clientapp import ClientApp\nfrom flwr.common import log\n"
              "import numpy._core\nfrom aggregation import _x\nself_data = '_personal'\n")
    assert flower_internals(source, _flower_common_names()) == []
