"""A warm, long-lived ClientApp executor for a SuperNode started with ``--isolation process``.

Flower's default (``--isolation subprocess``) starts a fresh ``flwr-clientapp`` process
for every message, which pays for importing flwr, torch and the app, and for building
the model and loading the partition, on every round. This executor is one process per
SuperNode that claims the SuperNode's ClientApp tasks on its Runtime API, runs them in
process with the ClientApp loaded once per FAB (so fedring's per-process model and data
cache carries over from round to round), and reports back exactly as ``flwr-clientapp``
does::

    flower-supernode --isolation process --host 127.0.0.1 --port 9094 ...
    python -m client.executor --runtime-api-address 127.0.0.1:9094 --insecure

By default it asks for a task every ``--poll`` seconds while idle. Started beside
``client.supernode --task-signal NAME`` with the same ``--task-signal NAME``, it waits
for the SuperNode's wake-up instead and asks only when woken, or every ``--idle-poll``
seconds (``client.task_signal``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from client.held_fab import HeldFabHeader, held_app
from client.protocol import flower_compat as flower
from client.task_signal import TaskSignal

TASK_HEARTBEAT_S = 15.0  # the SuperNode expires a running task after 60 s without one
log = logging.getLogger("fedring.executor")


class _Heartbeat:
    """Keep one claimed task alive; failures are ignored (the task then simply expires)."""

    def __init__(self, client: Any, interval: float = TASK_HEARTBEAT_S) -> None:
        self._client, self._request = client, flower.task_heartbeat_request()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._client.SendTaskHeartbeat(self._request)
            except Exception as exc:  # the next one may succeed; never kill the executor
                log.debug("task heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class WarmExecutor:
    """Claim ClientApp tasks from one SuperNode's Runtime API and run them in this process."""

    def __init__(self, runtime_api_address: str, *, insecure: bool,
                 root_certificates: bytes | None = None, poll_s: float = 0.05,
                 wake: TaskSignal | None = None, idle_poll_s: float = 1.0) -> None:
        self.address, self.insecure, self.certificates = (runtime_api_address, insecure,
                                                          root_certificates)
        self.poll_s, self.wake, self.idle_poll_s = poll_s, wake, idle_poll_s
        self.tasks_done = 0
        self._acquire_request = flower.acquire_task_request()
        self._control = self._client("SuperExec")
        self._app: Any = None
        self._fab_hash = ""
        self._app_dir: Path | None = None

    def _client(self, component: str, token: str | None = None) -> Any:
        held = (HeldFabHeader(self._fab_hash),) if token and self._fab_hash else ()
        return flower.runtime_client(self.address, insecure=self.insecure,
                                     root_certificates=self.certificates,
                                     component=component, token=token, interceptors=held)

    def serve_forever(self) -> None:
        """Claim and run tasks until interrupted; idle between polls (or until woken)."""
        while True:
            try:
                busy = self.run_one()
            except Exception:  # a failed task or a lost SuperNode: keep serving
                log.exception("task handling failed")
                busy = False
            if not busy:
                self.idle()

    def idle(self) -> None:
        """Wait before the next claim: ``poll_s``, or until the SuperNode's wake-up (at
        most ``idle_poll_s``) with a task signal."""
        if self.wake is None:
            time.sleep(self.poll_s)
        else:
            self.wake.wait(self.idle_poll_s)

    def run_one(self) -> bool:
        """Claim one pending ClientApp task and run it; False when there was none."""
        res = self._control.AcquireTask(self._acquire_request)
        if not (res.HasField("task") and res.token):
            return False
        self.run_task(res.token)
        return True

    def run_task(self, token: str) -> None:
        """What ``flwr-clientapp --token`` does, without starting or importing anything anew."""
        from flwr.app import Error, Message

        client = self._client("flwr-clientapp", token)
        flower.share_connection(client, self._control)  # no TLS handshake per task
        heartbeat = _Heartbeat(client)
        message = reply = context = None
        sub_status, details = flower.SubStatus.FAILED, "ClientApp task failed"
        t0 = time.perf_counter()
        try:
            message, context, run, fab = flower.pull_task_input(client, self.poll_s)
            t1 = time.perf_counter()
            app = self._load(run, fab)
            t2 = time.perf_counter()
            reply = app(message=message, context=context)
            t3 = time.perf_counter()
            log.info("task %s: input %.3f s, load %.3f s, app %.3f s",
                     message.metadata.message_type, t1 - t0, t2 - t1, t3 - t2)
            sub_status, details = flower.SubStatus.COMPLETED, ""
        except Exception as exc:
            log.exception("ClientApp task failed")
            code = flower.client_app_error_code(exc)
            details = f"{type(exc)}:<'{exc}'>"
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    flower.push_reply(client, reply, context)
            except Exception:
                log.exception("pushing the reply failed")
                sub_status, details = flower.SubStatus.FAILED, "pushing the reply failed"
            heartbeat.stop()
            flower.push_task_output(client, context, sub_status, details)
            self.tasks_done += 1
            log.info("task done in %.3f s", time.perf_counter() - t0)

    def _load(self, run: Any, fab: Any) -> Any:
        """The run's ClientApp, loaded once per FAB (a new FAB drops the old app's modules);
        a FAB sent without its content must be the one held (``client.held_fab``)."""
        if (app := held_app(self._app, self._fab_hash, fab)) is not None:
            return app
        self._unload()
        self._app, app_dir = flower.load_client_app(run, fab)
        self._fab_hash, self._app_dir = fab.hash_str, app_dir
        return self._app

    def _unload(self) -> None:
        if self._app_dir is None:
            return
        root = str(self._app_dir.resolve())
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and os.path.abspath(path).startswith(root + os.sep):
                del sys.modules[name]
        sys.path[:] = [p for p in sys.path if os.path.abspath(p) != root]
        importlib.invalidate_caches()
        self._app, self._fab_hash, self._app_dir = None, "", None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client.executor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                        help="the SuperNode's Runtime API (its --host:--port)")
    tls = parser.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API")
    tls.add_argument("--root-certificates", metavar="CA_PEM",
                     help="CA certificate that signed the SuperNode's --ssl-certfile")
    parser.add_argument("--parent-pid", type=int,
                        help="exit when this process (the SuperNode) exits")
    parser.add_argument("--poll", type=float, default=0.05,
                        help="seconds between task polls when idle (default 0.05)")
    parser.add_argument("--task-signal", metavar="NAME",
                        help="wait for the SuperNode's wake-up on this socket name "
                             "(client.supernode --task-signal) instead of polling")
    parser.add_argument("--idle-poll", type=float, default=1.0,
                        help="with --task-signal: seconds between task polls when no "
                             "wake-up comes (default 1)")
    parser.add_argument("--threads", type=int, default=0,
                        help="cap torch's CPU threads (0: torch's default)")
    parser.add_argument("--preload", default="torch,numpy",
                        help="comma-separated modules to import at start, before any task")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.poll, args.idle_poll) <= 0:
        parser.error("--poll and --idle-poll must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    if args.threads > 0:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    wake = TaskSignal(args.task_signal) if args.task_signal else None  # before the imports
    for name in filter(None, args.preload.split(",")):
        importlib.import_module(name.strip())
    if args.threads > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(args.threads)
    if args.parent_pid is not None:
        flower.start_parent_process_monitor(args.parent_pid)  # SIGINT once the parent is gone
    certs = Path(args.root_certificates).read_bytes() if args.root_certificates else None
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    executor = WarmExecutor(args.runtime_api_address, insecure=args.insecure,
                            root_certificates=certs, poll_s=args.poll, wake=wake,
                            idle_poll_s=args.idle_poll)
    log.info("warm ClientApp executor polling %s%s", args.runtime_api_address,
             f", woken on {args.task_signal!r}" if args.task_signal else "")
    try:
        executor.serve_forever()
    except KeyboardInterrupt:
        log.info("stopping after %d task(s)", executor.tasks_done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
