"""issue 32: a compressed response of a secret's host is decoded in the proxy, so its Masker sees the value."""
from __future__ import annotations

import gzip
import zlib

import pytest

from agnsup.egress.intercept import Decoder, Masker, Opaque, Secrets

VALUE = b"s3cr3t-canary-value"
BODY = b"Authorization: Bearer " + VALUE + b"\nHost: api\n"


def relay(raw: bytes, step: int = 7, head_request: bool = False) -> bytes:
    """The proxy's response path (Decoder, then Masker) fed in pieces of `step` bytes."""
    d, m, out = Decoder(head_request), Masker([VALUE]), b""
    for i in range(0, len(raw), step):
        out += m.feed(d(raw[i:i + step]))
    return out + m.feed(d.rest()) + m.flush()


def response(body: bytes, coding: bytes, chunked: bool = False) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: " + coding + b"\r\n"
    if chunked:
        framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + 5]), body[i:i + 5]) for i in range(0, len(body), 5))
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\nX-Trailer: 1\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _raw_deflate(b: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(b) + c.flush()


@pytest.mark.parametrize("coding,encode", [(b"gzip", gzip.compress), (b"x-gzip", gzip.compress),
                                           (b"deflate", zlib.compress), (b"deflate", _raw_deflate),
                                           (b"GZIP, identity", gzip.compress)])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_compressed_echo_is_decoded_masked_and_relayed_plain(coding, encode, chunked):
    out = relay(response(encode(BODY), coding, chunked))
    head, _, body = out.partition(b"\r\n\r\n")
    assert VALUE not in out
    assert body == BODY.replace(VALUE, b"*" * len(VALUE))
    low = head.lower()
    assert b"content-encoding" not in low and b"content-length" not in low and b"transfer-encoding" not in low
    assert b"content-type: text/plain" in low


def test_bytes_after_a_content_length_body_are_not_relayed():
    raw = response(gzip.compress(BODY), b"gzip") + b"garbage after the body"
    assert relay(raw).endswith(BODY.replace(VALUE, b"*" * len(VALUE)))


def test_an_interim_head_passes_and_an_uncoded_response_is_untouched():
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc"
    assert relay(raw) == raw


def test_a_head_response_with_a_coding_has_no_body():
    raw = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 40\r\n\r\n"
    assert relay(raw, head_request=True) == b"HTTP/1.1 200 OK\r\n\r\n"


@pytest.mark.parametrize("coding", [b"br", b"zstd", b"compress", b"gzip, gzip", b"deflate, br", b"x-custom"])
def test_a_coding_the_proxy_cannot_read_is_refused_before_anything_is_relayed(coding):
    d = Decoder()
    with pytest.raises(Opaque, match="Content-Encoding"):
        d(b"HTTP/1.1 200 OK\r\nContent-Encoding: " + coding + b"\r\nContent-Length: 4\r\n\r\nxxxx")


def test_a_body_that_does_not_decode_is_refused():
    with pytest.raises(Opaque, match="does not decode"):
        relay(response(b"this is not gzip at all", b"gzip"))


def test_the_request_upstream_accepts_identity_only():
    s = Secrets([])
    head, _, _ = s.rewrite_head(b"GET / HTTP/1.1\r\nHost: api\r\nAccept-Encoding: gzip, br\r\n"
                                b"accept-encoding: zstd", "api", 443)
    lines = head.lower().split(b"\r\n")
    assert [h for h in lines if h.startswith(b"accept-encoding")] == [b"accept-encoding: identity"]


def test_a_value_split_by_chunk_framing_is_masked_and_the_body_unframed():
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"".join(b"%x\r\n%s\r\n" % (len(BODY[i:i + 3]), BODY[i:i + 3]) for i in range(0, len(BODY), 3))
           + b"0\r\n\r\n")
    for step in (1, 4, len(raw)):
        out = relay(raw, step)
        assert out == b"HTTP/1.1 200 OK\r\n\r\n" + BODY.replace(VALUE, b"*" * len(VALUE)), out


def test_gzip_members_that_follow_one_another_are_all_decoded():
    body = gzip.compress(BODY[:10]) + gzip.compress(BODY[10:])
    assert relay(response(body, b"gzip")).endswith(BODY.replace(VALUE, b"*" * len(VALUE)))


def test_a_compressed_bomb_is_decoded_in_bounded_pieces():
    """64 MiB of zeros gzipped (~64 KiB on the wire) read at once: the decoder never holds more than
    MAX_INFLATE decoded bytes at a time, and everything arrives."""
    from agnsup.egress.intercept import MAX_INFLATE
    size = 64 << 20
    raw = response(gzip.compress(b"\0" * size), b"gzip")
    d = Decoder()
    pieces = [*d.pieces(raw), *d.pieces(b"")]
    head = pieces[0][:pieces[0].index(b"\r\n\r\n") + 4]
    assert b"Content-Encoding" not in head
    assert MAX_INFLATE <= 4 << 20 and max(len(p) for p in pieces) <= len(head) + MAX_INFLATE  # not 64 MiB at once
    assert sum(len(p) for p in pieces) - len(head) == size


@pytest.mark.timeout(10)
def test_bytes_after_the_end_of_a_deflate_stream_are_dropped_not_spun_on():
    """What follows a deflate stream's end is not the body: dropped (the decoder used to loop on it forever,
    a proxy thread at 100 % CPU for as long as the controller lived)."""
    raw = b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\n\r\n" + zlib.compress(b"hello world") + b"GARBAGE"
    d = Decoder()
    out = d(raw) + d.rest()
    assert out.endswith(b"\r\n\r\nhello world")
