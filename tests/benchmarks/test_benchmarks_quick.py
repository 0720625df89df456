"""Each benchmark script runs in its quick mode and ends with a well-formed JSON line."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from privacy.secagg.workers import default_threads

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, timeout: float = 180, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``benchmarks/<script> --quick``; return the JSON object on its last stdout line."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


PFL_PYTHON = os.environ.get("PFL_PYTHON")  # an interpreter with pfl[pytorch]==0.6.0


@pytest.mark.slow
def test_simulation_overhead_quick() -> None:
    pfl = PFL_PYTHON is not None and Path(PFL_PYTHON).exists()
    result = run_quick("simulation_overhead.py", timeout=400,
                       extra=("--pfl-python", str(PFL_PYTHON)) if pfl else ())
    assert result["benchmark"] == "simulation_overhead" and result["quick"] is True
    for key in ("platform", "cpus", "torch", "flwr"):
        assert key in result["machine"]
    assert len(result["loadavg_before"]) == 3 and len(result["loadavg_after"]) == 3
    [row] = result["results"]
    assert row["clients"] == 4 and row["params"] == 9610 and row["flower_s"] is None
    for key in ("bare_s", "fedring_s", "fedring_raw_s", "fedring_store_wall_s",
                "fedring_eval_s", "fedring_checkpoint_write_s"):
        assert positive(row[key]), (key, row[key])
    assert math.isfinite(row["fedring_over_bare_ms_per_client"])
    assert row["fedring_vs_bare_max_abs_diff"] < 1e-4  # both trained the same model
    cold = result["cold_start"]
    for key in ("bare_s", "fedring_s", "bare_cpu_s", "fedring_cpu_s"):
        assert positive(cold[key]), (key, cold[key])
    for target in result["targets"].values():
        assert target["met"] in (True, False, None)
    pfl_part = result["pfl_workload"]
    [row] = pfl_part["rows"]
    assert pfl_part["pfl"] is pfl and row["clients"] == 10 and row["params"] == 9610
    systems = {"fedring", "fedring_vectorized", "fedring_auto", "bare_unwrapped_step"} | (
        {"pfl"} if pfl else set())
    assert set(row["wall_ratio_to_bare"]["median"]) == systems
    for ratios in (row["wall_ratio_to_bare"]["median"], row["cpu_ratio_to_bare"]["median"]):
        assert all(positive(r) for r in ratios.values()), ratios
    assert row["fedring_vs_bare_max_abs_diff"] < 1e-4  # sequential and vectorized alike
    assert row["bare_unwrapped_step_vs_bare_max_abs_diff"] == 0.0  # the same step, unwrapped
    assert positive(row["fedring_to_bare_unwrapped_step"]["median"]["fedring"])
    paired = row["paired_rounds"]  # fedring's warm rounds, each beside a bare round
    assert set(paired) == {"fedring", "fedring_vectorized", "fedring_auto"}
    assert paired["fedring"]["wall"]["n"] == 2 and positive(paired["fedring"]["cpu"]["median"])
    for target in pfl_part["targets"].values():
        assert target["met"] in (True, False, None)
    [memory] = result["population_memory"]
    assert memory["users"] == 300 and memory["partitions"] == 300
    assert memory["peak_rss"] > memory["rss_before"] > 0 and memory["data_bytes"] > 0


@pytest.mark.slow
def test_simulation_overhead_cohort_sizes_quick() -> None:
    """The cohort-size mode: fedring beside the bare loop at each N, the same model."""
    result = run_quick("simulation_overhead.py", extra=("--cohort-sizes", "8,40"))
    assert result["mode"] == "cohort_sizes" and result["quick"] is True
    rows = result["cohorts"]["rows"]
    assert [r["clients"] for r in rows] == [8, 40]
    for row in rows:
        assert positive(row["bare_s"]) and positive(row["fedring_s"]), row
        assert math.isfinite(row["fedring_over_bare_ms_per_client"])
        assert row["fedring_vs_bare_max_abs_diff"] < 1e-4  # both trained the same model
    assert result["cohorts"]["target_overhead_at_largest_not_above_smallest"]["met"] in (
        True, False)


@pytest.mark.slow
def test_simulation_overhead_cifar_bn_quick() -> None:
    """The batch-norm CNN at CIFAR shape: fedring and the bare loop end with the same
    weights and batch-norm statistics."""
    from simulations.models import build_model, count_parameters

    result = run_quick("simulation_overhead.py", extra=("--cifar-bn-only",))
    assert result["results"] == [] and result["cold_start"] is None
    row = result["cifar_bn"]
    model = build_model("resnet", input_shape=(3, 32, 32), num_classes=10, width=8)
    floats = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert row["clients"] == 4 and row["params"] == count_parameters(model)
    assert row["float_buffers"] == floats > 0 and row["vector"] == row["params"] + floats
    for key in ("bare_s", "fedring_s", "fedring_raw_s", "fedring_eval_s", "fedring_over_bare"):
        assert positive(row[key]), (key, row[key])
    assert row["fedring_vs_bare_max_abs_diff"] < 1e-4


@pytest.mark.slow
def test_stragglers_quick() -> None:
    result = run_quick("stragglers.py")
    assert result["benchmark"] == "stragglers" and result["quick"] is True
    assert result["target_accuracy"] == 0.8 and result["plot"] is None
    assert set(result["drivers"]) == {"sync_fedavg", "fedasync", "fedbuff", "secure_fedbuff"}
    for name, row in result["drivers"].items():
        assert row["runs"] == 1 and row["reached"] == 1, name
        assert positive(row["time_to_target_s"]) and positive(row["versions"])
    for run in result["runs"]:
        assert run["final_accuracy"] >= 0.8 and run["time_to_target_s"] == run[
            "simulated_time_s"]
    sync, buff = result["drivers"]["sync_fedavg"], result["drivers"]["fedbuff"]
    # a sync round waits for a 10x straggler: ~10 simulated seconds per aggregate
    assert sync["time_to_target_s"] >= 10 * sync["versions"] * 0.9
    assert result["fedbuff_speedup"] == round(sync["time_to_target_s"]
                                              / buff["time_to_target_s"], 2)
    assert result["target"]["met"] is (result["fedbuff_speedup"] >= 2.0)
    # the secure stages take no simulated time and the same clients fill the same buffers
    secure = result["drivers"]["secure_fedbuff"]
    assert abs(secure["versions"] - buff["versions"]) <= 1
    assert positive(secure["secure_s_per_buffer"])
    assert secure["time_to_target_s"] == pytest.approx(buff["time_to_target_s"], rel=0.2)


@pytest.mark.slow
def test_secagg_quick() -> None:
    result = run_quick("secagg.py", timeout=120)
    assert result["benchmark"] == "secagg" and result["quick"] is True
    assert [(r["N"], r["d"]) for r in result["results"]] == [(4, 1000), (6, 10_000)]
    for row in result["results"]:
        assert positive(row["plain"]["round_s"]) and "flower_shares3" not in row
        for name in ("fedring_auto", "fedring_k3", "fedring_full", "fedring_auto_1t",
                     "fedring_k3_1t", "fedring_full_1t"):
            got = row[name]
            assert 1 <= got["t"] <= got["k"] <= row["N"] - 1, name
            assert got["mask_threads"] == (1 if name.endswith("_1t") else default_threads())
            for key in ("round_s", "client_cpu_s", "prg_bound_s"):
                assert positive(got[key]), (name, key, got[key])
            # a client in its own process derives the graph (none to derive for a full one)
            assert (got["graph_derivation_s"] > 0) == (got["k"] < row["N"] - 1), name
        assert row["fedring_full"]["k"] == row["N"] - 1
        for name in ("fedring_auto", "fedring_full"):
            drop = row[name]["dropout10"]
            assert drop["dropped"] == 1 and drop["survivors"] == row["N"] - 1
            assert positive(drop["unmask_s"]) and positive(drop["prg_dropped_masks_s"])
        for name in ("fedring_auto", "fedring_k3", "fedring_full", "fedring_auto_1t",
                     "fedring_k3_1t", "fedring_full_1t"):  # each against a lying server too
            for suffix, own in (("_malicious", False), ("_malicious_per_client", True)):
                semi = row[name + suffix.replace("_malicious", "")]
                assert semi["security"] == "semi_honest" and semi["own_signature_memo"] is own
                assert "consistency_check" not in semi["server_stage_s"]
                got = row[name + suffix]
                assert got["security"] == "malicious" and got["own_signature_memo"] is own
                assert (got["k"], got["t"]) == (semi["k"], semi["t"])
                assert positive(got["server_stage_s"]["consistency_check"])
                assert len(got["round_s_each"]) == len(semi["round_s_each"]) == result["reps"]
                assert got["round_over_semi_honest"] == pytest.approx(
                    got["round_s"] / semi["round_s"])
                assert positive(got["round_cpu_over_semi_honest"])
    assert result["security"] == ["semi_honest", "malicious"]
    for target in result["targets"].values():
        assert target["met"] in (True, False, None)


@pytest.mark.slow
def test_secagg_quick_semi_honest_only() -> None:
    result = run_quick("secagg.py", extra=("--variants", "k3", "--security", "semi_honest",
                                           "--no-dropouts"))
    for row in result["results"]:
        assert [k for k in row if k.startswith("fedring_")] == ["fedring_k3"]


def test_secagg_per_client_memos_in_a_malicious_round() -> None:
    """The per-client variants: before each client message the verified signatures are
    forgotten, and the graphs before each SETUP and PUBLIC_KEYS (once per client each), so
    every client pays its own verifications and graphs, as in its own process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import secagg as bench

    from privacy.secagg import graph, malicious
    from privacy.secagg.stages import MsgType
    from server.secagg_config import SecAggScenarioConfig
    from simulations.inprocess import InProcessGrid
    from simulations.secagg_pki import make_pki

    n, d = 6, 100  # k = 3: a graph to derive (the full graph needs no permutation)
    app = bench.Timed(bench.fedring_client_app(bench.make_inputs(n, d)))
    seen: list[tuple[MsgType | None, int, int]] = []
    inner = app.app

    def spy(msg: Any, context: Any) -> Any:
        graphs = malicious._core.cache_info().currsize + \
            graph._placement.cache_info().currsize
        seen.append((bench.secagg_kind(msg), len(malicious._VERIFIED), graphs))
        return inner(msg, context)

    app.app, app.own_caches = spy, True
    settings = SecAggScenarioConfig(enabled=True, neighbors=3, clip_range=bench.CLIP,
                                    security="malicious")
    _, out = bench.fedring_round(InProcessGrid(app, n, pki=make_pki(n)), list(range(1, n + 1)),
                                 d, settings, 1)
    assert out.status == "completed"
    kinds = [k for k, _, _ in seen]
    assert kinds.count(MsgType.PUBLIC_KEYS) == n and kinds.count(MsgType.SETUP) == n
    assert all(verified == 0 for _, verified, _ in seen)  # no client sees another's checks
    assert all(graphs == 0 for k, _, graphs in seen if k in (MsgType.SETUP,
                                                               MsgType.PUBLIC_KEYS))
    assert any(graphs for k, _, graphs in seen if k is not MsgType.PUBLIC_KEYS)


