"""The documents due for processing, between the journal and the workers.

The journal is the authority on what is queued; this holds only the few ids the workers are about
to take (``depth``), and which ids are waiting or in hand, so that no document is handed to two
workers at once however many times it is announced (intake, the retry loop, recovery).
"""

from __future__ import annotations

import asyncio


class WorkQueue:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._waiting: set[str] = set()
        self._active: set[str] = set()

    def put(self, doc_id: str) -> bool:
        """Queue ``doc_id`` unless it is waiting or in hand already: whether it was queued."""
        if doc_id in self._waiting or doc_id in self._active:
            return False
        self._waiting.add(doc_id)
        self._queue.put_nowait(doc_id)
        return True

    async def take(self) -> str | None:
        """The next document for a worker, now in hand; None tells the worker to stop."""
        doc_id = await self._queue.get()
        if doc_id is not None:
            self._waiting.discard(doc_id)
            self._active.add(doc_id)
        return doc_id

    def done(self, doc_id: str) -> None:
        self._active.discard(doc_id)

    def stop_workers(self, count: int) -> None:
        for _ in range(count):
            self._queue.put_nowait(None)

    @property
    def waiting(self) -> frozenset[str]:
        return frozenset(self._waiting)

    @property
    def active(self) -> frozenset[str]:
        return frozenset(self._active)
