"""The one backoff rule: exponential from a base, capped."""

from __future__ import annotations


def backoff_seconds(base: float, attempt: int, cap: float | None = None) -> float:
    """``base * 2**(attempt - 1)`` for attempt 1, 2, ...; at most ``cap``. The exponent stops
    growing at 30, so a long outage's thousandth retry cannot overflow a float."""
    delay = base * 2.0 ** min(max(attempt - 1, 0), 30)
    return delay if cap is None else min(delay, cap)
