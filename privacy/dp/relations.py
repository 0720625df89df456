"""Neighbouring relations: which pair of datasets an epsilon is stated for.

- add/remove-one: one client's data present or absent (the sum moves by C);
- replace-one: one client's data replaced by another's (the sum moves by 2C);
- zero-out: one client's contribution replaced by zero while its participation stays
  known (the sum moves by C; what a server that sees who replied faces).
"""

from __future__ import annotations

ADD_REMOVE = "add/remove-one"
REPLACE_ONE = "replace-one"
ZERO_OUT = "zero-out"
RELATIONS = (ADD_REMOVE, REPLACE_ONE, ZERO_OUT)


def relation(sampling: str) -> str:
    """The natural neighbouring relation of an epsilon under ``sampling``."""
    return REPLACE_ONE if sampling == "fixed" else ADD_REMOVE
