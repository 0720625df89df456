"""What ``fedring deploy up`` runs: its options and the command lines and environment of
the SuperLink, the SuperNodes (in each mode), the warm executors and ``flwr run``."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from simulations.deploy.processes import HOST

STATE_DIR = Path("runs/deploy")
FEDERATION = "fedring-local"
MODES = ("fedring", "warm", "fastpoll", "flower")
WARM_MODES = ("fedring", "warm")  # a long-lived executor per SuperNode
DEFAULT_DB = "sqlite:///runs/fedring.db"
# third-party modules fedring's ClientApp imports, loaded by each executor before any run
PRELOAD = "torch,numpy,sklearn.datasets,dp_accounting,sqlalchemy"
REPO_ROOT = Path(__file__).resolve().parents[2]  # for `python -m client.executor` etc.
# FLWR_SUPEREXEC_TASK_POLL_INTERVAL. With warm executors the only SuperExec is the
# SuperLink's, which starts a run's ServerApp and otherwise asks the SuperLink for work
# on every poll for the whole run: polled every 1 s (Flower's default), it adds at most
# that to a run's start and one request a second to the SuperLink's load during rounds
# (0.1 s: 10).
# Where a SuperExec starts a ClientApp per message (fastpoll) or the SuperNodes keep
# Flower's waits (warm), 0.1 s, as before.
SUPEREXEC_POLL_S = {"fedring": "1.0", "warm": "0.1", "fastpoll": "0.1"}


@dataclass(frozen=True)
class Options:
    """What ``fedring deploy up`` was asked for."""

    nodes: int = 3
    tls: bool = False
    auth: bool = False
    db: str = DEFAULT_DB
    state_dir: Path = STATE_DIR
    federation: str = FEDERATION
    mode: str = "fedring"
    pull_interval: float = 0.2
    executor_poll: float = 0.05
    threads: int | None = None  # torch threads per ClientApp; None: the cores shared out
    timeout_s: float = 120.0
    partitions: int | None = None  # defaults to nodes
    flower_superlink: bool = False  # Flower's flower-superlink rather than server.superlink

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {self.nodes}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got '{self.mode}'")
        if self.auth and not self.tls:
            raise ValueError("SuperNode authentication needs TLS: add --tls")
        if self.pull_interval <= 0 or self.executor_poll <= 0:
            raise ValueError("poll intervals must be > 0")
        if self.threads is not None and self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")

    @property
    def torch_threads(self) -> int:
        """Threads per ClientApp (0: torch's default, one per core, in every process)."""
        if self.threads is not None:
            return self.threads
        return max(1, (os.cpu_count() or 1) // self.nodes) if self.mode in WARM_MODES else 0


def _bin(name: str) -> str:
    """A console script next to this interpreter (the venv's), else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def task_signal(runtime_port: int) -> str:
    """The socket name on which SuperNode and executor of ``runtime_port`` meet
    (``client.task_signal``): the executor waits for the SuperNode's wake-up."""
    return f"fedring-tasks-{runtime_port}"


def superlink_command(port: int, *, certs: Path | None, auth: bool,
                      wrapped: bool = True) -> list[str]:
    """The SuperLink's command: ``python -m server.superlink -- ARGS`` (Flower's
    ``flower-superlink ARGS`` with less CPU per request), or ``flower-superlink ARGS``
    itself when not ``wrapped``."""
    link = ([sys.executable, "-m", "server.superlink", "--"] if wrapped
            else [_bin("flower-superlink")])
    cmd = [*link, "--host", HOST, "--port", str(port),
           "--disable-runtime-dependency-installation"]
    if certs is None:
        return [*cmd, "--insecure"]
    cmd += ["--ssl-ca-certfile", str(certs / "ca.pem"), "--ssl-certfile",
            str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key")]
    return [*cmd, "--enable-supernode-auth"] if auth else cmd


def node_config(i: int, partitions: int, certs: Path | None) -> str:
    """SuperNode ``i``'s ``--node-config``: its partition and, when ``certs`` holds them,
    its SecAgg+ identity key and the federation's trusted keys (``fedring certs``)."""
    from simulations.certs import TRUSTED_KEYS_FILE

    items = [f"partition-id={i}", f"num-partitions={partitions}"]
    if certs is None:
        return " ".join(items)
    identity, trusted = certs / f"node-{i}.secagg", certs / TRUSTED_KEYS_FILE
    if identity.is_file() and trusted.is_file():
        for key, path in (("secagg-identity-key", identity), ("secagg-trusted-keys", trusted)):
            if "'" in str(path):  # a TOML literal string cannot hold one
                raise ValueError(f"{path}: a node config path cannot contain ', use a --dir "
                                 "without one")
            items.append(f"{key}='{path}'")
    return " ".join(items)


def supernode_command(i: int, superlink: str, runtime_port: int, opts: Options,
                      certs: Path | None) -> list[str]:
    partitions = opts.partitions or opts.nodes
    args = ["--superlink", superlink, "--host", HOST, "--port", str(runtime_port),
            "--node-config", node_config(i, partitions, certs)]
    if certs is None:
        args.append("--insecure")
    else:
        args += ["--root-certificates", str(certs / "ca.pem")]
    if opts.auth:
        args += ["--auth-supernode-private-key", str(certs / f"node-{i}.auth")]
    if opts.mode == "flower":
        return [_bin("flower-supernode"), *args, "--isolation", "subprocess"]
    wrapper = [sys.executable, "-m", "client.supernode", "--pull-interval",
               str(opts.pull_interval)]
    if opts.mode == "fedring":
        wrapper += ["--task-signal", task_signal(runtime_port)]
    wrapper.append("--")
    if opts.mode == "fastpoll":
        return [*wrapper, *args, "--isolation", "subprocess"]
    if certs is not None:  # the node's own Runtime API, where its executor connects
        args += ["--ssl-certfile", str(certs / f"node-{i}.pem"), "--ssl-keyfile",
                 str(certs / f"node-{i}.key"), "--ssl-ca-certfile", str(certs / "ca.pem")]
    if opts.mode == "warm":
        return [_bin("flower-supernode"), *args, "--isolation", "process"]
    return [*wrapper, *args, "--isolation", "process"]


def executor_command(runtime_port: int, parent_pid: int, opts: Options,
                     certs: Path | None) -> list[str]:
    tls = ["--insecure"] if certs is None else ["--root-certificates", str(certs / "ca.pem")]
    return [sys.executable, "-m", "client.executor", "--runtime-api-address",
            f"{HOST}:{runtime_port}", *tls, "--parent-pid", str(parent_pid),
            "--poll", str(opts.executor_poll), "--threads", str(opts.torch_threads),
            "--preload", PRELOAD,
            *(["--task-signal", task_signal(runtime_port)] if opts.mode == "fedring" else [])]


def run_command(federation: str, db: str, nodes: int, scenario: str = "default") -> str:
    """``flwr run`` for the deployment: rounds go on without one node (docs/DEPLOYMENT.md,
    Faults), and a relative SQLite ``db`` is made absolute here, where the user is."""
    from server.store import absolute_url

    overrides = f"federation.clients={nodes} federation.min_clients={max(1, nodes - 1)}"
    db = absolute_url(db)
    run_config = f'scenario="{scenario}" db="{db}" overrides="{overrides}"'
    return f"flwr run . {federation} --run-config {shlex.quote(run_config)} --stream"


def command_env(opts: Options) -> dict[str, str]:
    """The environment every started process gets: this venv first on PATH, the repository
    on PYTHONPATH, Flower's update checks off and, but in ``flower`` mode, a shorter
    SuperExec poll than Flower's 1 s."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    if opts.mode != "flower":  # SuperExecs start the ServerApp (and ClientApps) sooner
        env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", SUPEREXEC_POLL_S[opts.mode])
    if opts.torch_threads > 0:
        env["OMP_NUM_THREADS"] = str(opts.torch_threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                      env.get("PYTHONPATH", "")]))
    return env
