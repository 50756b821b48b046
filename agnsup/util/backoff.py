"""Polling with growing sleeps: the one back-off of every wait (its first check costs no sleep)."""
from __future__ import annotations

import time


def delays(first: float, most: float, factor: float = 2.0):
    """first, first * factor, ..., never more than `most`: the sleeps of one wait."""
    d = first
    while True:
        yield d
        d = min(d * factor, most)


def until(done, deadline: float, first: float, most: float) -> bool:
    """Call `done()` until it is true (True), sleeping `delays(first, most)` between calls, or until the
    monotonic `deadline` passed (False). The last sleep ends at the deadline."""
    for d in delays(first, most):
        if done():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(d, left))
    return False  # not reached: delays() never ends
