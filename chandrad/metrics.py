"""Prometheus metrics, on a registry of this daemon's own (no global state), served on a local address."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from chandrad import __version__

_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        Info("chandrad", "chandrad build", registry=registry).info({"version": __version__})
        self.documents = Counter("chandrad_documents", "Documents by outcome", ["inbox", "outcome"],
                                 registry=registry)
        self.pages = Counter("chandrad_pages", "Pages by outcome", ["outcome"], registry=registry)
        self.queue_depth = Gauge("chandrad_queue_depth", "Items waiting", ["queue"], registry=registry)
        self.documents_in_flight = Gauge("chandrad_documents_in_flight", "Documents being processed",
                                         registry=registry)
        self.pages_in_flight = Gauge("chandrad_pages_in_flight", "Pages at the engine", registry=registry)
        self.stage_seconds = Histogram("chandrad_stage_seconds", "Time spent per stage", ["stage"],
                                       buckets=_LATENCY_BUCKETS, registry=registry)
        self.tokens = Counter("chandrad_tokens", "Tokens processed by the engine", ["kind"], registry=registry)
        self.engine_restarts = Gauge("chandrad_engine_restarts", "Unplanned engine restarts since start",
                                     registry=registry)
        self.engine_recycles = Gauge("chandrad_engine_recycles", "Planned engine recycles since start",
                                     registry=registry)
        self.gpu_memory = Gauge("chandrad_gpu_memory_used_bytes", "GPU memory in use (NVML)", registry=registry)
        self.ready = Gauge("chandrad_ready", "1 once watchers are armed and the engine answered", registry=registry)
        self._server = None

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

    def __init__(self, engine: object, metrics: Metrics, clock: object = None) -> None:
        import time

        self._engine = engine
        self._metrics = metrics
        self._clock = clock or time.monotonic
        self.in_flight = 0
        self.last_progress = self._clock()  # type: ignore[operator]
        self.pages_done = 0

    def __getattr__(self, name: str) -> object:  # name, model, stats, restarts, ... of the real engine
        return getattr(self._engine, name)

    async def start(self) -> None:
        await self._engine.start()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        await self._engine.aclose()  # type: ignore[attr-defined]

    async def ocr(self, request: object) -> object:
        from chandrad.errors import PermanentError

        self.in_flight += 1
        self._metrics.pages_in_flight.inc()
        started = self._clock()  # type: ignore[operator]
        try:
            result = await self._engine.ocr(request)  # type: ignore[attr-defined]
        except PermanentError:
            self._metrics.pages.labels("failed").inc()
            self.last_progress = self._clock()  # type: ignore[operator]
            raise
        finally:
            self.in_flight -= 1
            self._metrics.pages_in_flight.dec()
        self.last_progress = self._clock()  # type: ignore[operator]
        self.pages_done += 1
        self._metrics.pages.labels("ok").inc()
        self._metrics.stage_seconds.labels("page").observe(self.last_progress - started)  # type: ignore[operator]
        self._metrics.tokens.labels("prompt").inc(result.prompt_tokens)
        self._metrics.tokens.labels("output").inc(result.output_tokens)
        return result
