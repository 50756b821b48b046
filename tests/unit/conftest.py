"""Unit tests: pure logic over the fake backend (tests/unit/fake_backend.py): no root, no
cgroups, no cell processes; `pytest tests/unit` runs in seconds anywhere."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
