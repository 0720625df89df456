"""The error of a message field that cannot be decoded."""

from __future__ import annotations


class WireError(ValueError):
    """A message field that cannot be decoded; the text is the stored reason."""
