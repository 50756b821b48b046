"""The proxy's reading of a request to a secret's host (agnsup/egress/intercept.py): what is replaced, what is
refused, and the body scan across reads and chunks. Pure: no sockets."""
from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest

from agnsup.egress.intercept import BadRequest, Exfiltration, Held, Reader, Secrets, stream_body

VALUE = b"canary-5f1e9a77c0"


def secret(name="gh", hosts=(("api.secret.test", 443),), inject="placeholder", value=VALUE):
    ref = SimpleNamespace(name=name, hosts=list(hosts), inject=inject)
    return SimpleNamespace(ref=ref, value=value, placeholder="agnsup-secret:" + name)


def head(*headers: str, line="GET /repos HTTP/1.1") -> bytes:
    return "\r\n".join([line, "Host: api.secret.test", *headers]).encode()


def rewrite(h: bytes, *secrets, host="api.secret.test", port=443):
    return Secrets(secrets or [secret()]).rewrite_head(h, host, port)


def test_a_placeholder_in_a_header_to_a_listed_host_is_replaced():
    out, used, framing = rewrite(head("X-Token: agnsup-secret:gh"))
    assert b"X-Token: " + VALUE + b"\r\n" in out and b"agnsup-secret" not in out
    assert used == {"gh"} and framing == {"length": 0}
    assert out.endswith(b"Connection: close\r\n\r\n")


def test_a_placeholder_inside_a_basic_credential_is_decoded_replaced_and_reencoded():
    cred = base64.b64encode(b"user:agnsup-secret:gh").decode()
    out, used, _ = rewrite(head(f"Authorization: Basic {cred}"))
    assert b"Authorization: Basic " + base64.b64encode(b"user:" + VALUE) in out
    assert used == {"gh"}


@pytest.mark.parametrize("inject, expect", [
    ("bearer", b"Authorization: Bearer " + VALUE),
    ("basic:x-access-token", b"Authorization: Basic " + base64.b64encode(b"x-access-token:" + VALUE)),
    ("header:PRIVATE-TOKEN", b"PRIVATE-TOKEN: " + VALUE),
])
def test_inject_sets_the_header_and_replaces_one_the_cell_sent(inject, expect):
    out, used, _ = rewrite(head("Authorization: Bearer mine", "private-token: mine"), secret(inject=inject))
    assert expect in out and used == {"gh"}
    hname = expect.split(b":")[0].lower()
    assert sum(1 for h in out.split(b"\r\n") if h.lower().startswith(hname + b":")) == 1


def test_nothing_is_injected_into_a_request_to_another_port():
    out, used, _ = rewrite(head(), secret(inject="bearer"), port=8443)
    assert VALUE not in out and used == set()


def test_a_placeholder_in_a_header_to_a_host_its_secret_does_not_list_is_refused():
    other = secret("npm", hosts=[("registry.test", 443)])
    with pytest.raises(Exfiltration) as e:
        rewrite(head("X-Leak: agnsup-secret:npm"), secret(), other)
    assert (e.value.name, e.value.where) == ("npm", "header")
    cred = base64.b64encode(b"u:agnsup-secret:npm").decode()
    with pytest.raises(Exfiltration):
        rewrite(head(f"Authorization: Basic {cred}"), secret(), other)


@pytest.mark.parametrize("line", ["GET /?t=agnsup-secret:gh HTTP/1.1", "GET /?t=agnsup-secret%3Agh HTTP/1.1",
                                  "GET /AGNSUP-SECRET:GH HTTP/1.1"])
def test_a_placeholder_in_the_url_is_refused_even_to_a_listed_host(line):
    with pytest.raises(Exfiltration) as e:
        rewrite(head(line=line))
    assert e.value.where == "url"


def test_a_case_mangled_placeholder_in_a_header_is_refused_not_passed():
    with pytest.raises(Exfiltration):
        rewrite(head("X-Token: Agnsup-Secret:gh"))


def test_hop_headers_and_expect_are_not_forwarded():
    out, _, _ = rewrite(head("Connection: keep-alive", "Proxy-Authorization: Basic eA==", "Expect: 100-continue",
                             "Upgrade: websocket"))
    low = out.lower()
    assert b"keep-alive" not in low and b"proxy-authorization" not in low and b"expect" not in low
    assert b"upgrade" not in low


@pytest.mark.parametrize("headers", [("Content-Length: 3", "Transfer-Encoding: chunked"),
                                     ("Transfer-Encoding: gzip",), ("Content-Length: 3", "Content-Length: 4"),
                                     ("Content-Length: -1",), (" folded",),
                                     ("Content-Length : 5",), ("no colon",)])
def test_requests_that_cannot_be_framed_unambiguously_are_bad(headers):
    with pytest.raises(BadRequest):
        rewrite(head(*headers))


def test_a_value_with_a_line_break_is_never_put_in_a_header():
    with pytest.raises(ValueError) as e:
        Secrets([secret(value=b"abc\r\nX-Evil: 1")])
    assert "abc" not in str(e.value)