@pytest.mark.slow
def test_secagg_quick_at_the_cifar_model_size() -> None:
    from simulations.models import build_model

    model = build_model("resnet", input_shape=(3, 32, 32), num_classes=10)
    d = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers() if b.is_floating_point())
    result = run_quick("secagg.py", extra=("--cifar-model", "--variants", "k3",
                                           "--no-dropouts"))
    [row] = result["results"]
    assert (row["N"], row["d"]) == (4, d) and row["model"]["d"] == d
    assert positive(row["plain"]["round_s"]) and positive(row["fedring_k3"]["round_s"])
    assert row["fedring_k3"]["k"] == 3


@pytest.mark.slow
def test_deploy_latency_quick() -> None:
    result = run_quick("deploy_latency.py", timeout=240)
    assert result["benchmark"] == "deploy_latency" and result["quick"] is True
    assert result["nodes"] == 3 and result["params"] == 9610
    [row] = result["results"]
    assert row["mode"] == "fedring" and row["rounds"] == 3 and len(row["round_s"]) == 3
    for key in ("first_round_s", "warm_round_median_s", "up_s", "run_s"):
        assert positive(row[key]), (key, row[key])
    assert row["final_accuracy"] > 0.5
    assert result["target"]["met"] in (True, False)


@pytest.mark.slow
def test_deploy_latency_secure_quick() -> None:
    result = run_quick("deploy_latency.py", timeout=420, extra=("--secure",))
    assert result["secure"] is True and result["nodes"] == 3
    rows = {r["mode"]: r for r in result["results"]}
    assert list(rows) == ["plain", "semi_honest", "malicious"]
    assert rows["plain"]["secure_rounds"] == []
    for name in ("semi_honest", "malicious"):
        assert [(s["round"], s["status"], s["security"]) for s in rows[name]["secure_rounds"]] \
            == [(r, "completed", name) for r in (1, 2, 3)]
        assert result["over_plain"][name] == pytest.approx(
            rows[name]["warm_round_median_s"] / rows["plain"]["warm_round_median_s"], abs=1e-3)
    assert all(r["final_accuracy"] > 0.5 for r in rows.values())
    assert result["target"]["met"] in (True, False)


