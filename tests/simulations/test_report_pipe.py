"""Every ``fedring`` command stops quietly when the reader of its output is gone
(``fedring report RUN --json | head -c 10``): nothing on stderr, the status of a pipe
writer on SIGPIPE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.store import Store, UpdateRecord
from simulations.cli import SIGPIPE_EXIT

FEDRING = str(Path(sys.executable).with_name("fedring"))
# as a user runs it: Python's stdout is buffered into a pipe
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "COLUMNS": "80"}


@pytest.fixture(scope="module")
def big_run(tmp_path_factory) -> tuple[str, str]:
    """A run whose report is over a megabyte as JSON, far more than a pipe holds: 40 rounds
    of 600 metrics and 50 rejected updates each."""
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'runs.db'}"
    with Store(url) as store:
        run_id = store.create_run(config={}, seed=0, name="big")
        for rnd in range(1, 41):
            store.record_round(run_id, round=rnd, model_version=rnd, num_sampled=50,
                               num_replies=50, num_rejected=50,
                               metrics={f"metric_{i:04d}": 0.125 * i for i in range(600)},
                               updates=[UpdateRecord(f"c{i}", "rejected",
                                                     reason="accuracy is NaN " * 8)
                                        for i in range(50)])
        store.finish_run(run_id, status="completed", summary={"rounds": 40})
    return url, run_id


@pytest.mark.parametrize("argv", [["--json"], ["--updates", "--json"], [], ["--updates"]],
                         ids=["json", "updates-json", "table", "updates"])
def test_a_closed_pipe_ends_a_command_quietly(big_run, tmp_path, argv):
    url, run_id = big_run
    writer = subprocess.Popen([FEDRING, "report", run_id, "--db", url, "--out",
                               str(tmp_path), *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=ENV)
    head = subprocess.Popen(["head", "-c", "10"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()  # head alone reads it: its exit closes the pipe
    out, _ = head.communicate(timeout=120)
    err = writer.stderr.read().decode()
    code = writer.wait(timeout=120)
    assert len(out) == 10 and err == ""
    if "--json" in argv:  # a megabyte in two writes (the JSON, its newline): the second fails
        assert code == SIGPIPE_EXIT
    else:  # a table is one write: where the system counts it written, nothing fails
        assert code in (0, SIGPIPE_EXIT)


def test_a_reader_gone_before_the_first_write_ends_any_command_quietly(big_run):
    """``head -c 0`` leaves at once: the short JSON list of ``runs`` waits in Python's
    buffer until the command ends, and fails there."""
    url, _ = big_run
    writer = subprocess.Popen([FEDRING, "runs", "--db", url, "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=ENV)
    head = subprocess.Popen(["head", "-c", "0"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()
    head.communicate(timeout=120)
    err = writer.stderr.read().decode()
    assert writer.wait(timeout=120) == SIGPIPE_EXIT and err == ""
