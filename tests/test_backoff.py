"""The one backoff rule: ``base * 2**(attempt - 1)``, capped, never overflowing."""

from __future__ import annotations

import pytest

from chandrad.backoff import backoff_seconds


@pytest.mark.parametrize(("attempt", "delay"), [(1, 30.0), (2, 60.0), (3, 120.0), (4, 240.0)])
def test_the_delay_doubles_from_the_base_with_each_attempt(attempt: int, delay: float) -> None:
    assert backoff_seconds(30.0, attempt) == delay


def test_attempt_zero_or_below_waits_the_base() -> None:
    assert backoff_seconds(5.0, 0) == backoff_seconds(5.0, -3) == 5.0


def test_the_cap_bounds_the_delay_and_leaves_shorter_delays_alone() -> None:
    assert backoff_seconds(1.0, 3, cap=60.0) == 4.0
    assert backoff_seconds(1.0, 7, cap=60.0) == 60.0


def test_the_exponent_stops_growing_at_30_so_a_long_outage_cannot_overflow() -> None:
    assert backoff_seconds(1.0, 31) == 2.0**30
    assert backoff_seconds(1.0, 10_000) == 2.0**30
    assert backoff_seconds(1.0, 10_000, cap=60.0) == 60.0


def test_a_zero_base_means_no_wait() -> None:
    assert backoff_seconds(0.0, 5) == 0.0