def _deploy_latency() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import deploy_latency

    return deploy_latency


def test_deploy_latency_secure_summary_and_checks() -> None:
    bench = _deploy_latency()
    rows = [{"mode": "plain", "warm_round_median_s": 1.0},
            {"mode": "semi_honest", "warm_round_median_s": 1.5},
            {"mode": "malicious", "warm_round_median_s": 2.1}]
    got = bench.secure_summary(rows)
    assert got["over_plain"] == {"semi_honest": 1.5, "malicious": 2.1}
    assert got["target"] == {"max_secure_over_plain": 2.0, "met": False}
    rows[2]["warm_round_median_s"] = 2.0
    assert bench.secure_summary(rows)["target"]["met"] is True
    assert bench.secure_summary(rows[:2])["target"]["met"] is None  # a variant missing
    assert "secagg.security=malicious" in bench.SECURE_VARIANTS["malicious"]
    assert "secagg.enabled=true" in bench.SECURE_VARIANTS["semi_honest"]
    assert "secagg" not in bench.SECURE_VARIANTS["plain"]
    ok = {"rounds": 2, "secure_rounds": [
        {"round": r, "status": "completed", "security": "malicious", "k": 2, "t": 2}
        for r in (1, 2)]}
    bench.check_secure("malicious", ok)
    for bad in ({**ok, "secure_rounds": ok["secure_rounds"][:1]},  # a round not secure
                {**ok, "secure_rounds": [{**ok["secure_rounds"][0], "status": "aborted"},
                                         ok["secure_rounds"][1]]}):
        with pytest.raises(RuntimeError, match="malicious: secure rounds recorded as"):
            bench.check_secure("malicious", bad)
    with pytest.raises(RuntimeError, match="semi_honest: secure rounds recorded as"):
        bench.check_secure("semi_honest", ok)  # recorded in another mode


