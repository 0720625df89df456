"""Before and after a change, alternated in one sitting: the engine's and SecAgg+'s costs.

Runs ``simulation_overhead.py`` and ``secagg.py`` of this checkout and of ``--baseline``
(a checkout of an earlier fedring, e.g. ``git worktree add /tmp/before <rev>``) in
turns: A B, then B A, ``--reps`` times, each script in its own interpreter with its
checkout first on the path, so load drifts cancel out of the comparison. For each figure
it reports the median before and after, their ratio and every value.

Figures: per simulation size, fedring's warm round (net of its central evaluation), the
bare torch loop's beside it, their ratio and fedring's overhead per client; per SecAgg+
size and variant, the round's wall time and a client's secure overhead (CPU time spent
on the protocol). A refactor that changes no behaviour should leave every ratio within
the spread of the values.

    python benchmarks/before_after.py --baseline TREE [--after TREE] [--quick] [--reps R]
        [--parts simulation,secagg]
        [--sizes 10x10k,100x10k,10x1m] [--secagg-sizes 100x100000,100x1000000]
        [--variants auto_1t,auto]

Human-readable lines go to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
FULL = {"sizes": "10x10k,100x10k,10x1m", "secagg_sizes": "100x100000,100x1000000",
        "variants": "auto_1t,auto"}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that makes ``tree``'s packages the ones imported (an editable
    install of another checkout would otherwise win for scripts that do not put their
    checkout on the path themselves)."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def check_imports(tree: Path) -> None:
    """Refuse to compare when ``tree``'s interpreter would import another checkout."""
    out = subprocess.run([sys.executable, "-c", "import server; print(server.__file__)"],
                         capture_output=True, text=True, cwd=tree / "benchmarks",
                         env=tree_env(tree))
    found = Path(out.stdout.strip()).resolve() if out.returncode == 0 else None
    if found is None or tree not in found.parents:
        raise SystemExit(f"{tree}: its benchmarks would import fedring from {found}")


def run_script(tree: Path, script: str, args: list[str]) -> dict[str, Any]:
    """Run ``tree``'s ``benchmarks/script``; the JSON object on its last stdout line."""
    env = tree_env(tree)
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args],
                         capture_output=True, text=True, cwd=tree, env=env, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{tree}/benchmarks/{script} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def simulation_figures(result: dict[str, Any]) -> dict[str, float]:
    out = {}
    for row in result["results"]:
        key = f"simulation N={row['clients']} params={row['params']}"
        out[f"{key} fedring_s"] = row["fedring_s"]
        out[f"{key} bare_s"] = row["bare_s"]
        out[f"{key} fedring/bare"] = row["fedring_s"] / row["bare_s"]
        out[f"{key} overhead_ms_per_client"] = row["fedring_over_bare_ms_per_client"]
    return out


def secagg_figures(result: dict[str, Any]) -> dict[str, float]:
    out = {}
    for row in result["results"]:
        for name, cell in row.items():
            if not name.startswith("fedring_") or not isinstance(cell, dict):
                continue
            key = f"secagg N={row['N']} d={row['d']} {name.removeprefix('fedring_')}"
            out[f"{key} round_s"] = cell["round_s"]
            out[f"{key} client_overhead_ms"] = 1e3 * cell["client_secure_overhead_s"]
    return out


def measure(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One repetition of both scripts in ``tree``."""
    if args.quick:
        sim = ["--quick", "--no-cold", "--no-pfl-workload", "--memory-users", "0"]
        sec = ["--quick", "--variants", args.variants or "auto_1t", "--no-dropouts"]
    else:
        sim = ["--sizes", args.sizes or FULL["sizes"], "--no-flower", "--no-cold",
               "--no-pfl-workload", "--memory-users", "0", "--reps", "1"]
        sec = ["--sizes", args.secagg_sizes or FULL["secagg_sizes"], "--variants",
               args.variants or FULL["variants"], "--no-flower", "--no-dropouts",
               "--reps", "2"]
    out = {}
    if "simulation" in args.parts:
        out.update(simulation_figures(run_script(tree, "simulation_overhead.py", sim)))
    if "secagg" in args.parts:
        out.update(secagg_figures(run_script(tree, "secagg.py", sec)))
    return out


def compare(rows: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per figure: medians before and after, their ratio, and every value."""
    out = {}
    for key in rows["before"][0]:
        before = [r[key] for r in rows["before"]]
        after = [r[key] for r in rows["after"]]
        b, a = statistics.median(before), statistics.median(after)
        out[key] = {"before": b, "after": a, "after_over_before": a / b if b else None,
                    "before_all": before, "after_all": after}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a checkout of the earlier fedring")
    parser.add_argument("--after", default=str(HERE),
                        help="the checkout with the change (default: this one)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="alternations (default 6)")
    parser.add_argument("--parts", default="simulation,secagg",
                        type=lambda text: tuple(text.split(",")),
                        help="what to measure: simulation, secagg or both (the default)")
    parser.add_argument("--sizes", default=None, help=f"simulation sizes ({FULL['sizes']})")
    parser.add_argument("--secagg-sizes", default=None,
                        help=f"SecAgg+ sizes, N x d ({FULL['secagg_sizes']})")
    parser.add_argument("--variants", default=None, help=f"SecAgg+ variants ({FULL['variants']})")
    args = parser.parse_args()
    if not args.parts or set(args.parts) - {"simulation", "secagg"}:
        parser.error("--parts takes simulation, secagg or both, comma-separated")
    trees = {"before": Path(args.baseline).resolve(), "after": Path(args.after).resolve()}
    for name, tree in trees.items():
        if not (tree / "benchmarks" / "secagg.py").exists():
            raise SystemExit(f"--{'baseline' if name == 'before' else 'after'} {tree}: not a "
                             f"fedring checkout")
    for tree in trees.values():
        check_imports(tree)
    reps = args.reps or (1 if args.quick else 6)
    started, load_before = time.perf_counter(), os.getloadavg()
    rows: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for rep in range(reps):
        for name in (("before", "after") if rep % 2 == 0 else ("after", "before")):
            rows[name].append(measure(trees[name], args))
            log(f"repetition {rep + 1}/{reps}: {name} done at "
                f"{time.perf_counter() - started:.0f} s")
    figures = compare(rows)
    for key, f in figures.items():
        ratio = f["after_over_before"]
        log(f"{key:52s} before {f['before']:10.4g}  after {f['after']:10.4g}  "
            f"after/before {ratio:.3f}" if ratio is not None else f"{key}: before is 0")
    print(json.dumps({"benchmark": "before_after", "quick": args.quick, "reps": reps,
                      "baseline": str(trees["before"]), "after": str(trees["after"]),
                      "loadavg_before": load_before,
                      "loadavg_after": os.getloadavg(),
                      "wall_s": time.perf_counter() - started, "figures": figures}))


if __name__ == "__main__":
    main()
