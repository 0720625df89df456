"""Layout: packing state dicts into one flat float32 vector and back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from aggregation import Layout


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, kernel_size=3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 5),
        nn.Linear(5, 2, bias=False),
    )


def test_torch_state_dict_round_trip() -> None:
    model = _model()
    sd = model.state_dict()
    layout = Layout.of(sd)

    assert layout.names == tuple(sd)
    assert layout.shapes[0] == (4, 3, 3, 3)
    assert layout.dtypes[0] == "float32"
    assert "int64" in layout.dtypes  # BatchNorm's num_batches_tracked
    # 108 + 4 conv, 4 + 4 + 4 + 4 + 1 batchnorm, 80 + 5 linear, 10 linear without bias
    assert layout.dim == 108 + 4 + 4 + 4 + 4 + 4 + 1 + 80 + 5 + 10
    assert layout.offsets[:3] == (0, 108, 112)

    flat = layout.flatten(sd)
    assert flat.dtype == np.float32 and flat.shape == (layout.dim,)
    np.testing.assert_array_equal(flat[:108], sd["0.weight"].numpy().reshape(-1))

    back = layout.unflatten(flat)
    assert list(back) == list(sd)
    for name, tensor in sd.items():
        assert back[name].shape == tuple(tensor.shape)
        np.testing.assert_array_equal(back[name], tensor.numpy().astype(np.float32))

    # The unflattened arrays load back into a fresh model and give the same outputs.
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in back.items()})
    model.eval()
    other.eval()
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(other(x), model(x))


def test_parameters_with_grad_flatten() -> None:
    model = _model()
    params = dict(model.named_parameters())  # requires_grad tensors
    layout = Layout.of(params)
    flat = layout.flatten(params)
    np.testing.assert_array_equal(layout.unflatten(flat)["4.bias"],
                                  params["4.bias"].detach().numpy())


def test_numpy_dict_round_trip_by_hand() -> None:
    arrays = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([-1.5, 2.5], dtype=np.float64),
        "s": np.array(7.0, dtype=np.float32),  # a scalar
    }
    layout = Layout.of(arrays)
    assert layout.shapes == ((2, 3), (2,), ())
    assert layout.sizes == (6, 2, 1)
    assert layout.offsets == (0, 6, 8)
    assert layout.dtypes == ("float32", "float64", "float32")

    flat = layout.flatten(arrays)
    np.testing.assert_array_equal(flat, [0, 1, 2, 3, 4, 5, -1.5, 2.5, 7.0])

    back = layout.unflatten(flat)
    np.testing.assert_array_equal(back["w"], [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(back["b"], [-1.5, 2.5])
    assert back["s"].shape == () and float(back["s"]) == 7.0
    # Views, not copies: writing the vector shows through.
    flat[7] = 9.0
    assert back["b"][1] == 9.0
    assert all(np.shares_memory(v, flat) for v in back.values())


def test_flatten_into_given_buffer() -> None:
    arrays = {"a": np.ones((2, 2), np.float32), "b": np.full(3, 2.0, np.float32)}
    layout = Layout.of(arrays)
    out = np.zeros(7, dtype=np.float32)
    assert layout.flatten(arrays, out=out) is out
    np.testing.assert_array_equal(out, [1, 1, 1, 1, 2, 2, 2])


def test_to_dict_from_dict_through_json() -> None:
    sd = _model().state_dict()
    layout = Layout.of(sd, buffers={"1.running_mean", "1.running_var"},
                       norm={n for n in sd if n.startswith("1.")})
    d = json.loads(json.dumps(layout.to_dict()))
    assert set(d) == {"names", "shapes", "dtypes", "trainable", "norm"}
    again = Layout.from_dict(d)
    assert again == layout
    assert again.dim == layout.dim and again.offsets == layout.offsets
    # a layout written before the flags existed: all parameters, no normalization layer
    old = Layout.from_dict({k: d[k] for k in ("names", "shapes", "dtypes")})
    assert old.trainable == (True,) * len(sd) and old.norm == (False,) * len(sd)


def test_flags_tell_parameters_buffers_and_what_fedbn_keeps() -> None:
    arrays = {"w": np.zeros((2, 3)), "bn.weight": np.zeros(2), "bn.mean": np.zeros(2),
              "extra": np.zeros(1), "b": np.zeros(3)}
    layout = Layout.of(arrays, buffers={"bn.mean", "extra"}, norm={"bn.weight", "bn.mean"})
    assert layout.trainable == (True, True, False, False, True)
    assert layout.local == (False, True, True, True, False)  # norm layers and every buffer
    mask = layout.mask(layout.local)
    assert mask.dtype == bool and mask.shape == (layout.dim,)
    np.testing.assert_array_equal(np.flatnonzero(mask), [6, 7, 8, 9, 10])
    with pytest.raises(ValueError, match="one flag per layout entry"):
        layout.mask((True,))
    with pytest.raises(ValueError, match="trainable must have one entry per name"):
        Layout(("a", "b"), ((1,), (2,)), ("float32", "float32"), trainable=(True,))


def test_empty_layout() -> None:
    layout = Layout.of({})
    assert layout.dim == 0 and layout.offsets == ()
    assert layout.flatten({}).shape == (0,)
    assert layout.unflatten(np.zeros(0, np.float32)) == {}


def test_errors() -> None:
    arrays = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}
    layout = Layout.of(arrays)

    with pytest.raises(ValueError, match="'a' has shape"):
        layout.flatten({"a": np.zeros((3, 2), np.float32), "b": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match=r"missing.*'b'"):
        layout.flatten({"a": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match="out must be float32"):
        layout.flatten(arrays, out=np.zeros(10, np.float64))
    with pytest.raises(ValueError, match="out must be float32"):
        layout.flatten(arrays, out=np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="out must be float32"):
        layout.flatten(arrays, out=np.zeros((10, 1), np.float32))
    with pytest.raises(ValueError, match="vector has shape"):
        layout.unflatten(np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="same length"):
        Layout(("a",), ((1,), (2,)), ("float32",))
    with pytest.raises(ValueError, match="unique"):
        Layout(("a", "a"), ((1,), (2,)), ("float32", "float32"))
