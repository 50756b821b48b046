"""The shared destination matcher (agnsup/netpolicy.py) and the gate's use of it.

Pure logic, no network: names are resolved by the tests' own functions. The
proxy and the kernel are proven with real cells in tests/test_egress.py.
"""
from __future__ import annotations

import ipaddress

import pytest

from agnsup.netpolicy import Rules, destination, parse_entry

# The host's loopback as clients spell it: every one is 127/8, ::1 or a form that reaches it.
LOOPBACK_SPELLINGS = [
    "127.0.0.1", "127.1", "127.0.1", "2130706433", "0x7f000001", "0x7F000001", "0x7f.0.0.1", "0x7f.1",
    "0177.0.0.1", "0177.1", "017700000001", "127.000.000.001", "127.0.0.2", "127.255.255.254", "127.0.0.1.",
    "[::1]", "[0:0:0:0:0:0:0:1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:127.0.0.1]",
    "[64:ff9b::7f00:1]", "[2002:7f00:1::]", "localhost", "LOCALHOST", "localhost.", "api.localhost",
    "\uff10x7f000001", "127\u30020\u30020\u30021",
]
# What a connect() to these reaches is the host itself, too.
UNSPECIFIED = ["0.0.0.0", "0", "0x0", "[::]"]


def _never(name, port):
    raise AssertionError(f"{name} must be judged without resolving it")


ANY = Rules.of({"mode": "allowlist", "allow": ["*"]})


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS)
def test_every_loopback_spelling_is_refused_as_an_address_never_resolved(host):
    v, dest, addrs = ANY.judge(host, 443, _never)
    assert not v.allowed and v.rule == "address:loopback", (host, v)
    assert dest.address is not None and ipaddress.ip_address(addrs[0]) is not None


def test_there_are_at_least_26_loopback_spellings():
    assert len(set(LOOPBACK_SPELLINGS)) >= 26


@pytest.mark.parametrize("host", UNSPECIFIED)
def test_unspecified_addresses_are_refused_even_with_allow_private(host):
    r = Rules.of({"mode": "allowlist", "allow": ["*"], "allow_private": True})
    v, _, _ = r.judge(host, 80, _never)
    assert not v.allowed and v.rule == "address:unspecified"


@pytest.mark.parametrize("addr, cls", [("10.1.2.3", "private"), ("172.16.0.9", "private"),
                                       ("192.168.1.1", "private"), ("[fd00::1]", "private"),
                                       ("169.254.1.1", "link-local"), ("[fe80::1]", "link-local"),
                                       ("100.64.0.1", "cgnat"), ("224.0.0.1", "multicast"),
                                       ("169.254.169.254", "metadata"), ("[fd00:ec2::254]", "metadata"),
                                       ("[::ffff:169.254.169.254]", "metadata"), ("0251.0376.0251.0376", "metadata")])
def test_non_public_addresses_are_refused_by_class(addr, cls):
    v, _, _ = ANY.judge(addr, 443, _never)
    assert not v.allowed and v.rule == f"address:{cls}", v


def test_allow_private_opens_private_and_loopback_but_never_metadata_or_multicast():
    r = Rules.of({"mode": "allowlist", "allow": ["*"], "allow_private": True})
    for ok in ("10.1.2.3", "127.0.0.1", "[::1]", "100.64.0.1", "169.254.1.1"):
        assert r.judge(ok, 443, _never)[0].allowed, ok
    for bad in ("169.254.169.254", "[fd00:ec2::254]", "224.0.0.1"):
        assert not r.judge(bad, 443, _never)[0].allowed, bad


