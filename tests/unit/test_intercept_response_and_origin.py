"""Two things of an intercepted request (egress/intercept.py), found with real clients (tests/test_secrets_clients.py):
the response head the cell gets says `Connection: close` (CloseHead): the proxy serves one request per connection,
and a client that reused the connection for a body it cannot resend (git's push of a large pack) failed; and the
request must name the host it was intercepted for (Host, an absolute-form target): a value injected into a
request whose Host names another host would go wherever a shared front end routes that name (domain fronting)."""
from types import SimpleNamespace

import pytest

from agnsup.egress.intercept import HEAD_MAX, BadRequest, CloseHead, Secrets


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


def _rewrite(head: str, host="api.secret.test", port=443):
    ref = SimpleNamespace(name="gh", hosts=[("api.secret.test", 443), ("api.secret.test", 8443)], inject="bearer")
    secret = SimpleNamespace(ref=ref, value=b"canary-1", placeholder="agnsup-secret:gh")
    return Secrets([secret]).rewrite_head(head.encode(), host, port)


@pytest.mark.parametrize("head, port", [
    ("GET / HTTP/1.1\r\nHost: api.secret.test", 443),
    ("GET / HTTP/1.1\r\nhost: API.Secret.Test.:443", 443),
    ("GET / HTTP/1.1\r\nHost: api.secret.test:8443", 8443),
    ("GET https://api.secret.test:8443/x HTTP/1.1\r\nHost: api.secret.test:8443", 8443),
    ("OPTIONS * HTTP/1.1\r\nHost: api.secret.test", 443),
])
def test_a_request_that_names_its_destination_gets_the_value(head, port):
    out, used, _ = _rewrite(head, port=port)
    assert used == {"gh"} and b"Bearer canary-1" in out


@pytest.mark.parametrize("head", [
    "GET / HTTP/1.1\r\nHost: evil.example",                                  # fronting
    "GET / HTTP/1.1\r\nHost: api.secret.test:8443",                          # another port of it
    "GET / HTTP/1.1\r\nHost: api.secret.test\r\nHost: evil.example",        # two
    "GET / HTTP/1.1",                                                          # none
    "GET https://evil.example/ HTTP/1.1\r\nHost: api.secret.test",           # the target wins at the server
    "GET http://api.secret.test/ HTTP/1.1\r\nHost: api.secret.test",
    "GET / HTTP/1.1\r\nHost: api.secret.test@evil.example",
])
def test_a_request_that_names_another_host_is_refused(head):
    with pytest.raises(BadRequest):
        _rewrite(head)
