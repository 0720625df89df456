"""Certificates, auth keys, the SuperNode wait shim, process bookkeeping and the CLI."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_ssh_private_key

from client.executor import build_parser as executor_parser
from client.supernode import FLOWER_IDLE_SLEEP_S, FLOWER_REPLY_SLEEP_S, make_sleep
from simulations import deploy
from simulations.certs import public_key_pem, write_all
from simulations.cli import build_parser
from simulations.deploy.commands import command_env
from simulations.deploy.deployment import POINTER_FILE


def test_certificates_chain_to_the_ca_and_name_the_hosts(tmp_path: Path) -> None:
    m = write_all(tmp_path, nodes=2, hosts=["127.0.0.1", "link.example"])
    ca = x509.load_pem_x509_certificate(m.ca.read_bytes())
    server = x509.load_pem_x509_certificate(m.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["link.example"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = load_pem_private_key(m.server_key.read_bytes(), None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()
    for cert, _ in m.node_certs:
        x509.load_pem_x509_certificate(cert.read_bytes()).verify_directly_issued_by(ca)
    assert (tmp_path / "ca.key").stat().st_mode & 0o077 == 0


def test_other_ca_does_not_verify(tmp_path: Path) -> None:
    a, b = write_all(tmp_path / "a", nodes=0), write_all(tmp_path / "b", nodes=0)
    server = x509.load_pem_x509_certificate(a.server_cert.read_bytes())
    with pytest.raises(InvalidSignature):  # same issuer name, another key
        server.verify_directly_issued_by(x509.load_pem_x509_certificate(b.ca.read_bytes()))


def test_auth_keys_are_what_flower_loads(tmp_path: Path) -> None:
    m = write_all(tmp_path, nodes=1)
    private, public = m.auth_keys[0]
    key = load_ssh_private_key(private.read_bytes(), None)  # as flower-supernode does
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    from flwr.cli.supernode.register import try_load_public_key

    assert try_load_public_key(public) == public_key_pem(public)  # as `flwr supernode register`
    assert (tmp_path / "node-0.auth").stat().st_mode & 0o077 == 0


def test_sleep_shim_maps_flower_waits_only() -> None:
    slept: list[float] = []
    sleep = make_sleep(0.2, 0.01, sleep=slept.append)
    for s in (FLOWER_IDLE_SLEEP_S, FLOWER_REPLY_SLEEP_S, 0.1, 7.0):
        sleep(s)
    assert slept == [0.2, 0.01, 0.1, 7.0]


def test_shorten_waits_patches_the_supernode_loop() -> None:
    import time as real_time

    from flwr.supernode import start_client_internal as loop

    from client.supernode import shorten_waits

    saved_time, saved_pull = loop.time, loop.pull_objects
    try:
        shorten_waits(0.2, 0.01)
        assert loop.time is not real_time and loop.time.monotonic is real_time.monotonic
        assert loop.pull_objects.keywords == {"initial_backoff": 0.05, "backoff_cap": 0.2}
    finally:
        loop.time, loop.pull_objects = saved_time, saved_pull


def test_options_validate() -> None:
    with pytest.raises(ValueError, match="needs TLS"):
        deploy.Options(auth=True, tls=False)
    with pytest.raises(ValueError, match="nodes"):
        deploy.Options(nodes=0)
    with pytest.raises(ValueError, match="mode"):
        deploy.Options(mode="ray")
    assert deploy.Options(nodes=2, threads=3).torch_threads == 3
    assert deploy.Options(mode="flower").torch_threads == 0
    assert deploy.Options(nodes=1000).torch_threads == 1


def test_commands_stand_for_flower_commands(tmp_path: Path) -> None:
    opts = deploy.Options(nodes=3, tls=True, auth=True)
    node = deploy.supernode_command(1, "127.0.0.1:9", 10, opts, tmp_path)
    assert node[1:3] == ["-m", "client.supernode"] and node[-2:] == ["--isolation", "process"]
    assert "partition-id=1 num-partitions=3" in node
    assert str(tmp_path / "node-1.auth") in node and str(tmp_path / "ca.pem") in node
    stock = deploy.supernode_command(0, "127.0.0.1:9", 10, deploy.Options(mode="flower"), None)
    assert Path(stock[0]).name == "flower-supernode" and "--insecure" in stock
    assert stock[-2:] == ["--isolation", "subprocess"]
    link = deploy.superlink_command(9, certs=tmp_path, auth=True)
    assert "--enable-supernode-auth" in link and "--insecure" not in link
    assert link[1:4] == ["-m", "server.superlink", "--"]  # Flower's, with less CPU a request
    stock_link = deploy.superlink_command(9, certs=None, auth=False, wrapped=False)
    assert Path(stock_link[0]).name == "flower-superlink" and link[4:6] == stock_link[1:3]
    assert "--insecure" in stock_link
    exe = deploy.executor_command(10, 1234, opts, tmp_path)
    args = executor_parser().parse_args(exe[3:])
    assert args.parent_pid == 1234 and args.root_certificates == str(tmp_path / "ca.pem")
    # SuperNode and executor of one runtime port meet on one wake-up socket (fedring mode)
    node10 = deploy.supernode_command(1, "127.0.0.1:9", 10, opts, tmp_path)
    assert node10[node10.index("--task-signal") + 1] == args.task_signal == "fedring-tasks-10"
    warm = deploy.Options(mode="warm")
    assert "--task-signal" not in deploy.supernode_command(0, "127.0.0.1:9", 10, warm, None)
    assert "--task-signal" not in deploy.executor_command(10, 1, warm, None)
    command = deploy.run_command("fed", "sqlite:///x.db", 3)
    assert "federation.clients=3 federation.min_clients=2" in command  # survives one loss
    assert f'db="sqlite:///{Path.cwd()}/x.db"' in command  # not the SuperLink's directory


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_stop_processes_stops_the_recorded_tree_and_nothing_else() -> None:
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; "
                               "time.sleep(60)']); time.sleep(60)"])
    bystander, recycled = _sleeper(), _sleeper()
    try:
        deadline = time.monotonic() + 20
        while not deploy.descendants([parent.pid]) and time.monotonic() < deadline:
            time.sleep(0.05)
        [child] = deploy.descendants([parent.pid])
        records = [{"pid": parent.pid, "start_time": deploy.start_time(parent.pid)},
                   # same PID, other start time: a PID reused by another process
                   {"pid": recycled.pid, "start_time": deploy.start_time(recycled.pid) - 1}]
        stopped = deploy.stop_processes(records, timeout_s=5)
        parent.wait(5)
        assert sorted(stopped) == sorted([parent.pid, child])
        assert not deploy.alive(child) and not deploy.alive(parent.pid)
        assert deploy.alive(bystander.pid) and deploy.alive(recycled.pid)
    finally:
        for p in (parent, bystander, recycled):
            p.kill()
            p.wait()


def test_started_processes_import_this_repository(monkeypatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = command_env(deploy.Options())
    [root] = env["PYTHONPATH"].split(os.pathsep)
    assert (Path(root) / "client" / "executor.py").is_file()  # `python -m client.executor`


def test_down_without_state_says_where_it_looked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(deploy.DeployError, match=f"looked for {tmp_path}/nothing/state.json"):
        deploy.down(tmp_path / "nothing")
    with pytest.raises(deploy.DeployError) as info:
        deploy.down()
    assert f"{tmp_path}/runs/deploy/state.json" in str(info.value)
    assert f"{tmp_path}/flwr/{POINTER_FILE}" in str(info.value)


def test_down_finds_the_deployment_up_recorded_and_removes_its_federation(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """`deploy down` without --dir, from another directory, in a new process's place."""
    from simulations.deploy.deployment import _set_pointer, write_state
    from simulations.deploy.federation import flwr_config_path, write_federation

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    write_federation("other", "127.0.0.1:2", None)  # someone else's entry stays
    toml = write_federation("fedtest", "127.0.0.1:1", None)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    sleeper = _sleeper()
    try:
        write_state(state_dir, {
            "federation": "fedtest", "state_dir": str(state_dir), "federation_toml": toml,
            "flwr_home": str(tmp_path / "flwr"),
            "processes": [{"name": "superlink", "pid": sleeper.pid,
                           "start_time": deploy.start_time(sleeper.pid)}]})
        _set_pointer("fedtest", state_dir)
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        assert build_parser().parse_args(["deploy", "down"]).dir is None
        args = build_parser().parse_args(["deploy", "down"])
        assert args.func(args) == 0
        assert sleeper.wait(10) is not None
        assert f"stopped 1 process(es): [{sleeper.pid}]" in capsys.readouterr().out
    finally:
        sleeper.kill()
        sleeper.wait()
    config = flwr_config_path().read_text()
    assert "[superlink.fedtest]" not in config and "[superlink.other]" in config
    assert json.loads((tmp_path / "flwr" / POINTER_FILE).read_text()) == {}
    args = build_parser().parse_args(["deploy", "down"])
    assert args.func(args) == 1  # nothing recorded any more: it says where it looked
    assert "no deployment state found" in capsys.readouterr().err


