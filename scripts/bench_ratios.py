"""The regression guard's judgement (scripts/bench_guard.py measures; this decides). Pure: no clock, no
process, no file but the history it is handed; tests/unit/test_bench_guard.py runs it.

A record is one measured run: {"commit", "date", "host": {"cgroup", "cores"}, "ratios": {NAME: {"ratio", ...}},
...}; bench/ratios.jsonl keeps one per line, oldest first. A ratio is a median of agnsup's cost over a floor
measured in the same interleaved rounds (agnsup run -- true over python -c pass; a serve cell over bwrap), so
the machine's own speed and load mostly cancel out. A new run is compared with the last record of the same host
kind (cgroup layout and core count: a pure-v2 machine or a wider one has other ratios), ratio by ratio:

    new <= 1.25 x old   ok
    new >  1.25 x old   WARN (exit 0: a line to read, not a red CI)
    new >  2 x old      FAIL, but only if a second interleaved measurement of that ratio is over 2x too
                        (one burst of load on a shared machine must not fail CI; a real regression is
                        over 2x both times)
"""
from __future__ import annotations

import json
import statistics

WARN_OVER = 1.25
FAIL_OVER = 2.0


def cgroup_layout(mounts: str) -> str:
    """'v2' (one cgroup2 hierarchy at /sys/fs/cgroup), 'hybrid' (v1 controllers beside a cgroup2 at
    /sys/fs/cgroup/unified), 'v1' (no cgroup2), from /proc/self/mounts' text."""
    v2_at, v1 = set(), False
    for line in mounts.splitlines():
        f = line.split()
        if len(f) < 3:
            continue
        if f[2] == "cgroup2":
            v2_at.add(f[1])
        elif f[2] == "cgroup":
            v1 = True
    if "/sys/fs/cgroup" in v2_at and not v1:
        return "v2"
    if v1:
        return "hybrid" if v2_at else "v1"
    return "v2" if v2_at else "none"


def host_kind(record: dict) -> tuple:
    """What makes two records comparable: the cgroup layout and the number of cores the run could use."""
    h = record.get("host") or {}
    return (h.get("cgroup"), h.get("cores"))


def ratio_of(num_ms: list[float], den_ms: list[float]) -> dict:
    """A ratio of two commands timed in the same rounds: medians (the compared figure) and lower quartiles."""
    def p25(xs):
        return statistics.quantiles(xs, n=4)[0] if len(xs) > 1 else xs[0]
    nm, dm = statistics.median(num_ms), statistics.median(den_ms)
    return {"ratio": round(nm / dm, 3), "p25_ratio": round(p25(num_ms) / p25(den_ms), 3),
            "num_median_ms": round(nm, 2), "den_median_ms": round(dm, 2),
            "num_p25_ms": round(p25(num_ms), 2), "den_p25_ms": round(p25(den_ms), 2), "rounds": len(num_ms)}


def parse_history(text: str, source: str = "bench/ratios.jsonl") -> list[dict]:
    """The records, oldest first; blank lines skipped; a line that is not a JSON object is an error
    naming its line (a hand-edited history must not be read as 'no previous record')."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{source}:{n}: not JSON: {e}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("ratios"), dict):
            raise ValueError(f"{source}:{n}: not a record (an object with 'ratios')")
        out.append(rec)
    return out


def previous(history: list[dict], record: dict) -> dict | None:
    """The last record of the same host kind as `record`, or None."""
    kind = host_kind(record)
    for rec in reversed(history):
        if host_kind(rec) == kind:
            return rec
    return None


def level(old: float, new: float) -> str:
    factor = new / old
    return "fail" if factor > FAIL_OVER else "warn" if factor > WARN_OVER else "ok"


class Verdict:
    """One ratio's comparison. level: ok, warn, fail; new (no previous value); gone (previous only)."""

    def __init__(self, name: str, old: float | None, new: float | None, level: str,
                 first: float | None = None):
        self.name, self.old, self.new, self.level = name, old, new, level
        self.first = first  # the first measurement, when `new` is a re-measure

    @property
    def factor(self) -> float | None:
        return self.new / self.old if self.old and self.new is not None else None

    def line(self) -> str:
        if self.level == "new":
            return f"new   {self.name} {self.new:.2f} (no previous value)"
        if self.level == "gone":
            return f"gone  {self.name} (was {self.old:.2f}; not measured now)"
        tag = {"ok": "ok   ", "warn": "WARN ", "fail": "FAIL "}[self.level]
        s = f"{tag} {self.name}: old {self.old:.2f}, new {self.new:.2f}, factor {self.factor:.2f}x"
        if self.level == "warn":
            s += f" (over {WARN_OVER}x)"
        if self.first is not None:
            s += (f" (first measure {self.first:.2f} = {self.first / self.old:.2f}x, over {FAIL_OVER}x: "
                  f"re-measured, {'over ' + str(FAIL_OVER) + 'x again' if self.level == 'fail' else 'not over ' + str(FAIL_OVER) + 'x'})")
        elif self.level == "fail":
            s += f" (over {FAIL_OVER}x)"
        return s


def compare(prev: dict | None, ratios: dict[str, float]) -> list[Verdict]:
    """Each ratio against the previous record's value of the same name (none: every ratio is new)."""
    old = {k: v["ratio"] for k, v in (prev or {}).get("ratios", {}).items()}
    out = []
    for name, new in ratios.items():
        out.append(Verdict(name, None, new, "new") if name not in old else Verdict(name, old[name], new,
                                                                                      level(old[name], new)))
    out += [Verdict(name, o, None, "gone") for name, o in old.items() if name not in ratios]
    return out


def guard(prev: dict | None, measure) -> tuple[list[Verdict], dict[str, float], dict[str, float]]:
    """Measure, compare, and re-measure once what failed: (verdicts, first ratios, re-measured ratios).
    `measure(names or None)` -> {name: ratio} (None: every ratio). A ratio fails only if its re-measure is
    over FAIL_OVER too; its verdict then carries both figures."""
    first = measure(None)
    verdicts = compare(prev, first)
    failing = [v.name for v in verdicts if v.level == "fail"]
    again: dict[str, float] = {}
    if failing:
        again = measure(failing)
        for v in verdicts:
            if v.name in failing:
                v.first, v.new = v.new, again[v.name]
                v.level = level(v.old, v.new)
    return verdicts, first, again


def exit_code(verdicts: list[Verdict]) -> int:
    return 1 if any(v.level == "fail" for v in verdicts) else 0