def test_a_listed_name_is_resolved_once_and_every_answer_is_judged():
    calls = []

    def resolve(answers):
        def f(name, port):
            calls.append(name)
            return answers
        return f

    r = Rules.of({"mode": "allowlist", "allow": ["pkg.example"]})
    v, dest, addrs = r.judge("PKG.Example.", 443, resolve(["93.184.215.14"]))
    assert v.allowed and v.rule == "allow:pkg.example" and dest.name == "pkg.example"
    assert [str(a) for a in addrs] == ["93.184.215.14"] and calls == ["pkg.example"]
    # a DNS-rebinding-style answer: a public address and a private one -> the name is refused
    v, _, _ = r.judge("pkg.example", 443, resolve(["93.184.215.14", "10.0.0.7"]))
    assert not v.allowed and v.rule == "address:private"
    v, _, _ = r.judge("pkg.example", 443, resolve(["::ffff:127.0.0.1"]))
    assert not v.allowed and v.rule == "address:loopback"
    v, _, _ = r.judge("pkg.example", 443, resolve([]))
    assert not v.allowed and v.rule == "address:none"
    # an unlisted name is never resolved
    calls.clear()
    v, _, _ = r.judge("other.example", 443, resolve(["93.184.215.14"]))
    assert not v.allowed and v.rule == "unlisted" and calls == []


def test_deny_wins_and_wildcards_and_ports_match_as_documented():
    r = Rules.of({"mode": "allowlist", "allow": ["*.example.org", "example.net:8443", "files.example.com:*",
                                                 "203.0.113.0/24"],
                  "deny": ["secret.example.org"], "allow_private": True})
    def rule(host, port):
        return r.match(destination(host), port).rule
    assert rule("a.example.org", 443) == "allow:*.example.org"
    assert rule("a.b.example.org", 80) == "allow:*.example.org"
    assert rule("example.org", 443) == "unlisted"               # *.x is the names below x
    assert rule("a.example.org", 22) == "unlisted"              # no port: 80 and 443 only
    assert rule("secret.example.org", 443) == "deny:secret.example.org"
    assert rule("example.net", 8443) == "allow:example.net:8443"
    assert rule("example.net", 443) == "unlisted"
    assert rule("files.example.com", 2222) == "allow:files.example.com:*"
    assert rule("203.0.113.9", 443) == "allow:203.0.113.0/24"   # an IP literal matches address entries
    assert rule("[::ffff:203.0.113.9]", 443) == "allow:203.0.113.0/24"
    assert rule("evil-example.org", 443) == "unlisted"


def test_an_ip_literal_never_matches_a_name_entry():
    r = Rules.of({"mode": "allowlist", "allow": ["127.0.0.1.nip.example", "*.in-addr.arpa"]})
    assert r.match(destination("2130706433"), 443).rule == "unlisted"
    assert r.match(destination("127.0.0.1"), 443).rule == "unlisted"


def test_internal_mode_reaches_private_destinations_only():
    r = Rules.of({"mode": "internal", "allow": ["*"]})
    assert r.judge("10.2.3.4", 443, _never)[0].allowed
    assert r.judge("db.corp.example", 443, lambda n, p: ["192.168.7.7"])[0].allowed
    v, _, _ = r.judge("www.example.org", 443, lambda n, p: ["93.184.215.14"])
    assert not v.allowed and v.rule == "address:public"
    assert not r.judge("169.254.169.254", 80, _never)[0].allowed


@pytest.mark.parametrize("entry, problem", [
    ("", "is not a destination"), ("exa mple.org", "is not a host name"), ("*.*.org", "is not a host name"),
    ("ex*ample.org", "is not a host name"), ("example.org:0", "port '0'"), ("example.org:http", "port 'http'"),
    ("example.org:70000", "port '70000'"), ("[::1", "an IPv6 entry"), ("1.2.3.999", "malformed IP address"),
    ("0x7f.1.2.3.4", "malformed IP address"),
])
def test_bad_entries_say_what_is_wrong(entry, problem):
    with pytest.raises(ValueError, match=problem.replace("*", r"\*").replace("[", r"\[")):
        parse_entry(entry)


def test_good_entries_parse():
    for e in ("example.org", "*.example.org", "*", "*:*", "example.net:443", "10.0.0.0/8", "[::1]:8080",
              "fd00::/8", "b\u00fccher.example", "EXAMPLE.ORG."):
        parse_entry(e)
    assert parse_entry("b\u00fccher.example").value == "xn--bcher-kva.example"


