"""Process supervision on Linux: start a logged process, wait for it, and stop it for sure.

A process is recorded as a dict (``name``, ``pid``, ``start_time``, ``cmd``, ``log``); the
kernel start time read from ``/proc`` tells a recorded process from a later one that got
its PID, so stopping never signals someone else's process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


class DeployError(RuntimeError):
    """A process did not start, or the deployment is in a state ``up``/``down`` refuse."""


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], start time [19])."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def alive(pid: int, started: int | None = None) -> bool:
    """Running (not a zombie) and, if ``started`` is given, the same process as recorded."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return started is None or int(fields[19]) == started


def descendants(pids: Sequence[int]) -> list[int]:
    """All live descendants of ``pids`` (children first found breadth-first)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat(int(entry.name))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], list(pids)
    while frontier:
        nxt = [c for p in frontier for c in children.get(p, [])]
        found += nxt
        frontier = nxt
    return found


def stop_processes(records: Sequence[dict[str, Any]], timeout_s: float = 10.0) -> list[int]:
    """SIGTERM the recorded processes still running as recorded and all their descendants,
    then SIGKILL what is left after ``timeout_s``; returns the PIDs signalled."""
    mine = [r["pid"] for r in records if alive(r["pid"], r.get("start_time"))]
    targets = {pid: start_time(pid) for pid in [*mine, *descendants(mine)]}
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p, s) for p, s in targets.items()):
        _reap()
        time.sleep(0.1)
    for pid, started in targets.items():
        if alive(pid, started):
            _signal(pid, signal.SIGKILL)
    _reap()
    return list(targets)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _reap() -> None:
    """Collect exited children of this process (when ``up`` ran in this process)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def launch_process(name: str, cmd: list[str], log_dir: Path,
                   env: dict[str, str]) -> dict[str, Any]:
    """Start ``cmd`` in its own session, output to a fresh ``<log_dir>/<name>.log``;
    returns its record."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:  # a fresh log: readiness is read from it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return {"name": name, "pid": proc.pid, "start_time": start_time(proc.pid),
            "cmd": cmd, "log": str(log_path)}


def _tail(path: str | Path, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_until(what: str, ready: Callable[[], bool], procs: Sequence[dict[str, Any]],
               timeout_s: float) -> None:
    """Poll ``ready()`` until it holds; raise DeployError, with the log's end, if one of
    ``procs`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for rec in procs:
            if not alive(rec["pid"], rec["start_time"]):
                raise DeployError(f"{rec['name']} exited while waiting for {what}; its log "
                                  f"({rec['log']}) ends with:\n{_tail(rec['log'])}")
        if time.monotonic() > deadline:
            raise DeployError(f"timed out after {timeout_s:.0f} s waiting for {what}; see "
                              + ", ".join(r["log"] for r in procs))
        time.sleep(0.1)


def log_has(path: str | Path, text: str) -> bool:
    try:
        return text in Path(path).read_text(errors="replace")
    except OSError:
        return False
