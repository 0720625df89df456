"""The supported Pythons: pyproject.toml, the Makefile and CI agree, and each gets its own venv."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
RUNNING = f"{sys.version_info.major}.{sys.version_info.minor}"


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _supported() -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "python_versions.py")],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def _makefile_value(name: str) -> str:
    """A variable's text in the Makefile, continuation lines joined."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name} :?= (.*)$", text, re.MULTILINE)
    assert match, f"no {name} in the Makefile"
    return match.group(1)


@pytest.fixture(autouse=True)
def _shell_environment(monkeypatch):
    """A user's shell: no PYTHONPATH or PYTHONHOME, which Ray leaves set for Python 3.11 in
    this process once a test started it, and which breaks other Pythons."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("PYTHONHOME", raising=False)


def _make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``make -n ARGS`` in a copy of the Makefile, .ci/ and pyproject.toml (no venv there)."""
    if not (tmp_path / "Makefile").exists():
        shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
        shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
        shutil.copytree(ROOT / ".ci", tmp_path / ".ci")
    return subprocess.run(["make", "-n", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


def _venv_name(version: str) -> str:
    return ".venv" if version == _makefile_value("DEFAULT_VERSION") else f".venv-{version}"


def test_requires_python_admits_exactly_the_classified_versions():
    supported = _supported()
    spec = SpecifierSet(_project()["requires-python"])
    admitted = [f"3.{minor}" for minor in range(40) if spec.contains(f"3.{minor}.0")]
    assert admitted == supported
    # Ubuntu 24.04's python3 is 3.12; Flower 1.41, torch 2.13 and Ray install on 3.13
    assert {"3.11", "3.12", "3.13"} <= set(supported)
    assert RUNNING in supported


def test_make_defaults_to_the_oldest_version_and_ci_tries_every_other():
    supported = _supported()
    assert _makefile_value("DEFAULT_VERSION") == supported[0]
    others = subprocess.run([sys.executable, str(ROOT / ".ci" / "python_versions.py"),
                             "--others"], capture_output=True, text=True, check=True).stdout
    assert others.split() == supported[1:]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test\n" in ci and "python_versions.py --others" in ci
    assert "make test-quick PYTHON=" in ci and "simulate --rounds 2" in ci


def test_find_python_resolves_versions_and_refuses_a_missing_one():
    found = subprocess.run([str(ROOT / ".ci" / "find-python"), RUNNING], capture_output=True,
                           text=True, check=True).stdout.strip()
    version = subprocess.run([found, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == str(sys.version_info[:2])
    missing = subprocess.run([str(ROOT / ".ci" / "find-python"), "3.99"], capture_output=True,
                             text=True)
    assert missing.returncode == 1 and "no Python named '3.99'" in missing.stderr


@pytest.mark.parametrize("version", _supported())
def test_each_python_gets_its_own_venv(tmp_path, version):
    found = subprocess.run([str(ROOT / ".ci" / "find-python"), version], capture_output=True,
                           text=True)
    if found.returncode != 0 and not os.environ.get("CI"):  # CI must have every one
        pytest.skip(f"Python {version} is not installed here")
    assert found.returncode == 0, found.stderr
    for target in ("run", "test", "test-quick"):
        plan = _make(tmp_path, target, f"PYTHON={found.stdout.strip()}")
        assert plan.returncode == 0, plan.stderr
        assert f" -m venv {_venv_name(version)}\n" in plan.stdout
        assert f"{_venv_name(version)}/bin/pip install" in plan.stdout


def test_make_refuses_a_venv_built_with_another_python(tmp_path):
    fake = tmp_path / _venv_name(RUNNING) / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 3.9\n")
    fake.chmod(0o755)
    for target in ("run", "test"):
        plan = _make(tmp_path, target, f"PYTHON={sys.executable}")
        assert plan.returncode != 0
        assert f"was built with Python 3.9, not {RUNNING}" in plan.stderr
    assert _make(tmp_path, "clean", f"PYTHON={sys.executable}").returncode == 0


def test_make_refuses_a_python_that_does_not_run(tmp_path):
    plan = _make(tmp_path, "run", "PYTHON=python3.99")
    assert plan.returncode != 0 and "PYTHON=python3.99 does not run" in plan.stderr
    # `make clean` with a PYTHON that does not run must not fall back to the default's venv
    assert _make(tmp_path, "clean", "PYTHON=python3.99").returncode != 0


def test_quick_tests_name_existing_tests():
    for item in _makefile_value("QUICK_TESTS").split():
        path, _, name = item.partition("::")
        assert (ROOT / path).is_file(), item
        if name:
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), item