def test_the_name_check_finds_a_placeholder_in_a_connect_or_socks_name():
    s = Secrets([secret()])
    for name in ("agnsup-secret:gh.evil.test:443", "AGNSUP-SECRET%3Agh.evil.test"):
        with pytest.raises(Exfiltration) as e:
            s.check_name(name)
        assert e.value.where == "dns"
    s.check_name("api.secret.test:443")


def test_a_plain_http_request_with_a_placeholder_anywhere_in_its_head_is_refused():
    s = Secrets([secret()])
    with pytest.raises(Exfiltration):
        s.check_plain(b"GET http://x.test/agnsup-secret:gh HTTP/1.1\r\nHost: x.test")
    with pytest.raises(Exfiltration):
        s.check_plain(b"GET http://api.secret.test/ HTTP/1.1\r\nX-T: agnsup-secret:gh")
    cred = base64.b64encode(b"u:agnsup-secret:gh").decode()
    with pytest.raises(Exfiltration):
        s.check_plain(f"GET / HTTP/1.1\r\nAuthorization: Basic {cred}".encode())
    s.check_plain(b"GET http://x.test/ HTTP/1.1\r\nHost: x.test")


# -- the body --------------------------------------------------------------------------------
def pieces(*chunks: bytes):
    it = iter(chunks)
    return lambda n: next(it, b"")


def relay(framing, *chunks):
    s = Secrets([secret()])
    out: list[bytes] = []
    stream_body(Reader(pieces(*chunks)), framing, s.scanner(), out.append)
    return b"".join(out)


def test_a_content_length_body_is_relayed_exactly():
    assert relay({"length": 10}, b"hello", b"world", b"NEXT REQUEST") == b"helloworld"


def test_a_placeholder_split_across_reads_of_a_content_length_body_is_found():
    body = b"x" * 100 + b"agnsup-secret:gh" + b"y" * 10
    reads = [body[i:i + 7] for i in range(0, len(body), 7)]
    with pytest.raises(Exfiltration) as e:
        relay({"length": len(body)}, *reads)
    assert e.value.where == "body"


def test_a_chunked_body_is_relayed_with_its_framing():
    raw = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    assert relay({"chunked": True}, raw[:9], raw[9:20], raw[20:]) == raw


def test_a_placeholder_split_across_chunks_is_found_in_the_decoded_body():
    raw = b"a\r\nxxagnsup-s\r\n8\r\necret:gh\r\n0\r\n\r\n"
    assert b"agnsup-secret" not in raw  # invisible to a scan of the raw bytes
    with pytest.raises(Exfiltration):
        relay({"chunked": True}, raw)


def test_a_placeholder_in_a_chunk_extension_or_trailer_is_found():
    with pytest.raises(Exfiltration):
        relay({"chunked": True}, b"1;x=agnsup-secret:gh\r\na\r\n0\r\n\r\n")
    with pytest.raises(Exfiltration):
        relay({"chunked": True}, b"0\r\nX-T: agnsup-secret:gh\r\n\r\n")


def test_a_bad_chunk_is_a_bad_request():
    with pytest.raises(BadRequest):
        relay({"chunked": True}, b"zz\r\n")
    with pytest.raises(BadRequest):
        relay({"chunked": True}, b"2\r\nabc\r\n0\r\n\r\n")


def test_held_sends_nothing_until_the_hold_is_exceeded_or_flushed():
    out: list[bytes] = []
    held = Held(out.append, b"HEAD")
    held(b"x" * 100)
    assert out == [] and not held.started
    held.flush()
    assert out == [b"HEAD" + b"x" * 100]
    out.clear()
    big = Held(out.append, b"H")
    big(b"y" * (64 * 1024 + 1))
    assert big.started and len(out) == 1


# -- the response ------------------------------------------------------------------------------
def masked(values, *reads):
    from agnsup.egress.intercept import Masker
    m = Masker(values)
    out = [m.feed(r) for r in reads] + [m.flush()]
    return b"".join(out), m.masked, out


def test_an_echoed_value_is_overwritten_with_as_many_stars_even_across_reads():
    body = b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\nyou sent: " + VALUE + b" and " + VALUE
    for step in (1, 3, 7, len(body)):
        out, n, _ = masked([VALUE], *(body[i:i + step] for i in range(0, len(body), step)))
        assert VALUE not in out and len(out) == len(body) and n == 2
        assert out.endswith(b"*" * len(VALUE))


def test_a_streamed_response_is_held_back_only_where_a_value_could_begin():
    _, _, out = masked([VALUE], b"data: one\n\n", b"data: two canary-5f", b"1e9a77c0\n\n")
    assert out[0] == b"data: one\n\n"                    # nothing that could begin the value: sent at once
    assert out[1] == b"data: two "                        # "canary-5f" waits
    assert out[2] == b"*" * len(VALUE) + b"\n\n"
