"""allreduce against dist.all_reduce on real gloo process groups of several sizes.

One process group per world size runs every algorithm, length and dtype; the
tests below check different parts of its report.
"""

from __future__ import annotations

import pytest
import ring_workers
from ring_launch import launch

pytestmark = pytest.mark.slow

WORLD_SIZES = (1, 2, 3, 4, 5, 8)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"n{n}")
def report(request: pytest.FixtureRequest) -> dict[str, object]:
    n = request.param
    return {
        "n": n,
        "sweep": launch(ring_workers.sweep, n, timeout=300),
        "masked": launch(ring_workers.masked, n, timeout=120),
        "weighted": launch(ring_workers.weighted, n, timeout=120),
        "arguments": launch(ring_workers.bad_arguments, n, timeout=60),
        "edges": launch(ring_workers.segment_edges, n, timeout=120),
    }


def _fails(report: dict, kind: str) -> list[str]:
    return [f"rank {r}: {f}" for r, out in enumerate(report["sweep"]) for f in out["fails"][kind]]


def test_every_call_completes(report: dict) -> None:
    assert _fails(report, "calls") == []


def test_float_results_match_native_within_reordering_error(report: dict) -> None:
    assert _fails(report, "float") == []


def test_integer_results_equal_native_including_overflow(report: dict) -> None:
    assert _fails(report, "int") == []


def test_segmented_unpipelined_grouped_in_place_mean_and_strided_variants(report: dict) -> None:
    assert _fails(report, "variant") == []


def test_input_is_not_modified(report: dict) -> None:
    assert _fails(report, "input") == []


def test_all_ranks_get_bit_identical_results(report: dict) -> None:
    digests = [out["digests"] for out in report["sweep"]]
    expected_keys = 4 * (len(ring_workers.LENGTHS) - 1) * (
        len(ring_workers.FLOATS) + len(ring_workers.INTEGERS))
    assert len(digests[0]) > expected_keys
    differing = [k for k in digests[0] if any(d.get(k) != digests[0][k] for d in digests[1:])]
    assert differing == []


def test_masked_updates_through_the_ring_unmask_to_the_plain_sum(report: dict) -> None:
    outs = report["masked"]
    assert [f for out in outs for f in out["fails"]] == []
    assert int(outs[0]["checks"][0]) == 3 * (3 * 4 - 1)


def test_weighted_mean(report: dict) -> None:
    assert [f for out in report["weighted"] for f in out["fails"]] == []


def test_bad_arguments_raise(report: dict) -> None:
    assert [f for fails in report["arguments"] for f in fails] == []


def test_chunks_with_different_segment_counts_match_native(report: dict) -> None:
    assert [f for out in report["edges"] for f in out["fails"]] == []


def test_ring_scratch_stays_about_one_chunk_plus_the_window(report: dict) -> None:
    """gloo reports a send done only once waited on; unless the ring waits for old
    sends, each reduce-scatter segment of steps 0..n-3 keeps its own buffer."""
    for out in report["edges"]:
        assert out["slots"] <= out["bound"]