def test_deploy_latency_alternates_the_secure_variants_and_pools_their_warm_rounds() -> None:
    bench = _deploy_latency()
    assert bench.sitting_order(1) == ["plain", "semi_honest", "malicious"]
    assert bench.sitting_order(3) == ["plain", "semi_honest", "malicious", "malicious",
                                      "semi_honest", "plain", "plain", "semi_honest",
                                      "malicious"]
    run = {"mode": "malicious", "rounds": 3, "first_round_s": 2.0, "final_accuracy": 0.9,
           "superlink_cpu_s": 1.5, "up_s": 6.0,
           "secure_rounds": [{"round": r} for r in (1, 2, 3)]}
    early = {**run, "round_s": [2.0, 1.0, 1.2], "warm_round_median_s": 1.1}
    late = {**run, "round_s": [5.0, 0.4, 0.5], "warm_round_median_s": 0.45}
    assert bench.pooled("malicious", [early]) is early
    row = bench.pooled("malicious", [early, late])
    assert row["warm_round_median_s"] == 0.75  # of 1.0, 1.2, 0.4, 0.5: first rounds left out
    assert row["warm_round_max_s"] == 1.2
    assert row["superlink_cpu_s"] == 3.0 and row["runs"] == [early, late]
    assert len(row["secure_rounds"]) == 6


def test_deploy_latency_refuses_secure_with_modes() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "deploy_latency.py"),
                          "--secure", "--modes", "flower"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--secure runs fedring's deployment only" in out.stderr


@pytest.mark.slow
def test_aggregation_throughput_quick() -> None:
    result = run_quick("aggregation_throughput.py")
    assert result["benchmark"] == "aggregation_throughput" and result["quick"] is True
    assert result["results"]
    for row in result["results"]:
        assert positive(row["pipeline_gbps"]) and positive(row["copy_gbps"])
        assert row["ratio_of_medians"] == pytest.approx(row["pipeline_gbps"] / row["copy_gbps"],
                                                        rel=0.01)
        low, high = row["ratio_range"]
        assert 0 < low <= row["ratio"] <= high
        assert row["meets_target"] == (row["ratio"] >= result["target_ratio"])
        assert set(row["kernel_ratios"]) == {"two_pass", "fused_unchecked", "fused_undo",
                                             "fused_pingpong"}
        assert all(positive(v) for v in row["kernel_ratios"].values())


@pytest.mark.slow
def test_dp_tradeoff_quick() -> None:
    result = run_quick("dp_tradeoff.py", timeout=300)
    assert result["benchmark"] == "dp_tradeoff" and result["quick"] is True
    modes = {row["mode"] for row in result["results"]}
    assert modes == {"central", "central-adaptive", "local", "distributed"}
    for row in result["results"]:
        assert positive(row["epsilon"]) and 0 <= row["accuracy"] <= 1
        assert row["round_statuses"] == ["completed"], row
    eps = {r["mode"]: r["epsilon"] for r in result["results"]}
    assert eps["central"] == pytest.approx(eps["central-adaptive"])  # same total z
    # distributed DP at the same z costs the same epsilon, up to the discrete noise's tau
    assert eps["distributed"] == pytest.approx(eps["central"], rel=1e-6)
    overhead = result["overhead"]
    secure = overhead["secure_round"]
    assert secure["clients"] == 5 and secure["words"] >= secure["dim"]
    assert secure["ratio"] == pytest.approx(secure["distributed_s"] / secure["secagg_s"],
                                            rel=0.01)  # both rounded to 4 digits
    for row in overhead["client_encoding"]:
        assert positive(row["quantize_ms"]) and positive(row["distributed_ms"])
    assert positive(overhead["training_runs"]["round_ratio"])


