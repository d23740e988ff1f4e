"""Hand final documents on: webhooks (signed JSON POSTs) and hooks (argument-list commands).

A document's deliveries are planned (``targets``, ``plan``) when its final state is committed and
recorded in the same transaction (``Journal.publish``, ``Journal.fail``): the journal is a
transactional outbox, so a crash or ``kill -9`` after the commit loses nothing. ``Deliverer.run``,
a task of its own, then sends what is pending with bounded concurrency and exponential backoff
until each succeeds or is given up (a 4xx other than 408/429, ``max_attempts`` of a hook,
``max_age_hours``). Delivery is at least once: a receiver uses ``doc_id`` as its idempotency key.

This module never decides a document's fate: by the time a delivery exists the document is
published or failed, and nothing a receiver or hook does changes that.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import hmac
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog

from chandrad import __version__
from chandrad.backoff import backoff_seconds
from chandrad.config import HookSettings, InboxSettings, Settings, WebhookSettings
from chandrad.metrics import Metrics
from chandrad.runtime import Runtime
from chandrad.storage.journal import Delivery, Document, Journal, NewDelivery

log = structlog.get_logger("chandrad.output.delivery")

SIGNATURE_HEADER = "X-Chandrad-Signature"
POLL_SECONDS = 1.0  # new deliveries are looked for this often (and whenever an attempt ends)
PENDING_GAUGE_SECONDS = 5.0
HOOK_KILL_GRACE_SECONDS = 2.0  # SIGTERM to the hook's process group, then SIGKILL after this
HOOK_OUTPUT_LINES = 200  # lines of a hook's output logged per run; the rest is counted
HOOK_LINE_CHARS = 2000
ERROR_EXCERPT_BYTES = 300  # of a refusing receiver's answer, kept with the attempt

# systemd's channels to the daemon itself: a hook is not the service and must not speak for it.
_NOT_FOR_HOOKS = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"})

# 4xx answers that say "try again later" rather than "never".
RETRYABLE_4XX = frozenset({408, 429})


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def sign(secret: str, body: bytes) -> str:
    """The ``X-Chandrad-Signature`` value: ``sha256=`` and the hex HMAC-SHA256 of the body."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


# -- planning (when the final state is committed) ---------------------------------------------------


def _applies(name: str, inboxes: tuple[str, ...] | None, events: tuple[str, ...], inbox: InboxSettings,
             listed: tuple[str, ...] | None, event: str) -> bool:  # fmt: skip
    if event not in events:
        return False
    if listed is not None:  # the inbox or its rule names the targets: exactly those
        return name in listed
    return inboxes is None or inbox.name in inboxes


def targets(settings: Settings, inbox: InboxSettings, event: str) -> tuple[list[WebhookSettings], list[HookSettings]]:
    """The webhooks and hooks a document of ``inbox`` (its effective settings, rules applied) gets for ``event``."""
    webhooks = [w for w in settings.webhook if _applies(w.name, w.inboxes, w.events, inbox, inbox.webhooks, event)]
    hooks = [h for h in settings.hook if _applies(h.name, h.inboxes, h.events, inbox, inbox.hooks, event)]
    return webhooks, hooks


def output_files(outbox: Path, output_dir: str | None) -> list[str]:
    """The published document's files, relative to the outbox, sorted (blocking: run in a thread)."""
    if not output_dir:
        return []
    folder = Path(output_dir)
    try:
        found = [path for path in folder.rglob("*") if path.is_file()]
    except OSError:
        return []
    return sorted(_relative(path, outbox) for path in found)


def _relative(path: Path | str, base: Path) -> str:
    try:
        return Path(path).relative_to(base).as_posix()
    except ValueError:
        return str(path)


