"""``up`` and ``down``: start the SuperLink and SuperNodes, keep their records in the state
file, and stop exactly what was recorded."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from simulations.deploy.commands import (
    STATE_DIR,
    WARM_MODES,
    Options,
    command_env,
    executor_command,
    run_command,
    superlink_command,
    supernode_command,
)
from simulations.deploy.federation import (
    flwr_config_path,
    flwr_home,
    register_supernode,
    remove_federation,
    write_federation,
)
from simulations.deploy.processes import (
    HOST,
    DeployError,
    alive,
    free_port,
    launch_process,
    log_has,
    port_open,
    stop_processes,
    wait_until,
)

STATE_FILE = "state.json"
POINTER_FILE = "fedring-deployments.json"  # in Flower's home: {federation: state dir}


def pointer_path() -> Path:
    """Where ``up`` records its state directory, for a ``down`` without ``--dir``."""
    return flwr_config_path().parent / POINTER_FILE


def _pointers() -> dict[str, str]:
    path = pointer_path()
    return json.loads(path.read_text()) if path.exists() else {}


def _set_pointer(federation: str, state_dir: Path | None) -> None:
    pointers = _pointers()
    if state_dir is None:
        pointers.pop(federation, None)
    else:
        pointers[federation] = str(state_dir)
    pointer_path().parent.mkdir(parents=True, exist_ok=True)
    pointer_path().write_text(json.dumps(pointers, indent=2))


def find_state_dir(state_dir: Path | None = None) -> Path:
    """The state directory of the deployment to stop: ``state_dir``; without it, the one
    ``up`` recorded in Flower's home, else the default. Fails saying where it looked."""
    if state_dir is not None:
        candidates = [Path(state_dir).resolve()]
    else:
        candidates = [*(Path(d) for d in _pointers().values()), STATE_DIR.resolve()]
    found = list(dict.fromkeys(d for d in candidates if read_state(d) is not None))
    running = [d for d in found if read_state(d)["processes"]]
    if len(running) > 1:
        raise DeployError("several deployments are running, from "
                          f"{', '.join(map(str, running))}: give --dir")
    if running or found:
        return (running or found)[0]
    looked = ", ".join(str(d / STATE_FILE) for d in dict.fromkeys(candidates))
    where = "" if state_dir is not None else f" (and the record in {pointer_path()})"
    raise DeployError(f"no deployment state found: looked for {looked}{where}; give the "
                      "--dir that `fedring deploy up` used")


def read_state(state_dir: Path = STATE_DIR) -> dict[str, Any] | None:
    path = Path(state_dir) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def write_state(state_dir: Path, state: dict[str, Any]) -> None:
    (Path(state_dir) / STATE_FILE).write_text(json.dumps(state, indent=2))


def _node_id(log: str) -> int | None:
    for line in Path(log).read_text(errors="replace").splitlines():
        if "SuperNode ID:" in line:
            return int(line.rsplit(":", 1)[1].strip().split()[0])
    return None


