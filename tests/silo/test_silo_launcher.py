"""``fedring silo`` builds the right torchrun command; bad options and scenarios fail at start."""

from __future__ import annotations

import shlex
import sys

import pytest
import torch

from simulations.cli import main
from simulations.config import load_scenario
from simulations.silo_cli import WORKER_MODULE, SiloLaunch, torchrun_command


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_one_machine_runs_a_standalone_torchrun_of_the_silo_worker() -> None:
    cmd = torchrun_command(SiloLaunch(nproc_per_node=4, runtime_api_address="127.0.0.1:9094",
                                      insecure=True, device="cpu", threads=2))
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    launcher, worker = cmd[:cmd.index("-m", 3)], cmd[cmd.index("-m", 3) + 1:]
    assert "--standalone" in launcher and "--node-rank" not in launcher
    assert _flag(launcher, "--nproc-per-node") == "4" and _flag(launcher, "--nnodes") == "1"
    assert worker[0] == WORKER_MODULE
    assert _flag(worker, "--runtime-api-address") == "127.0.0.1:9094"
    assert "--insecure" in worker and _flag(worker, "--device") == "cpu"
    assert _flag(worker, "--threads") == "2"


def test_several_machines_share_a_rendezvous_endpoint_and_a_node_rank() -> None:
    cmd = torchrun_command(SiloLaunch(nproc_per_node=8, nnodes=2, node_rank=1,
                                      rdzv_endpoint="10.0.0.1:29400"))
    launcher = cmd[:cmd.index("-m", 3)]
    assert "--standalone" not in launcher
    assert _flag(launcher, "--nnodes") == "2" and _flag(launcher, "--node-rank") == "1"
    assert _flag(launcher, "--rdzv-endpoint") == "10.0.0.1:29400"
    assert "--insecure" not in cmd  # only node 0 talks to the SuperNode


def test_dry_run_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["silo", "--nproc-per-node", "2", "--insecure", "--dry-run",
                 "--runtime-api-address", "10.1.2.3:9094", "--device", "cpu"]) == 0
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed == torchrun_command(SiloLaunch(nproc_per_node=2, insecure=True,
                                                  runtime_api_address="10.1.2.3:9094",
                                                  device="cpu"))


BAD_OPTIONS = [
    (["--nproc-per-node", "0", "--insecure"], "--nproc-per-node must be >= 1"),
    (["--nnodes", "2", "--insecure"], "needs --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be in"),
    (["--rdzv-endpoint", "no-port", "--insecure"], "--rdzv-endpoint must be HOST:PORT"),
    (["--runtime-api-address", "9094", "--insecure"], "--runtime-api-address must be"),
    ([], "give --insecure or --root-certificates"),
    (["--root-certificates", "/nonexistent/ca.pem"], "no such file"),
    (["--timeout", "0", "--insecure"], "--timeout must be > 0"),
]


@pytest.mark.parametrize(("args", "message"), BAD_OPTIONS)
def test_bad_options_fail_before_anything_starts(args: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["silo", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["silo", "--device", "cuda", "--insecure"]) == 2
    assert "--device cuda needs one GPU per process" in capsys.readouterr().err


CROSS_SILO = {"driver.kind": "cross_silo"}
BAD_SCENARIOS = [
    ({"silo.ring_timeout_s": -1.0}, "silo.ring_timeout_s must be > 0"),
    ({"silo.algorithm": "star"}, "silo.algorithm 'star' is unknown; choose one of: ring"),
    ({"silo.backend": "mpi"}, "silo.backend 'mpi' is unknown"),
    ({"silo.rendezvous_port": 70000}, "silo.rendezvous_port must be a TCP port"),
    ({"silo.ring_order": "sorted"}, "unknown key(s) silo.ring_order"),
    ({**CROSS_SILO, "aggregation.combine": "median"}, "aggregation.combine 'median'"),
    ({**CROSS_SILO, "dp.mode": "central", "aggregation.weight_by": "uniform",
      "dp.noise_multiplier": 1.0}, "dp.mode 'central' clips individual updates on the server"),
    ({**CROSS_SILO, "secagg.enabled": True, "dp.mode": "local", "dp.noise_multiplier": 1.0},
     "dp.mode = 'local' together with secagg is not supported"),
    ({**CROSS_SILO, "secagg.enabled": True, "aggregation.combine": "sum",
      "aggregation.max_norm": 5.0}, "set aggregation.max_norm = 0"),
    ({**CROSS_SILO, "secagg.enabled": True, "compression.kind": "qsgd"},
     "compression does not apply"),
    ({**CROSS_SILO, "federation.round_timeout_s": 100.0}, "silo.join_timeout_s + "
                                                          "silo.ring_timeout_s = 150 s"),
]


@pytest.mark.parametrize(("values", "message"), BAD_SCENARIOS)
def test_bad_cross_silo_scenarios_fail_at_start_naming_the_key(values: dict,
                                                                message: str) -> None:
    with pytest.raises(ValueError) as err:
        load_scenario("default", values=values)
    assert message in str(err.value)


def test_a_good_cross_silo_scenario_resolves_with_its_silo_section() -> None:
    config = load_scenario("default", values={**CROSS_SILO, "silo.ring_timeout_s": 5.0,
                                              "silo.algorithm": "tree"})
    assert config["driver"]["kind"] == "cross_silo"
    assert config["silo"]["ring_timeout_s"] == 5.0 and config["silo"]["algorithm"] == "tree"


@pytest.mark.parametrize("dp", [{}, {"dp.mode": "distributed"}, {"dp.mode": "central"}])
def test_secure_cross_silo_scenarios_resolve(dp: dict) -> None:
    values = {**CROSS_SILO, "secagg.enabled": True, **dp}
    if dp:
        values.update({"aggregation.weight_by": "uniform", "dp.noise_multiplier": 1.0})
    config = load_scenario("default", values=values)
    assert config["secagg"]["enabled"] and config["driver"]["kind"] == "cross_silo"


def test_simulate_refuses_cross_silo_on_an_engine_that_cannot_run_rings(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--engine", "flower", "--set", "driver.kind=cross_silo",
                 "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    assert code == 2
    assert "use --engine inprocess" in capsys.readouterr().err
