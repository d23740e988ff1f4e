"""A stop always stops: placeholder, filled in below."""

from __future__ import annotations

import asyncio
from typing import Any


def run_to_exit(daemon: Any) -> int:
    return int(asyncio.run(daemon.serve()))