def body(
    doc: Document,
    inbox: InboxSettings,
    event: str,
    entry: dict[str, Any] | None,
    files: list[str],
    *,
    engine: str,
    model: str,
    now: float,
) -> dict[str, Any]:
    """What a receiver is told about a final document (the webhook's JSON body)."""
    failed = event == "failed"
    return {
        "event": event,
        "doc_id": doc.id,
        "inbox": inbox.name,
        "source": doc.rel_path,
        "sha256": doc.sha256 or None,
        "pages": doc.page_count,
        "output_dir": _relative(doc.output_dir, inbox.outbox) if doc.output_dir and not failed else None,
        "files": files,
        "failed_file": _relative(doc.final_path, inbox.failed) if failed and doc.final_path else None,
        "reason": entry.get("reason") if entry else None,
        "kind": entry.get("kind") if entry else None,
        "stage": entry.get("stage") if entry else None,
        "received_at": _iso(doc.created_at),
        "finished_at": _iso(now),
        "engine": engine,
        "model": model,
    }


def hook_environment(described: dict[str, Any], inbox: InboxSettings) -> dict[str, str]:
    """The CHANDRAD_* variables a hook runs with; paths are absolute (the hook runs on this host)."""
    output_dir = described["output_dir"]
    failed_file = described["failed_file"]
    return {
        "CHANDRAD_EVENT": described["event"],
        "CHANDRAD_DOC_ID": described["doc_id"],
        "CHANDRAD_INBOX": described["inbox"],
        "CHANDRAD_SOURCE": described["source"],
        "CHANDRAD_OUTPUT_DIR": str(inbox.outbox / output_dir) if output_dir else "",
        "CHANDRAD_FILES": "\n".join(str(inbox.outbox / name) for name in described["files"]),
        "CHANDRAD_REASON": described["reason"] or "",
        "CHANDRAD_KIND": described["kind"] or "",
        "CHANDRAD_FAILED_FILE": str(inbox.failed / failed_file) if failed_file else "",
        "CHANDRAD_SHA256": described["sha256"] or "",
        "CHANDRAD_PAGES": "" if described["pages"] is None else str(described["pages"]),
    }


def plan(
    webhooks: list[WebhookSettings],
    hooks: list[HookSettings],
    described: dict[str, Any],
    inbox: InboxSettings,
) -> list[NewDelivery]:
    """One delivery per target, its payload fixed now: every attempt sends the same bytes."""
    event = str(described["event"])
    # ASCII JSON: a name that is not UTF-8 (stored with escapes) cannot break the encoding.
    payload = json.dumps(described, separators=(",", ":"))
    environment = json.dumps(hook_environment(described, inbox), separators=(",", ":"))
    return [NewDelivery("webhook", w.name, event, payload) for w in webhooks] + [
        NewDelivery("hook", h.name, event, environment) for h in hooks
    ]


async def planned(
    runtime: Runtime, doc: Document, inbox: InboxSettings, event: str, entry: dict[str, Any] | None = None
) -> list[NewDelivery]:
    """The webhooks and hooks ``doc`` gets for its final state ``event`` ("published",
    "failed"; ``entry`` says why it failed), to be committed with that state. ``chandrad
    once`` (originals not moved) has no delivery task: nothing is planned for it."""
    if not runtime.move_originals:
        return []
    webhooks, hooks = targets(runtime.settings, inbox, event)
    if not webhooks and not hooks:
        return []
    journal = runtime.journal
    current = await journal.call(journal.get, doc.id)  # output_dir and final_path as committed
    files = await asyncio.to_thread(output_files, inbox.outbox, current.output_dir) if event == "published" else []
    described = body(
        current, inbox, event, entry, files, engine=runtime.engine.name, model=runtime.engine.model, now=runtime.clock()
    )
    return plan(webhooks, hooks, described, inbox)


# -- sending ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """How one attempt went: ``ok``; else whether it may be retried, the HTTP status or exit code, why."""

    ok: bool
    retryable: bool = True
    status: int | None = None
    error: str | None = None
    retry_after: float | None = None


