"""Look at a stored run: the per-round table, each update's fate and reason, and a PNG of
accuracy and loss per round, with the spread of the clients' own accuracies on rounds that
evaluated on them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from server.spread import COUNT, LOSS, PERSONAL, STATS, accuracy_key
from server.store import RoundInfo, RunInfo, Store, UpdateRecord
from server.store.models import SEMI_HONEST

SECAGG_COLUMNS = {"advertise_keys": "drop@keys", "share_keys": "drop@shares",
                  "masked_input": "drop@input", "consistency_check": "drop@check",
                  "unmasking": "drop@unmask"}  # drop@check: malicious-mode sessions only
# the federated evaluation's columns: the global model's, then the clients' own models'
FEDERATED_COLUMNS = tuple(accuracy_key(stat, personal=personal)
                          for personal in (False, True) for stat in (None, "p10", "min"))
# what ``fedring report`` shows without --wide: readable at 80 columns
ESSENTIAL_COLUMNS = ("round", "status", "accepted", "rejected", "dropped", "accuracy", "loss",
                     *FEDERATED_COLUMNS, "epsilon", "noise_to_signal", "secagg_clipped")
# short or two-line headers for the figures whose names are too wide for a table
HEADERS = {"noise_to_signal": "noise/s",
           COUNT: "fed\nclients", LOSS: "fed\nloss", LOSS + PERSONAL: "pers\nloss",
           **{accuracy_key(stat, personal=personal): f"{'pers' if personal else 'fed'}\n"
              f"{stat or 'acc'}" for personal in (False, True) for stat in (None, *STATS)}}
# essential columns left out, in turn, when the table is wider than the terminal: first
# those with the same value on every round (e.g. no update ever rejected), then these;
# what still does not fit goes on in a second table
NARROW_DROPS = ("loss", accuracy_key("p10", personal=False), accuracy_key("p10", personal=True),
                accuracy_key("min", personal=True), accuracy_key("min", personal=False))
CONSTANT_DROPS = ("status", "rejected", "dropped")
RUN_COLUMNS = ("run", "name", "status", "rounds", "accuracy", "created", "differs")
# what ``fedring report --updates`` shows of each update (its JSON carries every field)
UPDATE_COLUMNS = ("round", "client", "fate", "weight", "norm", "staleness", "reason")


def round_table(rounds: list[RoundInfo],
                secagg: list[dict[str, Any]] | None = None) -> list[dict[str, object]]:
    """One row per round with the metrics and the fate counts of its updates.

    With the run's secure rounds (``Store.secagg_rounds``), each such round also shows
    k/t, the survivors, the dropouts of every protocol stage and the threat model the
    session held against (``security``: "semi_honest" or "malicious").
    """
    secure = {s["round"]: s for s in secagg or []}
    rows = []
    for r in rounds:
        row: dict[str, object] = {"round": r.round, "version": r.model_version,
                                  "status": r.status, "sampled": r.num_sampled,
                                  "accepted": r.num_accepted, "rejected": r.num_rejected,
                                  "dropped": r.num_dropped, "wall_s": round(r.wall_s, 3)}
        if r.round in secure:
            s = secure[r.round]
            row["k/t"] = f"{s['k']}/{s['t']}"
            row["security"] = s.get("security") or SEMI_HONEST
            row["survivors"] = s["num_survivors"]
            for stage, column in SECAGG_COLUMNS.items():
                if stage in s["dropouts"] or stage != "consistency_check":
                    row[column] = len(s["dropouts"].get(stage, ()))
        for key in sorted(r.metrics):
            value = r.metrics[key]  # bytes on the wire are whole numbers
            row[key] = int(value) if key.startswith("bytes_") and isinstance(value, float) \
                else value
        rows.append(row)
    return rows


def report_columns(rows: list[dict[str, object]], *, wide: bool) -> list[str]:
    """The columns of a run's round table: every one with ``wide``, else the essential ones
    that the run has (a federated column: some round evaluated on the clients)."""
    present = list(dict.fromkeys(k for row in rows for k in row))
    return present if wide else [c for c in ESSENTIAL_COLUMNS if c in present]


def fit_columns(columns: list[str], rows: list[dict[str, object]], width_of: Any,
                width: int) -> list[str]:
    """``columns`` less those of :data:`CONSTANT_DROPS` that hold one value on every row,
    then those of :data:`NARROW_DROPS`, in turn, until ``width_of(columns)`` (the table's
    rendered width) fits in ``width``."""
    columns = list(columns)
    constant = [c for c in CONSTANT_DROPS if len({str(row.get(c)) for row in rows}) == 1]
    for drop in (*constant, *NARROW_DROPS):
        if width_of(columns) <= width:
            break
        if drop in columns:
            columns.remove(drop)
    return columns


def column_groups(columns: list[str], width_of: Any, width: int) -> list[list[str]]:
    """``columns`` cut into groups whose tables (``width_of(group)`` wide) each fit in
    ``width``, in order; every group after the first starts again with the first column
    (the round), so each table reads on its own. A column too wide for any group is a
    group alone with the first."""
    if not columns:
        return []
    key, groups = columns[0], [[columns[0]]]
    for column in columns[1:]:
        if len(groups[-1]) > 1 and width_of([*groups[-1], column]) > width:
            groups.append([key])
        groups[-1].append(column)
    return groups


def update_rows(updates: list[tuple[int, UpdateRecord]]) -> list[dict[str, Any]]:
    """One row per update (``Store.updates``): its round and every field of its record."""
    return [{"round": rnd, "client": u.client_id, **{k: v for k, v in asdict(u).items()
                                                      if k != "client_id"}}
            for rnd, u in updates]


def report_json(info: RunInfo, rounds: list[dict[str, object]], privacy: str | None,
                updates: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``fedring report --json``: the run (its row, the count of training rounds as
    ``num_rounds``), its rounds' rows, the privacy and audit lines, the stored summary,
    and each update's row with ``--updates``."""
    run = run_row(info)
    run["num_rounds"] = run.pop("rounds")
    out = {"run": run, "rounds": rounds, "privacy": privacy, "audit": audit_line(info.summary),
           "summary": info.summary}
    if updates is not None:
        out["updates"] = updates
    return out


