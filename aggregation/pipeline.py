"""The aggregation pipeline: per-update stages, one combine, post stages, a server optimizer.

    pipe = Pipeline(Validate(), Clip(1.0), Weight("examples"), WeightedMean(), FedAdam())
    agg = pipe.open_round(dim=layout.dim, version=7)
    for update in updates:
        verdict = agg.submit(update)      # accepted with a weight, or rejected with a reason
    params = pipe.apply(params, agg.finish())
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from aggregation.combine import Combine, blas_on_calling_thread
from aggregation.server_opt import FedAvg, ServerOptimizer
from aggregation.stages import Candidate, UpdateStage
from aggregation.update import Rejected, Update, Verdict


class PostStage:
    """A stage applied to the combined delta before the server optimizer (e.g. noise)."""

    def apply(self, aggregate: np.ndarray, total_weight: float, count: int) -> np.ndarray:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class Pipeline:
    """Stages in order: UpdateStage*, one Combine, PostStage*, optional ServerOptimizer.

    Without a server optimizer the aggregate is added as is (FedAvg with lr 1).
    """

    def __init__(self, *stages: UpdateStage | Combine | PostStage | ServerOptimizer) -> None:
        self.update_stages: list[UpdateStage] = []
        self.post_stages: list[PostStage] = []
        combines = [s for s in stages if isinstance(s, Combine)]
        if len(combines) != 1:
            raise ValueError(f"a pipeline needs exactly one combine stage, got {len(combines)}")
        self.combine = combines[0]
        self.server_opt: ServerOptimizer = FedAvg()
        seen_combine = False
        for i, stage in enumerate(stages):
            if isinstance(stage, UpdateStage):
                if seen_combine:
                    raise ValueError(f"per-update stage {stage!r} must come before the combine")
                self.update_stages.append(stage)
            elif isinstance(stage, Combine):
                seen_combine = True
            elif isinstance(stage, PostStage):
                if not seen_combine:
                    raise ValueError(f"post stage {stage!r} must come after the combine")
                self.post_stages.append(stage)
            elif isinstance(stage, ServerOptimizer):
                if i != len(stages) - 1:
                    raise ValueError("the server optimizer must be the last stage")
                self.server_opt = stage
            else:
                raise TypeError(f"not a pipeline stage: {stage!r}")

    @property
    def linear(self) -> bool:
        """True when the combine is a weighted sum/mean (secure aggregation and rings need it)."""
        return self.combine.linear

    def open_round(self, *, dim: int, version: int) -> RoundAggregation:
        """Start aggregating updates against model ``version`` of length ``dim``."""
        return RoundAggregation(self, dim=dim, version=version)

    def apply(self, params: np.ndarray, aggregate: np.ndarray | None, *,
              total_weight: float = 0.0, count: int = 0) -> np.ndarray:
        """Post stages then the server optimizer; params unchanged if nothing was aggregated."""
        if aggregate is None:
            return params
        for stage in self.post_stages:
            aggregate = stage.apply(aggregate, total_weight, count)
        return self.server_opt.step(params, aggregate)

    def state_dict(self) -> dict[str, Any]:
        """State of every stateful stage, for checkpoints."""
        state: dict[str, Any] = {"server_opt": self.server_opt.state_dict()}
        for i, stage in enumerate(self.post_stages):
            state[f"post{i}"] = stage.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server_opt.load_state_dict(state.get("server_opt", {}))
        for i, stage in enumerate(self.post_stages):
            stage.load_state_dict(state.get(f"post{i}", {}))


class RoundAggregation:
    """One aggregation: updates go in one at a time, the combined delta comes out."""

    def __init__(self, pipeline: Pipeline, *, dim: int, version: int) -> None:
        self.pipeline = pipeline
        self.dim = dim
        self.version = version
        self.verdicts: list[Verdict] = []
        self._seen: set[str] = set()
        self.total_weight = 0.0
        self.num_accepted = 0
        self._finished = False
        self._result: np.ndarray | None = None
        blas_on_calling_thread()  # norms and sums of long vectors: one BLAS call each
        # Each round accumulates in its own combine, so rounds open at once stay apart.
        self.combine = copy.copy(pipeline.combine)
        self.combine.start(dim)

    def reject(self, client_id: str, reason: str, **fields: Any) -> Verdict:
        """Record a reply that could not even be decoded into an update."""
        verdict = Verdict(client_id=client_id, accepted=False, reason=reason, **fields)
        self.verdicts.append(verdict)
        return verdict

    def submit(self, update: Update) -> Verdict:
        """Run one update through the per-update stages and into the combine."""
        staleness = (int(self.version) - int(update.base_version)
                     if isinstance(update.base_version, int | np.integer) else 0)
        c = Candidate(update=update, staleness=staleness)
        try:
            if self._finished:
                raise Rejected("this aggregation is already finished")
            if update.client_id in self._seen:
                raise Rejected(f"duplicate update from client {update.client_id} in this "
                               "aggregation")
            for stage in self.pipeline.update_stages:
                stage.process(c, self.dim, self.version)
        except Rejected as exc:
            return self.reject(update.client_id, exc.reason, num_examples=_int_or_none(
                update.num_examples), base_version=_int_or_none(update.base_version),
                staleness=c.staleness, norm=c.norm)
        self._seen.add(update.client_id)
        self.combine.add(c.delta, c.weight)
        self.total_weight += c.weight
        self.num_accepted += 1
        verdict = Verdict(client_id=update.client_id, accepted=True,
                          num_examples=int(update.num_examples),
                          base_version=int(update.base_version), staleness=c.staleness,
                          norm=c.l2_norm(), weight=c.weight)
        self.verdicts.append(verdict)
        return verdict

    def finish(self) -> np.ndarray | None:
        """The combined delta of the accepted updates (None if none was accepted)."""
        if not self._finished:
            self._finished = True
            self._result = self.combine.result() if self.num_accepted else None
        return self._result


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int | np.integer) and not isinstance(value, bool) \
        else None

