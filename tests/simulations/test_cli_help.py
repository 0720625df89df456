"""``fedring --help`` names every command, each with a line of help, and so does the help of
every command that has commands of its own (``deploy up``, ``deploy down``)."""

from __future__ import annotations

import argparse
import re

import pytest

from simulations.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


def _help(capsys, monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def _help_lines(text: str) -> dict[str, str]:
    """``{command: its help}`` from the listing under "positional arguments"."""
    return dict(re.findall(r"(?m)^    (\S+) +(\S.*)$", text))


def test_fedring_help_names_every_command_with_its_help(capsys, monkeypatch):
    commands = _commands(build_parser())
    names = list(commands.choices)
    assert {"simulate", "runs", "report", "deploy", "certs", "silo"} <= set(names)
    text = _help(capsys, monkeypatch)
    description = " ".join(text.split("positional arguments")[0].split("\n", 2)[2].split())
    assert description.endswith(f"commands: {', '.join(names)}."), description
    listed = _help_lines(text)
    assert list(listed) == names
    helps = {a.dest: a.help for a in commands._choices_actions}
    for name in names:
        assert helps[name] and listed[name] == helps[name], name  # whole, on one line


@pytest.mark.parametrize("command", ["deploy"])
def test_a_command_with_commands_lists_each_with_its_help(capsys, monkeypatch, command):
    parser = _commands(build_parser()).choices[command]
    names = list(_commands(parser).choices)
    listed = _help_lines(_help(capsys, monkeypatch, command))
    assert list(listed) == names and all(listed.values())