@pytest.mark.slow
def test_allreduce_quick() -> None:
    result = run_quick("allreduce.py")
    assert result["benchmark"] == "allreduce" and result["quick"] is True
    algorithms = {row["algorithm"] for row in result["results"]}
    assert {"ring", "native", "master", "tree", "halving_doubling", "all_to_all",
            "round_robin"} <= algorithms
    for row in result["results"]:
        assert positive(row["algbw_GBps"])
        n = row["n"]
        assert row["busbw_GBps"] == pytest.approx(2 * (n - 1) / n * row["algbw_GBps"], rel=1e-3)
    samples = {(r["n"], r["size_bytes"], r["algorithm"]): r["samples_s"]
               for r in result["results"]}
    for row in result["halving_doubling_vs_native"]:  # iteration-by-iteration ratios
        for alg, got in row["paired"].items():
            native = samples[(row["n"], row["size_bytes"], "native")]
            ratios = sorted(a / b for a, b in zip(
                native, samples[(row["n"], row["size_bytes"], alg)], strict=True))
            assert got["min"] == pytest.approx(ratios[0], abs=1e-3)
            assert got["max"] == pytest.approx(ratios[-1], abs=1e-3)
            assert got["min"] <= got["q1"] <= got["median"] <= got["q3"] <= got["max"]
    for row in result["round_robin_vs_ring"]:  # ring time / round_robin time, per iteration
        ring, rr = (samples[(row["n"], row["size_bytes"], a)] for a in ("ring", "round_robin"))
        ratios = sorted(a / b for a, b in zip(ring, rr, strict=True))
        assert row["paired"]["min"] == pytest.approx(ratios[0], abs=1e-3)
        assert row["paired"]["max"] == pytest.approx(ratios[-1], abs=1e-3)
    assert len(result["round_robin_vs_ring"]) == 4  # n = 2, 3 at two sizes
    assert set(result["machine"]["load_average_by_world_size"]) == {"2", "3"}
    assert len(result["model_errors"]) == len(result["results"])
    rows = {(r["n"], r["size_bytes"], r["algorithm"]): r for r in result["results"]}
    cores = result["machine"]["cpu_cores"]
    for err in result["model_errors"]:
        row = rows[(err["n"], err["size_bytes"], err["algorithm"])]
        assert err["measured_s"] == pytest.approx(row["best_s"], abs=1e-6)  # fitted to best
        assert err["measured_median_s"] == pytest.approx(row["time_s"], abs=1e-6)
        # from the 9-digit times (the rows' 6 digits are 0.3% off for a 0.2 ms time)
        assert err["rel_error_median"] == pytest.approx(
            err["predicted_s"] / err["measured_median_s"] - 1, abs=2e-3)
        n, size = err["n"], err["size_bytes"]
        if err["algorithm"] in ("master", "ring"):  # master: rank 0 and one worker busy
            model = result["alpha_beta"][err["algorithm"]]
            busy = 2 if err["algorithm"] == "master" else n
            per_byte = 2 * (n - 1) if err["algorithm"] == "master" else 2 * (n - 1) / n
            slow = max(1.0, busy / cores)  # latency and bandwidth: each its own exponent
            expected = (model["alpha_s"] * 2 * (n - 1) * slow ** model["sharing_gamma_alpha"]
                        + model["beta_s_per_byte"] * per_byte * size
                        * slow ** model["sharing_gamma_beta"])
            assert err["predicted_s"] == pytest.approx(expected, rel=1e-3, abs=1e-9)
    for err in result["model_errors"]:
        assert err["rel_error"] == pytest.approx(err["predicted_s"] / err["measured_s"] - 1,
                                                 abs=2e-3)
    winners = result["prediction"]["winners"]
    assert {(w["n"], w["size_bytes"]) for w in winners} == {
        (n, s) for n in (64, 128, 256, 512, 1024) for s in (64 << 10, 1 << 20, 16 << 20, 64 << 20)}
    for w in winners:  # the winner is the fastest prediction, the runner-up the next
        ranked = sorted(w["time_s_by_algorithm"].items(), key=lambda kv: kv[1])
        assert "halving_doubling" in w["time_s_by_algorithm"]
        assert w["winner"] == ranked[0][0] and w["runner_up"] == ranked[1][0]
        assert w["speedup_over_runner_up"] >= 1.0


@pytest.mark.slow
def test_allreduce_pair_quick() -> None:
    """``--pair``: native gloo and one algorithm only, alternated; ratios from the samples."""
    result = run_quick("allreduce.py", extra=("--pair", "halving_doubling_inplace"))
    assert result["benchmark"] == "allreduce_pair" and result["quick"] is True
    assert result["algorithm"] == "halving_doubling_inplace"
    rows = {(r["n"], r["size_bytes"], r["algorithm"]): r for r in result["results"]}
    assert {a for _, _, a in rows} == {"native", "halving_doubling_inplace"}
    assert [(c["n"], c["size_bytes"]) for c in result["cells"]] == [(2, 64 << 10), (2, 1 << 20)]
    for cell in result["cells"]:
        native = rows[(cell["n"], cell["size_bytes"], "native")]
        other = rows[(cell["n"], cell["size_bytes"], "halving_doubling_inplace")]
        assert len(native["samples_s"]) == len(other["samples_s"]) == result["iterations"]
        # the rows' figures are rounded to 1e-6 (s), the cells' ratios to 3 decimals
        def rounded(ratio: float, a: float, b: float) -> float:
            return 5e-4 + ratio * (1e-6 / a + 1e-6 / b)

        t_native, t_other = native["time_s"], other["time_s"]
        assert cell["over_native_busbw"] == pytest.approx(
            t_native / t_other, abs=rounded(t_native / t_other, t_native, t_other))
        ratios = sorted(a / b for a, b in zip(native["samples_s"], other["samples_s"],
                                              strict=True))
        assert cell["paired"]["min"] == pytest.approx(ratios[0], abs=1e-3)
        assert cell["paired"]["max"] == pytest.approx(ratios[-1], abs=1e-3)
        c_native, c_other = native["cpu_s_all_ranks"], other["cpu_s_all_ranks"]
        assert cell["cpu_over_native"] == pytest.approx(
            c_other / c_native, abs=rounded(c_other / c_native, c_native, c_other))
    assert result["target"] == {"over_native_busbw": 0.95, "met": None}  # not judged when quick


