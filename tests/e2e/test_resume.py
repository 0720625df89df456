"""A server killed with SIGKILL mid-run resumes from its checkpoint and finishes as an
uninterrupted run does: the model, its version, the rounds, the server optimizer's state
(FedAdam's moments) and the privacy accountant's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from itertools import pairwise

import numpy as np
import pytest

from server.store import Store

ARGS = ["--clients", "4", "--rounds", "5", "--seed", "7", "--set", "train.local_epochs=4",
        "--set", "data.partitioner=iid", "--set", "aggregation.server_opt=fedadam",
        "--set", "aggregation.server_lr=0.01"]
# Central DP: the noise comes from OS entropy, so models differ between runs; what must
# match an uninterrupted run is the accountant's ledger, round by round.
CENTRAL_DP = ["--set", "dp.mode=central", "--set", "dp.clip=1.0",
              "--set", "aggregation.weight_by=uniform",
              "--set", "dp.noise_multiplier=0.8"]


def fedring(*args: str, cwd) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "simulations.cli", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("dp", [False, True], ids=["fedadam", "fedadam-central-dp"])
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, dp: bool):
    args = ARGS + (CENTRAL_DP if dp else [])
    db = f"sqlite:///{tmp_path / 'store.db'}"
    victim = fedring("simulate", *args, "--db", db, cwd=tmp_path)
    run_id, deadline = None, time.monotonic() + 240
    with Store(db) as store:
        while time.monotonic() < deadline:
            runs = store.list_runs() if (tmp_path / "store.db").exists() else []
            if runs and max((r.round for r in store.rounds(runs[0].run_id)), default=0) >= 2:
                run_id = runs[0].run_id
                break
            assert victim.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
    assert run_id is not None, "round 2 never reached the store"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()

    with Store(db) as store:
        assert store.get_run(run_id).status == "running"  # died without finishing
        killed_at = max(r.round for r in store.rounds(run_id))
        resumed_from = store.load_checkpoint(run_id).round
    assert 1 <= resumed_from <= killed_at < 5

    resumed = fedring("simulate", "--resume", run_id, "--db", db, "--json", cwd=tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["run_id"] == run_id and summary["rounds"] == 5 and summary["versions"] == 5

    clean = fedring("simulate", *args, "--db", db, "--json", cwd=tmp_path)
    out, err = clean.communicate(timeout=300)
    assert clean.returncode == 0, err
    clean_summary = json.loads(out.strip().splitlines()[-1])
    clean_id = clean_summary["run_id"]

    with Store(db) as store:
        assert store.get_run(run_id).status == "completed"
        assert [r.round for r in store.rounds(run_id)] == [0, 1, 2, 3, 4, 5]  # none twice
        resumed_ckpt, clean_ckpt = store.load_checkpoint(run_id), store.load_checkpoint(clean_id)
        ledgers = store.privacy_ledger(run_id), store.privacy_ledger(clean_id)
    assert resumed_ckpt.model_version == clean_ckpt.model_version == 5
    opt = resumed_ckpt.state["pipeline"]["server_opt"]
    assert set(opt) == {"m", "v"}  # FedAdam's moments are checkpointed
    if not dp:  # no noise: the model and the moments equal the uninterrupted run's, bit for bit
        np.testing.assert_array_equal(resumed_ckpt.params, clean_ckpt.params)
        for key in ("m", "v"):
            np.testing.assert_array_equal(opt[key], clean_ckpt.state["pipeline"]["server_opt"][key])
        assert ledgers == ([], [])
        return
    # The accountant went on from its checkpoint: every round's entry, before and after the
    # kill, and the final epsilon equal the uninterrupted run's.
    resumed_ledger, clean_ledger = ledgers
    assert [e["round"] for e in resumed_ledger] == [1, 2, 3, 4, 5]
    assert resumed_ledger == clean_ledger
    epsilons = [e["epsilon"] for e in clean_ledger]
    assert all(b > a > 0 for a, b in pairwise(epsilons))
    assert summary["epsilon"] == clean_summary["epsilon"] == epsilons[-1]
    assert resumed_ckpt.state["dp"] == clean_ckpt.state["dp"]


def test_resume_refuses_changed_configuration(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "simulations.cli", "simulate", "--resume", "r1",
                           "--rounds", "9", "--db", f"sqlite:///{tmp_path / 's.db'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "drop --rounds" in proc.stderr
