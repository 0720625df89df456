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


from simulations.deploy.cli import add_parsers, cmd_certs, cmd_down, cmd_up
from simulations.deploy.commands import (
    DEFAULT_DB,
    FEDERATION,
    MODES,
    PRELOAD,
    STATE_DIR,
    WARM_MODES,
    Options,
    command_env,
    executor_command,
    run_command,
    superlink_command,
    supernode_command,
)
from simulations.deploy.deployment import (
    STATE_FILE,
    describe,
    down,
    read_state,
    start_supernode,
    up,
    write_state,
)
from simulations.deploy.federation import flwr_config_path, register_supernode, write_federation
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
    wait_until,
)

__all__ = [
    "DEFAULT_DB", "FEDERATION", "HOST", "MODES", "PRELOAD", "STATE_DIR", "STATE_FILE",
    "WARM_MODES", "DeployError", "Options", "add_parsers", "alive", "cmd_certs", "cmd_down",
    "cmd_up", "command_env", "descendants", "describe", "down", "executor_command",
    "flwr_config_path", "free_port", "launch_process", "log_has", "port_open", "read_state",
    "register_supernode", "run_command", "start_supernode", "start_time", "stop_processes",
    "superlink_command", "supernode_command", "up", "wait_until", "write_federation",
    "write_state",
]
