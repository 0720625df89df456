"""simulations.models: shapes, hand-counted parameters, determinism, training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simulations.models import build_model, count_parameters, model_names


def test_names():
    assert model_names() == ["bn_mlp", "cnn", "logreg", "mlp"]


@pytest.mark.parametrize(
    ("kind", "input_shape", "params"),
    [
        ("mlp", (1, 8, 8), {}),
        ("mlp", (60,), {"hidden": [32, 16]}),
        ("cnn", (1, 8, 8), {}),
        ("cnn", (3, 28, 28), {"channels": [8]}),
        ("cnn", (2, 7, 9), {"channels": [4, 4, 4]}),
        ("logreg", (60,), {}),
        ("logreg", (1, 8, 8), {}),
        ("bn_mlp", (1, 8, 8), {"hidden": [16, 8], "cumulative": True}),
    ],
)
def test_output_shapes(kind, input_shape, params):
    model = build_model(kind, input_shape=input_shape, num_classes=7, **params)
    out = model(torch.zeros(5, *input_shape))
    assert out.shape == (5, 7) and out.dtype == torch.float32


@pytest.mark.parametrize(
    ("kind", "input_shape", "num_classes", "params", "expected"),
    [
        # 64*128+128 + 128*10+10: the ~10k benchmark model
        ("mlp", (1, 8, 8), 10, {"hidden": [128]}, 9_610),
        # 64*1024+1024 + 1024*1024+1024 + 1024*10+10: the ~1M benchmark model
        ("mlp", (1, 8, 8), 10, {"hidden": [1024, 1024]}, 1_126_410),
        ("mlp", (1, 8, 8), 10, {}, 64 * 64 + 64 + 64 * 10 + 10),
        ("mlp", (60,), 10, {"hidden": 32}, 60 * 32 + 32 + 32 * 10 + 10),
        ("mlp", (60,), 10, {"hidden": []}, 610),
        # conv 1->16: 16*9+16; conv 16->32: 32*16*9+32; linear 32*4*4 -> 10
        ("cnn", (1, 8, 8), 10, {}, 160 + 4_640 + 5_130),
        ("cnn", (3, 28, 28), 5, {"channels": [8]}, (8 * 3 * 9 + 8) + (8 * 14 * 14 * 5 + 5)),
        ("cnn", (1, 7, 9), 2, {"channels": [4, 6]}, 40 + (6 * 4 * 9 + 6) + (6 * 3 * 4 * 2 + 2)),
        ("logreg", (60,), 10, {}, 610),
        ("logreg", (1, 8, 8), 10, {}, 650),
        # the mlp's plus each batch norm's weight and bias (its running statistics are buffers)
        ("bn_mlp", (1, 8, 8), 10, {"hidden": [16]}, 64 * 16 + 16 + 2 * 16 + 16 * 10 + 10),
    ],
)
def test_parameter_counts_by_hand(kind, input_shape, num_classes, params, expected):
    model = build_model(kind, input_shape=input_shape, num_classes=num_classes, **params)
    assert count_parameters(model) == expected


@pytest.mark.parametrize("kind", ["mlp", "cnn", "logreg"])
def test_deterministic_under_manual_seed(kind):
    def weights(seed):
        torch.manual_seed(seed)
        model = build_model(kind, input_shape=(1, 8, 8), num_classes=10)
        return [p.detach().clone() for p in model.parameters()]

    a, b, c = weights(0), weights(0), weights(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("kind", ["mlp", "cnn", "logreg"])
def test_no_dropout_or_batchnorm(kind):
    model = build_model(kind, input_shape=(1, 8, 8), num_classes=10)
    allowed = (nn.Sequential, nn.Flatten, nn.Linear, nn.Conv2d, nn.ReLU, nn.MaxPool2d)
    assert all(isinstance(m, allowed) for m in model.modules())
    assert len(list(model.buffers())) == 0
    x = torch.randn(4, 1, 8, 8)
    model.train()
    y_train = model(x)
    model.eval()
    assert torch.equal(y_train, model(x))


@pytest.mark.parametrize(
    ("kind", "params", "lr"),
    [("mlp", {"hidden": [128]}, 0.1), ("cnn", {}, 0.05), ("logreg", {}, 0.1)],
)
def test_sgd_reduces_loss_on_digits(kind, params, lr):
    from simulations.datasets import load_dataset

    d = load_dataset("digits", seed=0)
    x = torch.from_numpy(d.x_train[:512])
    y = torch.from_numpy(d.y_train[:512])
    torch.manual_seed(0)
    model = build_model(kind, input_shape=d.input_shape, num_classes=d.num_classes, **params)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    with torch.no_grad():
        before = loss_fn(model(x), y).item()
    for _ in range(30):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = loss_fn(model(x), y).item()
    assert after < 0.5 * before


@pytest.mark.parametrize(
    ("kind", "kwargs", "pattern"),
    [
        ("resnet", {}, "unknown model 'resnet'; choose one of: bn_mlp, cnn, logreg, mlp"),
        ("mlp", {"hidden_sizes": [3]}, "unknown parameter 'hidden_sizes' for model 'mlp'"),
        ("logreg", {"hidden": [3]}, "unknown parameter 'hidden' for model 'logreg'"),
        ("cnn", {"dropout": 0.5}, "unknown parameter 'dropout' for model 'cnn'"),
        ("mlp", {"hidden": [0]}, "hidden must hold positive ints"),
        ("mlp", {"hidden": "64"}, "hidden must hold positive ints"),
        ("mlp", {"hidden": 1.5}, "hidden must be an int or a list of ints"),
        ("cnn", {"channels": []}, "channels needs at least one entry"),
        ("cnn", {"input_shape": (64,)}, r"cnn needs input_shape \(channels, height, width\)"),
        ("cnn", {"input_shape": (1, 1, 8)}, "height, width >= 2"),
        ("mlp", {"input_shape": ()}, "input_shape must be a tuple of positive ints"),
        ("mlp", {"input_shape": (0, 3)}, "input_shape must be a tuple of positive ints"),
        ("mlp", {"num_classes": 1}, "num_classes must be an integer >= 2"),
    ],
)
def test_errors_name_the_problem(kind, kwargs, pattern):
    args = {"input_shape": (1, 8, 8), "num_classes": 10} | kwargs
    with pytest.raises(ValueError, match=pattern):
        build_model(kind, **args)