def test_cli_parses_deploy_and_certs(tmp_path: Path) -> None:
    args = build_parser().parse_args(["deploy", "up", "--nodes", "4", "--auth", "--db",
                                      "sqlite:///x.db"])
    assert args.func is deploy.cmd_up and args.nodes == 4 and args.auth
    assert build_parser().parse_args(["deploy", "down"]).func is deploy.cmd_down
    args = build_parser().parse_args(["certs", "--out", str(tmp_path), "--nodes", "1"])
    assert args.func(args) == 0
    assert {p.name for p in tmp_path.iterdir()} == {
        "ca.pem", "ca.key", "server.pem", "server.key", "node-0.pem", "node-0.key",
        "node-0.auth", "node-0.auth.pub", "node-0.secagg", "secagg-trusted-keys.txt"}


def test_device_profile_is_memory_light() -> None:
    from simulations.config import load_scenario
    from simulations.models import count_parameters
    from simulations.task import ScenarioTask

    config = load_scenario("device")
    assert config["train"]["batch_size"] <= 16 and config["train"]["local_epochs"] == 1
    assert count_parameters(ScenarioTask.from_config(config).build_model()) < 5000


def test_executor_drops_an_old_apps_modules(tmp_path: Path, monkeypatch) -> None:
    from client.executor import WarmExecutor

    app_dir = tmp_path / "app-v1"
    (app_dir / "fedring_fake_pkg").mkdir(parents=True)
    (app_dir / "fedring_fake_pkg" / "__init__.py").write_text("VERSION = 1\n")
    monkeypatch.syspath_prepend(str(app_dir))
    import fedring_fake_pkg

    assert fedring_fake_pkg.VERSION == 1
    executor = WarmExecutor("127.0.0.1:9", insecure=True)
    executor._app, executor._fab_hash, executor._app_dir = object(), "h1", app_dir
    executor._unload()
    assert "fedring_fake_pkg" not in sys.modules
    assert str(app_dir) not in sys.path
    assert executor._app is None and executor._fab_hash == ""
