"""Prometheus metrics, on a registry of this daemon's own (no global state), served on a local address."""

from __future__ import annotations

import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from chandrad import __version__
from chandrad.engine.base import Engine, EngineStatus, PageRequest, PageResult
from chandrad.errors import PermanentError

_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        Info("chandrad", "chandrad build", registry=registry).info({"version": __version__})
        self.documents = Counter("chandrad_documents", "Documents by outcome", ["inbox", "outcome"], registry=registry)
        self.pages = Counter("chandrad_pages", "Pages by outcome", ["outcome"], registry=registry)
        self.queue_depth = Gauge("chandrad_queue_depth", "Items waiting", ["queue"], registry=registry)
        self.documents_in_flight = Gauge("chandrad_documents_in_flight", "Documents being processed", registry=registry)
        self.pages_in_flight = Gauge("chandrad_pages_in_flight", "Pages at the engine", registry=registry)
        self.stage_seconds = Histogram(
            "chandrad_stage_seconds", "Time spent per stage", ["stage"], buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.tokens = Counter("chandrad_tokens", "Tokens processed by the engine", ["kind"], registry=registry)
        self.engine_restarts = Gauge(
            "chandrad_engine_restarts", "Unplanned engine restarts since start", registry=registry
        )
        self.engine_recycles = Gauge(
            "chandrad_engine_recycles", "Planned engine recycles since start", registry=registry
        )
        self.gpu_memory = Gauge("chandrad_gpu_memory_used_bytes", "GPU memory in use (NVML)", registry=registry)
        # Webhook requests and hook runs: "delivered", "retried" (an attempt failed, another follows),
        # "failed" (given up: a 4xx, max_attempts, max_age_hours, or the target is no longer configured).
        self.deliveries = Counter(
            "chandrad_deliveries", "Webhook and hook attempts by outcome", ["kind", "outcome"], registry=registry
        )
        self.deliveries_pending = Gauge(
            "chandrad_deliveries_pending", "Webhook and hook deliveries not yet done", registry=registry
        )
        self.ready = Gauge("chandrad_ready", "1 once watchers are armed and the engine answered", registry=registry)
        self._server: WSGIServer | None = None

    def serve(self, address: str) -> None:
        """Serve /metrics on ``host:port`` (a thread of prometheus_client's)."""
        host, _, port = address.rpartition(":")
        self._server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ObservedEngine:
    """An engine seen through metrics: pages in flight, latency, tokens, outcomes, last progress.

    The daemon's watchdog reads ``in_flight`` and ``last_progress``: pages at the engine while
    nothing completes for too long means the pipeline is hung, and systemd should know.
    """

    def __init__(self, engine: Engine, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._metrics = metrics
        self._clock = clock
        self.name = engine.name
        self.in_flight = 0
        self.last_progress = clock()
        self.pages_done = 0

    @property
    def model(self) -> str:
        return self._engine.model  # known only once the engine has started (a remote server names it)

    async def start(self) -> None:
        await self._engine.start()

    def status(self) -> EngineStatus:
        return self._engine.status()

    async def memory_in_use(self) -> int | None:
        return await self._engine.memory_in_use()

    def stopping(self) -> None:
        self._engine.stopping()

    async def aclose(self) -> None:
        await self._engine.aclose()

    async def ocr(self, request: PageRequest) -> PageResult:
        self.in_flight += 1
        self._metrics.pages_in_flight.inc()
        started = self._clock()
        try:
            result = await self._engine.ocr(request)
        except PermanentError:
            self._metrics.pages.labels("failed").inc()
            self.last_progress = self._clock()
            raise
        finally:
            self.in_flight -= 1
            self._metrics.pages_in_flight.dec()
        self.last_progress = self._clock()
        self.pages_done += 1
        self._metrics.pages.labels("ok").inc()
        self._metrics.stage_seconds.labels("page").observe(self.last_progress - started)
        self._metrics.tokens.labels("prompt").inc(result.prompt_tokens)
        self._metrics.tokens.labels("output").inc(result.output_tokens)
        return result