def run_row(run: RunInfo) -> dict[str, Any]:
    """A run as ``fedring runs`` lists it (and as ``--json`` prints it): with the scenario
    it was run from, the keys set over it (``overrides``) and those in short (``differs``)."""
    summary = run.summary or {}
    return {"run": run.run_id, "name": run.name or "", "status": run.status,
            "rounds": run.num_rounds, "accuracy": summary.get("final_accuracy"),
            "created": run.created_at.isoformat(timespec="seconds"),
            "differs": differs(run.config, run.name), "seed": run.seed,
            "finished": run.finished_at.isoformat(timespec="seconds")
            if run.finished_at else None, "stop_reason": summary.get("stop_reason"),
            "scenario": run.config.get("scenario"),
            "overrides": dict(run.config.get("overrides") or {})}


DIFFERS_KEYS = {"task.module": "task", "federation.clients": "clients",
                "federation.rounds": "rounds", "seed": "seed"}  # shown first, by these names


def differs(config: Mapping[str, Any], name: str | None) -> str:
    """What a run changed of the scenario it was run from, in short: the task module,
    --clients/--rounds/--seed, the other overrides, then that scenario where the run's
    name is not its own (``task=my_task.py rounds=3 aggregation.combine=median``)."""
    overrides = dict(config.get("overrides") or {})
    parts = []
    for key, short in DIFFERS_KEYS.items():
        if key in overrides:
            value = overrides.pop(key)
            if key == "task.module" and isinstance(value, str) and value.endswith(".py"):
                value = Path(value).name  # a path: its file name
            parts.append(f"{short}={_value_text(value)}")
    parts += [f"{key}={_value_text(value)}" for key, value in overrides.items()]
    scenario = config.get("scenario")
    if scenario and name != Path(scenario).stem:
        parts.append(f"scenario={Path(scenario).name}")
    return " ".join(parts)


