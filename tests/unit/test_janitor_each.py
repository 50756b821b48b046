"""janitor._each: the releases (and the recovered cells' receipt files) side by side, never two of one key at once."""
from __future__ import annotations

import threading

import pytest

from agnsup import janitor


def test_each_does_every_item_once_and_one_keys_items_in_order_in_one_thread():
    items = [{"k": i % 3, "n": i} for i in range(12)]
    done, threads = [], {}
    lock = threading.Lock()

    def work(it):
        with lock:
            done.append(it["n"])
            threads.setdefault(it["k"], set()).add(threading.get_ident())
    janitor._each(work, items, key=lambda it: it["k"])
    assert sorted(done) == list(range(12))
    assert all(len(t) == 1 for t in threads.values())
    for k in range(3):
        assert [n for n in done if n % 3 == k] == [n for n in range(12) if n % 3 == k]


def test_each_with_a_key_per_item_runs_them_side_by_side_and_the_meanwhile_in_the_callers_thread():
    items = list(range(8))
    seen, main = set(), threading.get_ident()
    barrier = threading.Barrier(2, timeout=10)  # two items at once: only if they run side by side
    ran = []

    def work(i):
        seen.add(threading.get_ident())
        if i < 2:
            barrier.wait()
    janitor._each(work, items, meanwhile=lambda: ran.append(threading.get_ident()), key=id)
    assert ran == [main] and len(seen) >= 2


def test_each_raises_what_a_worker_raised():
    def work(i):
        if i == 3:
            raise OSError(5, "boom")
    with pytest.raises(OSError, match="boom"):
        janitor._each(work, list(range(6)), key=id)
