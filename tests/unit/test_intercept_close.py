"""The response head an intercepted cell gets says `Connection: close` (egress/intercept.CloseHead): the proxy
serves one request per connection, and a client that reused the connection for a body it cannot resend (git's
push of a large pack) would fail (tests/test_secrets_clients.py::test_git_push_of_a_large_pack_...)."""
from agnsup.egress.intercept import HEAD_MAX, CloseHead


def feed(*parts: bytes) -> bytes:
    t = CloseHead()
    out = b"".join(t(p) for p in parts)
    return out + t.buf


def test_the_final_head_gets_connection_close_and_loses_its_own_options():
    resp = b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\nok"
    assert feed(resp) == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


def test_a_head_split_across_reads_and_interim_heads_pass():
    resp = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
    out = feed(*[resp[i:i + 7] for i in range(0, len(resp), 7)])
    assert out == b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def test_the_body_is_untouched_even_when_it_looks_like_a_head():
    body = b"Connection: keep-alive\r\n\r\nHTTP/1.1 200 OK\r\n\r\n"
    assert feed(b"HTTP/1.1 200 OK\r\n\r\n", body) == b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body


def test_a_head_past_the_limit_passes_as_it_came():
    big = b"HTTP/1.1 200 OK\r\nX: " + b"a" * (HEAD_MAX + 10)
    assert feed(big, b"\r\n\r\nbody") == big + b"\r\n\r\nbody"