class Deliverer:
    """The delivery task: pending deliveries from the journal, sent ``delivery.concurrency`` at a time.

    ``settings`` is called for each attempt, so a reload's new URL, secret or command applies to
    deliveries still pending; a target removed from the configuration ends its deliveries.
    """

    def __init__(
        self,
        settings: Callable[[], Settings],
        journal: Journal,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._journal = journal
        self._metrics = metrics
        self._clock = clock
        self._in_hand: set[int] = set()
        self._ended_meanwhile: set[int] = set()  # attempts that ended since the last query was sent
        self._wake = asyncio.Event()
        # When the retries this task scheduled fall due: it wakes for them rather than at the next poll.
        self._retries_at: list[float] = []

    @property
    def in_hand(self) -> int:
        """Deliveries being attempted now (at most ``delivery.concurrency``)."""
        return len(self._in_hand)

    async def run(self) -> None:
        config = self._settings().delivery
        concurrency = config.concurrency  # fixed for the task's life: a change needs a restart
        # A retry is never further ahead than the longest backoff; one that is means the wall
        # clock stepped back, and it is due now.
        horizon = config.backoff_max_seconds + 60
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        journal = self._journal
        self._in_hand.clear()
        last_gauge = -math.inf
        # Building the client loads the CA bundle into an SSL context (25-45 ms on an idle core,
        # over 100 ms on busy ones: the event-loop test saw it): in a thread, off the loop.
        client = await asyncio.to_thread(
            httpx.AsyncClient, limits=limits, timeout=httpx.Timeout(10.0), follow_redirects=False
        )
        async with client, asyncio.TaskGroup() as group:
            while True:
                self._wake.clear()
                now = self._clock()
                free = concurrency - len(self._in_hand)
                if free > 0:
                    # Those in hand are still pending: ask for enough to fill every free slot anyway.
                    self._ended_meanwhile.clear()
                    due = await journal.call(journal.due_deliveries, now, horizon, free + len(self._in_hand))
                    for delivery in due:
                        # One that ended while the query ran may be read as it was before it ended.
                        stale = delivery.id in self._ended_meanwhile
                        if not stale and delivery.id not in self._in_hand and len(self._in_hand) < concurrency:
                            self._in_hand.add(delivery.id)
                            group.create_task(self._attempt(client, delivery))
                if self._metrics is not None and time.monotonic() - last_gauge >= PENDING_GAUGE_SECONDS:
                    last_gauge = time.monotonic()
                    counts = await journal.call(journal.delivery_counts)
                    self._metrics.deliveries_pending.set(counts.get("pending", 0))
                while self._retries_at and self._retries_at[0] <= self._clock():
                    heapq.heappop(self._retries_at)  # due: the query above has it, or will once a slot frees
                wait = POLL_SECONDS
                if self._retries_at:
                    wait = min(wait, max(self._retries_at[0] - self._clock(), 0.01))
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
                # that comes as the wait ends, and then this task would outlive the daemon's stop.
                try:
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                except TimeoutError:
                    pass

    async def _attempt(self, client: httpx.AsyncClient, delivery: Delivery) -> None:
        """One attempt, its outcome recorded; nothing it meets may end the task."""
        try:
            settings = self._settings()
            with structlog.contextvars.bound_contextvars(
                doc=delivery.doc_id, delivery=delivery.id, kind=delivery.kind, target=delivery.target
            ):
                attempt = await self._send(client, settings, delivery)
                await self._record(settings, delivery, attempt)
        except asyncio.CancelledError:
            raise  # stopping: the delivery stays pending and is sent after the restart
        except Exception as error:
            log.exception("delivery attempt crashed; it stays pending", delivery=delivery.id)
            await self._postpone(delivery, f"internal error: {type(error).__name__}: {error}")
        finally:
            self._in_hand.discard(delivery.id)
            self._ended_meanwhile.add(delivery.id)
            self._wake.set()

    async def _postpone(self, delivery: Delivery, why: str) -> None:
        """After a bug in an attempt: try again after the longest backoff, not at once and forever."""
        journal, next_at = self._journal, self._clock() + self._settings().delivery.backoff_max_seconds
        try:
            await journal.call(
                journal.delivery_attempted, delivery.id, "pending", next_attempt_at=next_at, status=None, error=why
            )
        except Exception:
            log.exception("cannot record the crashed attempt", delivery=delivery.id)
        heapq.heappush(self._retries_at, next_at)

    async def _send(self, client: httpx.AsyncClient, settings: Settings, delivery: Delivery) -> Attempt:
        if delivery.kind == "webhook":
            webhook = next((w for w in settings.webhook if w.name == delivery.target), None)
            if webhook is None:
                return Attempt(False, retryable=False, error=f"no [[webhook]] named {delivery.target!r} any more")
            return await post(client, webhook, delivery)
        hook = next((h for h in settings.hook if h.name == delivery.target), None)
        if hook is None:
            return Attempt(False, retryable=False, error=f"no [[hook]] named {delivery.target!r} any more")
        return await run_hook(hook, delivery)

    async def _record(self, settings: Settings, delivery: Delivery, attempt: Attempt) -> None:
        journal, now = self._journal, self._clock()
        attempts = delivery.attempts + 1
        fields: dict[str, Any] = {"status": attempt.status, "error": attempt.error}
        if attempt.ok:
            await journal.call(journal.delivery_attempted, delivery.id, "delivered", **fields)
            self._count(delivery.kind, "delivered")
            log.info("delivered", outcome=delivery.event, attempts=attempts, status=attempt.status)
            return
        give_up = self._give_up_reason(settings, delivery, attempt, attempts, now)
        if give_up is not None:
            await journal.call(journal.delivery_attempted, delivery.id, "failed", **fields)
            self._count(delivery.kind, "failed")
            log.error(
                "delivery given up",
                why=give_up,
                status=attempt.status,
                error=attempt.error,
                attempts=attempts,
                outcome=delivery.event,
            )
            return
        config = settings.delivery
        delay = backoff_seconds(config.backoff_seconds, attempts, config.backoff_max_seconds)
        if attempt.retry_after is not None:
            delay = max(delay, min(attempt.retry_after, config.backoff_max_seconds))
        next_at = min(now + delay, self._deadline(settings, delivery))
        await journal.call(journal.delivery_attempted, delivery.id, "pending", next_attempt_at=next_at, **fields)
        heapq.heappush(self._retries_at, next_at)
        self._count(delivery.kind, "retried")
        log.warning(
            "delivery failed; will retry",
            status=attempt.status,
            error=attempt.error,
            attempts=attempts,
            retry_in_s=round(next_at - now, 2),
        )

    def _deadline(self, settings: Settings, delivery: Delivery) -> float:
        target = _target(settings, delivery)
        return delivery.created_at + (target.max_age_hours if target else 0) * 3600

    def _give_up_reason(
        self, settings: Settings, delivery: Delivery, attempt: Attempt, attempts: int, now: float
    ) -> str | None:
        if not attempt.retryable:
            return "the answer says a retry cannot succeed" if attempt.status else "it cannot be sent"
        target = _target(settings, delivery)
        if isinstance(target, HookSettings) and attempts >= target.max_attempts:
            return f"max_attempts ({target.max_attempts}) used"
        if now >= self._deadline(settings, delivery):
            return f"max_age_hours ({target.max_age_hours if target else 0:g}) passed"
        return None

    def _count(self, kind: str, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.deliveries.labels(kind, outcome).inc()


def _target(settings: Settings, delivery: Delivery) -> WebhookSettings | HookSettings | None:
    pool: tuple[WebhookSettings, ...] | tuple[HookSettings, ...] = (
        settings.webhook if delivery.kind == "webhook" else settings.hook
    )
    return next((target for target in pool if target.name == delivery.target), None)


async def post(client: httpx.AsyncClient, webhook: WebhookSettings, delivery: Delivery) -> Attempt:
    """POST the delivery's body; 2xx is success, a 4xx other than 408/429 is final, the rest retried."""
    content = delivery.payload.encode("utf-8")
    headers = {
        "Content-Type": "application/json",
        "User-Agent": f"chandrad/{__version__}",
        "X-Chandrad-Event": delivery.event,
        "X-Chandrad-Delivery": str(delivery.id),
    }
    if webhook.secret:
        headers[SIGNATURE_HEADER] = sign(webhook.secret, content)
    timeout = webhook.timeout_seconds
    try:
        # One deadline for the whole exchange (httpx's timeouts are per phase: a receiver dripping
        # its answer could outlast each of them).
        async with (
            asyncio.timeout(timeout),
            client.stream("POST", webhook.url, content=content, headers=headers, timeout=timeout) as response,
        ):
            status = response.status_code
            if 200 <= status < 300:
                return Attempt(True, status=status)
            excerpt = b""
            async for chunk in response.aiter_bytes():  # a little of the answer, never all of it
                excerpt += chunk
                if len(excerpt) >= ERROR_EXCERPT_BYTES:
                    break
            retry_after = _retry_after(response.headers.get("Retry-After"))
    except TimeoutError:
        return Attempt(False, error=f"no answer within {timeout:g} s (timeout_seconds)")
    except (httpx.HTTPError, httpx.InvalidURL, OSError) as error:
        return Attempt(False, error=f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    text = excerpt[:ERROR_EXCERPT_BYTES].decode("utf-8", "replace").strip()
    why = f"HTTP {status}" + (f": {text}" if text else "")
    final = 400 <= status < 500 and status not in RETRYABLE_4XX
    return Attempt(False, retryable=not final, status=status, error=why, retry_after=retry_after)


def _retry_after(value: str | None) -> float | None:
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None  # an HTTP date: our own backoff applies


async def run_hook(hook: HookSettings, delivery: Delivery) -> Attempt:
    """Run the hook's command with the delivery's CHANDRAD_* variables; its output goes to the log.
    Exit status 0 is success. Past ``timeout_seconds`` its whole process group is ended (SIGTERM,
    then SIGKILL), so that a child it started cannot linger either."""
    inherited = {key: value for key, value in os.environ.items() if key not in _NOT_FOR_HOOKS}
    environment = {**inherited, **json.loads(delivery.payload)}
    try:
        process = await asyncio.create_subprocess_exec(
            *hook.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=environment,
            start_new_session=True,  # its own process group, to be ended as a whole
        )
    except OSError as error:
        return Attempt(False, error=f"cannot run {hook.command[0]}: {error.strerror or error}")
    try:
        async with asyncio.timeout(hook.timeout_seconds):
            await _log_output(process, hook.name)
            code = await process.wait()
    except TimeoutError:
        await _end_group(process)
        return Attempt(False, error=f"still running after {hook.timeout_seconds:g} s (timeout_seconds); ended")
    except asyncio.CancelledError:
        _signal_group(process, signal.SIGKILL)
        raise
    if code == 0:
        return Attempt(True, status=0)
    why = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return Attempt(False, status=code, error=why)


async def _log_output(process: asyncio.subprocess.Process, name: str) -> None:
    """Each line the hook writes (stdout and stderr together), logged, up to HOOK_OUTPUT_LINES."""
    assert process.stdout is not None
    lines = 0
    pending = b""

    def emit(raw: bytes) -> None:
        nonlocal lines
        lines += 1
        if lines <= HOOK_OUTPUT_LINES:
            log.info("hook output", hook=name, line=raw.decode("utf-8", "replace").rstrip()[:HOOK_LINE_CHARS])

    while chunk := await process.stdout.read(65536):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            emit(raw)
        if len(pending) > HOOK_LINE_CHARS * 4:  # no newline in sight: log what there is
            emit(pending)
            pending = b""
    if pending:
        emit(pending)
    if lines > HOOK_OUTPUT_LINES:
        log.warning("hook output cut short in the log", hook=name, lines=lines, logged=HOOK_OUTPUT_LINES)


def _signal_group(process: asyncio.subprocess.Process, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


async def _end_group(process: asyncio.subprocess.Process) -> None:
    _signal_group(process, signal.SIGTERM)
    try:
        async with asyncio.timeout(HOOK_KILL_GRACE_SECONDS):
            await process.wait()
    except TimeoutError:
        pass
    _signal_group(process, signal.SIGKILL)  # the leader may be gone while its children live on
    await process.wait()
