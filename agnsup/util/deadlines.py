"""Keyed deadlines served by one timer thread: what a controller of many cells lets go of some seconds later (a pod's
linger, pod.Linger; the cgroup directories its cells hang from, backend/cgroups._Held)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable


class Deadlines:
    """{key: (value, due)}. When a key's time comes the thread takes it out and calls fire(key, value) outside the
    lock. The thread starts with the first deadline and wakes on every change; close() ends it and hands back
    what was still waiting, for the caller to settle at once."""

    def __init__(self, fire: Callable[[Any, Any], None], name: str):
        self._fire, self._name = fire, name
        self._due: dict = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, key, after: float, make: Callable[[Any], Any]) -> bool:
        """Set `key` due `after` s from now, its value make(the value it had, or None); False once closed."""
        with self._cv:
            if self._closed:
                return False
            old = self._due.get(key)
            self._due[key] = (make(old[0] if old else None), time.monotonic() + after)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return True

    def pop(self, key, default=None):
        """The key's value, no longer due (or `default`)."""
        with self._cv:
            item = self._due.pop(key, None)
            return item[0] if item is not None else default

    def has(self, key) -> bool:
        with self._cv:
            return key in self._due

    def keys(self) -> list:
        with self._cv:
            return list(self._due)

    def close(self) -> dict:
        """{key: value} of what was still waiting; the thread ends."""
        with self._cv:
            self._closed = True
            left, self._due = self._due, {}
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(5)
        return {k: v for k, (v, _) in left.items()}

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                due = [k for k, (_, at) in self._due.items() if at <= now]
                if not due:
                    wake = min((at for _, at in self._due.values()), default=None)
                    self._cv.wait(None if wake is None else max(0.0, wake - now))
                    continue
                fired = [(k, self._due.pop(k)[0]) for k in due]
            for key, value in fired:
                self._fire(key, value)