@pytest.mark.slow
def test_robustness_quick() -> None:
    from simulations.attacks import choose_attackers

    result = run_quick("robustness.py")
    assert result["benchmark"] == "robustness" and result["quick"] is True
    assert result["plot"] is None and list(result["results"]) == ["iid"]
    quick_combines = {"mean", "geometric_median", "cc_bucketing_m", "cc_secagg_m", "cc_nnm_m",
                      "cc_secagg_mu"}
    secure = ("cc_secagg_m", "cc_secagg_mu")
    quick_attacks = {"none", "sign_flip", "alie", "ipm"}
    table = result["results"]["iid"]
    assert set(table) == {"none", "sign_flip", "scale", "gaussian_noise", "label_flip",
                          "alie", "ipm"}
    for attack, row in table.items():
        for combine, acc in row.items():
            # run: the quick cells, except the omniscient attacks under secure aggregation
            ran = attack in quick_attacks and combine in quick_combines and not (
                attack in ("alie", "ipm") and combine in secure)
            assert (acc is not None) == ran, (attack, combine)
            assert acc is None or 0 <= acc <= 1, (attack, combine, acc)
    assert len(result["runs"]) == 20
    attackers = list(choose_attackers(0.2, 20, seed=0))
    for run in result["runs"]:  # the clients that reported attacking are the chosen 20%
        assert run["versions"] == 2 and run["not_accepted"] == 0, run  # both rounds applied
        # the recommended settings run with server momentum, the controls without
        assert run["server_opt"] == ("fedavgm" if run["combine"].startswith("cc_") else
                                     "fedavg")
        if run["combine"] in secure:  # the secure sum keeps no per-client metrics
            assert run["attackers"] in ([], attackers), run
            assert run["clip_radius"] > 0
            continue
        assert run["attackers"] == ([] if run["attack"] == "none" else attackers), run
    assert result["targets"] == {}  # no Dirichlet cells in quick mode
    assert all(isinstance(v, bool) for v in result["sanity"].values())
    assert all(run["client_momentum"] == 0 for run in result["runs"])