def _value_text(value: object) -> str:
    """An override's value as it would be typed after ``--set key=``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value, default=str)


def ledger_relations(entry: Mapping[str, Any]) -> dict[str, str]:
    """Each figure of a ledger entry with the relation stored beside it (none for rows
    recorded before relations were)."""
    out = {"epsilon": entry.get("relation"),
           "epsilon_replace_one": "replace-one" if entry.get("epsilon_replace_one")
           is not None else None,
           "epsilon_model": entry.get("relation_model")}
    return {key: value for key, value in out.items() if value}


def privacy_summary(ledger: list[dict[str, Any]]) -> str | None:
    """One line on what a run's privacy ledger says after its last round, naming whom each
    epsilon protects against and the neighbouring relation stored with it; None without
    a ledger."""
    if not ledger:
        return None
    last = ledger[-1]
    relations = ledger_relations(last)
    against = last.get("protects_against") or "unrecorded adversary"

    def figure(key: str) -> str:
        relation = relations.get(key, "relation not recorded")
        return f"{key} {last[key]:.4g} ({relation})"

    line = f"{last['mode']} DP after round {last['round']}: {figure('epsilon')}"
    if last.get("epsilon_replace_one") is not None:
        line += f", {figure('epsilon_replace_one')}"
    line += f" against the {against}"
    if last.get("epsilon_model") is not None:
        line += f", {figure('epsilon_model')} against the released model"
    return f"{line}; delta {last['delta']:g}, {last['accountant']}"


def audit_line(summary: dict[str, Any] | None) -> str | None:
    """The canary audit's estimate (``[audit]``), its lower bound, the exact epsilon it is
    judged against and the verdict, beside the accountant's epsilon; None when the run
    had no audit."""
    summary = summary or {}
    if summary.get("epsilon_audit") is None:
        return None
    line = (f"privacy audit: epsilon_audit {summary['epsilon_audit']:.4g} (one-shot canary "
            f"estimate, {summary.get('audit_canaries')} canaries, delta "
            f"{summary.get('audit_delta'):g})")
    if summary.get("epsilon_audit_lower") is not None:
        line += (f", {summary.get('audit_confidence', 0.95):.0%} lower bound "
                 f"{summary['epsilon_audit_lower']:.4g}")
    if summary.get("epsilon_audit_reference") is not None:
        verdict = ("FLAGGED: the lower bound exceeds it" if summary.get("audit_flag")
                   else "not flagged")
        line += (f"; exact epsilon for a canary {summary['epsilon_audit_reference']:.4g} "
                 f"(PLD, {summary.get('audit_relation')}): {verdict}")
    if summary.get("epsilon") is not None:
        line += f"; the accountant's epsilon {summary['epsilon']:.4g}"
    return line


def spread_series(rounds: list[RoundInfo]) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (rounds, values)}`` for the spread panel: the clients' mean accuracy, its
    10th and 90th percentiles and the weighted mean, of the global model and of the
    clients' own, on the rounds that evaluated on the clients; the central accuracy on
    those and every other round that has it. {} when no round evaluated on the clients."""
    keys = [accuracy_key(stat, personal=personal) for personal in (False, True)
            for stat in (None, "mean", "p10", "p90")]
    out = {}
    for key in [*keys, "accuracy"]:
        points = [(r.round, float(r.metrics[key])) for r in rounds
                  if r.metrics.get(key) is not None]
        if points:
            out[key] = ([x for x, _ in points], [y for _, y in points])
    return out if accuracy_key() in out else {}


