"""A torch model whose parameters and floating-point buffers are views into one flat
float32 buffer.

Loading a global model is then one copy, and the delta ``w_local - w_base`` is one
subtraction, with no per-layer loop on the hot path. Floating-point buffers (batch
norm's running mean and variance) travel in the vector with the parameters; the layout
tells them apart (``Layout.trainable``). Buffers that are not floating point (batch
norm's ``num_batches_tracked`` count, int64) are never put through float32: they stay
outside the vector, exact, in :attr:`FlatModel.exact`, and each client keeps its own
(``client.local_state``).

On a GPU the flat buffer lives on the device and ``flat_np`` is a host mirror: the
model crosses to the device once when a global model is loaded (:meth:`to_device`) and
back once after training (:meth:`to_host`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from aggregation.flat import Layout

NORM_LAYERS = (_BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm: layers with running statistics


def norm_tensor_names(module: torch.nn.Module) -> set[str]:
    """Names of every parameter and buffer that belongs to a batch-norm layer."""
    names: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, NORM_LAYERS):
            head = f"{prefix}." if prefix else ""
            names.update(head + n for n, _ in sub.named_parameters(recurse=False))
            names.update(head + n for n, _ in sub.named_buffers(recurse=False))
    return names


def _set_buffer(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module.get_submodule(owner)._buffers[leaf] = value


class FlatModel:
    """Wraps a module; ``flat`` holds every parameter and floating-point buffer, in
    state-dict order; ``exact`` every other persistent buffer, untouched."""

    def __init__(self, module: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.module = module.to(self.device)
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        tensors: dict[str, torch.Tensor] = {}
        self.exact: dict[str, torch.Tensor] = {}
        for name in module.state_dict(keep_vars=True):  # persistent tensors, in order
            if name in params:
                tensors[name] = params[name]
            elif name in buffers:
                target = tensors if buffers[name].is_floating_point() else self.exact
                target[name] = buffers[name]
        self.layout = Layout.of(tensors, buffers=set(tensors) - set(params),
                                norm=norm_tensor_names(module))
        flat = torch.zeros(self.layout.dim, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for t, off, size in zip(tensors.values(), self.layout.offsets, self.layout.sizes,
                                    strict=True):
                flat[off:off + size].view(t.shape).copy_(t.detach().to(torch.float32))
        self._owners = [params.get(name) for name in tensors]  # (None: a buffer)
        self._bind(flat)
        self.exact_initial = {n: t.detach().cpu().clone() for n, t in self.exact.items()}
        if self.device.type == "cpu":
            self.flat_np = self.flat.numpy()  # shares memory with ``flat``
        else:
            host = torch.empty(self.layout.dim, dtype=torch.float32,
                               pin_memory=torch.cuda.is_available())
            self._host = host
            self.flat_np = host.numpy()

    @property
    def dim(self) -> int:
        return self.layout.dim

    @property
    def on_host(self) -> bool:
        """True when ``flat_np`` is the model itself (a CPU model), not a mirror."""
        return self.device.type == "cpu"

    def to_device(self) -> None:
        """Copy the host mirror ``flat_np`` into the model (a no-op on the CPU)."""
        if not self.on_host:
            self.flat.copy_(self._host, non_blocking=False)

    def to_host(self) -> None:
        """Copy the model into the host mirror ``flat_np`` (a no-op on the CPU)."""
        if not self.on_host:
            self._host.copy_(self.flat)

    def load(self, vector: np.ndarray) -> None:
        """Copy a flat vector into the model's parameters and buffers (one copy)."""
        np.copyto(self.flat_np, vector, casting="same_kind")
        self.to_device()

    def vector(self) -> np.ndarray:
        """The current parameters and buffers as a flat float32 numpy array (a view of the
        model on the CPU; the refreshed host mirror on a GPU)."""
        self.to_host()
        return self.flat_np

    def rebind(self, flat_np: np.ndarray) -> None:
        """Move a CPU model into ``flat_np``, a float32 vector of its length: parameters and
        floating-point buffers become views of it, as they were of ``flat`` (whose values
        are not copied). The parameters stay the same objects, so an optimizer over them
        goes on working."""
        if not self.on_host:
            raise ValueError("only a model on the CPU can be moved into a host vector")
        if flat_np.dtype != np.float32 or flat_np.shape != (self.dim,):
            raise ValueError(f"a model of {self.dim} parameters needs a float32 vector of that "
                             f"length, got {flat_np.dtype} of shape {flat_np.shape}")
        self._bind(torch.from_numpy(flat_np))
        self.flat_np = flat_np

    def _bind(self, flat: torch.Tensor) -> None:
        """Make every parameter and floating-point buffer a view of ``flat``."""
        layout = self.layout
        for name, owner, off, size, shape in zip(layout.names, self._owners, layout.offsets,
                                                 layout.sizes, layout.shapes, strict=True):
            view = flat[off:off + size].view(shape)
            if owner is not None:
                owner.data = view
            else:
                _set_buffer(self.module, name, view)
        self.flat = flat

    def reset_exact(self) -> None:
        """Put the non-floating buffers back to their values when the model was built."""
        with torch.no_grad():
            for name, t in self.exact.items():
                t.copy_(self.exact_initial[name])
