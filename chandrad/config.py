"""Settings: a TOML file plus ``CHANDRAD_*`` environment overrides, validated at construction.

Nothing else in chandrad reads the environment or a config file: the ``Settings`` object built
here is passed to whoever needs it. Bad settings fail at startup with a ``ConfigError`` that
names the key and says what to do, never on the first document.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from chandrad.errors import ConfigError

DEFAULT_CONFIG_PATHS = (Path("/etc/chandrad/config.toml"),)
DEFAULT_ROOT = Path("/srv/chandrad")

OutputFormat = Literal["md", "html", "json", "pdf"]
Event = Literal["published", "failed"]
EVENTS: tuple[Event, ...] = ("published", "failed")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@functools.lru_cache(maxsize=256)
def glob_regex(pattern: str) -> re.Pattern[str]:
    """A rule's glob as a regex on the path relative to the inbox ("/"-separated), case-insensitive
    like the inbox's include/ignore patterns: ``*`` and ``?`` stay within one folder level, ``[...]``
    is a character class (``[!...]`` negated), and ``**`` as a whole level matches any number of
    levels (``invoices/**``: everything under invoices/; ``**/*.tif``: a .tif at any depth, the
    inbox's top level included). A pattern without "/" matches files at the top level only."""
    parts: list[str] = []
    segments = pattern.split("/")
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == "**":
            parts.append(".*" if last else "(?:[^/]*/)*")
            continue
        parts.append(_segment_regex(segment) + ("" if last else "/"))
    return re.compile("".join(parts), re.IGNORECASE)


def _segment_regex(segment: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(segment):
        char = segment[i]
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = segment.find("]", i + 2 if segment[i + 1 : i + 2] in ("!", "^") else i + 1)
            if end == -1:
                raise ValueError(f"unclosed [ in the pattern segment {segment!r}")
            body = segment[i + 1 : end]
            if body[:1] in ("!", "^"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def glob_matches(pattern: str, rel_path: str) -> bool:
    return glob_regex(pattern).fullmatch(rel_path.replace(os.sep, "/")) is not None


class InboxRule(_Strict):
    """``[[inbox.rule]]``: settings for the files of an inbox whose relative path matches ``match``.
    Keys left out keep the inbox's own value; the first rule that matches wins."""

    match: str
    prompt_type: Literal["ocr_layout", "ocr"] | None = None
    formats: tuple[OutputFormat, ...] | None = None
    on_success: Literal["archive", "delete", "keep"] | None = None
    date_prefix: bool | None = None
    duplicates: Literal["skip", "reprocess"] | None = None
    # Which [[webhook]] / [[hook]] names apply to these files (instead of those the inbox gets); [] = none.
    webhooks: tuple[str, ...] | None = None
    hooks: tuple[str, ...] | None = None

    @field_validator("match")
    @classmethod
    def _valid_glob(cls, match: str) -> str:
        if not match or match.startswith("/") or ".." in match.split("/"):
            raise ValueError(f'match {match!r} must be a glob relative to the inbox, such as "invoices/**"')
        try:
            glob_regex(match)
        except (ValueError, re.error) as error:
            raise ValueError(f"match {match!r} is not a valid glob: {error}") from None
        return match

    @field_validator("formats")
    @classmethod
    def _formats_not_empty(cls, formats: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if formats is not None and not formats:
            raise ValueError("list at least one of md, html, json, pdf")
        return formats

    def overrides(self) -> dict[str, Any]:
        """The inbox keys this rule sets."""
        keys = ("prompt_type", "formats", "on_success", "date_prefix", "duplicates", "webhooks", "hooks")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}


class InboxSettings(_Strict):
    """One watched folder and where its documents go."""

    path: Path
    outbox: Path
    archive: Path | None = None
    failed: Path
    name: str = ""
    recursive: bool = True
    # "auto": polling when the inbox lives on cifs/smb/nfs/fuse (inotify sees no remote writes there).
    polling: Literal["auto"] | bool = "auto"
    poll_interval_seconds: float = Field(default=5.0, gt=0)
    rescan_seconds: float = Field(default=300.0, gt=0)
    settle_seconds: float = Field(default=5.0, ge=0)
    # Scanners that create the name empty and fill it later: an empty file must stay empty this long.
    empty_settle_seconds: float = Field(default=60.0, ge=0)
    include: tuple[str, ...] = ("*",)
    ignore: tuple[str, ...] = ()
    on_success: Literal["archive", "delete", "keep"] = "archive"
    prompt_type: Literal["ocr_layout", "ocr"] = "ocr_layout"
    formats: tuple[OutputFormat, ...] = ("md", "html", "json")
    date_prefix: bool = False
    duplicates: Literal["skip", "reprocess"] = "skip"
    compress: Literal["lossless", "ebook", "printer"] = "lossless"
    pdf_password: str | None = None
    # The searchable PDF ("pdf" in formats): PDF/A-2b unless false; a text layer already in the PDF is
    # kept (no doubled text) unless pdf_replace_text; pdf_word_boxes places each word on its own box;
    # pdf_to also drops the PDF into another folder (e.g. a document system's consume folder).
    pdfa: bool = True
    pdf_replace_text: bool = False
    pdf_word_boxes: bool = True
    pdf_to: Path | None = None
    # Which [[webhook]] / [[hook]] names apply to this inbox's documents. Default (unset): every one
    # whose own `inboxes` list names this inbox or is unset.
    webhooks: tuple[str, ...] | None = None
    hooks: tuple[str, ...] | None = None
    # [[inbox.rule]] tables: settings per sub-folder or kind of file, the first match wins.
    rule: tuple[InboxRule, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _derive_folders(cls, data: Any) -> Any:
        """Only ``path`` is required: outbox/archive/failed default to siblings of the inbox."""
        if isinstance(data, dict) and "path" in data:
            base = Path(data["path"]).parent
            data = dict(data)
            data.setdefault("outbox", base / "outbox")
            data.setdefault("failed", base / "failed")
            rules = data.get("rule") or ()
            wants_archive = [data.get("on_success", "archive")] + [
                rule.get("on_success") if isinstance(rule, dict) else getattr(rule, "on_success", None)
                for rule in rules
            ]
            if "archive" in wants_archive:
                data.setdefault("archive", base / "archive")
            data.setdefault("name", Path(data["path"]).name)
        return data

    @field_validator("formats")
    @classmethod
    def _formats_not_empty(cls, formats: tuple[str, ...]) -> tuple[str, ...]:
        if not formats:
            raise ValueError("list at least one of md, html, json, pdf")
        return formats

    @model_validator(mode="after")
    def _archive_needed(self) -> InboxSettings:
        if self.on_success == "archive" and self.archive is None:
            raise ValueError('on_success = "archive" needs an archive folder')
        for rule in self.rule:
            if rule.on_success == "archive" and self.archive is None:
                raise ValueError(f'the rule for {rule.match!r} sets on_success = "archive": give the inbox an archive')
        return self

    def rule_for(self, rel_path: str) -> tuple[int, InboxRule] | None:
        """The first rule matching ``rel_path`` (relative to the inbox) and its number (1, 2, ...)."""
        for number, rule in enumerate(self.rule, start=1):
            if glob_matches(rule.match, rel_path):
                return number, rule
        return None

    def folder_rules(self, rel_folder: str) -> tuple[tuple[int, InboxRule] | None, list[tuple[int, InboxRule]]]:
        """For ``chandrad check``: the rule every file directly in ``rel_folder`` gets ("" is the
        inbox's top level; None: the inbox's own settings), and the earlier rules that take some
        of its files first by their names (such as ``**/*.tif``)."""
        prefix = f"{rel_folder.strip('/')}/" if rel_folder.strip("/") else ""
        anything = prefix + "\x01\x01name"  # stands for any name: matched by * and **, never by *.tif
        by_name: list[tuple[int, InboxRule]] = []
        for number, rule in enumerate(self.rule, start=1):
            if glob_matches(rule.match, anything):
                return (number, rule), by_name
            head, _, last = rule.match.rpartition("/")
            if last != "**" and glob_matches(f"{head}/*" if head else "*", anything):
                by_name.append((number, rule))
        return None, by_name

    def effective(self, rel_path: str) -> InboxSettings:
        """This inbox's settings as they apply to the file at ``rel_path``: the first matching
        rule's keys over the inbox's own. The one place rules are resolved; applying it twice
        gives the same settings (the rules are kept)."""
        found = self.rule_for(rel_path)
        if found is None:
            return self
        return self.model_copy(update=found[1].overrides())

    @property
    def destinations(self) -> dict[str, Path]:
        folders = {"outbox": self.outbox, "failed": self.failed}
        if self.archive is not None:
            folders["archive"] = self.archive
        if self.pdf_to is not None:
            folders["pdf_to"] = self.pdf_to
        return folders


class EngineSettings(_Strict):
    """Which OCR engine turns page images into Chandra HTML, and how it runs."""

    # "auto": vLLM when a CUDA GPU is visible, else tesseract (with a loud warning).
    kind: Literal["auto", "vllm", "tesseract"] = "auto"
    # A Hugging Face id (datalab-to/chandra-ocr-2, datalab-to/chandra) or a local model directory.
    model: str = "datalab-to/chandra-ocr-2"
    # Pages at the engine at once, across all documents; default: max_num_seqs (vLLM), cores (tesseract).
    max_pages_in_flight: int | None = Field(default=None, ge=1)
    page_timeout_seconds: float = Field(default=600.0, gt=0)
    tesseract_languages: str = "eng"

    # -- vLLM (see DESIGN.md "Engine facts"; defaults are Chandra 2's serving settings but the two
    # batch sizes, chosen from bench/NOTES-gpu.md's tuning table) --
    # A vLLM OpenAI-compatible server (".../v1") to use instead of an in-process engine, or a list of
    # them (a fleet: each health-checked, pages spread over those up, moved off one that fails).
    url: str | tuple[str, ...] | None = None
    api_key: str = "EMPTY"
    served_model_name: str | None = None
    # TLS for https:// servers: a CA bundle (PEM) to trust instead of the system's; extra HTTP
    # headers sent with every request (a router's routing or auth headers).
    ca_bundle: Path | None = None
    headers: dict[str, str] = {}
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int = Field(default=18000, ge=256)
    # Twice Chandra's serving settings (96 / 8192): on an H200 the raw engine read 3.81 pages/s at
    # 192 against 3.22 at 96, and 384 added 4 % for twice the page latency (bench/NOTES-gpu.md §6).
    # On a smaller GPU vLLM simply admits the sequences its KV cache holds.
    max_num_seqs: int = Field(default=192, ge=1)
    max_num_batched_tokens: int | None = Field(default=16384, ge=256)
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=0.98)
    # KV cache size in GiB instead of a share of GPU memory (required on CPU).
    kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    enable_prefix_caching: bool = True
    min_pixels: int = Field(default=3136, ge=784)
    max_pixels: int = Field(default=6_291_456, ge=784)
    # vLLM's cache of processed images: every scanned page is new, so it only costs hashing and
    # memory; it must be 0 when renderer_workers > 1 (vLLM's cache is not thread-safe).
    mm_processor_cache_gb: float = Field(default=0.0, ge=0)
    # Threads that tokenise prompts and run the image processor off the event loop, per engine
    # front end (vLLM's renderer_num_workers); one thread does ~5 pages/s on an H200 host.
    renderer_workers: int = Field(default=4, ge=1)
    enforce_eager: bool = False
    speculative_config: dict[str, Any] | None = None
    # Anything else for vllm's AsyncEngineArgs, passed through as is (wins over the above).
    engine_args: dict[str, Any] = {}
    # Chandra's output limit and retry ladder: greedy first; on a repetition loop or an engine
    # error, retry with rising temperature, at most max_retries times.
    max_tokens: int = Field(default=12384, ge=1)
    max_retries: int = Field(default=6, ge=0)
    # vLLM's built-in loop detector (where the installed vLLM has it): stop a page whose output ends
    # in a pattern of up to this many tokens repeated repetition_min_count times; 0 turns it off.
    # Conservative on purpose: long runs of empty table cells are legitimate repetition.
    repetition_max_pattern_tokens: int = Field(default=32, ge=0)
    repetition_min_count: int = Field(default=40, ge=2)
    # Benchmarks only: generate exactly max_tokens tokens per page (random-weight stand-ins).
    bench_force_max_tokens: bool = False

    # -- GPUs --
    gpus: tuple[int, ...] = (0,)
    # "auto": "single" for one GPU, "replicas" for several (1.98x one GPU on two H200s, where vLLM's
    # data-parallel mode gave 1.33x: bench/results/gpu-2xh200-replicas-*, README "Performance").
    layout: Literal["auto", "single", "replicas", "data-parallel", "tensor-parallel", "encoder-split"] = "auto"

    # -- supervision --
    # Restart the engine after this many pages (planned recycle against slow memory growth).
    recycle_after_pages: int | None = Field(default=None, ge=1)
    # ...or when GPU memory in use (NVML; the engine processes' RSS on CPU) passes this many GiB.
    memory_watermark_gb: float | None = Field(default=None, gt=0)
    restart_backoff_seconds: float = Field(default=2.0, ge=0)
    restart_backoff_max_seconds: float = Field(default=60.0, ge=0)
    # A page in flight during this many engine deaths is then sent alone; if the engine dies with
    # it alone too, the page fails instead of crashing the engine forever.
    poison_page_deaths: int = Field(default=2, ge=1)
    health_check_seconds: float = Field(default=30.0, gt=0)
    start_timeout_seconds: float = Field(default=1800.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _resolve_layout(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("layout", "auto") == "auto":
            gpus = data.get("gpus", cls.model_fields["gpus"].default)
            data = {**data, "layout": "replicas" if isinstance(gpus, (list, tuple)) and len(gpus) > 1 else "single"}
        return data

    @field_validator("url")
    @classmethod
    def _http_urls(cls, url: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        if isinstance(url, tuple):
            if not url:
                raise ValueError("engine.url: give at least one server, or leave it out")
            if len(set(url)) != len(url):
                raise ValueError("engine.url names a server twice")
            return tuple(_check_url(one) for one in url)
        return None if url is None else _check_url(url)

    @property
    def urls(self) -> tuple[str, ...]:
        """The remote servers, as a list (empty: the engine runs in this process)."""
        if self.url is None:
            return ()
        return self.url if isinstance(self.url, tuple) else (self.url,)

    @model_validator(mode="after")
    def _check_pixels(self) -> EngineSettings:
        if self.min_pixels > self.max_pixels:
            raise ValueError("engine.min_pixels must not exceed engine.max_pixels")
        if self.renderer_workers > 1 and self.mm_processor_cache_gb > 0:
            raise ValueError(
                "engine.mm_processor_cache_gb > 0 needs engine.renderer_workers = 1 (vLLM's image cache is "
                "not thread-safe); scanned pages never repeat, so mm_processor_cache_gb = 0 is the better fix"
            )
        return self


class PrepareSettings(_Strict):
    """How documents become page images."""

    dpi: int = Field(default=192, ge=50, le=600)
    min_short_side_px: int = Field(default=1024, ge=0)
    # Chandra scales every page to at most 3072x2048 px (6.3 MP): rendering larger is wasted work.
    max_page_pixels: int = Field(default=6_291_456, ge=100_000)
    # Below this DPI a page is so large that the text cannot survive: refuse it.
    min_dpi: int = Field(default=10, ge=1)
    max_pages: int = Field(default=2000, ge=1)
    max_file_mb: int = Field(default=1024, ge=1)
    # Images whose header claims more pixels than this are refused before decoding (pixel bombs).
    max_image_pixels: int = Field(default=400_000_000, ge=1_000_000)
    subprocess_timeout_seconds: float = Field(default=300.0, gt=0)
    # Address space each gs/pdftoppm/pdfinfo run may use (MiB; 0 = no limit): a hostile PDF fails
    # with a reason instead of waking the kernel's OOM killer on a GPU server.
    tool_memory_mb: int = Field(default=4096, ge=0)
    workers: int = Field(default=2, ge=1)


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url {url!r} must be an http:// or https:// address with a host")
    return url


class _DeliveryTarget(_Strict):
    """What webhooks and hooks share: a name, the events and inboxes they are for, an age limit."""

    # How rules and logs name it; default: the url (webhook) or the program (hook).
    name: str = ""
    events: tuple[Event, ...] = EVENTS
    # Inbox names whose documents it gets; default: all.
    inboxes: tuple[str, ...] | None = None
    # Retried with backoff until it succeeds or this long after the document's final state.
    max_age_hours: float = Field(default=24.0, gt=0)

    @field_validator("events")
    @classmethod
    def _events_not_empty(cls, events: tuple[Event, ...]) -> tuple[Event, ...]:
        if not events:
            raise ValueError('list at least one of "published", "failed"')
        return events


class WebhookSettings(_DeliveryTarget):
    """``[[webhook]]``: a JSON POST to ``url`` after a document is published or failed."""

    url: str
    # Then every request carries X-Chandrad-Signature: sha256=<hex HMAC-SHA256 of the body>.
    secret: str | None = Field(default=None, min_length=1, repr=False)
    timeout_seconds: float = Field(default=10.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "url" in data and not data.get("name"):
            data = {**data, "name": str(data["url"])}
        return data

    @field_validator("url")
    @classmethod
    def _http_only(cls, url: str) -> str:
        return _check_url(url)


class HookSettings(_DeliveryTarget):
    """``[[hook]]``: a command run after a document is published or failed, with CHANDRAD_* variables."""

    # An argument list, never a shell string: ["/usr/local/bin/to-dms", "--tag", "scan"].
    command: tuple[str, ...] = Field(min_length=1)
    # Its process group is killed after this long (the run counts as failed).
    timeout_seconds: float = Field(default=60.0, gt=0)
    # Runs (with backoff) before a failing hook is given up; 1: never run again.
    max_attempts: int = Field(default=1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _argument_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("command"), str):
            raise ValueError(
                f"hook command {data['command']!r} must be an argument list, e.g. "
                f'command = ["/usr/local/bin/to-dms", "--tag", "scan"] (no shell runs it)'
            )
        if isinstance(data, dict) and data.get("command") and not data.get("name"):
            data = {**data, "name": str(data["command"][0])}
        return data

    @field_validator("command")
    @classmethod
    def _program_named(cls, command: tuple[str, ...]) -> tuple[str, ...]:
        if not command[0]:
            raise ValueError("the command's first argument (the program) is empty")
        return command


class DeliverySettings(_Strict):
    """How webhooks and hooks are sent: how many at once, and the backoff between attempts."""

    # Deliveries (HTTP requests and hook runs) at once; also the most HTTP connections kept open.
    concurrency: int = Field(default=8, ge=1, le=256)
    # A failed attempt is retried after backoff_seconds, then twice that, ... at most backoff_max_seconds.
    backoff_seconds: float = Field(default=10.0, gt=0)
    backoff_max_seconds: float = Field(default=900.0, gt=0)


class RetentionSettings(_Strict):
    """How long chandrad remembers final documents (docs/architecture.md, "Retention")."""

    # Final journal rows (published, failed), their delivery rows, seen and taken markers, and
    # the heartbeats of hosts dead for longer than this are pruned; a copy of a pruned document is
    # processed again (duplicates are recognised within this window). 0 keeps everything forever.
    days: float = Field(default=365.0, ge=0)
    # How often the background prune looks, and how many rows or markers it removes per step
    # (each step is one short transaction or a few unlinks, off the event loop). Daily: a pass
    # stats every seen marker on the share (bench/growth.py: 11 s for a million on local disk,
    # far longer over SMB), and a day is fine-grained enough for a window counted in days.
    interval_seconds: float = Field(default=86400.0, gt=0)
    batch_size: int = Field(default=500, ge=1, le=100_000)


class Settings(BaseSettings):
    """Everything chandrad can be told. ``config.example.toml`` documents each key."""

    model_config = SettingsConfigDict(
        env_prefix="CHANDRAD_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    state_dir: Path = Path("/var/lib/chandrad")
    # This host's name among several chandrad hosts sharing an inbox (docs/scaling.md): its claims
    # live in <inbox>/.chandrad/claimed/<host_id>/ with a heartbeat. Default: the machine's hostname.
    # Two machines must never share one.
    host_id: str = Field(default_factory=lambda: socket.gethostname() or "localhost", min_length=1, max_length=64)
    # Another host whose heartbeat has not changed for this long (as this host's clock counts) is
    # taken to be dead: its claimed documents are taken over and processed from the start here.
    takeover_seconds: float = Field(default=600.0, gt=0)
    # "auto": journald's native fields under systemd, JSON lines when not on a terminal, else pretty.
    log_format: Literal["auto", "json", "console", "journald"] = "auto"
    journal_socket: Path = Path("/run/systemd/journal/socket")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Documents worked on at once. Default: as many as pages the engine takes at once (at least 4):
    # scanners mostly drop one-page files, and each document in flight holds at most one page
    # waiting for the engine, so fewer documents than engine slots would starve a GPU.
    max_documents_in_flight: int | None = Field(default=None, ge=1)
    # A transient failure (engine died, disk full, timeout) is retried this many times in all.
    max_attempts: int = Field(default=3, ge=1)
    retry_backoff_seconds: float = Field(default=30.0, ge=0)
    # On SIGTERM in-flight documents get this long to finish before they are requeued.
    drain_seconds: float = Field(default=20.0, ge=0)
    # The whole stop, from SIGTERM to exit, whatever a share or the engine does: the drain, the
    # engine's close and the threads' join share it, and what is left resumes from the journal at the
    # next start. Keep it below the unit's TimeoutStopSec (3 min), or systemd SIGKILLs first.
    stop_timeout_seconds: float = Field(default=30.0, gt=0)
    # Share of a document's pages that may fail (e.g. a page the model cannot take) while the rest
    # is still published, with the gaps marked. 0: any failed page fails the document.
    max_page_error_rate: float = Field(default=0.0, ge=0, le=1)
    # Prometheus /metrics on host:port (local by default); "" turns it off.
    metrics_address: str = "127.0.0.1:9325"
    # systemd watchdog: pages at the engine with none finishing for this long means the pipeline
    # is hung, and the pings stop (systemd then restarts chandrad). Default: engine.page_timeout_seconds.
    watchdog_stall_seconds: float | None = Field(default=None, gt=0)
    engine: EngineSettings = EngineSettings()
    prepare: PrepareSettings = PrepareSettings()
    inbox: tuple[InboxSettings, ...] = ()
    webhook: tuple[WebhookSettings, ...] = ()
    hook: tuple[HookSettings, ...] = ()
    delivery: DeliverySettings = DeliverySettings()
    retention: RetentionSettings = RetentionSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file; the file arrives as init kwargs (see load_settings).
        return (env_settings, init_settings)

    @field_validator("host_id")
    @classmethod
    def _host_id_is_a_folder_name(cls, host_id: str) -> str:
        # It names a folder on every shared inbox: no separators, nothing hidden, nothing to escape.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", host_id):
            raise ValueError(
                f"host_id {host_id!r} must be letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return host_id

    @model_validator(mode="after")
    def _check_inboxes(self) -> Settings:
        if self.drain_seconds >= self.stop_timeout_seconds:
            raise ValueError(
                f"drain_seconds ({self.drain_seconds:g}) must be below stop_timeout_seconds "
                f"({self.stop_timeout_seconds:g}): the drain is part of the stop"
            )
        _check_folder_layout(self.inbox)
        _check_targets(self)
        return self

    def documents_in_flight(self, pages_in_flight: int) -> int:
        """Documents in progress at once: ``max_documents_in_flight``, else enough to keep the engine's
        ``pages_in_flight`` busy with one-page documents (at least 4)."""
        if self.max_documents_in_flight is not None:
            return self.max_documents_in_flight
        return max(4, pages_in_flight)

    def with_default_inbox(self) -> Settings:
        """Embedded defaults: one inbox under /srv/chandrad when none is configured."""
        if self.inbox:
            return self
        # model_validate: outbox and failed are derived from path by _derive_folders, which the
        # type checker cannot see through keyword arguments.
        default = InboxSettings.model_validate({"path": DEFAULT_ROOT / "inbox"})
        return self.model_copy(update={"inbox": (default,)})


def _is_within(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


# A folder on a share that stopped answering must not hold the start or a reload in validation.
RESOLVE_SECONDS = 5.0


def _resolved_all(paths: list[Path]) -> dict[Path, Path]:
    """Each path ``resolve()``d (symlinks followed: an outbox linked into an inbox is caught), all at
    once in daemon threads within RESOLVE_SECONDS in all; one that has not answered by then (a hung
    share) is made absolute without the filesystem, which catches every layout mistake but one made
    with a symlink on that share."""
    found: dict[Path, Path] = {}
    threads = []
    for path in dict.fromkeys(paths):

        def resolve(path: Path = path) -> None:
            found[path] = path.resolve()

        thread = threading.Thread(target=resolve, name="resolve", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + RESOLVE_SECONDS
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0))
    return {path: found.get(path) or Path(os.path.abspath(path)) for path in paths}


def _check_folder_layout(inboxes: tuple[InboxSettings, ...]) -> None:
    names = [inbox.name for inbox in inboxes]
    if len(set(names)) != len(names):
        raise ValueError(f'inbox names must be unique, got {names}; set name = "..." on each [[inbox]]')
    resolved_of = _resolved_all(
        [inbox.path for inbox in inboxes] + [folder for inbox in inboxes for folder in inbox.destinations.values()]
    )
    all_inboxes = [resolved_of[inbox.path] for inbox in inboxes]
    for inbox in inboxes:
        for role, folder in inbox.destinations.items():
            resolved = resolved_of[folder]
            for inbox_path in all_inboxes:
                if _is_within(resolved, inbox_path):
                    raise ValueError(
                        f"inbox {inbox.name!r}: {role} {folder} is inside the inbox {inbox_path}; "
                        f"move it out, or chandrad would process its own output"
                    )
                if _is_within(inbox_path, resolved):
                    raise ValueError(f"inbox {inbox_path} is inside {role} {folder} of inbox {inbox.name!r}")


def _check_targets(settings: Settings) -> None:
    """Webhook and hook names are unique, and every name an inbox or rule lists exists."""
    inbox_names = {inbox.name for inbox in settings.inbox}
    for table, targets in (("webhook", settings.webhook), ("hook", settings.hook)):
        names = [target.name for target in targets]
        if len(set(names)) != len(names):
            raise ValueError(f'[[{table}]] names must be unique, got {names}; set name = "..." on each')
        for target in targets:
            unknown = sorted(set(target.inboxes or ()) - inbox_names) if settings.inbox else []
            if unknown:
                raise ValueError(f"[[{table}]] {target.name!r}: inboxes {unknown} are not configured")
        known = set(names)
        for inbox in settings.inbox:
            listings = [(f"inbox {inbox.name!r}", getattr(inbox, f"{table}s"))]
            listings += [
                (f"inbox {inbox.name!r}, rule {rule.match!r}", getattr(rule, f"{table}s")) for rule in inbox.rule
            ]
            for where, listed in listings:
                missing = sorted(set(listed or ()) - known)
                if missing:
                    raise ValueError(f"{where}: {table}s {missing} name no [[{table}]] (known: {sorted(known)})")


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown key — check its spelling against config.example.toml"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def find_config_file(explicit: Path | None) -> Path | None:
    """The file to read: --config, else $CHANDRAD_CONFIG, else /etc/chandrad/config.toml if present."""
    if explicit is not None:
        return explicit
    from_env = os.environ.get("CHANDRAD_CONFIG")
    if from_env:
        return Path(from_env)
    return next((path for path in DEFAULT_CONFIG_PATHS if path.is_file()), None)


def load_settings(config_path: Path | None = None, **overrides: Any) -> Settings:
    """Read, merge and validate settings; raise ConfigError with a readable message."""
    path = find_config_file(config_path)
    file_values: dict[str, Any] = {}
    source = "embedded defaults"
    if path is not None:
        source = str(path)
        try:
            with path.open("rb") as handle:
                file_values = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; create it from config.example.toml") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    file_values.update(overrides)
    try:
        settings = Settings(**file_values)
        return settings.with_default_inbox()
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None
    except ValueError as error:
        raise ConfigError(f"invalid configuration ({source}): {error}") from None


def prepare_folders(settings: Settings) -> None:
    """Create state, inbox and destination folders; refuse with a clear message if one cannot be."""
    folders = [settings.state_dir]
    for inbox in settings.inbox:
        folders.append(inbox.path)
        folders.extend(inbox.destinations.values())
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"cannot create folder {folder}: {error.strerror}; create it and give chandrad's user write access"
            ) from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"folder {folder} is not writable by chandrad's user (uid {os.getuid()})")


__all__ = [
    "ConfigError",
    "DeliverySettings",
    "EngineSettings",
    "HookSettings",
    "InboxRule",
    "InboxSettings",
    "PrepareSettings",
    "RetentionSettings",
    "Settings",
    "WebhookSettings",
    "glob_matches",
    "load_settings",
    "prepare_folders",
]