@pytest.mark.slow
def test_robustness_seed_study_quick() -> None:
    from simulations.attacks import choose_attackers

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import parse_seeds

    assert parse_seeds("3") == [0, 1, 2] and parse_seeds("5-9") == [5, 6, 7, 8, 9]
    assert parse_seeds("0,2,5") == [0, 2, 5] and parse_seeds("0-1,7") == [0, 1, 7]
    for bad in ("0", "9-5", "1,1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
            parse_seeds(bad)
    args = ("--workload", "default", "--seeds", "1-2", "--attacks", "sign_flip",
            "--combines", "cc_bucketing_m")
    result = run_quick("robustness.py", extra=(*args, "--diagnose"))
    assert result["seeds"] == [1, 2] and result["plot"] is None
    runs = {(r["seed"], r["attack"], r["combine"]): r for r in result["runs"]}
    assert set(runs) == {(s, a, c) for s in (1, 2) for a, c in
                         (("none", "mean"), ("sign_flip", "cc_bucketing_m"))}
    cell = result["per_seed"]["dirichlet"]["sign_flip"]["cc_bucketing_m"]
    acc = {s: runs[(s, "sign_flip", "cc_bucketing_m")]["accuracy"] for s in (1, 2)}
    gaps = {s: runs[(s, "none", "mean")]["accuracy"] - acc[s] for s in (1, 2)}
    assert cell["seeds"] == [1, 2] and cell["worst"] == min(acc.values())
    assert acc[cell["worst_seed"]] == cell["worst"]
    assert cell["gap"] == {str(s): pytest.approx(g, abs=1e-4) for s, g in gaps.items()}
    assert cell["gap_mean"] == pytest.approx(sum(gaps.values()) / 2, abs=1e-4)
    assert cell["gap_worst"] == pytest.approx(max(gaps.values()), abs=1e-4)
    assert cell["std"] == pytest.approx(abs(acc[1] - acc[2]) / 2, abs=1e-4)
    goal = result["seed_targets"]["cc_bucketing_m"]["attacks"]["sign_flip"]
    assert goal["met"] == (cell["gap_mean"] <= 0.03 and cell["gap_worst"] <= 0.06)
    facts = {f["seed"]: f for f in result["diagnosis"]["partitions"]}
    for s in (1, 2):
        assert facts[s]["attackers"] == list(choose_attackers(0.2, 20, s))
        assert 0 < facts[s]["attacker_examples_share"] < 1
        assert len(facts[s]["attacker_class_share"]) == 10
        rounds = runs[(s, "sign_flip", "cc_bucketing_m")]["rounds"]
        assert len(rounds) == 2 and all(r["tau"] > 0 for r in rounds)
        # 4 attackers in 10 buckets of 2: at least 2 buckets hold one
        assert all(r["attacker_to_center"] is not None for r in rounds)
        assert "rounds" not in runs[(s, "none", "mean")]
    # the probe reads the runs without changing them
    plain = run_quick("robustness.py", extra=args)
    assert {(r["seed"], r["combine"]): r["accuracy"] for r in plain["runs"]} == \
        {(s, c): r["accuracy"] for (s, _, c), r in runs.items()}


@pytest.mark.slow
def test_robustness_subset_with_client_momentum() -> None:
    result = run_quick("robustness.py", extra=("--attacks", "sign_flip", "--combines",
                                               "mean,cc_bucketing_m", "--client-momentum", "0.5"))
    assert result["plot"] is None and result["workload"]["client_momentum"] == 0.5
    momentum = {run["combine"]: run["client_momentum"] for run in result["runs"]}
    assert momentum == {"mean": 0, "cc_bucketing_m": 0.5}  # only the centered-clipping cells
    assert all(run["attack"] == "sign_flip" for run in result["runs"])


@pytest.mark.slow
def test_compression_quick() -> None:
    result = run_quick("compression.py")
    assert result["benchmark"] == "compression" and result["quick"] is True
    rows = {row["variant"]: row for row in result["results"]}
    assert list(rows) == ["none", "qsgd-4", "topk-10%", "secagg", "secagg+qsgd-8",
                          "secagg+randk-10%"]
    for row in rows.values():
        assert row["rounds"] == 1 and 0 <= row["final_accuracy"] <= 1
        assert row["bytes_up_per_round_stored"] == [row["bytes_up_total"]]
        dense = rows["secagg" if row["secure"] else "none"]
        assert row["bytes_down_total"] == dense["bytes_down_total"]
    assert rows["none"]["upload_ratio"] == rows["secagg"]["upload_ratio"] == 1.0
    assert rows["qsgd-4"]["upload_ratio"] > 5.5 and rows["topk-10%"]["upload_ratio"] > 4.5
    # secure: 16-bit masked words for QSGD's modulus; rand-k masks 10% of the words
    assert rows["secagg+qsgd-8"]["upload_ratio"] > 1.7
    assert rows["secagg+randk-10%"]["upload_ratio"] > 5


@pytest.mark.slow
def test_cross_silo_secure_quick() -> None:
    result = run_quick("cross_silo_secure.py")
    assert result["benchmark"] == "cross_silo_secure" and result["quick"] is True
    assert len(result["loadavg_before"]) == 3 and "cpus" in result["machine"]
    [row] = result["results"]
    assert row["model"] == "mlp_4.8k" and row["params"] == 4810 and row["silos"] == 3
    assert row["rounds_timed"] == 2
    for key in ("plain_round_s", "secure_round_s", "secure_over_plain"):
        assert positive(row[key]), (key, row[key])
    assert set(row["secure_stage_s"]) == {"advertise_keys", "share_keys", "masked_input",
                                          "unmasking"}


@pytest.mark.slow
def test_secure_fidelity_quick() -> None:
    result = run_quick("secure_fidelity.py")
    assert result["benchmark"] == "secure_fidelity" and result["quick"] is True
    rows = {row["variant"]: row for row in result["results"]}
    assert set(rows) == {"plain", "secure, auto range", "secure, range 1"}
    assert rows["plain"]["clipped"] is None and rows["secure, auto range"]["clipped"] == 0
    for variant in ("secure, auto range", "secure, range 1"):
        gap = abs(rows[variant]["accuracy"] - rows["plain"]["accuracy"])
        assert result["largest_gap_to_plain"][f"default / {variant}"] == pytest.approx(
            gap, abs=1e-4)
    assert all(row["status"] == "completed" for row in result["results"])


def test_privacy_audit_quick() -> None:
    result = run_quick("privacy_audit.py")
    assert result["benchmark"] == "privacy_audit" and result["quick"] is True
    rows = {row["mode"]: row for row in result["summary"]}
    assert set(rows) == {"none", "central", "distributed"}
    assert rows["none"]["epsilon"] is None and positive(rows["none"]["audit_mean"])
    for mode in ("central", "distributed"):
        assert positive(rows[mode]["epsilon"]) and rows[mode]["audit_mean"] >= 0
        assert positive(rows[mode]["epsilon_audit_reference"])
        assert 0 <= rows[mode]["audit_lower_max"] <= rows[mode]["audit_max"]
    assert rows["none"]["epsilon_audit_reference"] is None and rows["none"]["flagged"] == 0
    assert all(r["canaries"] == result["canaries"] for r in result["results"])
    training, stage = result["cost"]["training_runs"], result["cost"]["stage"]
    assert positive(training["cpu_s_without"]) and positive(training["cpu_s_with"])
    assert 0 < training["audit_cpu_share"] < 1
    assert stage["canaries"] == result["canaries"] and positive(stage["estimate_s"])
    assert positive(stage["round_s"]) and positive(stage["draw_s"])


@pytest.mark.slow
def test_gossip_quick() -> None:
    result = run_quick("gossip.py")
    assert result["benchmark"] == "gossip" and result["quick"] is True and result["plot"] is None
    assert set(result["rounds"]) == {"fedavg", "gossip_ring", "gossip_random"}
    assert all(run["status"] == "completed" for run in result["runs"].values())
    dim, clients = result["workload"]["parameters"], result["workload"]["clients"]
    assert (dim, clients) == (4810, 4)
    per_round = result["bytes_per_round"]
    assert per_round["fedavg"] == 2 * clients * 4 * dim  # every client down and up
    assert per_round["gossip_ring"] == 2 * clients * 4 * dim  # two neighbours each
    assert per_round["gossip_random"] == 3 * clients * 4 * dim  # 4 silos: complete graph
    for name, rows in result["rounds"].items():
        assert [r["round"] for r in rows] == [1, 2]
        assert all(0 <= r["accuracy"] <= 1 for r in rows), name
    first = result["rounds"]["gossip_ring"][0]
    assert first["bytes"] == per_round["gossip_ring"] + clients * 4 * dim  # the initial model
    assert all(r["consensus_distance"] > 0 for r in result["rounds"]["gossip_ring"])
    for reached in result["reached"].values():
        assert (reached["round"] is None) == (reached["bytes"] is None)
    assert positive(result["exchange_s"])


@pytest.mark.slow
def test_federated_eval_quick() -> None:
    result = run_quick("federated_eval.py")
    assert result["benchmark"] == "federated_eval" and result["quick"] is True
    assert result["plot"] is None and result["seeds"] == [0]
    shift = result["shift"]
    runs = {row["variant"]: row for row in shift["runs"]}
    assert set(runs) == {"fedavg", "fedbn"} and shift["strength"] > 0
    assert all(row["status"] == "completed" and row["federated_clients"] == 5
               for row in runs.values())
    assert runs["fedavg"]["federated_accuracy_personal"] is None  # no model of its own
    [gap] = shift["gaps"]
    assert gap["gap"] == pytest.approx(
        runs["fedbn"]["federated_accuracy_personal"] - runs["fedavg"]["federated_accuracy"],
        abs=1e-4)
    # FedBN's personal figure is each client's own batch norm: well above its global model's
    assert gap["fedbn_personal"] > gap["fedbn_global_federated"] + 0.05
    assert 0 < gap["fedavg_own_statistics"] <= 1 and gap["gap"] > 0
    assert shift["target"]["smallest_gap"] == gap["gap"]
    low, high = gap["contrast_range"]
    assert 0 < low < 1 < high  # five clients' contrasts exp(0.75 g) straddle 1
    default = result["default"]
    [row] = default["results"]
    assert row["federated_clients"] == 5 and row["central_examples"] == 360
    assert 0 < row["federated_examples"] < 1437 * 0.5  # the 5 clients' held-out splits
    assert 0 <= row["federated_min"] <= row["federated_p10"] <= row["federated"] <= 1
    assert row["difference"] == pytest.approx(row["federated"] - row["central"], abs=1e-4)
    ratios = [r["eval_s"] / (r["wall_s"] - r["eval_s"]) for r in row["round_s"]]
    assert len(ratios) == 2 and all(positive(r) for r in ratios)
    assert row["eval_over_train"] == pytest.approx(ratios, rel=1e-3, abs=1e-4)
    cost = default["targets"]["cost"]
    assert cost["eval_over_train_median"] == pytest.approx(sorted(ratios)[0] / 2
                                                           + sorted(ratios)[1] / 2, abs=1e-4)
    assert cost["met"] is (cost["eval_over_train_median"] < 0.1)
    fidelity = default["targets"]["fidelity"]
    assert fidelity["largest_difference"] == abs(row["difference"])


PACKAGES = ("aggregation", "benchmarks", "client", "privacy", "server", "simulations")


@pytest.mark.slow
def test_before_after_quick(tmp_path: Path) -> None:
    """Alternates two checkouts (this one and a copy of its packages) and pairs every
    figure; each runs its own packages, not the installed checkout's."""
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    result = run_quick("before_after.py", timeout=300, extra=("--baseline", str(tmp_path)))
    assert result["benchmark"] == "before_after" and result["reps"] == 1
    assert result["baseline"] == str(tmp_path.resolve()) and result["after"] == str(ROOT)
    figures = result["figures"]
    assert any(k.startswith("simulation N=4 ") for k in figures)
    assert any(k.startswith("secagg N=") and k.endswith("round_s") for k in figures)
    for key, f in figures.items():
        assert len(f["before_all"]) == len(f["after_all"]) == 1, key
        if "overhead" not in key:  # an overhead is a difference: it may be below 0
            assert positive(f["before"]) and positive(f["after"]), key
            assert f["after_over_before"] == pytest.approx(f["after"] / f["before"])


def test_before_after_refuses_a_folder_that_is_no_checkout(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "before_after.py"),
                          "--quick", "--baseline", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "not a fedring checkout" in out.stderr


def test_before_after_refuses_a_checkout_whose_packages_come_from_elsewhere(
        tmp_path: Path) -> None:
    """A folder with the scripts but not the packages would measure another checkout."""
    import shutil

    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "before_after.py"),
                          "--quick", "--baseline", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "would import fedring from" in out.stderr


@pytest.mark.slow
def test_crossbow_quick() -> None:
    result = run_quick("crossbow.py")
    assert result["benchmark"] == "crossbow" and result["quick"] is True
    assert set(result["samples_per_s"]) == {"sma_L4_b8", "one_b32", "one_b8"}
    assert all(positive(v) for v in result["samples_per_s"].values())
    assert positive(result["throughput_ratio_L4_b8_over_one_b8"])
    assert set(result["to_target"]) == {"sma_L4_b16", "one_b64", "one_b16"}
    for run in result["to_target"].values():
        assert len(run["curve"]) >= 1 and all(0 <= acc <= 1 for _, acc in run["curve"])
