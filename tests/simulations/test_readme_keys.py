"""The README's table of scenario keys lists exactly the keys each section takes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from privacy.dp import DPConfig
from simulations.config import SECTIONS, TOP_LEVEL_KEYS

README = Path(__file__).resolve().parents[2] / "README.md"
TYPED = {**SECTIONS, "dp": DPConfig}


def _without_parentheses(text: str) -> str:
    """``text`` with every parenthesised part (nested too) removed: what is left of a row
    is its keys, since values and notes are written in parentheses."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def readme_table() -> dict[str, set[str]]:
    """{section: the keys its row names}, from the table under "Scenario files"."""
    rows: dict[str, set[str]] = {}
    text = README.read_text()
    table = text[text.index("| section | keys |"):]
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        section, keys = (cell.strip() for cell in line.strip("|").split("|", 1))
        name = section.strip("`[]") if section.startswith("`") else "top level"
        rows[name] = set(re.findall(r"`([a-z_0-9]+)`", _without_parentheses(keys)))
    return rows


def test_the_table_has_a_row_for_every_section_and_no_gap():
    rows = readme_table()
    assert set(rows) == {*TYPED, "model", "top level"}  # a blank line would cut it short


@pytest.mark.parametrize("section", sorted(TYPED))
def test_each_row_lists_exactly_its_section_keys(section):
    fields = {f.name for f in dataclasses.fields(TYPED[section])}
    assert readme_table()[section] == fields


def test_top_level_keys():
    assert readme_table()["top level"] == set(TOP_LEVEL_KEYS)