def start_supernode(i: int, state: dict[str, Any], opts: Options,
                    env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start SuperNode ``i`` (and its executor) against a running deployment; returns the
    new process records (not yet in the state file)."""
    logs = Path(state["state_dir"]) / "logs"
    certs = Path(state["certs"]) if state.get("certs") else None
    env = env or command_env(opts)
    port = free_port()
    node = launch_process(f"supernode-{i}",
                          supernode_command(i, state["address"], port, opts, certs), logs, env)
    records = [node]
    if opts.mode in WARM_MODES:
        records.append(launch_process(f"executor-{i}",
                                      executor_command(port, node["pid"], opts, certs),
                                      logs, env))
    return records


def up(opts: Options) -> dict[str, Any]:
    """Start the SuperLink and SuperNodes, write the federation entry; returns the state."""
    state_dir = Path(opts.state_dir).resolve()
    previous = read_state(state_dir)
    if previous and any(alive(r["pid"], r["start_time"]) for r in previous["processes"]):
        raise DeployError(f"a deployment from {state_dir} is still running: "
                          "`fedring deploy down` first")
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    certs = None
    if opts.tls:
        from simulations.certs import write_all

        certs = state_dir / "certs"
        write_all(certs, nodes=opts.nodes)
    env = command_env(opts)
    port = free_port()
    address = f"{HOST}:{port}"
    state: dict[str, Any] = {"federation": opts.federation, "address": address,
                             "state_dir": str(state_dir), "certs": str(certs) if certs else None,
                             "mode": opts.mode, "nodes": opts.nodes, "tls": opts.tls,
                             "auth": opts.auth, "db": opts.db, "processes": [],
                             "flwr_home": os.environ.get("FLWR_HOME", "")}
    try:
        wrapped = opts.mode == "fedring" and not opts.flower_superlink
        link = launch_process("superlink", superlink_command(
            port, certs=certs, auth=opts.auth, wrapped=wrapped), state_dir / "logs", env)
        state["processes"].append(link)
        write_state(state_dir, state)
        wait_until("the SuperLink", lambda: port_open(port), [link], opts.timeout_s)
        state["federation_toml"] = write_federation(
            opts.federation, address, certs / "ca.pem" if certs else None)
        if opts.auth:
            state["registered"] = [register_supernode(opts.federation,
                                                      certs / f"node-{i}.auth.pub")
                                   for i in range(opts.nodes)]
        for i in range(opts.nodes):
            state["processes"] += start_supernode(i, state, opts, env)
            write_state(state_dir, state)
        nodes = [r for r in state["processes"] if r["name"].startswith("supernode-")]
        wait_until("the SuperNodes to connect",
                   lambda: all(log_has(r["log"], "SuperNode ID:") for r in nodes),
                   state["processes"], opts.timeout_s)
        state["node_ids"] = [_node_id(r["log"]) for r in nodes]
    except BaseException:
        stop_processes(state["processes"])
        state["processes"] = []
        write_state(state_dir, state)
        raise
    state["run_command"] = run_command(opts.federation, opts.db, opts.nodes)
    write_state(state_dir, state)
    _set_pointer(opts.federation, state_dir)
    return state


def down(state_dir: Path | None = None, timeout_s: float = 10.0) -> list[int]:
    """Stop the processes ``up`` recorded (and their descendants) and remove the federation
    entry it wrote; returns the PIDs signalled. Without ``state_dir``, ``up``'s record
    says where its state is (``find_state_dir``)."""
    state_dir = find_state_dir(state_dir)
    state = read_state(state_dir)
    assert state is not None
    stopped = stop_processes(state["processes"], timeout_s)
    state["processes"] = []
    with flwr_home(state.get("flwr_home")):
        if state.get("federation_toml"):
            remove_federation(state["federation"])
        if _pointers().get(state["federation"]) == str(state_dir):
            _set_pointer(state["federation"], None)
    write_state(state_dir, state)
    return stopped
def describe(state: dict[str, Any]) -> str:
    """The federation entry, the run command and the plain commands behind a deployment."""
    lines = [f"Flower federation '{state['federation']}' on {state['address']} "
             f"({state['nodes']} SuperNodes, {'TLS' if state['tls'] else 'no TLS'}"
             f"{', SuperNode auth' if state['auth'] else ''}, {state['mode']} mode)",
             "", f"# written to {flwr_config_path()}", state["federation_toml"].rstrip(), "",
             "# run fedring's app on it:", state["run_command"], "",
             "# the processes started (logs in " + str(Path(state["state_dir"]) / "logs") + "):"]
    for rec in state["processes"]:
        lines.append(f"{rec['name']} (pid {rec['pid']}): {shlex.join(rec['cmd'])}")
    if state.get("auth"):
        certs = Path(state["certs"])
        lines += ["", "# SuperNode keys registered before the SuperNodes started, as with:"]
        lines += [f"flwr supernode register {certs / f'node-{i}.auth.pub'} {state['federation']}"
                  for i in range(state["nodes"])]
    lines += ["", f"# stop them: fedring deploy down (the state is in {state['state_dir']})"]
    return "\n".join(lines)
