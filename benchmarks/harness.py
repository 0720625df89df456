"""What the benchmarks share: progress lines, the command line of a benchmark over seeds,
and timed training runs on the in-process engine.

A benchmark prints human-readable lines on stderr (``log``) and one JSON object as the last
line of stdout, with what it ran on and under which load (``machine_info``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The benchmarks but federated evaluation's train on whole partitions, as their figures
# in docs/BENCHMARKS.md were measured: no client holds data out for evaluation.
WHOLE_PARTITIONS = {"data.client_test_fraction": 0.0}
WHOLE_PARTITIONS_OVERRIDE = "data.client_test_fraction=0"


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``: unlike ``ru_maxrss`` it is not
    inherited from the parent that spawned it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def log(text: str) -> None:
    """One human-readable line, on stderr (stdout carries the JSON)."""
    print(text, file=sys.stderr, flush=True)


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: ``N`` is the first N seeds (0..N-1), ``A-B`` the seeds A to B inclusive,
    ``A,B,..`` those seeds, in that order (a range may be one item of a list: ``0-4,7``)."""
    def fail(why: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"--seeds {text!r}: {why}; write a count (3), a "
                                          "range (0-9) or a list (0,2,5)")

    items = [item.strip() for item in text.split(",")]
    if len(items) == 1 and items[0].isdigit():
        count = int(items[0])
        if count < 1:
            raise fail("a count must be at least 1")
        return list(range(count))
    seeds: list[int] = []
    for item in items:
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise fail(f"{item!r} is not a seed or a range of seeds")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise fail(f"the range {item!r} runs backwards")
        seeds.extend(range(first, last + 1))
    if len(set(seeds)) != len(seeds):
        raise fail("a seed is named twice")
    return seeds


def seeds_args(doc: str, quick_help: str, plot_name: str,
               more: Callable[[argparse.ArgumentParser], Any] | None = None
               ) -> argparse.Namespace:
    """The command line of a benchmark over seeds, parsed: ``--quick``, ``--seeds`` (a list,
    see :func:`parse_seeds`: 3 seeds, 1 in quick mode), ``--plot`` (a Path:
    docs/``plot_name`` unless given; None in quick mode unless given) and ``--threads`` (set
    in torch); ``more`` adds arguments."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--seeds", type=parse_seeds, default=None,
                        help="a count N (seeds 0..N-1), a range A-B (one seed: 5-5) or a "
                             "list A,B,.. (default 3 seeds, quick 1)")
    if more is not None:
        more(parser)
    parser.add_argument("--plot", default=None,
                        help=f"PNG path (default docs/{plot_name}; none in quick mode)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    args.seeds = args.seeds or list(range(1 if args.quick else 3))
    args.plot = (Path(args.plot or ROOT / "docs" / plot_name) if args.plot or not args.quick
                 else None)
    return args


def timed_simulation(config: dict[str, Any], db: str) -> tuple[dict[str, Any], float]:
    """Train a resolved scenario on the in-process engine (real ServerApp, ClientApp and
    store ``db``): the run's summary and its wall seconds."""
    from simulations.cli import run_simulation

    started = time.perf_counter()
    summary = run_simulation(config, engine="inprocess", db=db)
    return summary, time.perf_counter() - started
