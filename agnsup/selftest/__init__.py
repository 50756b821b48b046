"""Self-tests that ship with agnsup, so a user can certify their own host.

    blackout.py   the authority-blackout scenario (../shared/spec/authority-blackout.md)
    isolation.py  the isolation probes (../shared/spec/isolation.md)

The test suite drives the same code (tests/e2e/), so what CI proves and what
`agnsup selftest` reports on a user's host cannot drift apart.
"""