# ----------------------------------------------------------------------------------- the gate agrees

def _policy(role_net: dict, kernel_enforced: str = "flag"):
    """A validated role (every default filled in) with this network table."""
    from agnsup.models import Policy
    from agnsup.policy import Frozen
    return Frozen(Policy.model_validate({"role": {"name": "t"}, "env": {"path": ["/usr/bin"]}, "network": role_net,
                                         "governance": {"mode": "open", "kernel_enforced": kernel_enforced}}
                                        ).model_dump())


def _gate(role_net: dict, command: str, kernel_enforced: str = "flag"):
    from agnsup import governance
    from agnsup.gate import check
    pol = _policy(role_net, kernel_enforced)
    return check("run_shell", {"command": command}, governance.context(pol, "/tmp", None))


NET = {"mode": "allowlist", "allow": ["pkg.example", "*.cdn.example:*"], "deny": ["bad.cdn.example"]}


@pytest.mark.parametrize("command, operand, verdict", [
    ("curl -fsS https://pkg.example/simple/", "https://pkg.example/simple/", None),
    ("pip download --index-url https://pkg.example/simple x", "https://pkg.example/simple", None),
    ("git clone https://a.cdn.example:8443/r.git", "https://a.cdn.example:8443/r.git", None),
    ("curl https://other.example/", "https://other.example/", "unlisted"),
    ("git clone https://bad.cdn.example/r.git", "https://bad.cdn.example/r.git", "deny:bad.cdn.example"),
    ("wget http://2130706433/", "http://2130706433/", "unlisted"),
    ("curl pkg.example:8080", "pkg.example:8080", "unlisted"),
])
def test_the_gate_judges_command_destinations_with_the_proxy_matcher(command, operand, verdict):
    from agnsup.gate.egress import destination_of
    host, port = destination_of(operand)
    proxy_says = Rules.of(NET).match(destination(host), port)
    assert proxy_says.allowed == (verdict is None) and (verdict is None or proxy_says.rule == verdict)
    flagged, _ = _gate(NET, command)
    denied, _ = _gate(NET, command, kernel_enforced="deny")
    if verdict is None:
        assert flagged.allowed and "network.kernel_enforced" not in flagged.flags
        assert denied.allowed
    else:
        assert flagged.allowed and "network.kernel_enforced" in flagged.flags
        assert [f["egress_rule"] for f in flagged.flagged] == [verdict]
        assert not denied.allowed and denied.rule == "network.egress" and verdict in denied.reason


def test_dev_tcp_under_an_allowlist_is_kernel_enforced_it_never_goes_through_the_proxy():
    d, _ = _gate(NET, "echo hi > /dev/tcp/pkg.example/443")
    assert d.allowed and "network.kernel_enforced" in d.flags
    d, _ = _gate(NET, "echo hi > /dev/tcp/pkg.example/443", kernel_enforced="deny")
    assert not d.allowed and d.rule == "network.dev_tcp"


def test_a_url_argument_of_a_fetch_tool_is_resolved_and_judged_by_the_lists():
    from agnsup import governance
    from agnsup.gate import check
    ctx = governance.context(_policy(NET), "/tmp", None)
    d, _ = check("fetch", {"url": "https://pkg.example/x"}, ctx, resolver=lambda h: ["93.184.215.14"])
    assert d.allowed and d.pinned == "93.184.215.14"
    d, _ = check("fetch", {"url": "https://pkg.example/x"}, ctx, resolver=lambda h: ["10.9.9.9"])
    assert not d.allowed and "address:private" in d.reason
    d, _ = check("fetch", {"url": "https://elsewhere.example/x"}, ctx, resolver=lambda h: ["93.184.215.14"])
    assert not d.allowed and d.rule == "network.egress" and "unlisted" in d.reason
