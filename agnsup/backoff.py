"""Polling with growing sleeps: the one back-off every waiter uses (a first check costs no sleep;
a long wait costs few wake-ups)."""
from __future__ import annotations

import time


def delays(first: float, most: float, factor: float = 2.0):
    """first, first * factor, ..., never more than `most`: the sleeps of one wait."""
    d = first
    while True:
        yield d
        d = min(d * factor, most)


def until(done, deadline: float | None, first: float, most: float) -> bool:
    """Call `done()` until it is true (True), sleeping `delays(first, most)` between calls, or until the
    monotonic `deadline` passed (False; None: never). The last sleep ends at the deadline."""
    for d in delays(first, most):
        if done():
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        time.sleep(d if left is None else min(d, left))
    return False  # not reached: delays() never ends