def _spread_panel(ax: Any, spread: dict[str, tuple[list[int], list[float]]]) -> None:
    """The clients' accuracy per round: the mean over clients with its 10th-90th
    percentile band, the personal models' likewise, and the central accuracy beside."""
    for personal, label, color in ((False, "federated", "tab:blue"),
                                   (True, "personal", "tab:green")):
        mean, low, high, weighted = (accuracy_key(stat, personal=personal) for stat in
                                     ("mean", "p10", "p90", None))
        if mean in spread:  # none under secure evaluation: only the totals are known
            ax.plot(*spread[mean], marker="o", color=color, label=f"{label} mean over clients")
        if weighted in spread:
            ax.plot(*spread[weighted], marker="x", linestyle=":", color=color,
                    label=f"{label}, example-weighted")
        if low in spread and high in spread:
            ax.fill_between(spread[low][0], spread[low][1], spread[high][1], color=color,
                            alpha=0.2, label=f"{label} 10th-90th percentile")
    if "accuracy" in spread:
        ax.plot(*spread["accuracy"], marker=".", color="black", linestyle="--",
                label="central")
    ax.set(title="accuracy across clients", xlabel="round", ylim=(0, 1))
    ax.legend(fontsize="small")


#: Runs of up to this many rounds are plotted with markers and a bar per round.
MARKED_ROUNDS = 200


def plot_run(store: Store, run_id: str, out_dir: Path) -> Path:
    """Write ``<run_id>.png``: accuracy, loss and update fates per round, the spread of the
    clients' accuracies where rounds evaluated on them, privacy spent under DP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = store.rounds(run_id)
    if not rounds:
        raise ValueError(f"run {run_id} has no recorded rounds")
    xs = [r.round for r in rounds]

    def series(key: str) -> list[float]:
        return [float(r.metrics.get(key, float("nan")) or float("nan")) for r in rounds]

    ledger = store.privacy_ledger(run_id)
    spread = spread_series(rounds)
    panels = 3 + bool(spread) + bool(ledger)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4), constrained_layout=True)
    few = len(rounds) <= MARKED_ROUNDS  # markers and bars; else lines and areas (fast)
    axes[0].plot(xs, series("accuracy"), marker="o" if few else None)
    axes[0].set(title="test accuracy", xlabel="round", ylim=(0, 1))
    axes[1].plot(xs, series("loss"), marker="o" if few else None, label="test loss")
    if any(r.metrics.get("train_loss") is not None for r in rounds):
        axes[1].plot(xs, series("train_loss"), marker="." if few else None, label="train loss")
    axes[1].set(title="loss", xlabel="round")
    axes[1].legend()
    fates = {"accepted": [r.num_accepted for r in rounds],
             "rejected": [r.num_rejected for r in rounds],
             "dropped": [r.num_dropped for r in rounds]}
    if few:
        bottom = [0] * len(xs)
        for label, counts in fates.items():
            axes[2].bar(xs, counts, bottom=bottom, label=label)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    else:  # one patch per fate, not one per round and fate
        axes[2].stackplot(xs, *fates.values(), labels=list(fates), step="mid")
    axes[2].set(title="updates", xlabel="round")
    axes[2].legend()
    info = store.get_run(run_id)
    if spread:
        _spread_panel(axes[3], spread)
    if ledger:
        rounds_ = [e["round"] for e in ledger]
        against = ledger[-1].get("protects_against") or "unrecorded adversary"
        relations = ledger_relations(ledger[-1])
        for key, marker, party in (("epsilon", "o", against),
                                   ("epsilon_replace_one", "s", against),
                                   ("epsilon_model", ".", "released model")):
            if any(e.get(key) is not None for e in ledger):
                relation = relations.get(key, "relation not recorded")
                axes[-1].plot(rounds_, [e.get(key) for e in ledger], marker=marker,
                             label=f"{key}: the {party} ({relation})")
        axes[-1].set(title=f"privacy spent (delta={ledger[-1]['delta']:g}, "
                          f"{ledger[-1]['mode']} DP)", xlabel="round", ylabel="epsilon")
        axes[-1].legend()
    fig.suptitle(f"run {run_id} ({info.name})")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{run_id}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
