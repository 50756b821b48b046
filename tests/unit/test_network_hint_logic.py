"""The network hint's and the refusals' pure logic: the kernel counters' text, which rule maps to which
role key, the CLI's line, and when tool.network_hint speaks (issue 28 items 2 and 3)."""
from __future__ import annotations

import pytest

from agnsup.egress.summary import allow_entry, allow_key, refused, refused_line
from agnsup.linux import netns
from agnsup.tool import network_hint

SNMP = ("Ip: Forwarding DefaultTTL InReceives InHdrErrors InAddrErrors ForwDatagrams InUnknownProtos InDiscards "
        "InDelivers OutRequests OutDiscards OutNoRoutes ReasmTimeout ReasmReqds ReasmOKs ReasmFails FragOKs "
        "FragFails FragCreates OutTransmits\n"
        "Ip: 2 64 8 0 0 0 0 0 8 8 2 5 0 0 0 0 0 0 0 8\n"
        "Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti "
        "MemErrors\n"
        "Udp: 0 4 0 4 0 0 0 0 0\n")
SNMP6 = "Ip6InReceives                   \t0\nIp6OutNoRoutes                  \t3\nUdp6NoPorts \t1\n"


def test_the_no_route_counters_are_read_from_the_kernels_text():
    assert netns.parse_counters(SNMP, SNMP6) == {"ipv4_no_route": 5, "ipv6_no_route": 3}
    assert netns.parse_counters("", "") == {"ipv4_no_route": 0, "ipv6_no_route": 0}
    # a pod's leader sends the two files as they are (netns.raw_here); the controller parses them
    assert netns.from_raw(SNMP.encode() + b"\0" + SNMP6.encode()) == {"ipv4_no_route": 5, "ipv6_no_route": 3}


def test_what_a_cell_tried_is_the_delta_over_its_life():
    now = {"ipv4_no_route": 7, "ipv6_no_route": 3}
    assert netns.tried(now, None) == {"ipv4_no_route": 7, "ipv6_no_route": 3, "no_route": 10}
    # a shared namespace (a pod): what its neighbours did before this cell started is not its own
    assert netns.tried(now, {"ipv4_no_route": 7, "ipv6_no_route": 1})["no_route"] == 2
    assert netns.decode(netns.encode(now)) == now


@pytest.mark.parametrize("rule,host,port,mode,key", [
    ("address:private", "pypi.org", 443, "allowlist", "network.allow_private = true"),
    ("address:loopback", "pkg.test", 8080, "allowlist", "network.allow_private = true"),
    ("address:link-local", "x.test", 80, "allowlist", "network.allow_private = true"),
    ("address:cgnat", "x.test", 80, "allowlist", "network.allow_private = true"),
    ("unlisted", "pypi.org", 443, "allowlist", 'network.allow += ["pypi.org"]'),
    ("unlisted", "example.org", 8443, "allowlist", 'network.allow += ["example.org:8443"]'),
    ("unlisted", "2001:db8::1", 8443, "allowlist", 'network.allow += ["[2001:db8::1]:8443"]'),
    ("deny:*.evil.test", "a.evil.test", 443, "allowlist", 'network.deny without "*.evil.test"'),
    ("address:public", "pypi.org", 443, "internal", 'network.mode = "allowlist"'),
    # never reachable through the proxy, whatever the role says
    ("address:metadata", "169.254.169.254", 80, "allowlist", None),
    ("address:host", "10.0.0.2", 80, "allowlist", None),
    ("address:unspecified", "0.0.0.0", 80, "allowlist", None),
    ("malformed", "1.2.3", 80, "allowlist", None),
    ("protocol", "", None, "allowlist", None),
    ("limit:concurrent", "", None, "allowlist", None),
])
def test_each_rule_names_the_key_that_would_allow_it(rule, host, port, mode, key):
    assert allow_key(rule, host, port, mode) == key


def test_an_allow_entry_without_a_port_covers_80_and_443():
    assert [allow_entry("a.test", p) for p in (80, 443, None, 22)] == ["a.test", "a.test", "a.test", "a.test:22"]


NET = {"mode": "allowlist", "by_destination": [
    {"name": "pkg.test", "port": 443, "decision": "allowed", "rule": "allow:pkg.test", "count": 9},
    {"name": "pypi.org", "port": 443, "decision": "refused", "rule": "address:private", "count": 1},
    {"name": "files.test", "port": 443, "decision": "refused", "rule": "unlisted", "count": 4},
    {"name": "gone.test", "port": 443, "decision": "failed", "rule": "unresolved", "count": 2}]}


def test_refusals_most_first_never_a_failure_or_an_allowed_one():
    assert refused(NET) == [
        {"host": "files.test", "port": 443, "rule": "unlisted", "allow_key": 'network.allow += ["files.test"]'},
        {"host": "pypi.org", "port": 443, "rule": "address:private", "allow_key": "network.allow_private = true"}]
    assert refused(None) == [] and refused({"mode": "allowlist", "by_destination": NET["by_destination"][:1]}) == []


def test_the_cli_line_names_host_port_rule_and_key():
    line = refused_line("c1", refused(NET))
    assert line == ('agnsup: cell c1: the proxy refused files.test:443 (unlisted): network.allow += ["files.test"] '
                    "allows it; pypi.org:443 (address:private): network.allow_private = true allows it")
    many = [{"host": f"h{i}.test", "port": 443, "rule": "unlisted", "allow_key": None} for i in range(5)]
    assert refused_line("c", many).endswith("; 2 more (agnsup receipts)")
    assert "no role key allows it" in refused_line("c", many)
    assert refused_line("c", []) is None


def _receipt(exit_code=1, state="exited", mode="deny", net=None):
    return {"state": state, "exit_code": exit_code, "role": "executor", "isolation": {"network": mode},
            "kernel_record": {"network": net if net is not None else {"mode": mode, "observable": False}}}


def test_the_hint_speaks_only_when_the_kernel_counted_a_try():
    counted = {"mode": "deny", "observable": True, "no_route": 2}
    assert network_hint(_receipt(net=counted)).startswith("agnsup: the cell ran without network: role executor")
    assert "2 connection(s) or DNS queries" in network_hint(_receipt(net=counted))
    assert network_hint(_receipt(net={**counted, "no_route": 0})) == ""  # a failing test suite: nothing
    assert network_hint(_receipt(exit_code=0, net=counted)) == ""
    assert network_hint(_receipt(state="timeout", exit_code=124, net=counted)) == ""
    assert network_hint(_receipt(mode="allowlist", net=counted)) == ""
    # not read (a receipt from before, or counters the controller could not read): as before, on any failure
    assert network_hint(_receipt()).startswith("agnsup: the cell ran without network")
