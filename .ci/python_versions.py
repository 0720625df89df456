"""Print the Python versions fedring supports, one per line, oldest first.

They are the ``Programming Language :: Python :: 3.X`` classifiers of pyproject.toml; a test
holds them to ``requires-python``. ``--others`` leaves out the oldest (the Makefile's default).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PREFIX = "Programming Language :: Python :: "


def supported(pyproject: Path) -> list[str]:
    """The 3.X versions the classifiers name, oldest first."""
    project = tomllib.loads(pyproject.read_text())["project"]
    versions = [c.removeprefix(PREFIX) for c in project.get("classifiers", [])
                if c.startswith(PREFIX) and c.removeprefix(PREFIX).count(".") == 1]
    return sorted(versions, key=lambda v: tuple(int(p) for p in v.split(".")))


if __name__ == "__main__":
    found = supported(Path(__file__).resolve().parent.parent / "pyproject.toml")
    print("\n".join(found[1:] if "--others" in sys.argv[1:] else found))
