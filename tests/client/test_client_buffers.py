"""Models with buffers in the flat vector: batch norm's statistics in, its count out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from client import local_state
from client.app import _Worker
from client.flat_model import FlatModel
from client.protocol.errors import WireError
from client.protocol.npy import npy_array
from client.protocol.updates import model_views
from client.training import (
    TrainConfig,
    check_model,
    make_optimizer,
    resolve_device,
    train,
    train_dp_sgd,
)


def _bn_cnn(momentum: float | None = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=momentum),
                         nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 5),
                         nn.BatchNorm1d(5, momentum=momentum), nn.Linear(5, 3))


def _data(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_float_buffers_live_in_the_vector_and_the_count_outside() -> None:
    model = FlatModel(_bn_cnn())
    layout = model.layout
    assert "1.running_mean" in layout.names and "5.running_var" in layout.names
    assert not any(n.endswith("num_batches_tracked") for n in layout.names)
    assert set(model.exact) == {"1.num_batches_tracked", "5.num_batches_tracked"}
    assert all(t.dtype == torch.int64 for t in model.exact.values())
    buffers = {n for n, t in zip(layout.names, layout.trainable, strict=True) if not t}
    assert buffers == {"1.running_mean", "1.running_var", "5.running_mean", "5.running_var"}
    assert {n for n, f in zip(layout.names, layout.norm, strict=True) if f} == {
        f"{i}.{k}" for i in (1, 5) for k in ("weight", "bias", "running_mean", "running_var")}
    # the module's own buffers are the vector: a forward pass in training mode moves them
    before = model.vector().copy()
    model.module.train()
    model.module(_data()[0])
    moved = model.vector() - before
    views = layout.unflatten(moved)
    assert np.abs(views["1.running_mean"]).max() > 1e-3
    assert not views["0.weight"].any()
    sd = model.module.state_dict()
    for name, view in layout.unflatten(model.vector()).items():
        np.testing.assert_array_equal(view, sd[name].numpy())
    # loading a vector sets the buffers too
    model.load(np.arange(layout.dim, dtype=np.float32))
    np.testing.assert_array_equal(model.module[1].running_var.numpy(),
                                  layout.unflatten(np.arange(layout.dim, dtype=np.float32))
                                  ["1.running_var"])


def test_a_model_moved_into_another_vector_trains_and_keeps_its_buffers_there() -> None:
    """``rebind``: parameters and float buffers become views of the new vector, the
    parameters stay the objects an optimizer holds, and nothing is left in the old one."""
    model, plain = FlatModel(_bn_cnn()), FlatModel(_bn_cnn())
    params = list(model.module.parameters())
    cfg = TrainConfig(local_epochs=1, batch_size=8)
    opt = make_optimizer(params, cfg)
    old = model.flat_np
    target = np.empty(model.dim, dtype=np.float32)
    np.copyto(target, old)
    model.rebind(target)
    assert model.flat_np is target and list(model.module.parameters()) == params
    old_values = old.copy()
    x, y = _data()
    train(model.module, x, y, cfg, seed=3, optimizer=opt)
    train(plain.module, x, y, cfg, seed=3)
    np.testing.assert_array_equal(old, old_values)  # the old vector is no longer the model
    np.testing.assert_array_equal(target, plain.flat_np)  # weights and statistics moved here
    for name, view in model.layout.unflatten(target).items():
        np.testing.assert_array_equal(view, model.module.state_dict()[name].numpy())
    with pytest.raises(ValueError, match="float32 vector of that length"):
        model.rebind(np.empty(model.dim - 1, dtype=np.float32))
    with pytest.raises(ValueError, match="float32 vector"):
        model.rebind(np.empty(model.dim, dtype=np.float64))


def test_training_updates_parameters_by_gradient_and_buffers_by_the_batches() -> None:
    """The optimizer holds the parameters only: with lr tiny the parameters barely move,
    while the running statistics follow the batches as torch's own module does."""
    x, y = _data()
    model = FlatModel(_bn_cnn())
    plain = _bn_cnn()
    cfg = TrainConfig(local_epochs=1, batch_size=8, lr=1e-12)
    before = model.vector().copy()
    train(model.module, x, y, cfg, seed=3)
    train(plain, x, y, cfg, seed=3)
    delta = model.layout.unflatten(model.vector() - before)
    params = model.layout.mask(model.layout.trainable)
    assert np.abs((model.vector() - before)[params]).max() < 1e-6
    for name in ("1.running_mean", "1.running_var", "5.running_mean", "5.running_var"):
        assert np.abs(delta[name]).max() > 1e-3
        np.testing.assert_allclose(model.vector()[_span(model, name)],
                                   plain.state_dict()[name].numpy().reshape(-1), atol=1e-6)
    assert int(model.exact["1.num_batches_tracked"]) == 5  # 40 samples / batch 8


