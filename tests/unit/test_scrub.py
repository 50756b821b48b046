"""issue 32: a secret value in a cell's capture files is overwritten in place, same length, streamed."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from agnsup.egress import scrub

V = b"canary-0123456789abcdef"


def secret(name, value, inject="bearer"):
    return SimpleNamespace(ref=SimpleNamespace(name=name, inject=inject), value=value)


@pytest.mark.parametrize("block", [1, 5, len(V) - 1, len(V), 64, 1 << 20])
def test_every_value_is_masked_in_place_across_block_boundaries(tmp_path, monkeypatch, block):
    monkeypatch.setattr(scrub, "BLOCK", block)
    data = b"a" * 7 + V + b"\n" + V + V + b"b" * 31 + V[:-1] + b"\n" + V
    p = tmp_path / "stdout"
    p.write_bytes(data)
    assert scrub.scrub_file(str(p), [V]) == {V: 4}
    out = p.read_bytes()
    assert out == data.replace(V, b"*" * len(V)) and len(out) == len(data)


def test_a_cell_dir_is_scrubbed_per_secret_and_its_receipt_and_links_are_left(tmp_path):
    other = b"second-value-xyz"
    (tmp_path / "stdout").write_bytes(b"x" + V + b"y")
    (tmp_path / "stderr").write_bytes(other + b"\n" + other)
    (tmp_path / "pty").write_bytes(b"Zm9v" + V)
    (tmp_path / "receipt.json").write_bytes(b"{}")
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.write_bytes(V)
    os.symlink(outside, tmp_path / "link")
    got = scrub.scrub_cell(str(tmp_path), [secret("a", V), secret("b", other)])
    assert got == {"a": 2, "b": 2}
    assert (tmp_path / "stdout").read_bytes() == b"x" + b"*" * len(V) + b"y"
    assert (tmp_path / "stderr").read_bytes() == b"*" * len(other) + b"\n" + b"*" * len(other)
    assert outside.read_bytes() == V  # a link is not followed


def test_the_basic_credential_the_proxy_made_is_scrubbed_too(tmp_path):
    import base64
    cred = base64.b64encode(b"user:" + V)
    (tmp_path / "stdout").write_bytes(b"Authorization: Basic " + cred + b"\n")
    assert scrub.scrub_cell(str(tmp_path), [secret("a", V, "basic:user")]) == {"a": 1}
    assert cred not in (tmp_path / "stdout").read_bytes()


def test_a_file_without_a_value_is_not_written(tmp_path):
    p = tmp_path / "stdout"
    p.write_bytes(b"nothing here\n")
    before = os.stat(p).st_mtime_ns
    assert scrub.scrub_cell(str(tmp_path), [secret("a", V)]) == {"a": 0}
    assert os.stat(p).st_mtime_ns == before
