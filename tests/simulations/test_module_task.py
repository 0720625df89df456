"""``[task] module``: the user's model and data, loaded, checked and refused at start."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict

from client.app import FedringClient
from client.protocol.errors import WireError
from client.protocol.keys import ConfigKey
from simulations.apps import build_task, spec_from_run_config
from simulations.config import load_scenario
from simulations.module_task import ModuleTask, TaskModuleError, dataset_tensors, make_task
from simulations.task import ScenarioTask, task_spec

FIXTURES = Path(__file__).parent / "fixtures"
MY_TASK = FIXTURES / "my_task.py"
LOOPS = FIXTURES / "my_task_loops.py"
SMALL = ["federation.clients=4", "federation.rounds=1"]


def module_config(module: Path | str, *extra: str, scenario: str = "default") -> dict:
    return load_scenario(scenario, [*SMALL, f"task.module={module}", *extra])


def write_module(tmp_path: Path, body: str, name: str = "bad_task.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


GOOD = textwrap.dedent("""
    import torch
    from torch.utils.data import TensorDataset

    def build_model():
        return torch.nn.Sequential(torch.nn.Linear(3, 2))

    def load_partition(partition_id, num_partitions):
        return TensorDataset(torch.randn(6, 3), torch.tensor([0, 1] * 3))
