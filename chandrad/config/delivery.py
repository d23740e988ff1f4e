"""``[[webhook]]``, ``[[hook]]`` and ``[delivery]``: who hears of a final document, and how."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from chandrad.config.base import EVENTS, Event, StrictModel, check_url


class _DeliveryTarget(StrictModel):
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
        return check_url(url)


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


class DeliverySettings(StrictModel):
    """How webhooks and hooks are sent: how many at once, and the backoff between attempts."""

    # Deliveries (HTTP requests and hook runs) at once; also the most HTTP connections kept open.
    concurrency: int = Field(default=8, ge=1, le=256)
    # A failed attempt is retried after backoff_seconds, then twice that, ... at most backoff_max_seconds.
    backoff_seconds: float = Field(default=10.0, gt=0)
    backoff_max_seconds: float = Field(default=900.0, gt=0)
