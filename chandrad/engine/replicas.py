"""One engine per GPU, each supervised on its own, pages balanced between them ("replicas").

A replica is a whole engine: its own vLLM front end (tokenising, image processing, output
handling) and its own EngineCore on one GPU. Two replicas scale with the GPUs because nothing is
shared above them but the daemon's event loop; vLLM's data-parallel mode instead feeds every GPU
from one front end (bench/results, issue 7). Each replica restarts and recycles alone: while one
reloads, the others keep reading pages — including those that were in flight on it when it died —
and their planned recycles are staggered and wait until every other replica is up.
"""

from __future__ import annotations

import asyncio
from functools import partial

import structlog

from chandrad.engine.base import EngineStatus, PageRequest, PageResult
from chandrad.engine.supervisor import SupervisedEngine, gpu_memory_used_bytes
from chandrad.errors import ReplicaDown

log = structlog.get_logger("chandrad.engine.replicas")


class ReplicaSet:
    def __init__(self, replicas: list[SupervisedEngine]) -> None:
        self.replicas = replicas
        self.name = "vllm"
        self.model = replicas[0].model
        self._pages_at: list[int] = [0] * len(replicas)
        deaths: dict[tuple[str, int], int] = {}
        for index, replica in enumerate(replicas):
            replica.join_replicas(partial(self.others_up, index), partial(self.all_others_up, index), deaths)

    # -- what the daemon reads ----------------------------------------------------------------

    @property
    def state(self) -> str:
        states = [replica.state for replica in self.replicas]
        if all(state == "up" for state in states):
            return "up"
        up = states.count("up")
        if up:
            return f"up ({up} of {len(states)} replicas; the others {'/'.join(sorted(set(states) - {'up'}))})"
        return "starting" if all(state == "starting" for state in states) else "restarting"

    def status(self) -> EngineStatus:
        peaks = [peak for replica in self.replicas if (peak := replica.peak_running) is not None]
        return EngineStatus(
            state=self.state,
            restarts=sum(replica.restarts for replica in self.replicas),
            recycles=sum(replica.recycles for replica in self.replicas),
            peak_running=sum(peaks) if peaks else None,
        )

    async def memory_in_use(self) -> int | None:
        gpus = tuple(gpu for replica in self.replicas for gpu in replica.settings.gpus)
        return await asyncio.to_thread(gpu_memory_used_bytes, gpus)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """All replicas load side by side; ready when every one has answered its warm-up. The first
        that fails to start ends the others' loads (minutes each on a GPU) instead of waiting for them."""
        starts = [
            asyncio.create_task(replica.start(), name=f"start-replica-{index}")
            for index, replica in enumerate(self.replicas)
        ]
        try:
            await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # a stop while loading
            await _cancel_all(starts)
            raise
        failures = [
            task.exception() for task in starts if task.done() and not task.cancelled() and task.exception() is not None
        ]
        if failures:
            await _cancel_all(starts)
            await self.aclose()
            raise failures[0]  # type: ignore[misc]  # a BaseException, checked not None above
        self.model = self.replicas[0].model
        log.info("replicas up", replicas=len(self.replicas))

    def stopping(self) -> None:
        for replica in self.replicas:
            replica.stopping()

    async def aclose(self) -> None:
        await asyncio.gather(*(replica.aclose() for replica in self.replicas), return_exceptions=True)

    # -- pages ----------------------------------------------------------------------------------

    def _choose(self) -> int:
        """The replica with the fewest of our pages, among those up (any, if none is up)."""
        candidates = [i for i, replica in enumerate(self.replicas) if replica.state == "up"]
        if not candidates:
            candidates = list(range(len(self.replicas)))
        return min(candidates, key=lambda i: self._pages_at[i])

    def others_up(self, index: int) -> bool:
        """Whether a replica other than ``index`` can take pages now (its supervisor asks)."""
        return any(replica.state == "up" for i, replica in enumerate(self.replicas) if i != index)

    def all_others_up(self, index: int) -> bool:
        """Whether every replica but ``index`` is up: only then may ``index`` recycle."""
        return all(replica.state == "up" for i, replica in enumerate(self.replicas) if i != index)

    async def ocr(self, request: PageRequest) -> PageResult:
        while True:
            index = self._choose()
            self._pages_at[index] += 1
            try:
                return await self.replicas[index].ocr(request)
            except ReplicaDown:
                log.info("page moved to another replica", doc=request.doc_id, page=request.page_no, replica_down=index)
            finally:
                self._pages_at[index] -= 1


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
