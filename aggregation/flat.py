"""One flat float32 vector for a whole model, and the layout that maps it back.

Clipping, masking, noise and allreduce are then one vector operation each instead
of a loop over layers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Layout:
    """Names, shapes and dtypes of the tensors packed into one flat vector, in order.

    ``trainable`` tells parameters (True) from buffers such as batch norm's running
    statistics (False); ``norm`` marks the tensors of normalization layers that keep
    running statistics (batch norm), which FedBN keeps on the clients. Both default to
    "all parameters, no normalization layer".
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    trainable: tuple[bool, ...] = ()
    norm: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.shapes) == len(self.dtypes)):
            raise ValueError("layout names, shapes and dtypes must have the same length")
        if len(set(self.names)) != len(self.names):
            raise ValueError("layout names must be unique")
        for flag, default in (("trainable", True), ("norm", False)):
            value = tuple(bool(v) for v in getattr(self, flag)) or (default,) * len(self.names)
            if len(value) != len(self.names):
                raise ValueError(f"layout {flag} must have one entry per name")
            object.__setattr__(self, flag, value)

    # A layout is immutable: its sizes, offsets and length are worked out once, not at
    # every use (several times per client message).

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(o) for o in np.cumsum((0, *self.sizes[:-1]))) if self.names else ()

    @cached_property
    def dim(self) -> int:
        """Length of the flat vector."""
        return sum(self.sizes)

    @property
    def local(self) -> tuple[bool, ...]:
        """The entries FedBN keeps on each client: every buffer and every tensor of a
        normalization layer (``aggregation.local_buffers``)."""
        return tuple(n or not t for n, t in zip(self.norm, self.trainable, strict=True))

    def mask(self, entries: Sequence[bool]) -> np.ndarray:
        """A boolean mask over the flat vector: True on the entries flagged in ``entries``."""
        if len(entries) != len(self.names):
            raise ValueError(f"need one flag per layout entry ({len(self.names)}), got "
                             f"{len(entries)}")
        return np.repeat(np.asarray(entries, dtype=bool), self.sizes)

    @classmethod
    def of(cls, tensors: Mapping[str, Any], *, buffers: Collection[str] = (),
           norm: Collection[str] = ()) -> Layout:
        """The layout of a state dict (torch tensors or numpy arrays), in its order;
        ``buffers`` and ``norm`` name the entries that are buffers and that belong to
        normalization layers."""
        names, shapes, dtypes = [], [], []
        for name, t in tensors.items():
            names.append(name)
            shapes.append(tuple(int(s) for s in t.shape))
            dtypes.append(str(t.dtype).removeprefix("torch."))
        return cls(tuple(names), tuple(shapes), tuple(dtypes),
                   trainable=tuple(n not in buffers for n in names),
                   norm=tuple(n in norm for n in names))

    def to_dict(self) -> dict[str, list]:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "dtypes": list(self.dtypes), "trainable": list(self.trainable),
                "norm": list(self.norm)}

    @classmethod
    def from_dict(cls, d: Mapping[str, list]) -> Layout:
        return cls(tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]), tuple(d["dtypes"]),
                   trainable=tuple(d.get("trainable", ())), norm=tuple(d.get("norm", ())))

    def flatten(self, tensors: Mapping[str, Any], out: np.ndarray | None = None) -> np.ndarray:
        """Pack named arrays or tensors (same names and shapes) into one float32 vector."""
        if out is None:
            out = np.empty(self.dim, dtype=np.float32)
        elif out.shape != (self.dim,) or out.dtype != np.float32:
            raise ValueError(f"out must be float32 of shape ({self.dim},), got {out.dtype} "
                             f"{out.shape}")
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise ValueError(f"missing tensors for layout entries: {missing}")
        for name, shape, off, size in zip(self.names, self.shapes, self.offsets, self.sizes,
                                          strict=True):
            value = tensors[name]
            if hasattr(value, "detach"):
                value = value.detach().cpu().numpy()
            value = np.asarray(value)
            if tuple(value.shape) != shape:
                raise ValueError(f"tensor '{name}' has shape {tuple(value.shape)}, layout "
                                 f"expects {shape}")
            out[off:off + size] = value.reshape(-1)
        return out

    def unflatten(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        """Views (no copies) of the flat vector, one per layout entry, cast to float32 shape."""
        if vector.shape != (self.dim,):
            raise ValueError(f"vector has shape {vector.shape}, layout expects ({self.dim},)")
        return {name: vector[off:off + size].reshape(shape)
                for name, shape, off, size in zip(self.names, self.shapes, self.offsets,
                                                  self.sizes, strict=True)}