def test_fedprox_anchors_on_parameters_only() -> None:
    x, y = _data()
    model = FlatModel(_bn_cnn())
    anchor = [p.detach().clone() for p in model.module.parameters()]
    assert len(anchor) < len(model.layout.names)  # the buffers are not among them
    train(model.module, x, y, TrainConfig(batch_size=8, proximal_mu=0.5), seed=1,
          global_params=anchor)
    with pytest.raises(ValueError, match="FedProx needs"):
        train(model.module, x, y, TrainConfig(batch_size=8, proximal_mu=0.5), seed=1,
              global_params=[torch.from_numpy(model.vector().copy())])


def test_a_last_batch_of_one_sample_is_skipped_with_batch_norm() -> None:
    x, y = _data(17)  # batches of 8, 8 and 1
    model = FlatModel(_bn_cnn())
    train(model.module, x, y, TrainConfig(batch_size=8), seed=0)
    assert int(model.exact["1.num_batches_tracked"]) == 2
    # a worker finds its model's batch norm once and tells train(), which then skips it too
    worker = _Worker(task=None, model=FlatModel(_bn_cnn()), data={}, delta=np.empty(1))
    assert worker.batch_norm and not _Worker(task=None, model=FlatModel(nn.Linear(2, 2)),
                                             data={}, delta=np.empty(1)).batch_norm
    train(worker.model.module, x, y, TrainConfig(batch_size=8), seed=0,
          batch_norm=worker.batch_norm)
    assert int(worker.model.exact["1.num_batches_tracked"]) == 2
    with pytest.raises(ValueError, match="more than 1 value"):  # the one sample, if told none
        train(FlatModel(_bn_cnn()).module, x, y, TrainConfig(batch_size=8), seed=0,
              batch_norm=False)


def _span(model: FlatModel, name: str) -> slice:
    i = model.layout.names.index(name)
    off, size = model.layout.offsets[i], model.layout.sizes[i]
    return slice(off, off + size)


def test_each_node_keeps_its_own_count_exactly_and_fedbn_its_statistics() -> None:
    model = FlatModel(_bn_cnn(momentum=None))
    state_a, state_b = RecordDict(), RecordDict()
    big = 2**24 + 3
    model.exact["1.num_batches_tracked"].fill_(big)
    model.vector()[_span(model, "1.running_mean")] = 7.0
    local_state.keep(state_a, model, fedbn=True)
    model.reset_exact()
    assert int(model.exact["1.num_batches_tracked"]) == 0
    local_state.restore(state_b, model, fedbn=True)  # a node with nothing kept: as built
    assert int(model.exact["1.num_batches_tracked"]) == 0
    model.vector()[:] = 0.0
    local_state.restore(state_a, model, fedbn=False)  # the count always, the rest not
    assert int(model.exact["1.num_batches_tracked"]) == big
    assert not model.vector().any()
    local_state.restore(state_a, model, fedbn=True)
    assert (model.vector()[_span(model, "1.running_mean")] == 7.0).all()
    local = model.layout.mask(model.layout.local)
    assert not model.vector()[~local].any()
    # the cumulative average (momentum None) divides by the kept count
    x, _ = _data()
    model.module.train()
    with torch.no_grad():
        model.module(x[:8])
    assert int(model.exact["1.num_batches_tracked"]) == big + 1
    mean = x[:8].new_tensor(model.vector()[_span(model, "1.running_mean")])
    assert torch.allclose(mean, torch.full_like(mean, 7.0), atol=1e-5)  # 1/(2**24) of a step


def test_a_kept_tensor_of_another_shape_is_not_restored() -> None:
    model = FlatModel(_bn_cnn())
    state = RecordDict({local_state.LOCAL_STATE: ArrayRecord(
        {"1.num_batches_tracked": npy_array(np.zeros(2))})})
    model.exact["1.num_batches_tracked"].fill_(5)
    local_state.restore(state, model, fedbn=False)
    assert int(model.exact["1.num_batches_tracked"]) == 0  # as built, not the odd array


def test_a_stock_clients_integer_buffers_are_left_out_of_its_model() -> None:
    model = FlatModel(_bn_cnn())
    record = ArrayRecord(model.module.state_dict())  # as a stock Flower client sends it
    views = model_views(record, model.layout)
    assert set(views) == set(model.layout.names)
    record["0.extra"] = npy_array(np.zeros(2, np.float32))
    with pytest.raises(WireError, match=r"missing none; unexpected 0\.extra$"):
        model_views(record, model.layout)


def test_dp_sgd_refuses_batch_norm_and_suggests_group_norm() -> None:
    cfg = TrainConfig(dp_sgd_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="GroupNorm") as err:
        check_model(_bn_cnn(), cfg)
    assert "1, 5" in str(err.value) and "train.dp_sgd_noise_multiplier" in str(err.value)
    with pytest.raises(ValueError, match="GroupNorm"):
        train_dp_sgd(_bn_cnn(), *_data(), cfg)
    check_model(_bn_cnn(), TrainConfig())  # without DP-SGD batch norm is fine
    check_model(nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)), cfg)


def test_device_choices() -> None:
    with pytest.raises(ValueError, match=r"train\.device must be one of auto, cpu, cuda"):
        TrainConfig(device="gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_cuda_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"train.device = 'cuda'.*'auto'.*'cpu'"):
        resolve_device("cuda")
