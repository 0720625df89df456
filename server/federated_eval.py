"""Federated evaluation: sampled clients measure the current model on their own held-out
split and reply their figures.

Every ``federation.evaluate_every`` rounds (and after the last), a share
``federation.evaluate_fraction`` of the connected nodes is drawn (in secret under DP, like
training cohorts; from the seed otherwise) and sent the model in a Flower "evaluate"
message. Each reply is checked as a training reply is: it must answer a message sent to
that node, an error reply is rejected with its reason, and its figures must read
(``client.protocol.evaluation.read_evaluation``); a node silent past the deadline, or one
the SuperLink answers for as gone (``server.settle.unreachable``), is recorded as
dropped. The round's figures are the spread of the accepted answers (``server.spread``),
or under ``federation.secure_evaluation`` only their totals, summed securely
(``server.secure_evaluation``).
"""

from __future__ import annotations

from flwr.app import Message, MessageType, MetricRecord, RecordDict

from client.protocol.errors import WireError
from client.protocol.evaluation import evaluate_config, read_evaluation
from client.protocol.keys import RecordName
from server.cohort import evaluation_cohort
from server.grid_io import push_and_collect_in_order
from server.rounds import RunContext
from server.settle import settle, unreachable
from server.spread import spread
from server.store import EvalRecord


class FederatedEvaluation:
    """The run's federated evaluation rounds (a run with a central model)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.fed = ctx.fed

    def due(self, rnd: int) -> bool:
        """Whether round ``rnd`` ends with a federated evaluation."""
        return self.fed.evaluate_fraction > 0 and (rnd % self.fed.evaluate_every == 0
                                                   or rnd == self.fed.rounds)

    def cohort(self, rnd: int) -> list[int]:
        """The nodes asked to evaluate after round ``rnd``."""
        ctx = self.ctx
        return evaluation_cohort(ctx.grid.get_node_ids(), fraction=self.fed.evaluate_fraction,
                                 seed=ctx.seed, rnd=rnd, dp=ctx.dp)

    def evaluate(self, run_id: str, rnd: int) -> tuple[list[EvalRecord], dict[str, float]]:
        """Round ``rnd``'s evaluation: each client's record and the round's figures ({}
        when no answer was accepted)."""
        if self.fed.secure_evaluation:  # only the totals reach the server
            from server.secure_evaluation import secure_evaluate

            return secure_evaluate(self.ctx, run_id, rnd, self.cohort(rnd))
        records = self.run(run_id, rnd)
        return records, spread(records)

    def run(self, run_id: str, rnd: int) -> list[EvalRecord]:
        """Send the current model to round ``rnd``'s evaluation cohort; each client's
        record: accepted with its figures, rejected with the reason, or dropped."""
        ctx = self.ctx
        cohort = self.cohort(rnd)
        config = evaluate_config(rnd, ctx.state.version, ctx.task_json, ctx.seed,
                                 local_buffers=ctx.scenario.aggregation.local_buffers)
        content = RecordDict({RecordName.ARRAYS: ctx.model_record(), RecordName.CONFIG: config})
        messages = [Message(content, node, MessageType.EVALUATE, group_id=f"eval-{rnd}")
                    for node in cohort]
        sent: dict[str, tuple[int, None]] = {}
        records: list[EvalRecord] = []

        def consume(reply: Message) -> None:
            client_id, _, problem = settle(sent, reply, None)
            gone = None if problem is not None else unreachable(reply, int(client_id))
            if gone is not None:  # the SuperLink's word: the node is gone
                records.append(EvalRecord(client_id=client_id, fate="dropped", reason=gone))
                return
            try:
                if problem is not None:
                    raise WireError(problem)
                records.append(_accepted(client_id, reply))
            except WireError as exc:
                ctx.reporter.message(f"round {rnd}: rejected the evaluation of client "
                                     f"{client_id}: {exc}")
                records.append(EvalRecord(client_id=client_id, fate="rejected",
                                          reason=str(exc)))

        deadline = ctx.driver_config.deadline(self.fed.round_timeout_s)
        _, missing = push_and_collect_in_order(
            ctx.grid, messages, timeout=deadline, poll=self.fed.poll_s, on_reply=consume,
            on_push=lambda pushed: sent.update({i: (n, None) for i, n in pushed.items()}))
        records += [EvalRecord(client_id=str(node), fate="dropped",
                               reason=f"late: no reply within {deadline:g} s")
                    for node in missing]
        return records


def _accepted(client_id: str, reply: Message) -> EvalRecord:
    """The accepted record of an evaluate reply; WireError with the reason otherwise."""
    if reply.has_error():
        raise WireError(f"client error {reply.error.code}: {reply.error.reason}")
    kind = reply.metadata.message_type
    if kind.split(".")[0] != MessageType.EVALUATE:
        raise WireError(f"reply has message type {kind!r}, expected an 'evaluate' reply")
    metric_records = [v for v in reply.content.values() if isinstance(v, MetricRecord)]
    if len(metric_records) != 1:
        raise WireError(f"evaluate reply has {len(metric_records)} metric records, expected 1")
    ev = read_evaluation(metric_records[0])
    return EvalRecord(client_id=client_id, fate="accepted", num_examples=ev.num_examples,
                      loss=ev.loss, accuracy=ev.accuracy, loss_personal=ev.loss_personal,
                      accuracy_personal=ev.accuracy_personal)
