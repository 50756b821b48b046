"""Redaction's speed (run by scripts/bench redact): MB/s of agnsup.redact.Redactor over returned output.

    bench_redact.py [--kib 64] [--rounds 20]

Three texts of the same size: ordinary log lines (every rule's prefilter rules it out: a string scan),
the same with a bearer token and a GitHub token every 4 KiB (the rules' regular expressions run and
substitute), and one line of 64 KiB without a newline. All rule sets, two host secrets. Medians of
`rounds`; the earlier timed unit test's bound was 20 ms per 64 KiB of ordinary output (3.2 MB/s).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from agnsup.redact import Redactor

RULES = ["host_secrets", "key_formats", "bearer_tokens", "private_keys"]
TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"  # made up, in the documented format


def texts(size: int) -> dict[str, str]:
    line = "2024-01-01 INFO build step ok path=/src/app/module.py line=42 user@host\n"
    ordinary = (line * (size // len(line) + 1))[:size]
    block = (line * 60)[:4000] + f"Authorization: Bearer {TOKEN}\n"
    secrets = (block * (size // len(block) + 1))[:size]
    return {"ordinary": ordinary, "a token every 4 KiB": secrets, "one long line": "x" * size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"{args.kib} KiB per text, median of {args.rounds}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}:")
    for name, text in texts(args.kib << 10).items():
        took = []
        for _ in range(args.rounds):
            red = Redactor(RULES, secrets=["x" * 20 + "s", "y" * 30])
            start = time.perf_counter()
            red(text)
            took.append(time.perf_counter() - start)
        t = statistics.median(took)
        print(f"  {name:22s} {t * 1000:7.2f} ms  {len(text) / t / 1e6:7.1f} MB/s  redacted {sum(red.counts.values())}")


if __name__ == "__main__":
    main()