""")


# ---- the scenario: where the module is and what it replaces

def test_a_module_replaces_data_and_model_and_reaches_the_clients_absolute():
    cfg = module_config(os.path.relpath(MY_TASK))  # against the working directory
    assert cfg["task"]["module"] == str(MY_TASK.resolve())
    assert "data" not in cfg and "model" not in cfg  # the default scenario's are dropped
    spec = task_spec(cfg)
    assert spec["task"] == {"module": str(MY_TASK.resolve()), "client_test_fraction": 0.0}
    assert "data" not in spec and "model" not in spec
    assert isinstance(make_task(spec), ModuleTask)
    assert isinstance(make_task(task_spec(load_scenario("default", SMALL))), ScenarioTask)


def test_a_relative_path_in_a_scenario_file_is_relative_to_that_file(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.py").write_text(MY_TASK.read_text())
    scenario = tmp_path / "mine.toml"
    scenario.write_text('[task]\nmodule = "tasks/mine.py"\n[federation]\nclients = 3\n')
    cfg = load_scenario(str(scenario))
    assert cfg["task"]["module"] == str((tmp_path / "tasks" / "mine.py").resolve())


def test_an_import_name_is_sent_as_is():
    cfg = module_config("tests.simulations.fixtures.my_task")
    assert task_spec(cfg)["task"] == {"module": "tests.simulations.fixtures.my_task",
                                      "client_test_fraction": 0.0}
    build_task(cfg)  # importable here (the repository root is on sys.path)


def test_the_flower_run_config_resolves_the_module_too():
    spec = spec_from_run_config({"scenario": "default",
                                 "overrides": f"task.module={MY_TASK} federation.clients=3"})
    assert spec["task"] == {"module": str(MY_TASK.resolve()), "client_test_fraction": 0.0}
    assert spec["clients"] == 3


def test_a_scenario_setting_both_task_and_data_is_refused(tmp_path):
    scenario = tmp_path / "both.toml"
    scenario.write_text(f'[task]\nmodule = "{MY_TASK}"\n[data]\nalpha = 0.1\n'
                        '[model]\nkind = "cnn"\n')
    with pytest.raises(ValueError, match=r"\[data\] and \[model\] do not apply: remove "
                                         r"data.alpha, model.kind"):
        load_scenario(str(scenario))


def test_an_override_of_data_beside_a_module_is_refused():
    with pytest.raises(ValueError, match=r"\[data\] do not apply: remove data.alpha"):
        module_config(MY_TASK, "data.alpha=0.3")


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"task.module 'nowhere/my_task.py': no Python file"):
        module_config("nowhere/my_task.py")


def test_label_flip_needs_a_built_in_dataset():
    with pytest.raises(ValueError, match="label_flip"):
        module_config(MY_TASK, "attack.fraction=0.25", "attack.kind=label_flip")


# ---- the module: refused at start, naming the module and the function

@pytest.mark.parametrize("body, message", [
    ("import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n",
     r"lacks the function load_partition\(\)"),
    (GOOD.replace("return torch.nn.Sequential(torch.nn.Linear(3, 2))", "return [1, 2]"),
     r"bad_task\.py\.build_model\(\) returned list, expected a torch.nn.Module"),
    (GOOD.replace("return TensorDataset(torch.randn(6, 3), torch.tensor([0, 1] * 3))",
                  "return 42"),
     r"load_partition\(\) returned int for partition 0, expected a torch.utils.data.Dataset"),
    (GOOD + "\ndef load_test():\n    return None\n",
     r"load_test\(\) returned NoneType, expected a torch.utils.data.Dataset"),
    (GOOD + "\ndef load_test():\n    return load_partition(0, 1)\n"
            "\ndef evaluate(model, loader):\n    return [0.5]\n",
     r"evaluate\(\) returned list, expected dict\[str, float\]"),
    (GOOD + "\ndef load_test():\n    return load_partition(0, 1)\n"
            "\ndef evaluate(model, loader):\n    return {'accuracy': 'high'}\n",
     r"evaluate\(\) returned \{'accuracy': 'high'\}"),
    (GOOD + "\ndef train(model):\n    return {}\n",
     r"train\(\) must take \(model, loader, config\)"),
    (GOOD + "\nraise RuntimeError('no data here')\n",
     r"cannot be imported: RuntimeError: no data here"),
    (GOOD.replace("return TensorDataset(", "return [('text', 1)] or TensorDataset("),
     r"cannot stack its items into tensors"),
])
def test_a_bad_module_fails_at_start_naming_the_function(tmp_path, body, message):
    path = write_module(tmp_path, body)
    cfg = module_config(path)
    with pytest.raises(TaskModuleError, match=message) as info:
        build_task(cfg)
    assert str(path) in str(info.value)  # names the module


@pytest.mark.parametrize("setting, message", [
    ("train.dp_sgd_noise_multiplier=1.0", "DP-SGD"),
    ("train.proximal_mu=0.1", "FedProx"),
    ("driver.kind=cross_silo", "silos train with fedring's data-parallel loop"),
])
def test_settings_of_fedrings_own_loop_are_refused_beside_a_module_train(setting, message):
    with pytest.raises(TaskModuleError, match=message):
        build_task(module_config(LOOPS, setting))


def test_a_target_accuracy_needs_a_test_set(tmp_path):
    with pytest.raises(TaskModuleError, match="has no load_test"):
        build_task(module_config(write_module(tmp_path, GOOD), "driver.target_accuracy=0.9"))


def test_a_federated_target_needs_no_test_set_but_a_held_out_split(tmp_path):
    module = write_module(tmp_path, GOOD)
    federated = ["driver.target_accuracy=0.9", "driver.target_on=federated",
                 "federation.evaluate_fraction=1"]
    build_task(module_config(module, *federated, "task.client_test_fraction=0.5"))
    with pytest.raises(TaskModuleError, match=r"has no load_client_test\(\) and "
                                              r"task\.client_test_fraction = 0"):
        build_task(module_config(module, *federated))


# ---- what the task gives

def test_the_initial_model_is_seeded_by_the_run_seed_and_leaves_torch_rng_alone():
    cfg = module_config(MY_TASK)
    a, layout = make_task(task_spec(cfg)).initial_params()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    b, _ = make_task(task_spec(cfg)).initial_params()
    assert torch.rand(1) == before  # building the model did not consume the global RNG
    np.testing.assert_array_equal(a, b)
    assert layout.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    other, _ = make_task(task_spec({**cfg, "seed": cfg["seed"] + 1})).initial_params()
    assert not np.array_equal(a, other)


def test_a_partition_is_materialised_as_float32_inputs_and_int64_labels():
    task = build_task(module_config(MY_TASK))
    x, y = task.partition(1)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.shape == (200, 8) and y.shape == (200,)
    ds = task.load_partition(1, 4)
    np.testing.assert_allclose(x[7].numpy(), ds[7][0].astype(np.float32))
    assert int(y[7]) == ds[7][1]
    with pytest.raises(ValueError, match="out of range"):
        task.partition(4)


def test_central_evaluation_uses_the_test_set_and_is_absent_without_one(tmp_path):
    task = build_task(module_config(MY_TASK))
    params, _ = task.initial_params()
    metrics = task.evaluate(params)
    assert set(metrics) == {"loss", "accuracy"} and 0 <= metrics["accuracy"] <= 1
    moved = task.evaluate(params + 0.5)  # not the cached initial figure
    assert moved != metrics
    assert build_task(module_config(write_module(tmp_path, GOOD))).evaluate(params[:8]) == {}


def test_the_modules_own_loops_run_over_a_loader(tmp_path):
    task = build_task(module_config(LOOPS, "train.batch_size=50", "train.local_epochs=2",
                                    "task.client_test_fraction=0.25"))
    model = task.build_model()
    count, metrics = task.trainer(model, 0, 7)
    assert count == 150 and metrics["own_train_steps"] == 2 * 3  # 150 examples / 50, twice
    count, metrics = task.evaluator(model, 0)  # on the held-out quarter
    assert count == 50 and metrics["own_eval"] == 1.0
    assert task.evaluate(task.initial_params()[0])["own_eval"] == 1.0


def test_train_metrics_may_be_numpy_or_tensor_scalars(tmp_path):
    path = write_module(tmp_path, GOOD + "\nimport numpy as np\n"
                                         "def train(model, loader, config):\n"
                                         "    return {'a': np.float32(0.5), 'b': torch.tensor(2),"
                                         " 'c': 3}\n")
    task = build_task(module_config(path))
    assert task.trainer(task.build_model(), 0, 1) == (6, {"a": 0.5, "b": 2.0, "c": 3.0})


def test_a_train_returning_a_reserved_metric_is_refused(tmp_path):
    path = write_module(tmp_path, GOOD + "\ndef train(model, loader, config):\n"
                                         "    return {'num-examples': 3.0}\n")
    task = build_task(module_config(path))
    with pytest.raises(TaskModuleError, match=r"train\(\) returned the metric 'num-examples'"):
        task.trainer(task.build_model(), 0, 1)


def test_scenario_tasks_have_the_same_shape():
    task = build_task(load_scenario("default", SMALL))
    x, y = task.partition(2)
    ds = task.load_partition(2, 4)
    assert len(ds) == len(x)
    xs, ys = dataset_tensors(ds, "p")
    np.testing.assert_array_equal(xs.numpy(), x.numpy())
    np.testing.assert_array_equal(ys.numpy(), y.numpy())
    test = task.load_test()
    assert len(test) == len(task.dataset.y_test)
    assert isinstance(task.build_model(), torch.nn.Module)
    assert task.trainer is None and task.evaluator is None


def test_a_client_that_cannot_import_the_module_refuses_the_message_naming_it():
    spec = {**task_spec(module_config(MY_TASK)), "task": {"module": "/nowhere/my_task.py"}}
    client = FedringClient(make_task, spec_from_run_config)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(WireError, match=r"not a task this client can build: task.module "
                                        r"'/nowhere/my_task.py' cannot be imported"):
        client._worker(ConfigRecord({ConfigKey.TASK: json.dumps(spec)}), context)
