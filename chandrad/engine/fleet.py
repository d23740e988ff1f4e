"""The vLLM OpenAI-compatible servers of ``engine.url``, each health-checked, pages spread over those up.

One URL is a fleet of one. A server (``Endpoint``) is *up* once ``GET <root>/health`` answers
and ``GET <url>/models`` lists the model (the root is the url without its ``/v1``); a health
check every ``health_check_seconds`` keeps it so. It goes *down* on a connection error (refused,
reset: a ``kill -9`` mid-request), an HTTP 5xx, a timeout, or a failed health check; a server
that is down is probed with backoff (``restart_backoff_seconds`` doubling up to
``restart_backoff_max_seconds``) and taken back once it answers and serves the model again.

A page goes to the server up with the fewest pages in flight, each server taking at most its
share of the pages in flight. When its server fails, the page goes to another one that is up;
while none is, the page waits for one to come back, and just before the pipeline's page timeout
it ends with a ``WaitError`` (its document waits without using up an attempt). A 429 leaves the
server up: the page goes again after a backoff. Any other 4xx is the page's own fault
(``PermanentError``), unless it says the server refuses us (401, 403, 404, 407, 408: down).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import httpx
import structlog

from chandrad.backoff import backoff_seconds
from chandrad.config import EngineSettings
from chandrad.engine import pages_in_flight
from chandrad.errors import ConfigError, EngineDied, PermanentError, TransientError, WaitError

if TYPE_CHECKING:
    from openai import AsyncOpenAI

log = structlog.get_logger("chandrad.engine.fleet")

T = TypeVar("T")

PROBE_TIMEOUT_SECONDS = 10.0  # one health probe (and a request's connect phase) at most
MIN_PROBE_INTERVAL_SECONDS = 0.5  # even with restart_backoff_seconds = 0: a refused probe returns at once
# 4xx answers that say the server refuses us, not that the page is bad: the server is taken out.
SERVER_SIDE_4XX = frozenset({401, 403, 404, 407, 408})


def server_root(url: str) -> str:
    """Where a vLLM server's own routes (``/health``) are: ``url`` without its trailing ``/v1``."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def tls_verify(settings: EngineSettings) -> ssl.SSLContext | bool:
    """httpx's ``verify``: a context trusting ``ca_bundle`` if set, else the system's trust store."""
    if settings.ca_bundle is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(settings.ca_bundle))
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(f"engine.ca_bundle {settings.ca_bundle}: not a readable PEM CA bundle ({error})") from None


class ServerFailed(Exception):
    """The server failed a request: it is taken out and the page goes to another. ``blames_page``
    when the page may be the cause (a 5xx, a timeout), not when the server simply is gone;
    ``cut_mid_read`` when the server failed with the page at it (its connection cut mid-request),
    not when it refused us, refused the connection, or was taken out for another reason."""

    def __init__(self, reason: str, *, blames_page: bool, cut_mid_read: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.blames_page = blames_page
        self.cut_mid_read = cut_mid_read


class ServerBusy(Exception):
    """HTTP 429: the server is up but full; the page goes again after a backoff."""


@dataclass(frozen=True)
class Probe:
    """One health probe's answer: the models served, or what is wrong."""

    served: tuple[str, ...] = ()
    problem: str | None = None


class Endpoint:
    """One server: its clients (the OpenAI client and the probes share one connection pool), whether
    it is up, and the pages it holds."""

    def __init__(self, url: str, settings: EngineSettings, verify: ssl.SSLContext | bool) -> None:
        from openai import AsyncOpenAI

        self.url = url
        self.root = server_root(url)
        timeout = httpx.Timeout(
            settings.page_timeout_seconds, connect=min(PROBE_TIMEOUT_SECONDS, settings.page_timeout_seconds)
        )
        # The probes send what the OpenAI client sends: the key as a bearer token, then the extra
        # headers (which win, so that a router's own Authorization goes through).
        self.http = httpx.AsyncClient(
            verify=verify,
            headers={"Authorization": f"Bearer {settings.api_key}", **settings.headers},
            timeout=timeout,
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),  # openai's own
        )
        self.client: AsyncOpenAI = AsyncOpenAI(
            base_url=url,
            api_key=settings.api_key,
            default_headers=settings.headers,
            # openai >= 3 is typed for httpx2 but takes an httpx client too (its "legacy" path);
            # httpx is chandrad's own dependency, and the one openai 2 takes.
            timeout=timeout,  # type: ignore[arg-type]  # an httpx.Timeout: openai's legacy path takes it
            max_retries=0,
            http_client=self.http,  # type: ignore[arg-type]  # an httpx client: openai's legacy path
        )
        self.up = False
        self.period = 0  # up-periods so far: a failure seen in an earlier one takes no later one down
        self.problem: str | None = "not checked yet"
        self.down_since = time.monotonic()
        self.in_flight = 0
        self.went_down = asyncio.Event()  # set when this up-period ends; a new one for each

    @property
    def log(self) -> structlog.typing.FilteringBoundLogger:
        """The fleet's logger with this server's url bound (bound per use: logging may be set up later)."""
        return log.bind(url=self.url)  # type: ignore[no-any-return]  # structlog's bind is typed Any

    async def probe(self) -> Probe:
        """``GET <root>/health`` then ``GET <url>/models``."""
        try:
            health = await self.http.get(f"{self.root}/health", timeout=PROBE_TIMEOUT_SECONDS)
            if health.status_code != 200:
                return Probe(problem=f"GET {self.root}/health answered HTTP {health.status_code}")
            models = await self.http.get(f"{self.url.rstrip('/')}/models", timeout=PROBE_TIMEOUT_SECONDS)
            if models.status_code != 200:
                return Probe(problem=f"GET {self.url.rstrip('/')}/models answered HTTP {models.status_code}")
            served = tuple(str(model["id"]) for model in models.json()["data"])
        except httpx.HTTPError as error:
            return Probe(problem=f"does not answer: {str(error) or type(error).__name__}")
        except (ValueError, KeyError, TypeError):
            return Probe(problem=f"GET {self.url.rstrip('/')}/models answered no model list")
        return Probe(served=served)

    async def aclose(self) -> None:
        await self.client.close()
        await self.http.aclose()


