"""Every error kind chandrad raises or reacts to, in one module (also to avoid import loops).

A document's failure is one of two kinds, and the kind decides what happens:
``PermanentError`` (the input itself is unusable: encrypted, not a document, too large) sends the
original to ``failed/`` at once; ``TransientError`` (engine died, disk full, a timeout) is retried
with backoff up to ``max_attempts`` and only then fails, with its history. ``WaitError`` is a
transient error that is nobody's fault (a full disk, an unmounted share): the document waits
without using up its attempts.

Code that reacts to a particular case catches its subclass; it never reads an error's message.
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


# -- the cases code reacts to ----------------------------------------------------------------------


class UnreadablePdfError(PermanentError):
    """poppler cannot parse the PDF's structure: Ghostscript's repair may still rescue it."""


class PageTooLargeError(PermanentError):
    """A page's size exceeds the pixel cap: a repaired copy of the file would be just as large."""


class DuplicateError(PermanentError):
    """The same content was taken in before (``duplicates = "skip"``)."""

    @property
    def kind(self) -> str:
        return "duplicate"


class ToolTimeoutError(TransientError):
    """An external program (pdftoppm, Ghostscript, ...) ran past ``subprocess_timeout_seconds``."""


class WaitError(TransientError):
    """The environment is not ready (a full disk, an unreachable inbox). Not the document's fault
    and not worth giving up on: the document waits (retried with backoff up to
    ``MAX_WAIT_SECONDS`` of ``chandrad.output.failures``) without using up its ``max_attempts``, and
    resumes when the condition clears."""

    wait_kind = "waiting"

    @property
    def kind(self) -> str:
        return self.wait_kind


class DiskFullError(WaitError):
    wait_kind = "disk-full"


class InboxUnreachableError(WaitError):
    """The inbox (and the claimed originals in it) is gone: unmounted share, folder removed."""

    wait_kind = "inbox-unreachable"


class EngineDied(TransientError):
    """The engine process is gone (crash, OOM kill): restart it and send the page again."""


class ReplicaDown(Exception):
    """This replica's engine is down (restarting, recycling, or just died) while another replica is
    up: the page goes to that one. Never leaves the engine package."""


def is_disk_full(error: BaseException) -> bool:
    """Whether an OSError says a disk (or a quota) is full: the document waits, it is not at fault."""
    import errno

    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
