"""A synchronous round under secure aggregation: the cohort's SecAgg+ session
(``server.secagg_session``); the server learns only the cohort's sum. The run's keys
advertised ahead (``privacy.secagg.ahead``) are kept here between rounds, in memory."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from privacy.secagg.ahead import PendingAdverts
from server.rounds import RoundResult, RunContext
from server.secagg_session import TrainStart
from server.secure_aggregation import SecureAggregation, secure_result
from server.sync_rounds import Collector


class SecureSum(Collector):
    """A synchronous round's SecAgg+ session: the server learns only the cohort's sum."""

    def __init__(self, ctx: RunContext, secure: SecureAggregation) -> None:
        self.ctx = ctx
        self.secure = secure
        self.pending = PendingAdverts()  # the next round's key advertisements, by node

    @contextmanager
    def session(self) -> Iterator[None]:
        self.secure.prepare(self.ctx)
        yield

    def collect(self, run_id: str, rnd: int, cohort: list[int]) -> RoundResult:
        ctx, secure, dim = self.ctx, self.secure, self.ctx.layout.dim
        start = TrainStart(ctx.model_record(), ctx.train_config(rnd), dim,
                           sparse=secure.pattern(run_id, rnd, dim))
        session = secure.session(ctx, run_id, dp=ctx.dp, timeout=ctx.fed.round_timeout_s)
        outcome = session.run(cohort, rnd, start,
                              on_reply=lambda i: ctx.reporter.client_done(rnd, i, len(cohort)),
                              pending=self.pending)
        clock = ctx.clock
        if clock.simulated:  # the slowest participant's training
            clock.advance_to(max([clock.outcome(n).end for n in cohort] or [clock.now()]))
        return secure_result(outcome, secure.aggregate(outcome, ctx.dp, reporter=ctx.reporter),
                             num_sampled=len(cohort), metrics={})
