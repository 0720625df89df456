"""simulations.models: shapes, hand-counted parameters, determinism, training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simulations.models import build_model, count_parameters, model_names


def test_names():
    assert model_names() == ["bn_mlp", "char_lstm", "cnn", "logreg", "mlp", "resnet"]


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
        ("vgg", {}, "unknown model 'vgg'; choose one of: bn_mlp, char_lstm, cnn, logreg, mlp, "
                        "resnet"),
        ("resnet", {"input_shape": (64,)}, r"resnet needs input_shape \(channels, height"),
        ("resnet", {"input_shape": (3, 3, 32)}, "height, width >= 4"),
        ("resnet", {"width": 0}, "width must be a positive int"),
        ("resnet", {"blocks": 1.5}, "blocks must be a positive int"),
        ("char_lstm", {}, r"char_lstm needs input_shape \(sequence length,\)"),
        ("char_lstm", {"input_shape": (80,), "hidden": 0}, "hidden must be a positive int"),
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


# ------------------------------------------------------------------ resnet (batch norm)


@pytest.fixture
def one_thread():
    """Convolutions on a busy two-core machine run far faster on one thread than on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def conv_bn(c_in: int, c_out: int, k: int) -> int:
    """Parameters of a bias-free k x k convolution and its batch norm (weight and bias)."""
    return c_in * c_out * k * k + 2 * c_out


def block(c_in: int, c_out: int) -> int:
    shortcut = conv_bn(c_in, c_out, 1) if c_in != c_out else 0
    return conv_bn(c_in, c_out, 3) + conv_bn(c_out, c_out, 3) + shortcut


@pytest.mark.parametrize(("width", "blocks", "classes"), [(32, 1, 10), (16, 2, 100), (48, 1, 10)])
def test_resnet_parameters_by_hand(width, blocks, classes):
    w = width
    stages = [(w, w), (w, 2 * w), (2 * w, 4 * w)]
    expected = conv_bn(3, w, 3) + (4 * w * classes + classes)
    for c_in, c_out in stages:
        expected += block(c_in, c_out) + (blocks - 1) * block(c_out, c_out)
    model = build_model("resnet", input_shape=(3, 32, 32), num_classes=classes, width=width,
                        blocks=blocks)
    assert count_parameters(model) == expected


def test_resnet_default_is_cifar_sized_with_batch_norm(one_thread):
    torch.manual_seed(0)
    model = build_model("resnet", input_shape=(3, 32, 32), num_classes=10)
    assert 300_000 <= count_parameters(model) <= 1_000_000
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 1 + 3 * 2 + 2  # stem, two per block, two projection shortcuts
    names = {n for n, _ in model.named_buffers()}
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= names
    x = torch.randn(8, 3, 32, 32)
    model.train()
    out = model(x)
    assert out.shape == (8, 10)
    assert int(model[1].num_batches_tracked) == 1 and model[1].running_mean.abs().sum() > 0
    model.eval()  # running statistics, not the batch's: the outputs change
    assert not torch.allclose(out, model(x))
    # the spatial size halves twice: 32 -> 16 -> 8 before the global pool
    seen = []
    hook = model[-3].register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    model(x)
    hook.remove()
    assert seen == [(8, 128, 8, 8)]


def test_resnet_learns(one_thread):
    torch.manual_seed(0)
    x = torch.randn(32, 3, 16, 16)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long()  # a label the first channel decides
    model = build_model("resnet", input_shape=(3, 16, 16), num_classes=2, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------------------------ char_lstm


def lstm_layer(inputs: int, hidden: int) -> int:
    """Four gates, each with input and recurrent weights and two bias vectors (PyTorch)."""
    return 4 * hidden * (inputs + hidden) + 2 * 4 * hidden


def test_char_lstm_is_leafs_shakespeare_model(one_thread):
    torch.manual_seed(0)
    model = build_model("char_lstm", input_shape=(80,), num_classes=80)
    expected = 80 * 8 + lstm_layer(8, 256) + lstm_layer(256, 256) + (256 * 80 + 80)
    assert count_parameters(model) == expected == 819_920
    assert model.embedding.num_embeddings == 80 and model.embedding.embedding_dim == 8
    assert model.lstm.num_layers == 2 and model.lstm.hidden_size == 256
    assert len(list(model.buffers())) == 0
    x = torch.randint(0, 80, (5, 80), dtype=torch.int64)
    out = model(x)
    assert out.shape == (5, 80) and out.dtype == torch.float32
    # the prediction reads the last step's output: the last character reaches it
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 80
    assert not torch.allclose(out, model(y))


def test_char_lstm_learns_next_character(one_thread):
    torch.manual_seed(0)
    x = torch.randint(0, 10, (128, 12))
    y = x[:, -1]  # the next character repeats the last one
    model = build_model("char_lstm", input_shape=(12,), num_classes=10, hidden=32, layers=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(60):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert (model(x).argmax(1) == y).float().mean() > 0.9
