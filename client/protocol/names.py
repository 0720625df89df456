"""The base of the contract's key classes: namespaces of plain ``str`` constants."""

from __future__ import annotations

from typing import NoReturn


class Names:
    """A namespace of string constants (Flower's key-class style); never instantiated."""

    def __new__(cls) -> NoReturn:
        raise TypeError(f"{cls.__name__} cannot be instantiated")
