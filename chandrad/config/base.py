"""What every part of the settings shares: strict frozen models, the default root, the output formats and events."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

DEFAULT_ROOT = Path("/srv/chandrad")

OutputFormat = Literal["md", "html", "json", "pdf"]
Event = Literal["published", "failed"]
EVENTS: tuple[Event, ...] = ("published", "failed")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url {url!r} must be an http:// or https:// address with a host")
    return url
