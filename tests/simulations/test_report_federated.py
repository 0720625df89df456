"""The federated evaluation's figures where the user looks: the round line, the progress
line, the final status, ``fedring report``'s table, JSON and plot, and ``--target-on``."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from server.reporter import round_line, status_line
from server.spread import spread
from server.store import EvalRecord, Store
from simulations.cli import TARGETS, _resolve, build_parser, main
from simulations.report import spread_series

ROUNDS = 6
EVALUATED = (2, 4, 6)  # federation.evaluate_every = 2


def _answers(rnd: int, personal: bool) -> list[EvalRecord]:
    """Five clients' answers, with sizes and accuracies that differ (and one rejected)."""
    out = [EvalRecord(f"c{i}", "accepted", num_examples=10 + 7 * i, loss=1.0 / (i + rnd),
                      accuracy=0.3 + 0.1 * i + 0.01 * rnd,
                      loss_personal=0.5 / (i + rnd) if personal else None,
                      accuracy_personal=0.6 + 0.05 * i + 0.01 * rnd if personal else None)
           for i in range(5)]
    return [*out, EvalRecord("c9", "rejected", reason="accuracy is NaN")]


def _store(url: str, *, personal: bool, dp: bool = False,
           rejected_in: int | None = None) -> tuple[str, dict[int, dict]]:
    """A finished run whose even rounds evaluated on the clients; its figures by round."""
    figures: dict[int, dict] = {}
    with Store(url) as store:
        run_id = store.create_run(config={"federation": {"rounds": ROUNDS}}, seed=0,
                                  name="feature_shift")
        store.record_round(run_id, round=0, model_version=0, metrics={"accuracy": 0.1})
        for rnd in range(1, ROUNDS + 1):
            metrics = {"accuracy": 0.5 + rnd / 40, "loss": 1.0 / rnd}
            if dp:
                metrics["epsilon"] = 0.5 * rnd
            if rnd in EVALUATED:
                figures[rnd] = spread(_answers(rnd, personal))
                metrics.update(figures[rnd])
            rejected = int(rnd == rejected_in)
            store.record_round(run_id, round=rnd, model_version=rnd, num_sampled=5,
                               num_replies=5, num_accepted=5 - rejected,
                               num_rejected=rejected, metrics=metrics, wall_s=0.5)
        store.finish_run(run_id, status="completed", summary={"rounds": ROUNDS,
                                                              **figures[ROUNDS]})
    return run_id, figures


def _report(capsys, monkeypatch, columns: int, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["report", *argv]) == 0
    return capsys.readouterr().out


# -- lines -------------------------------------------------------------------------------

def test_the_round_line_shows_the_federated_accuracy_its_p10_and_min():
    figures = spread(_answers(4, personal=True))
    line = round_line(4, 10, {"accuracy": 0.5, "loss": 1.25, "accepted": 5.0, **figures})
    fed = (f"fed acc {figures['federated_accuracy']:.3f} "
           f"(p10 {figures['federated_accuracy_p10']:.2f}, "
           f"min {figures['federated_accuracy_min']:.2f})")
    own = (f"personal acc {figures['federated_accuracy_personal']:.3f} "
           f"(p10 {figures['federated_accuracy_personal_p10']:.2f}, "
           f"min {figures['federated_accuracy_personal_min']:.2f})")
    assert line == ("round 4/10: accuracy 0.5000, loss 1.2500, 5 accepted, 0 rejected, "
                    f"0 dropped, {fed}, {own}")
    # by hand: accuracies .34 .44 .54 .64 .74 on 10 17 24 31 38 examples: 71.8 / 120
    assert "fed acc 0.598 (p10 0.38, min 0.34)" in line
    plain = round_line(3, 10, {"accuracy": 0.5, "loss": 1.25, "accepted": 5.0})
    assert "fed" not in plain and "personal" not in plain


def test_the_final_status_line_carries_the_summary_figures():
    figures = spread(_answers(6, personal=False))
    line = status_line({"run_id": "r1", "status": "completed", "rounds": 6,
                        "final_accuracy": 0.9, "store": "sqlite://", **figures})
    # the round-4 figures above, each accuracy 0.02 higher
    assert line.endswith("accuracy 0.9000, fed acc 0.618 (p10 0.40, min 0.36), "
                         "store sqlite://"), line


