"""The aggregation pipeline: per-update stages, one combine, post stages, a server optimizer.

    pipe = Pipeline(Validate(), Clip(1.0), Weight("examples"), WeightedMean(), FedAdam())
    agg = pipe.open_round(dim=layout.dim, version=7)
    for update in updates:
        verdict = agg.submit(update)      # accepted with a weight, or rejected with a reason
    params = pipe.apply(params, agg.finish())
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from math import sqrt
from typing import Any

import numpy as np
from scipy.linalg.blas import saxpy, sdot

from aggregation.combine import Combine, WeightedMean, WeightedSum, blas_on_calling_thread
from aggregation.server_opt import FedAvg, ServerOptimizer
from aggregation.stages import MAX_COUNT, Candidate, UpdateStage, Validate, Weight
from aggregation.staleness import Constant, StalenessFn
from aggregation.update import Rejected, Update, Verdict


class PostStage:
    """A stage applied to the combined delta before the server optimizer (e.g. noise)."""

    def apply(self, aggregate: np.ndarray, total_weight: float, count: int) -> np.ndarray:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


PreCombine = Callable[[list[Update]], list[Update]]


class Pipeline:
    """Stages in order: UpdateStage*, one Combine, PostStage*, optional ServerOptimizer.

    Without a server optimizer the aggregate is added as is (FedAvg with lr 1).

    ``client_radius``: the clients clip their own update to this distance around the
    previous aggregate before they send it (centered clipping's step that needs no other
    client's update; see ``aggregation.centered.clip_around``). The pipeline then keeps the
    aggregate it applies (after the post stages, before the server optimizer) as the next
    round's centre, in its checkpointed state, as it does for a combine that
    ``needs_center``.

    ``pre_combine``: a function that may rewrite a round's decoded updates before they
    enter the per-update stages (simulated omniscient attackers); the round source calls it
    once per aggregation with all the updates (None: updates go in one by one).

    ``center_decay`` d in (0, 1): the kept centre is the running average
    ``c <- d c + (1 - d) aggregate`` from 0 instead of the last aggregate; with d the
    server's heavy-ball momentum it is ``(1 - d)`` times the momentum buffer.
    """

    def __init__(self, *stages: UpdateStage | Combine | PostStage | ServerOptimizer,
                 client_radius: float | None = None,
                 pre_combine: PreCombine | None = None, center_decay: float = 0.0) -> None:
        if client_radius is not None and not client_radius > 0:
            raise ValueError(f"client_radius must be > 0, got {client_radius}")
        if not 0 <= center_decay < 1:
            raise ValueError(f"center_decay must be in [0, 1), got {center_decay}")
        self.center_decay = float(center_decay)
        self.client_radius = client_radius
        self.pre_combine = pre_combine
        self.center: np.ndarray | None = None  # the last applied aggregate, when kept
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
    def keeps_center(self) -> bool:
        """Whether the last applied aggregate is kept (as the next round's centre)."""
        return self.client_radius is not None or self.combine.needs_center

    def client_center(self, dim: int) -> tuple[np.ndarray, float] | None:
        """The centre and radius clients clip their update around (0 before any aggregate),
        or None when clients do not clip."""
        if self.client_radius is None:
            return None
        center = self.center if self.center is not None else np.zeros(dim, dtype=np.float32)
        return center, self.client_radius

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
        if self.keeps_center and self.center_decay:
            old = 0.0 if self.center is None else self.center.astype(np.float64)
            self.center = (self.center_decay * old + (1 - self.center_decay)
                           * np.asarray(aggregate, np.float64)).astype(np.float32)
        elif self.keeps_center:
            self.center = np.array(aggregate, dtype=np.float32)  # a copy
        return self.server_opt.step(params, aggregate)

    def state_dict(self) -> dict[str, Any]:
        """State of every stateful stage, for checkpoints."""
        state: dict[str, Any] = {"server_opt": self.server_opt.state_dict()}
        for i, stage in enumerate(self.post_stages):
            state[f"post{i}"] = stage.state_dict()
        if self.center is not None:
            state["center"] = self.center.copy()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        center = state.get("center")
        self.center = None if center is None else np.array(center, dtype=np.float32)
        self.server_opt.load_state_dict(state.get("server_opt", {}))
        for i, stage in enumerate(self.post_stages):
            stage.load_state_dict(state.get(f"post{i}", {}))


class RoundAggregation:
    """One aggregation: updates go in one at a time, the combined delta comes out.

    Stage settings are read when the aggregation opens. When the per-update stages are
    exactly ``Validate`` (then optionally ``Weight``), an update that passes every check
    takes a lean path: a few attribute compares, one BLAS pass for the norm, one into the
    combine, and its verdict. Anything unusual (a failed check, a numpy integer count, a
    duplicate) goes through the stages one by one, which decide and word the rejection, so
    both paths give the same verdicts. Either way a rejected update never touches the
    aggregate.
    """

    def __init__(self, pipeline: Pipeline, *, dim: int, version: int) -> None:
        self.pipeline = pipeline
        self.dim = dim
        self.version = version
        self.verdicts: list[Verdict] = []
        self._seen: set[str] = set()  # the clients accepted so far
        self.total_weight = 0.0
        self._finished = False
        self._result: np.ndarray | None = None
        blas_on_calling_thread()  # norms and sums of long vectors: one BLAS call each
        # Each round accumulates in its own combine, so rounds open at once stay apart.
        self.combine = copy.copy(pipeline.combine)
        self.combine.start(dim)
        self.combine.begin(version=version, center=pipeline.center)
        self._add = self.combine.add
        self._lean = _lean_plan(pipeline.update_stages, self.combine, dim, version)

    @property
    def num_accepted(self) -> int:
        return len(self._seen)

    @property
    def lean(self) -> bool:
        """Whether valid updates take the lean path (see the class docstring)."""
        return self._lean is not None

    def reject(self, client_id: str, reason: str, **fields: Any) -> Verdict:
        """Record a reply that could not even be decoded into an update."""
        verdict = Verdict(client_id=client_id, accepted=False, reason=reason, **fields)
        self.verdicts.append(verdict)
        return verdict

    def submit(self, update: Update) -> Verdict:
        """Run one update through the per-update stages and into the combine."""
        plan = self._lean
        if plan is None:
            return self._submit_staged(update)
        shape, lowest_base, version, norm_bound, by_examples, staleness_fn, running_sum = plan
        d, n, b, cid = update.delta, update.num_examples, update.base_version, update.client_id
        seen = self._seen
        if not (type(d) is np.ndarray and d.dtype is _F32 and d.shape == shape
                and type(n) is int and 0 < n <= MAX_COUNT
                and type(b) is int and lowest_base <= b <= version and cid not in seen):
            return self._submit_staged(update)
        # NaN and Inf propagate into the sum of squares, and so does a float32 overflow:
        # norm_bound is at most the largest float32, so one compare rejects all three.
        norm = sqrt(sdot(d, d))
        staleness = version - b
        weight = float(n) if by_examples else 1.0
        if staleness_fn is not None:
            weight *= staleness_fn(staleness)
        if not (norm <= norm_bound and weight > 0):
            return self._submit_staged(update, norm)
        if running_sum is not None and seen:  # WeightedMean.add after the first, inline
            saxpy(d, running_sum, shape[0], weight)
        else:
            self._add(d, weight)
        seen.add(cid)
        self.total_weight += weight
        # Verdict(cid, True, None, ...) without the Python-level __new__ of a NamedTuple
        verdict = _new_tuple(Verdict, (cid, True, None, n, b, staleness, norm, weight))
        self.verdicts.append(verdict)
        return verdict

    def _submit_staged(self, update: Update, norm: float | None = None) -> Verdict:
        """Every per-update stage in turn; ``norm``: the delta's L2 norm if already known."""
        staleness = (int(self.version) - int(update.base_version)
                     if isinstance(update.base_version, int | np.integer) else 0)
        c = Candidate(update=update, staleness=staleness, norm=norm)
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
        self._add(c.delta, c.weight)
        self._seen.add(update.client_id)
        self.total_weight += c.weight
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
            if self._lean is not None and self._lean[-1] is not None:
                # the lean path added into the running sum itself: the same weights, in order
                self.combine.total_weight = self.total_weight
            self._lean = None  # later submissions are rejected by the staged path
            self._result = self.combine.result() if self._seen else None
        return self._result


_F32 = np.dtype(np.float32)
_F32_MAX = float(np.finfo(np.float32).max)
_new_tuple = tuple.__new__
_LeanPlan = tuple[tuple[int], float, int, float, bool, StalenessFn | None, np.ndarray | None]


def _lean_plan(stages: list[UpdateStage], combine: Combine, dim: int,
               version: int) -> _LeanPlan | None:
    """The settings of the lean path, or None when the stages are not exactly
    ``Validate`` then optionally ``Weight`` (subclasses and other stages go staged)."""
    if not stages or type(stages[0]) is not Validate or len(stages) > 2 \
            or (len(stages) == 2 and type(stages[1]) is not Weight) \
            or type(dim) is not int or dim <= 0 or type(version) is not int:
        return None
    validate = stages[0]
    weight = stages[1] if len(stages) == 2 else None
    # base_version >= version - max_staleness is staleness <= max_staleness
    lowest_base = 0 if validate.max_staleness is None else max(
        0, version - validate.max_staleness)
    # A finite float32 sum of squares is at most the largest float32, and so is its root.
    norm_bound = _F32_MAX if validate.max_norm is None else min(validate.max_norm, _F32_MAX)
    by_examples = weight is not None and weight.by == "examples"
    staleness_fn = None if weight is None or type(weight.staleness) is Constant \
        else weight.staleness
    # A weighted mean or sum is added into in place by submit (see WeightedMean).
    running_sum = combine.running_sum if type(combine) in (WeightedMean, WeightedSum) \
        else None
    return (dim,), lowest_base, version, norm_bound, by_examples, staleness_fn, running_sum


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, int | np.integer) and not isinstance(value, bool) \
        else None

