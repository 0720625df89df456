"""``fedring deploy up/down``: a Flower SuperLink and N SuperNodes for fedring's app on 127.0.0.1.

``up`` starts the processes (each in its own session, logs under the state directory),
records their PIDs with their kernel start times in ``<state dir>/state.json``, writes
the SuperLink connection that ``flwr run . <federation>`` needs to ``$FLWR_HOME/config.toml``
and prints it with the plain commands it ran; ``down`` stops exactly the recorded
processes and what they started (a PID whose start time differs is someone else's now).

Each SuperNode runs in one of two ways:

- ``fedring`` (default): ``python -m client.supernode`` (``flower-supernode`` with its 3 s
  idle poll and 0.5 s reply waits shortened) with ``--isolation process``, plus one
  ``python -m client.executor`` (a warm ClientApp process) per SuperNode;
- ``flower``: plain ``flower-supernode`` (``--isolation subprocess``: a fresh
  ``flwr-clientapp`` process for every message);
- ``warm``: plain ``flower-supernode --isolation process`` (Flower's waits) with the
  warm executor;
- ``fastpoll``: ``python -m client.supernode`` with ``--isolation subprocess`` (short
  waits, but still a fresh ``flwr-clientapp`` per message).

``warm`` and ``fastpoll`` measure the two changes apart (benchmarks/deploy_latency.py).

Modules: ``processes`` (start, watch and stop processes), ``commands`` (options, command
lines, environment), ``federation`` (Flower's config entry, key registration),
``deployment`` (``up``/``down`` and the state file), ``cli`` (the ``fedring`` commands).
"""


from simulations.deploy.cli import add_parsers, cmd_down, cmd_up
from simulations.deploy.commands import (
    Options,
    executor_command,
    run_command,
    superlink_command,
    supernode_command,
)
from simulations.deploy.deployment import (
    POINTER_FILE,
    STATE_FILE,
    down,
    find_state_dir,
    read_state,
    up,
)
from simulations.deploy.federation import write_federation
from simulations.deploy.processes import (
    HOST,
    DeployError,
    alive,
    descendants,
    free_port,
    launch_process,
    log_has,
    port_open,
    start_time,
    stop_processes,
)

__all__ = [
    "HOST", "POINTER_FILE", "STATE_FILE", "DeployError", "Options", "add_parsers", "alive",
    "cmd_down", "cmd_up", "descendants", "down", "executor_command", "find_state_dir",
    "free_port", "launch_process", "log_has", "port_open", "read_state", "run_command",
    "start_time", "stop_processes", "superlink_command", "supernode_command", "up",
    "write_federation",
]
