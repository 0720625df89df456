"""docs/CONFIGURATION.md's table of scenario keys lists exactly the keys each section takes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from privacy.dp import DPConfig
from simulations.config import SECTIONS, TOP_LEVEL_KEYS

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md"
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


def key_table() -> dict[str, set[str]]:
    """{section: the keys its row names}, from the table under "Scenario files"."""
    rows: dict[str, set[str]] = {}
    text = CONFIGURATION.read_text()
    table = text[text.index("| section | keys |"):]
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        section, keys = (cell.strip() for cell in line.strip("|").split("|", 1))
        name = section.strip("`[]") if section.startswith("`") else "top level"
        rows[name] = set(re.findall(r"`([a-z_0-9]+)`", _without_parentheses(keys)))
    return rows


def test_the_table_has_a_row_for_every_section_and_no_gap():
    rows = key_table()
    assert set(rows) == {*TYPED, "model", "top level"}  # a blank line would cut it short


@pytest.mark.parametrize("section", sorted(TYPED))
def test_each_row_lists_exactly_its_section_keys(section):
    fields = {f.name for f in dataclasses.fields(TYPED[section])}
    assert key_table()[section] == fields


def test_top_level_keys():
    assert key_table()["top level"] == set(TOP_LEVEL_KEYS)


def test_no_row_of_the_key_table_stands_outside_it():
    """Rows after a blank line would render as text: every section row is in the one table."""
    anywhere = re.findall(r"^\| `\[([a-z_]+)\]` \|", CONFIGURATION.read_text(), flags=re.M)
    assert sorted(anywhere) == sorted(set(anywhere))  # one row per section
    assert set(anywhere) | {"top level"} == set(key_table())


def test_the_model_row_names_every_kind_and_parameter():
    from simulations.models import _BUILDERS

    row = CONFIGURATION.read_text().split("| `[model]` |", 1)[1].split("\n", 1)[0]
    named = set(re.findall(r"`([a-z_0-9]+)`", row))
    assert named == {"kind", *_BUILDERS, *(p for _, params in _BUILDERS.values() for p in params)}


def test_simulate_options_in_the_docs_are_the_commands():
    """The list of `simulate` options in docs/CONFIGURATION.md names each option of the
    command, and no other."""
    from simulations.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    options = {o for a in sub.choices["simulate"]._actions for o in a.option_strings
               if o.startswith("--") and o != "--help"}
    text = CONFIGURATION.read_text()
    paragraph = text[text.index("Options of `simulate`"):].split("\n\n", 1)[0]
    assert set(re.findall(r"`(--[a-z-]+)", paragraph)) == options


def test_every_row_is_short():
    """A row names keys and a few values; explanations go to the notes below the table."""
    table = CONFIGURATION.read_text().split("| section | keys |", 1)[1].split("\n\n", 1)[0]
    for row in table.splitlines()[2:]:
        prose = re.sub(r"`[^`]*`|\[([^\]]*)\]\([^)]*\)", r"\1", row)  # code and link targets out
        assert len(prose) <= 150, f"{row[:20]}...: {len(prose)} characters of prose"
