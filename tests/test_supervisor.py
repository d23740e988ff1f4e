"""Supervision rules that need an engine crash caused by one particular page.

No input reliably crashes the real vLLM engine, so these tests use ``CrashingEngine``, a test
double for it: it dies (every page in flight gets ``EngineDied``) whenever a page listed as poison
is being read, or once on request. Crashes of the real engine (kill -9 of its EngineCore) are
tested in test_vllm.py and on the GPU (bench/soak_gpu.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import structlog.testing
from PIL import Image

from chandrad.config import EngineSettings
from chandrad.engine.base import PageRequest, PageResult
from chandrad.engine.replicas import ReplicaSet
from chandrad.engine.supervisor import SupervisedEngine
from chandrad.engine.vllm import EngineStats
from chandrad.errors import EngineDied, PermanentError, ReplicaDown

PAGE = Image.new("RGB", (8, 8), "white")


@dataclass
class World:
    poison: set[tuple[str, int]] = field(default_factory=set)
    crash_once: bool = False
    restart_seconds: float = 0.0
    slow: set[tuple[str, int]] = field(default_factory=set)  # pages read in 0.5 s instead of 0.05
    starts: int = 0
    abandoned_starts: int = 0  # starts cancelled midway that had cleaned up after themselves
    pages_read: int = 0
    concurrency_by_start: dict[int, int] = field(default_factory=dict)


class CrashingEngine:
    """Test double for the vLLM engine (see the module docstring)."""

    name = "vllm"
    model = "crashing-double"

    def __init__(self, world: World) -> None:
        self.world = world
        self.stats = EngineStats()
        self.alive = True
        self.reading: set[tuple[str, int]] = set()

    async def start(self) -> None:
        self.world.starts += 1
        self.generation = self.world.starts
        if self.generation > 1:
            try:
                await asyncio.sleep(self.world.restart_seconds)
            except asyncio.CancelledError:
                # Like VllmEngine.start: ending a load nobody wants takes a moment (ending its process).
                await asyncio.sleep(0.05)
                self.world.abandoned_starts += 1
                raise

    async def ocr(self, request: PageRequest) -> PageResult:
        key = (request.doc_id, request.page_no)
        self.reading.add(key)
        peak = self.world.concurrency_by_start
        peak[self.generation] = max(peak.get(self.generation, 0), len(self.reading))
        try:
            for _ in range(50 if key in self.world.slow else 5):
                await asyncio.sleep(0.01)
                if self.alive and (self.reading & self.world.poison or self.world.crash_once):
                    self.world.crash_once = False
                    self.alive = False
                if not self.alive:
                    raise EngineDied("the stand-in engine died", stage="engine")
            self.world.pages_read += 1
            return PageResult(html=f"<div>{request.doc_id} {request.page_no}</div>")
        finally:
            self.reading.discard(key)

    async def aclose(self) -> None:
        self.alive = False

    async def check_health(self) -> None:
        return None

    def engine_pids(self) -> list[int]:
        return []


def supervised(world: World) -> SupervisedEngine:
    settings = EngineSettings(kind="vllm", restart_backoff_seconds=0, health_check_seconds=3600, poison_page_deaths=2)
    return SupervisedEngine(lambda: CrashingEngine(world), settings)


async def read_all(engine: SupervisedEngine, pages: int) -> list[PageResult | BaseException]:
    """Pages 1..pages of one document at once, through a started engine that is closed after."""
    await engine.start()
    try:
        requests = [PageRequest("doc", page_no, PAGE) for page_no in range(1, pages + 1)]
        return await asyncio.gather(*(engine.ocr(request) for request in requests), return_exceptions=True)
    finally:
        await engine.aclose()


async def test_one_crash_sends_every_page_again_together_and_fails_none():
    world = World(crash_once=True)
    engine = supervised(world)
    results = await read_all(engine, 20)
    assert all(isinstance(result, PageResult) for result in results)
    assert engine.restarts == 1 and world.starts == 2
    # After the crash, the 20 pages went back at once (they were re-read one by one before).
    assert world.concurrency_by_start[2] == 20


async def test_a_page_that_keeps_crashing_the_engine_fails_alone_and_only_it():
    world = World(poison={("doc", 7)})
    engine = supervised(world)
    results = await read_all(engine, 20)
    failed = {page_no for page_no, result in enumerate(results, start=1) if not isinstance(result, PageResult)}
    assert failed == {7}
    assert isinstance(results[6], PermanentError) and "only page being read" in str(results[6])
    # Two crashes with everything in flight, then pages 1-20 suspected: each read alone once the
    # poison page crashed it a third time, alone.
    assert engine.restarts >= 3
    assert all(isinstance(result, PageResult) for page_no, result in enumerate(results, start=1) if page_no != 7)


@pytest.mark.parametrize("poison_deaths", [1, 3])
async def test_the_number_of_crashes_before_a_page_is_read_alone_is_configurable(poison_deaths):
    world = World(poison={("doc", 2)})
    settings = EngineSettings(kind="vllm", restart_backoff_seconds=0, health_check_seconds=3600,
                              poison_page_deaths=poison_deaths)
    engine = SupervisedEngine(lambda: CrashingEngine(world), settings)
    results = await read_all(engine, 4)
    assert [isinstance(result, PageResult) for result in results] == [True, False, True, True]
    # poison_deaths crashes in company, then one alone: the page fails at the crash after that.
    assert world.starts == 1 + poison_deaths + 1


class SilentlyDyingEngine(CrashingEngine):
    """Test double for vLLM's front end when its EngineCore is killed: the engine is marked dead at
    once (what ``check_health`` sees), but the pages it holds are never told and wait on. vLLM does
    this for the moment between marking its engine dead and failing the pages in flight; a
    restart that closes it meanwhile leaves them waiting for good."""

    async def ocr(self, request: PageRequest) -> PageResult:
        if self.generation == 1:  # the first engine dies under its first pages
            self.reading.add((request.doc_id, request.page_no))
            self.alive = False
            await asyncio.Event().wait()  # never answered
        return await super().ocr(request)

    async def check_health(self) -> None:
        if not self.alive:
            raise EngineDied("the stand-in engine is dead", stage="engine")


async def test_pages_an_engine_never_answers_after_its_death_are_read_by_the_restarted_engine():
    world = World()
    settings = EngineSettings(kind="vllm", restart_backoff_seconds=0, health_check_seconds=0.05)
    engine = SupervisedEngine(lambda: SilentlyDyingEngine(world), settings)
    await engine.start()
    try:
        async with asyncio.timeout(10):  # without the restart handing them back: the page timeout, 600 s
            results = await asyncio.gather(*(engine.ocr(PageRequest("doc", n, PAGE)) for n in range(1, 6)))
        assert all(isinstance(result, PageResult) for result in results)
        assert world.starts == 2 and engine.restarts == 1 and world.pages_read == 5
    finally:
        await engine.aclose()


async def test_a_page_cancelled_from_outside_ends_its_read_before_the_cancel_returns():
    world = World(slow={("doc", 1)})
    engine = supervised(world)
    await engine.start()
    try:
        reading = asyncio.ensure_future(engine.ocr(PageRequest("doc", 1, PAGE)))
        await asyncio.sleep(0.05)
        inner = next(iter(engine.engine.reading))  # type: ignore[union-attr]
        assert inner == ("doc", 1)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        # the engine's own read was cancelled and finished its cleanup (its finally) first
        assert not engine.engine.reading  # type: ignore[union-attr]
        assert world.pages_read == 0
    finally:
        await engine.aclose()


def replica_set(*worlds: World, poison_page_deaths: int = 2) -> ReplicaSet:
    settings = EngineSettings(kind="vllm", gpus=tuple(range(len(worlds))), restart_backoff_seconds=0,
                              health_check_seconds=3600, poison_page_deaths=poison_page_deaths)
    return ReplicaSet([SupervisedEngine(lambda world=world: CrashingEngine(world), settings) for world in worlds])


async def test_while_one_replica_restarts_the_others_read_the_pages():
    first, second = World(crash_once=True, restart_seconds=0.5), World()
    replicas = replica_set(first, second)
    await replicas.start()
    try:
        first.crash_once = True
        pending = asyncio.ensure_future(replicas.ocr(PageRequest("doc", 1, PAGE)))  # the first replica dies under it
        await asyncio.sleep(0.1)  # the first replica is now restarting (0.5 s)
        assert replicas.state.startswith("up (1 of 2 replicas")
        before = second.pages_read
        results = await asyncio.gather(*(replicas.ocr(PageRequest("doc", n, PAGE)) for n in range(2, 12)))
        assert all(isinstance(result, PageResult) for result in results)
        assert second.pages_read - before == 10, "every new page went to the replica that was up"
        assert isinstance(await pending, PageResult)
    finally:
        await replicas.aclose()


async def test_pages_in_flight_on_a_replica_that_dies_are_read_by_another_without_waiting_for_its_restart():
    # The dead replica takes a minute to come back (a real engine start); its pages must not wait for it.
    first, second = World(restart_seconds=60), World()
    replicas = replica_set(first, second)
    await replicas.start()
    try:
        first.crash_once = True
        results = await asyncio.gather(*(replicas.ocr(PageRequest("doc", n, PAGE)) for n in range(1, 21)))
        assert all(isinstance(result, PageResult) for result in results)
        assert replicas.replicas[0].state == "restarting", "the pages were read while the dead replica restarted"
        assert first.pages_read == 0 and second.pages_read == 20
    finally:
        await replicas.aclose()


async def test_a_page_that_crashes_every_replica_it_visits_fails_alone_and_only_it():
    poison = {("doc", 3)}
    first, second = World(poison=poison), World(poison=poison)
    replicas = replica_set(first, second)
    await replicas.start()
    try:
        results = await asyncio.gather(*(replicas.ocr(PageRequest("doc", n, PAGE)) for n in range(1, 9)),
                                       return_exceptions=True)
    finally:
        await replicas.aclose()
    failed = {page_no for page_no, result in enumerate(results, start=1) if not isinstance(result, PageResult)}
    assert failed == {3}
    assert isinstance(results[2], PermanentError) and "only page being read" in str(results[2])
    # The crash count follows the page between replicas: two crashes in company, then one alone.
    assert first.starts + second.starts == 2 + 3


async def test_a_replica_recycles_only_while_the_other_replicas_are_up():
    # On two H200s a planned recycle began while the other replica was restarting after a kill -9:
    # both were down at once. The recycle must wait, and the waiting replica keep reading pages.
    first, second = World(), World(restart_seconds=1.0)
    settings = EngineSettings(kind="vllm", gpus=(0, 1), restart_backoff_seconds=0, health_check_seconds=3600,
                              recycle_after_pages=3)
    replicas = ReplicaSet([SupervisedEngine(lambda world=world: CrashingEngine(world), settings)
                           for world in (first, second)])
    await replicas.start()
    try:
        second.crash_once = True
        with pytest.raises(ReplicaDown):
            await replicas.replicas[1].ocr(PageRequest("doc", 1, PAGE))
        assert replicas.replicas[1].state == "restarting"
        results = await asyncio.gather(*(replicas.ocr(PageRequest("doc", n, PAGE)) for n in range(2, 7)))
        assert all(isinstance(result, PageResult) for result in results)
        await asyncio.sleep(0.3)
        assert first.pages_read == 5 and first.starts == 1, "the recycle was due but the other replica was down"
        assert replicas.replicas[0].state == "up"
        for _ in range(100):
            if replicas.status().recycles == 1:
                break
            await asyncio.sleep(0.05)
        assert replicas.replicas[1].state == "up" and replicas.status().recycles == 1 and first.starts == 2
    finally:
        await replicas.aclose()


async def test_no_planned_recycle_begins_once_the_daemon_is_stopping():
    # On the GPU a recycle began a second after SIGTERM: the drain's last pages would have waited a
    # whole engine start for an engine that is closed right after.
    world = World()
    settings = EngineSettings(kind="vllm", restart_backoff_seconds=0, health_check_seconds=3600,
                              recycle_after_pages=2)
    engine = SupervisedEngine(lambda: CrashingEngine(world), settings)
    await engine.start()
    try:
        engine.stopping()
        with structlog.testing.capture_logs() as events:
            results = await asyncio.gather(*(engine.ocr(PageRequest("doc", n, PAGE)) for n in range(1, 7)))
            await asyncio.sleep(0.2)
        assert all(isinstance(result, PageResult) for result in results)
        assert world.starts == 1 and engine.recycles == 0 and engine.state == "up"
        # No pause for the pages either, and no line per page saying a recycle was skipped.
        assert not any(event["event"].startswith("engine recycl") for event in events), events
    finally:
        await engine.aclose()


async def test_a_recycle_waiting_for_its_pages_when_the_stop_comes_leaves_the_engine_serving():
    world = World(slow={("doc", 1)})
    settings = EngineSettings(kind="vllm", restart_backoff_seconds=0, health_check_seconds=3600,
                              recycle_after_pages=1)
    engine = SupervisedEngine(lambda: CrashingEngine(world), settings)
    await engine.start()
    try:
        slow = asyncio.ensure_future(engine.ocr(PageRequest("doc", 1, PAGE)))
        await engine.ocr(PageRequest("doc", 2, PAGE))  # the recycle is due, page 1 still in flight
        await asyncio.sleep(0.05)
        assert engine.state == "restarting", "the recycle waits for page 1, new pages wait for it"
        engine.stopping()
        await slow
        late = await asyncio.wait_for(engine.ocr(PageRequest("doc", 3, PAGE)), 5)
        assert isinstance(late, PageResult)
        await asyncio.sleep(0.2)
        assert world.starts == 1 and engine.recycles == 0 and engine.state == "up"
    finally:
        await engine.aclose()


async def test_closing_during_a_recycles_engine_start_ends_that_start_before_it_returns():
    # On the GPU a stop during a recycle's engine start logged "chandrad stopped" and then loaded
    # the new engine for 30 s more: closing must end the start, and only then return.
    world = World(restart_seconds=3600)
    settings = EngineSettings(kind="vllm", restart_backoff_seconds=0, health_check_seconds=3600,
                              recycle_after_pages=1)
    engine = SupervisedEngine(lambda: CrashingEngine(world), settings)
    await engine.start()
    await engine.ocr(PageRequest("doc", 1, PAGE))  # the recycle is due: the new engine starts
    for _ in range(100):
        if world.starts == 2:
            break
        await asyncio.sleep(0.01)
    assert world.starts == 2 and engine.state == "restarting"
    await engine.aclose()
    assert world.abandoned_starts == 1, "aclose returned while the recycle's engine start was still running"


async def test_a_replica_that_fails_to_start_ends_the_other_replicas_loads_instead_of_waiting_for_them():
    # A replica's load takes minutes on a GPU; with one replica failed the daemon cannot start anyway.
    class FailsToStart(CrashingEngine):
        async def start(self) -> None:
            raise RuntimeError("CUDA out of memory (stand-in)")

    world = World(restart_seconds=3600)
    world.starts = 1  # every start of this world's engines is a slow one (see CrashingEngine.start)
    settings = EngineSettings(kind="vllm", restart_backoff_seconds=0, health_check_seconds=3600)
    replicas = ReplicaSet([
        SupervisedEngine(lambda: CrashingEngine(world), settings),
        SupervisedEngine(lambda: FailsToStart(world), settings),
    ])
    with pytest.raises(RuntimeError, match="out of memory"):
        await asyncio.wait_for(replicas.start(), 10)
    assert world.abandoned_starts == 1, "the slow replica's load was ended, not waited for"
