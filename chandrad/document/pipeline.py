"""Where a file goes after it settles, in one place: ``intake`` then ``stages``.

    watch ─▶ Pipeline.take_in (intake.py) ─▶ journal ─▶ Pipeline.process (stages.py) ─▶ outbox
                                                         └─ failures.py: retry, wait, failed/

The daemon calls ``take_in`` for each settled file and ``process`` for each document the work
queue hands a worker; ``recover`` once at start-up. This class only composes the parts and
shares the ``Runtime`` (settings, journal, engine) between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from chandrad.config import Settings
from chandrad.document import recovery
from chandrad.document.stages import DocumentStages
from chandrad.engine.base import Engine
from chandrad.inbox.intake import Intake
from chandrad.inbox.watch import SettledFile
from chandrad.output.failures import Failures
from chandrad.runtime import Outcome, Runtime
from chandrad.storage.journal import Document, Journal

__all__ = ["Outcome", "Pipeline"]


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        journal: Journal,
        engine: Engine,
        *,
        move_originals: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runtime = Runtime(settings, journal, engine, move_originals=move_originals, clock=clock)
        self.failures = Failures(self.runtime)
        self.intake = Intake(self.runtime, self.failures)
        self.stages = DocumentStages(self.runtime, self.failures)

    def close(self) -> None:
        """Release the runtime's inbox threads."""
        self.runtime.close()

    def update_settings(self, settings: Settings) -> None:
        self.runtime.update_settings(settings)

    async def take_in(self, settled: SettledFile) -> Document | None:
        """A settled file becomes a queued document (or is refused with a reason); None: nothing to do."""
        return await self.intake.take_in(settled)

    async def take_in_batch(self, batch: Sequence[SettledFile]) -> list[Document]:
        """Settled files taken in together (two journal commits for all of them): the queued documents."""
        return await self.intake.take_in_batch(batch)

    async def process(self, doc_id: str) -> Outcome:
        """A queued document as far as it goes: published, failed, or queued for a retry."""
        return await self.stages.run(doc_id)

    async def recover(self) -> list[str]:
        """At start-up: the documents a crash or stop interrupted, to process again."""
        return await recovery.recover(self.runtime)