class Fleet:
    """The servers of ``engine.url``; ``call`` sends one request to one that is up."""

    def __init__(self, settings: EngineSettings) -> None:
        assert settings.urls, "a fleet needs at least one server"
        self.settings = settings
        verify = tls_verify(settings)
        self.endpoints = [Endpoint(url, settings, verify) for url in settings.urls]
        # Without served_model_name, the first server up may name the model (as before the fleet).
        self.model = settings.served_model_name or settings.model
        self._model_known = settings.served_model_name is not None
        self._limit = pages_in_flight(settings, "vllm-remote")
        self.recoveries = 0
        self._started = False
        self._closed = False
        self._changed = asyncio.Event()  # replaced at every change: who waits for a server wakes up
        self._watchers: list[asyncio.Task[None]] = []

    # -- what the daemon reads ----------------------------------------------------------------

    @property
    def state(self) -> str:
        if not self._started:
            return "starting"
        down = [endpoint.url for endpoint in self.endpoints if not endpoint.up]
        if not down:
            return "up"
        up, total = len(self.endpoints) - len(down), len(self.endpoints)
        return f"{'up' if up else 'down'} ({up} of {total} servers; {', '.join(down)} down)"

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Probe every server once; ready if one is up. The others are retried in the background.

        Raises:
            PermanentError: no server is up and every one serves another model.
            TransientError: no server is up, and some do not answer.
        """
        probes = await asyncio.gather(*(endpoint.probe() for endpoint in self.endpoints))
        wrong_model = 0
        for endpoint, probe in zip(self.endpoints, probes, strict=True):
            problem = probe.problem if probe.problem is not None else self._model_problem(endpoint, probe.served)
            if problem is None:
                self._bring_up(endpoint)
            else:
                wrong_model += probe.problem is None
                endpoint.problem = problem
        if not any(endpoint.up for endpoint in self.endpoints):
            await self.aclose()
            reasons = "; ".join(self._describe(endpoint) for endpoint in self.endpoints)
            if wrong_model == len(self.endpoints):
                raise PermanentError(reasons)
            raise TransientError(reasons)
        for endpoint in self.endpoints:
            if not endpoint.up:
                endpoint.log.warning("server down at start; retried in the background", reason=endpoint.problem)
        self._started = True
        self._watchers = [
            asyncio.create_task(self._watch(endpoint), name=f"server-health-{index}")
            for index, endpoint in enumerate(self.endpoints)
        ]
        log.info(
            "remote engine ready",
            url=self.endpoints[0].url if len(self.endpoints) == 1 else [e.url for e in self.endpoints],
            model=self.model,
            servers_up=sum(endpoint.up for endpoint in self.endpoints),
        )

    async def aclose(self) -> None:
        self._closed = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await asyncio.gather(*(endpoint.aclose() for endpoint in self.endpoints), return_exceptions=True)

    def _describe(self, endpoint: Endpoint) -> str:
        if endpoint.problem is not None and endpoint.problem.startswith("serves "):
            return f"the server at {endpoint.url} {endpoint.problem}"
        return f"the vLLM server at {endpoint.url} {endpoint.problem}"

    def _model_problem(self, endpoint: Endpoint, served: tuple[str, ...]) -> str | None:
        """None if ``endpoint`` serves the fleet's model; else what it serves instead."""
        if self.model in served:
            self._model_known = True
            return None
        if not self._model_known and served:
            self.model, self._model_known = served[0], True
            endpoint.log.info("served_model_name is not set: using the server's model", model=self.model)
            return None
        return f"serves {list(served)}, not {self.model!r}"

    async def _check(self, endpoint: Endpoint) -> str | None:
        probe = await endpoint.probe()
        return probe.problem if probe.problem is not None else self._model_problem(endpoint, probe.served)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _bring_up(self, endpoint: Endpoint) -> None:
        endpoint.up, endpoint.problem = True, None
        endpoint.period += 1
        endpoint.went_down = asyncio.Event()
        self._notify()

    def _take_down(self, endpoint: Endpoint, period: int, reason: str) -> None:
        """Take ``endpoint`` out, once per up-period however many pages saw it fail."""
        if not endpoint.up or endpoint.period != period:
            return
        endpoint.up, endpoint.problem = False, reason
        endpoint.down_since = time.monotonic()
        endpoint.went_down.set()  # its pages still in flight move too (a hung server answers none)
        endpoint.log.warning("server down", reason=reason, pages_in_flight=endpoint.in_flight)
        if not any(other.up for other in self.endpoints):
            log.warning("no server is up: pages wait for one to come back", servers=len(self.endpoints))
        self._notify()

    async def _watch(self, endpoint: Endpoint) -> None:
        """The health loop of one server, kept alive: an error it does not expect (a bug, a closed
        client) is logged and the loop starts again, instead of ending it silently, which would leave
        a server that went down never taken back."""
        while not self._closed:
            try:
                await self._watch_once(endpoint)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                endpoint.log.error("the server's health loop failed; starting it again", error=repr(error))
                await asyncio.sleep(max(self.settings.restart_backoff_seconds, MIN_PROBE_INTERVAL_SECONDS))

    async def _watch_once(self, endpoint: Endpoint) -> None:
        """While up, a health check every ``health_check_seconds``; while down, probes with backoff."""
        settings = self.settings
        attempt = 0
        last_problem: str | None = None
        while not self._closed:
            if endpoint.up:
                attempt, period, went_down = 0, endpoint.period, endpoint.went_down
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settings.health_check_seconds):
                        await went_down.wait()
                if endpoint.up and endpoint.period == period:
                    problem = await self._check(endpoint)
                    if problem is not None:
                        self._take_down(endpoint, period, f"health check: {problem}")
                continue
            attempt += 1
            delay = max(
                backoff_seconds(settings.restart_backoff_seconds, attempt, settings.restart_backoff_max_seconds),
                MIN_PROBE_INTERVAL_SECONDS,
            )
            await asyncio.sleep(delay)
            problem = await self._check(endpoint)
            if problem is None:
                self._bring_up(endpoint)
                self.recoveries += 1
                endpoint.log.warning(
                    "server back",
                    down_s=round(time.monotonic() - endpoint.down_since, 1),
                    recoveries=self.recoveries,
                )
                last_problem = None
            elif problem != last_problem:
                endpoint.log.info("server still down", reason=problem, attempt=attempt, retry_in_s=delay)
                last_problem = problem

    # -- requests ------------------------------------------------------------------------------

    async def _take(self, deadline: float) -> Endpoint:
        """The server up with the fewest pages in flight and room for one more; waits for one.

        Raises:
            WaitError: no server came up before ``deadline`` (monotonic).
        """
        while True:
            up = [endpoint for endpoint in self.endpoints if endpoint.up]
            share = math.ceil(self._limit / max(1, len(up)))
            free = [endpoint for endpoint in up if endpoint.in_flight < share]
            if free:
                endpoint = min(free, key=lambda e: e.in_flight)
                endpoint.in_flight += 1
                return endpoint
            changed = self._changed
            left = deadline - time.monotonic()
            if not up and left <= 0:
                raise WaitError(
                    f"no vLLM server is up ({'; '.join(self._describe(e) for e in self.endpoints)}); "
                    "the document waits for one to come back",
                    stage="engine",
                )
            try:
                async with asyncio.timeout(left if not up else None):
                    await changed.wait()
            except TimeoutError:
                continue

    async def call(self, send: Callable[[AsyncOpenAI], Awaitable[T]], doc_id: str, page_no: int, deadline: float) -> T:
        """``send(client)`` on a server that is up, moved to another whenever its server fails.

        Raises:
            PermanentError: the server refused the page itself (a 4xx: too long for the model, ...).
            TransientError: every server failed this page with a 5xx or a timeout.
            WaitError: no server was up until ``deadline``.
            EngineDied: ``poison_page_deaths`` servers failed while the page was at them (it uses an
                attempt of its document; a wait would not).
        """
        blamed = busy = deaths = 0
        while True:
            endpoint = await self._take(deadline)
            period = endpoint.period
            try:
                return await self._send(endpoint, send, page_no)
            except ServerFailed as failed:
                self._take_down(endpoint, period, failed.reason)
                blamed += failed.blames_page
                deaths += failed.cut_mid_read
                if deaths >= self.settings.poison_page_deaths:
                    # A page that crashes every server it reaches would otherwise move (and wait,
                    # which uses no attempt) forever. Ended so, it uses one of its document's
                    # attempts: a page that was merely unlucky is read again later; one that kills
                    # servers fails after max_attempts instead of taking the fleet down for good.
                    log.warning(
                        "page ended: its servers failed while reading it",
                        doc=doc_id,
                        page=page_no,
                        failures=deaths,
                        reason=failed.reason,
                    )
                    raise EngineDied(
                        f"the vLLM server failed {deaths} times while it read this page ({failed.reason}); "
                        "the page may be what crashes it",
                        stage="engine",
                    ) from None
                others_up = any(other.up for other in self.endpoints)
                endpoint.log.info(
                    "page moved to another server" if others_up else "page waits for a server to come back",
                    doc=doc_id,
                    page=page_no,
                    reason=failed.reason,
                )
                if blamed >= len(self.endpoints):
                    raise TransientError(f"the vLLM server failed: {failed.reason}", stage="engine") from None
            except ServerBusy:
                busy += 1
                delay = backoff_seconds(
                    max(self.settings.restart_backoff_seconds, 0.1), busy, self.settings.restart_backoff_max_seconds
                )
                endpoint.log.info("server busy (HTTP 429); page sent again", doc=doc_id, page=page_no, retry_in_s=delay)
                await asyncio.sleep(delay)
            finally:
                endpoint.in_flight -= 1
                self._notify()

    async def _send(self, endpoint: Endpoint, send: Callable[[AsyncOpenAI], Awaitable[T]], page_no: int) -> T:
        """One request, ended early if a health check takes its server out meanwhile."""
        from openai import APIConnectionError, APIStatusError, APITimeoutError

        async def request() -> T:
            return await send(endpoint.client)

        sending = asyncio.ensure_future(request())
        went_down = asyncio.ensure_future(endpoint.went_down.wait())
        try:
            await asyncio.wait({sending, went_down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sending.cancel()  # a no-op once it is done
            went_down.cancel()
        if not sending.done() or sending.cancelled():
            # Taken out for another page's failure or a health check: not evidence against this one.
            raise ServerFailed(f"taken out while the page was at it ({endpoint.problem})", blames_page=False)
        try:
            return sending.result()
        except APIStatusError as error:
            code = error.status_code
            if code == 429:
                raise ServerBusy() from None
            if code >= 500 or code in SERVER_SIDE_4XX:
                raise ServerFailed(f"HTTP {code}", blames_page=code >= 500) from None
            if 400 <= code < 500:
                raise PermanentError(f"the server refused page {page_no}: {error.message}", stage="engine") from None
            raise TransientError(f"the vLLM server failed: HTTP {code}", stage="engine") from None
        except APITimeoutError:
            raise ServerFailed("timed out", blames_page=True) from None
        except APIConnectionError as error:
            cause = error.__cause__ or error
            raise ServerFailed(
                f"connection failed: {str(cause) or type(cause).__name__}",
                blames_page=False,
                # A refused connection never reached the server: only a cut one counts against the page.
                cut_mid_read=not isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout),
            ) from None
