"""A Grid that keeps every reply the server pulls, for tests that inspect what it saw."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from flwr.app import Message


class RecordsReplies:
    """Mixin before a Grid class: every reply its ``pull_messages`` yields is kept in
    ``replies``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: list[Message] = []

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        for reply in super().pull_messages(message_ids):  # type: ignore[misc]
            self.replies.append(reply)
            yield reply
