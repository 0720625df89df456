"""A bug in the user's own task module ends ``fedring simulate`` in one line naming the
module, the function and the exception; the traceback goes to the log, ``--debug`` shows
it, and a bug in fedring itself still shows its traceback."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.store import Store
from simulations import module_task
from simulations.cli import main
from simulations.module_task import TaskCodeError

DATA = textwrap.dedent("""
    import torch
    from torch.utils.data import TensorDataset

    def load_partition(partition_id, num_partitions):
        g = torch.Generator().manual_seed(partition_id)
        return TensorDataset(torch.randn(16, 3, generator=g), torch.tensor([0, 1] * 8))
""")
WRONG_MODEL = "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(4, 2))\n"
MODEL = "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(3, 2))\n"
TEST_SET = "def load_test():\n    return load_partition(0, 1)\n"
WIDER_TEST_SET = "def load_test():\n    return TensorDataset(torch.randn(8, 5), torch.zeros(8))\n"
NET = textwrap.dedent("""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x.view(len(x), 2, 3))

    def build_model():
        return Net()
""")
SHAPES = "mat1 and mat2 shapes cannot be multiplied"


def write_task(tmp_path: Path, *parts: str, name: str = "user_task.py") -> Path:
    path = tmp_path / name
    path.write_text(DATA + "\n".join(parts))
    return path


def simulate(tmp_path: Path, task: Path, *extra: str, debug: bool = False) -> list[str]:
    return [*(["--debug"] if debug else []), "simulate", "--db",
            f"sqlite:///{tmp_path / 'runs.db'}", "--clients", "2", "--rounds", "2", "--set",
            f"task.module={task}", *extra]


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("engine", ["inprocess", "flower"])
def test_a_model_that_does_not_fit_the_data_is_one_line_and_logged(tmp_path, capsys, caplog,
                                                                    engine):
    task = write_task(tmp_path, MODEL, WIDER_TEST_SET)  # fails on central evaluation
    with caplog.at_level(logging.ERROR, logger="fedring"):
        assert main(simulate(tmp_path, task, "--engine", engine)) == 1
    assert one_line(capsys) == (f"fedring: error: {task}.build_model: RuntimeError: "
                                f"{SHAPES} (8x5 and 3x2)")
    (record,) = [r for r in caplog.records if r.name == "fedring" and r.levelno == logging.ERROR]
    assert isinstance(record.exc_info[1], TaskCodeError)
    assert isinstance(record.exc_info[1].__cause__, RuntimeError)  # the user's own error
    assert "Traceback" in caplog.text and "linear.py" in caplog.text  # the whole of it


@pytest.mark.parametrize("parts, function, error", [
    ((WRONG_MODEL,), "build_model", f"RuntimeError: {SHAPES}"),  # a batch in fedring's loop
    ((NET,), "Net.forward", "RuntimeError: shape '[2, 2, 3]' is invalid"),  # its own code
    ((MODEL.replace("return", "raise KeyError('hidden')\n    return"),), "build_model",
     "KeyError: 'hidden'"),
    ((MODEL, "def load_test():\n    return 1 / 0\n"), "load_test", "ZeroDivisionError"),
    ((MODEL, TEST_SET, "def _score(model, loader):\n    raise ValueError('no labels')\n"
      "def evaluate(model, loader):\n    return _score(model, loader)\n"),
     "_score", "ValueError: no labels"),
])
def test_the_line_names_the_innermost_function_of_the_module(tmp_path, capsys, parts,
                                                              function, error):
    task = write_task(tmp_path, *parts)
    assert main(simulate(tmp_path, task, "--set", "train.batch_size=2")) == 1
    assert one_line(capsys).startswith(f"fedring: error: {task}.{function}: {error}")


def test_an_error_in_a_later_round_ends_the_run_in_one_line(tmp_path, capsys):
    trained = tmp_path / "trained"
    task = write_task(tmp_path, MODEL, TEST_SET, textwrap.dedent(f"""
        import os

        def train(model, loader, config):
            open({str(trained)!r}, "w").close()
            with torch.no_grad():
                model[0].bias.add_(0.1)  # a new model, evaluated after the round
            return {{}}

        def evaluate(model, loader):
            if os.path.exists({str(trained)!r}):  # the start check passes, round 1 not
                raise RuntimeError("evaluation broke")
            return {{"accuracy": 0.5}}
    """))
    assert main(simulate(tmp_path, task)) == 1
    err = capsys.readouterr().err  # the progress of round 1, then the line
    assert err.strip().splitlines()[-1] == (f"fedring: error: {task}.evaluate: "
                                            "RuntimeError: evaluation broke")
    assert "Traceback" not in err and err.count("fedring: error") == 1
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        (run,) = store.list_runs()
    assert run.status == "failed"


def test_an_in_process_clients_train_error_is_stored_naming_the_function(tmp_path, capsys):
    task = write_task(tmp_path, MODEL,
                      "def train(model, loader, config):\n    raise RuntimeError('boom')\n")
    assert main(simulate(tmp_path, task, "--rounds", "1")) == 1  # no update: a failed run
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        (run,) = store.list_runs()
        reasons = [u.reason for _, u in store.updates(run.run_id)]
    assert len(reasons) == 2 and all(  # one line each, the traceback in the log
        r.endswith(f"{task}.train: RuntimeError: boom") and "\n" not in r
        for r in reasons), reasons


def test_debug_raises_the_error_with_the_users_as_its_cause(tmp_path):
    task = write_task(tmp_path, WRONG_MODEL, TEST_SET)
    with pytest.raises(TaskCodeError) as info:
        main(simulate(tmp_path, task, debug=True))
    assert isinstance(info.value.__cause__, RuntimeError) and SHAPES in str(info.value)


def test_a_bug_in_fedrings_own_loop_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(module, x, y, batch_size):
        raise TypeError("fedring's own bug")

    monkeypatch.setattr(module_task, "evaluate", broken)  # fedring's loop, not the model
    task = write_task(tmp_path, MODEL, TEST_SET)
    with pytest.raises(TypeError, match="fedring's own bug"):
        main(simulate(tmp_path, task))


@pytest.mark.slow
def test_the_command_prints_one_line_and_with_debug_the_traceback(tmp_path):
    task = write_task(tmp_path, WRONG_MODEL, TEST_SET)
    root = str(Path(__file__).resolve().parents[2])  # this checkout's fedring
    env = {**os.environ, "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}

    def fedring(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "simulations.cli", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)

    plain = fedring(*simulate(tmp_path, task))
    assert plain.returncode == 1 and plain.stderr.strip().splitlines() == [
        f"fedring: error: {task}.build_model: RuntimeError: {SHAPES} (16x3 and 4x2)"]
    debug = fedring(*simulate(tmp_path, task, debug=True))
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert "direct cause" in debug.stderr and "TaskCodeError" in debug.stderr