def test_the_progress_line_keeps_the_last_evaluation_with_its_round():
    from simulations.progress import RichReporter

    figures = spread(_answers(2, personal=True))
    with RichReporter(3, console=Console(file=io.StringIO(), width=200)) as reporter:
        reporter.round_finished(1, {"loss": 0.5, "accuracy": 0.75})
        assert "fed" not in reporter.progress.tasks[0].fields["info"]
        reporter.round_finished(2, {"loss": 0.5, "accuracy": 0.75, **figures})
        shown = reporter.progress.tasks[0].fields["info"]
        assert f"fed acc {figures['federated_accuracy']:.3f} (p10 " in shown
        assert f"personal acc {figures['federated_accuracy_personal']:.3f}" in shown
        assert "at round" not in shown
        reporter.round_finished(3, {"loss": 0.4, "accuracy": 0.8})
        assert reporter.progress.tasks[0].fields["info"].endswith(" at round 2")


# -- fedring report ----------------------------------------------------------------------

def test_report_json_carries_the_stored_figures_and_nothing_on_other_rounds(
        tmp_path, capsys, monkeypatch):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id, figures = _store(url, personal=True)
    out = json.loads(_report(capsys, monkeypatch, 80, run_id, "--db", url, "--json"))
    table = {row["round"]: row for row in out["rounds"]}
    for rnd, row in table.items():
        stored = figures.get(rnd, {})
        for key in spread(_answers(1, personal=True)):
            assert row.get(key) == stored.get(key), (rnd, key)
    assert out["summary"]["federated_accuracy_personal_min"] == pytest.approx(0.66)


@pytest.mark.parametrize("personal", [False, True])
@pytest.mark.parametrize("columns", [80, 120])
def test_report_table_shows_the_figures_blank_where_not_evaluated(
        tmp_path, capsys, monkeypatch, personal, columns):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id, figures = _store(url, personal=personal)
    out = _report(capsys, monkeypatch, columns, run_id, "--db", url, "--out", str(tmp_path))
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= columns
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["round"])
    above, names = lines[header - 1].split(), lines[header].split()
    assert above == ["fed"] * 3 + ["pers"] * (3 if personal else 0)
    assert names[-len(above):] == ["acc", "p10", "min"] * (2 if personal else 1)
    assert "accepted" in names and "accuracy" in names
    keys = ["federated_accuracy", "federated_accuracy_p10", "federated_accuracy_min"]
    if personal:
        keys += ["federated_accuracy_personal", "federated_accuracy_personal_p10",
                 "federated_accuracy_personal_min"]
    rows = {int(line.split()[0]): line.split() for line in lines
            if re.match(r"^\s*\d+\s", line)}
    assert sorted(rows) == list(range(ROUNDS + 1))
    for rnd, cells in rows.items():
        if rnd in figures:  # the stored numbers, in the table's 4 decimals
            assert cells[-len(keys):] == [f"{figures[rnd][k]:.4f}" for k in keys], cells
        else:  # blank: the row ends with the central figures
            central = [f"{0.5 + rnd / 40:.4f}" if rnd else "0.1000"]
            if rnd and "loss" in names:  # left out at 80 columns with personal figures
                central.append(f"{1.0 / rnd:.4f}")
            assert cells[-len(central):] == central, cells


def test_report_at_80_columns_with_dp_and_personal_figures_drops_columns_not_numbers(
        tmp_path, capsys, monkeypatch):
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id, _ = _store(url, personal=True, dp=True)
    out = _report(capsys, monkeypatch, 80, run_id, "--db", url, "--out", str(tmp_path))
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["round"])
    # no update rejected or dropped, every round completed: those columns go first
    assert lines[header].split() == ["round", "accepted", "accuracy", "acc", "min", "acc",
                                     "p10", "min", "epsilon"]
    assert lines[header - 1].split() == ["fed", "fed", "pers", "pers", "pers"]
    rejects, _ = _store(f"sqlite:///{tmp_path / 'rejects.db'}", personal=True, dp=True,
                        rejected_in=3)  # a rejection: that column stays, a p10 goes instead
    out = _report(capsys, monkeypatch, 80, rejects, "--db", f"sqlite:///{tmp_path}/rejects.db",
                  "--out", str(tmp_path))
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    header = next(line for line in out.splitlines() if line.split()[:1] == ["round"])
    assert header.split() == ["round", "accepted", "rejected", "accuracy", "acc", "min",
                              "acc", "min", "epsilon"]
    wide = _report(capsys, monkeypatch, 400, run_id, "--db", url, "--out", str(tmp_path),
                   "--wide")
    lines = wide.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["round"])
    assert "…" not in wide
    below = {m.start(): m.group() for m in re.finditer(r"\S+", lines[header])}
    pairs = [(m.group(), below[m.start()]) for m in re.finditer(r"\S+", lines[header - 1])]
    assert len(pairs) == 15  # every federated figure: 2 x 6 accuracies, 2 losses, clients
    for pair in (("fed", "p90"), ("fed", "std"), ("pers", "loss"), ("fed", "clients"),
                 ("pers", "mean")):
        assert pair in pairs, pairs


