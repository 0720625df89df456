"""``flower_compat.reply_message``: the reply Flower's ``Message(content, reply_to=...)``
makes, field for field, without its argument parsing."""

from __future__ import annotations

import time

import pytest
from flwr.app import ConfigRecord, Message, Metadata, MetricRecord, RecordDict

from client.protocol.flower_compat import reply_message


def _request(ttl: float = 600.0, created_ago: float = 5.0) -> Message:
    sent = Metadata(run_id=7, message_id="m12", src_node_id=0, dst_node_id=42,
                    reply_to_message_id="", group_id="3", created_at=time.time() - created_ago,
                    ttl=ttl, message_type="train", src_task_id=5, dst_task_id=9)
    return Message(RecordDict({"config": ConfigRecord({"a": 1})}), metadata=sent)


@pytest.mark.parametrize("ttl, created_ago", [(600.0, 5.0), (43_200.0, 0.0), (30.0, 29.5)])
def test_the_reply_has_every_field_flowers_constructor_sets(ttl, created_ago):
    request = _request(ttl, created_ago)
    content = RecordDict({"metrics": MetricRecord({"loss": 0.5})})
    want = Message(content, reply_to=request)
    got = reply_message(content, request)
    assert type(got) is Message and got.content is content and not got.has_error()
    assert list(got.__dict__) == list(want.__dict__)
    mine, flowers = dict(got.metadata.__dict__), dict(want.metadata.__dict__)
    assert list(mine) == list(flowers)  # the same fields, in the same order
    for key in ("_created_at", "_ttl"):  # made a moment apart
        assert mine.pop(key) == pytest.approx(flowers.pop(key), abs=0.05)
    assert mine == flowers
    # the reply expires when its request does, as Flower's does
    assert got.metadata.created_at + got.metadata.ttl == pytest.approx(
        request.metadata.created_at + request.metadata.ttl, abs=1e-6)
    assert got.metadata.reply_to_message_id == "m12" and got.metadata.dst_node_id == 0
    assert got.metadata.src_node_id == 42 and got.metadata.dst_task_id == 5


def test_content_of_another_type_goes_through_flowers_checks():
    with pytest.raises(TypeError):
        reply_message({"metrics": MetricRecord({"loss": 0.5})}, _request())  # type: ignore[arg-type]
