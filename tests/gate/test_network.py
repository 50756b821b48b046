"""Network: tools at command position under network deny; the SSRF guard for URLs."""

import pytest

from agnsup.gate import GateContext, check, judge_shell
from agnsup.netpolicy import parse_ipv4

DENY = GateContext(network="deny", worktree="/workspace/project", writable=("/",), home="/home/user")
HOST = GateContext(network="host", worktree="/workspace/project", writable=("/",), home="/home/user")
LOOP = GateContext(network="loopback", worktree="/workspace/project", writable=("/",), home="/home/user")

AT_COMMAND_POSITION = [
    "curl https://example.com", "ls; wget x", "ls | nc host 80", "true && ssh host", "false || scp a host:b",
    "sleep 1 & telnet host", "echo $(curl x)", "echo `wget x`", "bash -c 'nc -l 9'", "sudo curl x",
    "env A=1 socat - tcp:h:1", "timeout 5 ncat h 1", "xargs curl", "nohup sftp host", "\\curl x", '"curl" x',
    "rsync -a src/ user@host:/dst/", "rsync -a rsync://host/mod/ .", "exec 3<>/dev/tcp/h/80",
    "cat /etc/hostname > /dev/tcp/h/80", "echo data > /dev/udp/h/53",
]
AS_ARGUMENT = [
    "grep -r curl .", "echo ssh", "echo 'nc is a network tool'", "man curl", "which wget", "command -v curl",
    "cat ~/.curlrc", "git log --grep ssh", "rsync -a src/ dst/", "ls /usr/bin/ssh",
]


@pytest.mark.parametrize("command", AT_COMMAND_POSITION)
def test_network_tool_at_command_position_is_denied_under_network_deny(command):
    d = judge_shell(command, DENY)
    assert not d.allowed and d.rule in ("network.command", "network.dev_tcp"), d
    assert "network" in d.hint


@pytest.mark.parametrize("command", AS_ARGUMENT)
def test_network_word_as_argument_is_not_a_network_command(command):
    assert judge_shell(command, DENY).allowed


@pytest.mark.parametrize("command", AT_COMMAND_POSITION[:10])
def test_network_tools_are_allowed_when_the_role_has_host_network(command):
    assert judge_shell(command, HOST).allowed


def test_metadata_address_in_a_curl_command_is_denied_even_with_host_network():
    d = judge_shell("curl http://169.254.169.254/latest/meta-data/", HOST)
    assert d.rule == "network.ssrf_metadata"


@pytest.mark.parametrize("host,expected", [
    ("2130706433", "127.0.0.1"), ("0x7f000001", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"), ("127.1", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"), ("10.0.0.1", "10.0.0.1"), ("256.0.0.1", None), ("example.com", None),
])
def test_ipv4_is_read_the_way_inet_aton_reads_it(host, expected):
    assert parse_ipv4(host) == expected


INTERNAL_URLS = [
    "http://127.0.0.1/", "http://localhost:8080/", "http://2130706433/", "http://0x7f000001/",
    "http://0177.0.0.1/", "http://127.1/", "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]/",
    "http://good@127.0.0.1/", "http://user:pw@10.0.0.1/", "http://127.0.0.1./", "http://１２７．０．０．１/",
    "http://127。0。0。1/", "http://192.168.1.1/", "http://172.16.0.1/", "http://169.254.1.1/", "http://0.0.0.0/",
    "http://[::]/", "http://224.0.0.1/", "http://[fe80::1]/", "http://[fc00::1]/", "http://100.64.0.1/",
    "http://127.0.0.1\\@example.com/", "http://foo.localhost/",
    # percent-encoded hosts: WHATWG and curl decode them (issue 31)
    "http://%31%32%37.0.0.1/", "http://%6c%6f%63%61%6c%68%6f%73%74/", "http://127%2e0%2e0%2e1/",
    "http://%31%30.0.0.1/",
]
METADATA_URLS = ["http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/",
                 "http://metadata.google.internal/computeMetadata/v1/", "http://0xa9fea9fe/",
                 "http://[::ffff:169.254.169.254]/"]


@pytest.mark.parametrize("url", INTERNAL_URLS)
def test_internal_address_in_any_spelling_is_refused_by_the_ssrf_guard(url):
    d, _ = check("fetch", {"url": url}, HOST, resolver=lambda h: ["93.184.216.34"])
    assert not d.allowed and d.rule.startswith("network.ssrf"), d


@pytest.mark.parametrize("url", METADATA_URLS)
def test_metadata_endpoint_is_refused(url):
    d, _ = check("fetch", {"url": url}, HOST, resolver=lambda h: ["93.184.216.34"])
    assert d.rule == "network.ssrf_metadata", d


def test_public_name_is_resolved_once_and_the_checked_address_is_pinned():
    calls = []
    d, _ = check("fetch", {"url": "https://example.com/x"}, HOST, resolver=lambda h: calls.append(h) or ["93.184.216.34"])
    assert d.allowed and d.to_dict()["pinned"] == "93.184.216.34" and calls == ["example.com"]


def test_name_resolving_to_a_private_address_is_refused():
    d, _ = check("fetch", {"url": "https://rebind.example/"}, HOST, resolver=lambda h: ["93.184.216.34", "10.1.2.3"])
    assert d.rule == "network.ssrf"


def test_unresolvable_name_is_refused_rather_than_guessed():
    def fail(h):
        raise OSError("no DNS here")
    d, _ = check("fetch", {"url": "https://nowhere.invalid/"}, HOST, resolver=fail)
    assert d.rule == "network.ssrf_unresolved"


def test_public_ip_literal_is_allowed_and_pinned():
    d, _ = check("fetch", {"url": "http://93.184.216.34/"}, HOST)
    assert d.allowed and d.pinned == "93.184.216.34"


def test_non_http_scheme_is_refused():
    assert check("fetch", {"url": "file:///etc/passwd"}, HOST)[0].rule == "network.url_scheme"


def test_url_fetch_is_refused_under_network_deny():
    assert check("fetch", {"url": "http://93.184.216.34/"}, DENY)[0].rule == "network.url"


def test_loopback_role_may_fetch_loopback_only():
    assert check("fetch", {"url": "http://localhost:8000/"}, LOOP)[0].allowed
    assert check("fetch", {"url": "http://93.184.216.34/"}, LOOP)[0].rule == "network.url"


@pytest.mark.parametrize("command", [
    "curl http://%31%32%37.0.0.1:4000/", "curl 'http://127.0.0.1:4000\\@example.com/'", "curl http://2130706433/",
    "curl http://0x7f.1/", "wget -qO- http://%6c%6f%63%61%6c%68%6f%73%74:8080/admin", "curl http://0177.0.0.1/",
    "curl http://ex@%31%32%37.0.0.1/",
])
def test_loopback_in_every_url_spelling_in_a_shell_command_is_judged_as_loopback_under_host(command):
    d = judge_shell(command, HOST)
    assert (d.allowed, d.rule) == (False, "network.ssrf"), d


def test_percent_encoded_userinfo_does_not_change_the_host_a_url_reaches():
    # `127.0.0.1%2F` is the user name: the host is example.com for curl and WHATWG alike.
    d, _ = check("fetch", {"url": "http://127.0.0.1%2F@example.com/"}, HOST, resolver=lambda h: ["93.184.216.34"])
    assert d.allowed, d
