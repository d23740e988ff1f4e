"""Error types shared by the stages (own module to avoid import loops).

Every failure a document can meet is one of two kinds, and the kind decides what happens:
``PermanentError`` (the input itself is unusable: encrypted, not a document, too large) sends the
original to ``failed/`` at once; ``TransientError`` (engine died, disk full, a timeout) is retried
with backoff up to ``max_attempts`` and only then fails, with its history.
"""

from __future__ import annotations


class ConfigError(Exception):
    """Settings that cannot work; the message says which key and what to do."""


class DocumentError(Exception):
    """A document could not be processed. ``reason`` is written for the person who dropped it."""

    permanent: bool = False

    def __init__(self, reason: str, *, stage: str = "", detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.stage = stage
        self.detail = detail

    @property
    def kind(self) -> str:
        return "permanent" if self.permanent else "transient"


class PermanentError(DocumentError):
    """Retrying cannot help: the input itself is the problem."""

    permanent = True


class TransientError(DocumentError):
    """Worth retrying later: the environment (engine, disk, time) was the problem."""