def test_the_plot_has_the_spread_panel_with_the_stored_band(tmp_path, capsys, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    from simulations.report import _spread_panel

    url = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id, figures = _store(url, personal=True)
    with Store(url) as store:
        series = spread_series(store.rounds(run_id))
    assert series["federated_accuracy_p10"] == (
        list(EVALUATED), [figures[r]["federated_accuracy_p10"] for r in EVALUATED])
    assert series["federated_accuracy_personal_mean"][1] == [
        figures[r]["federated_accuracy_personal_mean"] for r in EVALUATED]
    assert series["accuracy"][0] == list(range(ROUNDS + 1))  # central: every round
    fig, ax = plt.subplots()
    _spread_panel(ax, series)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2  # the global model's and the personal models'
    ys = bands[0].get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(min(figures[r]["federated_accuracy_p10"] for r in EVALUATED))
    assert max(ys) == pytest.approx(max(figures[r]["federated_accuracy_p90"] for r in EVALUATED))
    means = next(line for line in ax.lines if line.get_label().startswith("federated mean"))
    assert list(means.get_ydata()) == [figures[r]["federated_accuracy_mean"]
                                       for r in EVALUATED]
    plt.close(fig)

    out = _report(capsys, monkeypatch, 120, run_id, "--db", url, "--out", str(tmp_path / "p"))
    png = tmp_path / "p" / f"{run_id}.png"
    assert f"plot: {png}" in out
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(head[16:20], "big") == 4 * 460  # four panels: the spread's is one


def test_no_spread_panel_without_a_federated_evaluation(tmp_path):
    from simulations.report import plot_run

    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with Store(url) as store:
        run_id = store.create_run(config={}, seed=0, name="plain")
        store.record_round(run_id, round=1, model_version=1, metrics={"accuracy": 0.5})
        assert spread_series(store.rounds(run_id)) == {}
        head = plot_run(store, run_id, tmp_path).read_bytes()[:24]
    assert int.from_bytes(head[16:20], "big") == 3 * 460


# -- --target-on -------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["central", "federated", "personal"])
def test_target_on_sets_driver_target_on(target):
    from server.driver_config import TARGET_METRICS

    assert tuple(TARGET_METRICS) == TARGETS
    own = ["--set", "aggregation.local_buffers=true"] if target == "personal" else []
    args = build_parser().parse_args(["simulate", "--target-accuracy", "0.9", "--target-on",
                                      target, "--set", "federation.evaluate_fraction=1", *own])
    config = _resolve(args)
    assert config["driver"]["target_on"] == target
    assert config["driver"]["target_accuracy"] == 0.9


def test_target_on_refuses_an_unknown_figure(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--target-on", "median"])
    assert "invalid choice: 'median'" in capsys.readouterr().err


def test_secure_evaluation_totals_show_without_a_spread(tmp_path):
    """Under federation.secure_evaluation the server learns only totals: the weighted
    accuracy shows alone, and the plot draws it without a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulations.report import _spread_panel

    totals = {"federated_accuracy": 0.8, "federated_loss": 0.6, "federated_clients": 4.0,
              "federated_clipped": 0.0}
    line = round_line(2, 2, {"accuracy": 0.81, "accepted": 4.0, **totals})
    assert line.endswith("0 dropped, fed acc 0.800")
    from simulations.tracking import spread_layout

    (chart,) = spread_layout(totals)["federated evaluation"].values()  # no margin chart
    assert chart == ["Multiline", ["^federated_accuracy$", "^federated_accuracy_min$",
                                   "^accuracy$"]]
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with Store(url) as store:
        run_id = store.create_run(config={}, seed=0, name="secure")
        store.record_round(run_id, round=1, model_version=1, metrics={"accuracy": 0.5})
        store.record_round(run_id, round=2, model_version=2, metrics={"accuracy": 0.81,
                                                                      **totals})
        series = spread_series(store.rounds(run_id))
    assert series["federated_accuracy"] == ([2], [0.8]) and "federated_accuracy_p10" not in series
    fig, ax = plt.subplots()
    _spread_panel(ax, series)
    assert not ax.collections
    assert [line.get_label() for line in ax.lines] == ["federated, example-weighted", "central"]
    plt.close(fig)
