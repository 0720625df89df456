"""The waits a deployment shortens, on Flower's own functions and without processes: the
SuperNode's pulls right after a reply, the executor's wake-up instead of its task poll,
the Grid's retry of a reply's object not yet on the SuperLink, and the SuperLink's
SuperExec poll."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace
from typing import ClassVar

import pytest

from client.protocol import flower_compat
from client.supernode import FLOWER_IDLE_SLEEP_S, FLOWER_REPLY_SLEEP_S, make_sleep
from server.grid_io import OBJECT_RETRY_CAP_S, collect
from simulations import deploy
from simulations.deploy.commands import MODES, command_env


def test_supernode_pulls_fast_for_a_window_after_a_reply_wait() -> None:
    now, slept = [0.0], []

    def at(t: float, seconds: float) -> None:
        now[0] = t
        sleep(seconds)

    sleep = make_sleep(0.2, 0.01, slept.append, busy_pull_s=0.05, busy_window_s=3.0,
                       clock=lambda: now[0])
    at(1.0, FLOWER_IDLE_SLEEP_S)  # no reply yet: idle
    at(10.0, FLOWER_REPLY_SLEEP_S)
    at(10.5, FLOWER_IDLE_SLEEP_S)  # waiting for the next stage
    at(12.9, FLOWER_IDLE_SLEEP_S)
    at(13.1, FLOWER_IDLE_SLEEP_S)  # the window is over
    at(20.0, FLOWER_REPLY_SLEEP_S)
    at(20.0, FLOWER_IDLE_SLEEP_S)
    assert slept == [0.2, 0.01, 0.05, 0.05, 0.2, 0.01, 0.05]


def test_supernode_pulls_ever_less_often_the_longer_the_wait() -> None:
    now, slept = [0.0], []
    sleep = make_sleep(0.2, 0.01, slept.append, busy_pull_s=0.05, busy_window_s=3.0,
                       busy_growth=0.125, clock=lambda: now[0])
    sleep(FLOWER_REPLY_SLEEP_S)
    for t in (0.1, 0.4, 0.8, 1.2, 1.6, 2.9, 3.1):
        now[0] = t
        sleep(FLOWER_IDLE_SLEEP_S)
    assert slept == pytest.approx([0.01, 0.05, 0.05, 0.1, 0.15, 0.2, 0.2, 0.2])


def test_supernode_without_a_window_always_pulls_at_the_idle_interval() -> None:
    slept: list[float] = []
    sleep = make_sleep(0.2, 0.01, slept.append, busy_pull_s=0.05, busy_window_s=0.0)
    for s in (FLOWER_REPLY_SLEEP_S, FLOWER_IDLE_SLEEP_S):
        sleep(s)
    assert slept == [0.01, 0.2]


def test_supernode_cli_rejects_bad_waits(capsys) -> None:
    from client.supernode import main

    for bad in (["--busy-pull-interval", "0"], ["--busy-window", "-1"],
                ["--busy-pull-growth", "1"]):
        with pytest.raises(SystemExit):
            main([*bad, "--", "--insecure"])
    err = capsys.readouterr().err
    assert "--busy-window must be >= 0" in err and "--busy-pull-growth must be in [0, 1)" in err


def test_a_stored_message_wakes_the_executor(monkeypatch) -> None:
    """The SuperNode loop's stored message reaches the executor's socket; a pull that
    stored nothing sends nothing."""
    from flwr.supernode import start_client_internal as loop

    from client.task_signal import TaskSignal, notifier

    name = f"fedring-test-{id(object())}"
    results = iter([None, 3])
    monkeypatch.setattr(loop, "_pull_and_store_message", lambda **_: next(results))
    wake = TaskSignal(name)
    try:
        flower_compat.on_supernode_message(notifier(name))
        loop._pull_and_store_message(state=None)
        assert not wake.wait(0.0)
        loop._pull_and_store_message(state=None)
        assert wake.wait(5.0) and not wake.wait(0.0)  # one wake-up, consumed
    finally:
        wake.close()
    notifier(name)()  # nobody listening: dropped, no error


def test_task_signal_consumes_every_pending_wake_up(tmp_path) -> None:
    from client.task_signal import TaskSignal, address, notifier

    assert address("x") == "\0x" and address(str(tmp_path / "s")) == str(tmp_path / "s")
    with pytest.raises(ValueError, match="non-empty"):
        address("")
    wake, notify = TaskSignal(str(tmp_path / "s")), notifier(str(tmp_path / "s"))
    try:
        for _ in range(3):
            notify()
        assert wake.wait(5.0) and not wake.wait(0.0)
    finally:
        wake.close()


def test_executor_waits_for_the_wake_up_instead_of_polling(monkeypatch) -> None:
    from client import executor as ex

    class Wake:
        timeouts: ClassVar[list[float]] = []

        def wait(self, timeout: float) -> bool:
            self.timeouts.append(timeout)
            return True

    slept: list[float] = []
    monkeypatch.setattr(ex.time, "sleep", slept.append)
    polling = ex.WarmExecutor("127.0.0.1:9", insecure=True, poll_s=0.05)
    polling.idle()
    woken = ex.WarmExecutor("127.0.0.1:9", insecure=True, poll_s=0.05, wake=Wake(),
                            idle_poll_s=1.0)
    woken.idle()
    assert slept == [0.05] and Wake.timeouts == [1.0]
    with pytest.raises(SystemExit):
        ex.main(["--insecure", "--idle-poll", "0"])


class _Waits:
    """``threading.Event`` for Flower's object pulls: records each backoff, never sleeps."""

    waits: ClassVar[list[float]] = []

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True

    def wait(self, seconds: float) -> bool:
        _Waits.waits.append(seconds)
        return self._set


