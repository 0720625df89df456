"""``flwr run .`` runs the same ServerApp and ClientApp under Flower's own tooling."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from server.store import Store

ROOT = Path(__file__).resolve().parents[2]


def _stop_superlinks(flwr_home: Path) -> None:
    """Stop the managed local SuperLink that ``flwr run`` started under this FLWR_HOME."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in args and str(flwr_home) in args:
            os.kill(int(cmdline.parent.name), signal.SIGTERM)


@pytest.mark.slow
def test_flwr_run_local_simulation(tmp_path):
    flwr_home = tmp_path / "flwr"
    db = f"sqlite:///{tmp_path / 'store.db'}"
    env = {**os.environ, "FLWR_HOME": str(flwr_home),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # federation.clients is left to the number of SuperNodes
    run_config = (f'scenario="default" db="{db}" '
                  'overrides="federation.rounds=2 train.local_epochs=1"')

    def flwr_run(config: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["flwr", "run", ".", "local", "--federation-config", "num-supernodes=3",
             "--run-config", config, "--stream"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)

    try:
        proc = flwr_run(run_config)
        bad = flwr_run(f'db="{db}" overrides="secagg.enabled=yes"')
    finally:
        _stop_superlinks(flwr_home)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with Store(db) as store:
        runs = store.list_runs()
        assert len(runs) == 1 and runs[0].status == "completed"
        assert runs[0].config["federation"]["clients"] == 3
        rounds = store.rounds(runs[0].run_id)
        assert [r.round for r in rounds] == [0, 1, 2]
        assert rounds[1].num_accepted == 3
        assert rounds[2].metrics["accuracy"] > rounds[0].metrics["accuracy"]
    stream = proc.stdout + proc.stderr
    assert "3 node(s) connected, federation.clients = 3" in stream
    for rnd in (1, 2):  # each round's line is on the stream
        assert re.search(rf"round {rnd}/2: accuracy 0\.\d{{4}}, loss [\d.]+, 3 accepted, "
                         r"0 rejected, 0 dropped", stream), stream[-3000:]
    assert f"fedring run {runs[0].run_id}: completed after 2 rounds" in stream
    bad_stream = bad.stdout + bad.stderr
    assert "fedring: error: secagg.enabled must be true or false" in bad_stream, bad_stream
    assert "Traceback" not in bad_stream
