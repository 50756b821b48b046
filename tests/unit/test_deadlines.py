"""util/deadlines.Deadlines: the one timer thread behind pod.Linger and the cgroup hold (backend/cgroups._Held)."""
import threading
import time

from agnsup.util.deadlines import Deadlines


def _fired():
    got, done = [], threading.Event()

    def fire(key, value):
        got.append((key, value))
        done.set()
    return got, done, fire


def test_a_key_fires_once_when_due_with_its_last_value_and_later_puts_postpone_it():
    got, done, fire = _fired()
    d = Deadlines(fire, "t")
    assert d.put("a", 0.2, lambda old: [old, 1])
    assert d.put("a", 0.2, lambda old: [old, 2])  # postponed, its value made from the old one
    assert d.has("a") and d.keys() == ["a"]
    assert done.wait(5)
    assert got == [("a", [[None, 1], 2])]
    assert not d.has("a")
    assert d.close() == {}


def test_pop_takes_a_key_out_before_it_fires_and_close_hands_back_what_waits():
    got, _, fire = _fired()
    d = Deadlines(fire, "t")
    d.put("a", 30, lambda _: "x")
    d.put("b", 30, lambda _: "y")
    assert d.pop("a") == "x" and d.pop("a", "none") == "none"
    assert d.close() == {"b": "y"}
    assert not d.put("c", 0, lambda _: "z")  # closed: the caller settles it itself
    time.sleep(0.05)
    assert got == []