def _pull_twice_unavailable(monkeypatch) -> list[float]:
    """Backoffs of the Grid's ``pull_objects`` for an object missing on two pulls."""
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError
    from flwr.superlink.grid import http_grid

    monkeypatch.setattr(inflatable_utils, "threading",
                        SimpleNamespace(Event=_Waits, Lock=threading.Lock))
    monkeypatch.setattr(inflatable_utils.random, "uniform", lambda a, b: 0.0)
    _Waits.waits = []
    tries = []

    def pull(object_id: str) -> bytes:
        tries.append(object_id)
        if len(tries) <= 2:
            raise ObjectUnavailableError(object_id)
        return b"content"

    assert http_grid.pull_objects(["a" * 64], pull) == {"a" * 64: b"content"}
    return _Waits.waits


def test_grid_retries_a_missing_reply_object_after_the_poll(monkeypatch) -> None:
    from flwr.superlink.grid import http_grid

    # Flower's own function (an earlier collect() in this process may have patched it),
    # the module's state restored after
    original = getattr(http_grid.pull_objects, "func", http_grid.pull_objects)
    monkeypatch.setattr(http_grid, "pull_objects", original)
    assert _pull_twice_unavailable(monkeypatch) == [1.0, 2.0]  # Flower's: 1 s, doubling
    grid = SimpleNamespace(pull_messages=lambda ids: [])
    assert collect(grid, ["m1"], timeout=0.0, poll=0.05, on_reply=print) == ["m1"]
    assert _pull_twice_unavailable(monkeypatch) == [0.05, 0.1]
    collect(grid, ["m1"], timeout=0.0, poll=0.15, on_reply=print)  # patched anew, not twice
    assert http_grid.pull_objects.keywords == {"initial_backoff": 0.15,
                                               "backoff_cap": OBJECT_RETRY_CAP_S}
    assert _pull_twice_unavailable(monkeypatch) == [0.15, 0.2]


def test_no_grid_module_no_patch(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "flwr.superlink.grid.http_grid")
    assert flower_compat.shorten_grid_object_retries(0.05, 0.2) is False


def test_superexec_poll_per_mode(monkeypatch) -> None:
    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    polls = {m: command_env(deploy.Options(mode=m)).get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL")
             for m in MODES}
    assert polls == {"fedring": "1.0", "warm": "0.1", "fastpoll": "0.1", "flower": None}
