"""``Settings``: everything chandrad can be told, the checks across its parts (folder layout,
delivery names), and ``[retention]``."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from chandrad.config.base import DEFAULT_ROOT, StrictModel
from chandrad.config.delivery import DeliverySettings, HookSettings, WebhookSettings
from chandrad.config.engine import EngineSettings, PrepareSettings
from chandrad.config.inbox import InboxSettings


class RetentionSettings(StrictModel):
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
