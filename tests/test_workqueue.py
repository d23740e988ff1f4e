"""The work queue between the journal and the workers: however often a document is announced
(intake, the retry loop, recovery), it is waiting at most once and in one worker's hands at most."""

from __future__ import annotations

import asyncio

from chandrad.service.workqueue import WorkQueue


async def test_an_id_already_waiting_is_not_queued_a_second_time() -> None:
    queue = WorkQueue()
    assert queue.put("a") is True
    assert queue.put("a") is False
    assert queue.waiting == frozenset({"a"})
    assert await queue.take() == "a"
    queue.stop_workers(1)
    assert await queue.take() is None, "only one entry for 'a' was queued"


async def test_an_id_in_hand_is_not_queued_again_until_its_worker_is_done() -> None:
    queue = WorkQueue()
    queue.put("a")
    assert await queue.take() == "a"
    assert (queue.waiting, queue.active) == (frozenset(), frozenset({"a"}))
    assert queue.put("a") is False, "a retry announced while it is being worked on"
    queue.done("a")
    assert queue.active == frozenset()
    assert queue.put("a") is True
    assert await queue.take() == "a"


async def test_ids_are_handed_out_in_the_order_they_were_queued() -> None:
    queue = WorkQueue()
    for doc_id in ("c", "a", "b"):
        queue.put(doc_id)
    assert [await queue.take() for _ in range(3)] == ["c", "a", "b"]


async def test_stop_workers_ends_each_worker_after_the_ids_queued_before_it() -> None:
    queue = WorkQueue()
    queue.put("a")
    queue.stop_workers(3)
    taken: list[str] = []

    async def worker() -> None:
        while (doc_id := await queue.take()) is not None:
            taken.append(doc_id)
            queue.done(doc_id)

    await asyncio.gather(*(worker() for _ in range(3)))  # returns: each worker got its None
    assert taken == ["a"]
    assert queue.active == frozenset()


async def test_no_id_is_in_two_workers_hands_at_once_however_often_it_is_announced() -> None:
    queue = WorkQueue()
    in_hand: set[str] = set()
    overlaps: list[str] = []
    handled: list[str] = []

    async def worker() -> None:
        while (doc_id := await queue.take()) is not None:
            if doc_id in in_hand:
                overlaps.append(doc_id)
            in_hand.add(doc_id)
            for _ in range(3):  # work that yields to the others meanwhile
                await asyncio.sleep(0)
            in_hand.discard(doc_id)
            handled.append(doc_id)
            queue.done(doc_id)

    workers = [asyncio.create_task(worker()) for _ in range(4)]
    for round_no in range(50):
        for doc_id in ("a", "b", "c"):
            queue.put(doc_id)
        if round_no % 2:
            await asyncio.sleep(0)
    queue.stop_workers(len(workers))
    await asyncio.gather(*workers)
    assert overlaps == []
    assert set(handled) == {"a", "b", "c"}
    assert len(handled) > 3, "the ids were announced again after they were done, and handled again"
