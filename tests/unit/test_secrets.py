"""Secrets by reference (agnsup/secrets.py): parsing, checking against the role, resolving; every bad input one line,
never a value in a message or a repr."""
import os
import pickle

import pytest

from agnsup import secrets
from agnsup.netpolicy import Rules, destination
from agnsup.process.helpers import run_helper
from agnsup.errors import UsageError
from agnsup.request import CellRequest

CANARY = "canary-" + os.urandom(8).hex()
ALLOWLIST = {"mode": "allowlist", "allow": ["api.secret.test:8443", "*.example.org"], "deny": ["bad.example.org"],
             "allow_private": True, "proxy_port": 3128}


def check(refs, network):
    rules = Rules.of(network) if network["mode"] in ("allowlist", "internal") else None
    secrets.check(refs, network["mode"], lambda h, p: rules.match(destination(h), p))


def ref(**table):
    return secrets.parse_table("gh", {"source": "env:GH", "hosts": ["api.secret.test:8443"], **table})


def test_a_table_parses_to_a_reference_without_a_value():
    r = secrets.parse_table("gh", {"source": "env:GH", "env": "GITHUB_TOKEN",
                                   "hosts": ["API.Secret.Test:8443", "uploads.example.org", "[::1]:9443"],
                                   "inject": "basic:bob"})
    assert r.hosts == (("api.secret.test", 8443), ("uploads.example.org", 443), ("::1", 9443))
    assert r.placeholder == "agnsup-secret:gh" and r.inject == "basic:bob" and r.env == "GITHUB_TOKEN"
    assert r.table() == {"name": "gh", "source": "env:GH", "env": "GITHUB_TOKEN", "inject": "basic:bob",
                         "hosts": ["api.secret.test:8443", "uploads.example.org", "[::1]:9443"]}
    assert ref().inject == "bearer"  # the default


@pytest.mark.parametrize("name, table, fragment", [
    ("GH", {"source": "env:GH", "hosts": ["a.test"]}, "'GH' is not a secret name"),
    ("a" * 41, {"source": "env:GH", "hosts": ["a.test"]}, "is not a secret name"),
    ("gh", "env:GH", "must be a table"),
    ("gh", {"source": "env:GH", "hosts": ["a.test"], "value": "x"}, "unknown key(s) value"),
    ("gh", {"hosts": ["a.test"]}, "source is required"),
    ("gh", {"source": "GH", "hosts": ["a.test"]}, "source 'GH' is not one of env:NAME"),
    ("gh", {"source": "file:relative/path", "hosts": ["a.test"]}, "is not one of"),
    ("gh", {"source": "command:keyring get", "hosts": ["a.test"]}, "is not one of"),
    ("gh", {"source": "env:GH"}, "hosts is required"),
    ("gh", {"source": "env:GH", "hosts": []}, "hosts is required"),
    ("gh", {"source": "env:GH", "hosts": ["*.example.org"]}, "never a wildcard"),
    ("gh", {"source": "env:GH", "hosts": ["a.test:0"]}, "port must be a number from 1 to 65535"),
    ("gh", {"source": "env:GH", "hosts": ["a.test:https"]}, "port must be a number"),
    ("gh", {"source": "env:GH", "hosts": ["https://a.test/"]}, "is not a host name"),
    ("gh", {"source": "env:GH", "hosts": ["a b.test"]}, "is not a host name"),
    ("gh", {"source": "env:GH", "hosts": ["a.test"], "inject": "digest"}, "inject 'digest' is not one of"),
    ("gh", {"source": "env:GH", "hosts": ["a.test"], "inject": "basic:"}, "is not one of"),
    ("gh", {"source": "env:GH", "hosts": ["a.test"], "inject": "header:Bad Name"}, "is not one of"),
    ("gh", {"source": "env:GH", "hosts": ["a.test"], "inject": "header:Host"}, "a header the proxy owns"),
    ("gh", {"source": "env:GH", "hosts": ["a.test"], "env": "1X"}, "env '1X' is not a variable name"),
    ("gh", {"source": "env:GH", "hosts": ["a.test"], "env": "AGNSUP_CELL_ID"}, "set by agnsup"),
])
def test_a_bad_table_is_one_line_naming_the_secret(name, table, fragment):
    with pytest.raises(UsageError) as e:
        secrets.parse_table(name, table, "role r")
    assert fragment in e.value.message and "\n" not in e.value.message and e.value.message.startswith("role r: ")


def test_the_flag_spelling_splits_hosts_on_plus_and_keeps_commas_in_a_command():
    r = secrets.parse_flag("gh:source=command:/usr/bin/printf %s a,b,hosts=api.secret.test:8443+x.example.org,"
                           "inject=header:X-Api-Key,env=TOKEN")
    assert r.source == "command:/usr/bin/printf %s a,b" and r.inject == "header:X-Api-Key" and r.env == "TOKEN"
    assert r.hosts == (("api.secret.test", 8443), ("x.example.org", 443)) and r.where == "--secret"


@pytest.mark.parametrize("text, fragment", [
    ("gh", "expected NAME:source="),
    ("gh:", "expected NAME:source="),
    ("gh:source=env:GH,hosts=a.test,source=env:X", "source given twice"),
    ("gh:token=x", "'token=x' is not KEY=VALUE"),
    ("gh:source=env:GH", "hosts is required"),
])
def test_a_bad_flag_is_one_line(text, fragment):
    with pytest.raises(UsageError) as e:
        secrets.parse_flag(text)
    assert fragment in e.value.message and "\n" not in e.value.message


def test_the_request_takes_secrets_as_tables_or_flags_and_is_never_in_a_tool_schema():
    from agnsup import tool
    from agnsup.doors.mcp.tools import SCHEMAS
    r = CellRequest.make(["true"], secrets=["gh:source=env:GH,hosts=api.secret.test:8443,env=T"])
    assert r.secrets == {"gh": {"source": "env:GH", "env": "T", "hosts": ["api.secret.test:8443"],
                                "inject": "bearer"}}
    assert CellRequest.make(["true"], secrets=()).secrets is None
    assert CellRequest.make(["true"], secrets={"gh": {"source": "env:GH"}}).secrets == {"gh": {"source": "env:GH"}}
    with pytest.raises(UsageError, match="secrets: must be"):
        CellRequest.make(["true"], secrets={"gh": "env:GH"})
    with pytest.raises(UsageError, match="--secret gh: given twice"):
        CellRequest.make(["true"], secrets=["gh:source=env:A,hosts=a.test", "gh:source=env:B,hosts=a.test"])
    # the model never names a secret: no LLM tool, no MCP tool takes it
    assert "secrets" not in tool.RUN_PROCESS_SCHEMA["parameters"]["properties"]
    for s in SCHEMAS.values():
        assert "secrets" not in s.get("parameters", {}).get("properties", {}), s["name"]
    out = tool.handle_tool_call("run_process", {"argv": ["true"], "secrets": {"gh": {}}}, state_dir="/nonexistent")
    assert out["exit_code"] == 125 and "unknown argument(s): secrets" in out["error"]


def test_a_call_may_not_shadow_a_role_secret():
    role = {"gh": {"source": "env:GH", "hosts": ["api.secret.test:8443"], "inject": "bearer"}}
    with pytest.raises(UsageError, match="is the role r's: a call may not replace it"):
        secrets.refs_of(role, {"gh": {"source": "env:X", "hosts": ["api.secret.test:8443"]}}, "r")
    refs = secrets.refs_of(role, ["npm:source=env:NPM,hosts=registry.example.org"], "r")
    assert [r.name for r in refs] == ["gh", "npm"] and refs[1].where == "--secret"


def test_where_it_may_go_is_judged_by_the_roles_lists_as_the_proxy_judges_a_name():
    check([ref(), secrets.parse_table("b", {"source": "env:B", "hosts": ["a.example.org"]})], ALLOWLIST)
    for hosts, fragment in ((["evil.test"], "evil.test, which the role does not allow: evil.test:443 is not in"),
                            (["api.secret.test"], "api.secret.test, which the role does not allow"),  # port 443
                            (["bad.example.org"], "matches the deny entry")):
        with pytest.raises(UsageError) as e:
            check([ref(hosts=hosts)], ALLOWLIST)
        assert fragment in e.value.message and "\n" not in e.value.message
    for mode in ("deny", "loopback", "host"):
        with pytest.raises(UsageError, match="secrets go out through the egress proxy: use an allowlist role"):
            check([ref()], {"mode": mode})
    with pytest.raises(UsageError, match="both set T"):
        check([ref(env="T"), secrets.parse_table("b", {"source": "env:B", "hosts": ["a.example.org"],
                                                               "env": "T"})], ALLOWLIST)


def test_resolve_reads_each_source_and_no_message_or_repr_holds_a_value(tmp_path):
    f = tmp_path / "token"
    f.write_text(CANARY + "\n")
    got = secrets.resolve([ref(source="env:GH"), secrets.parse_table("f", {"source": f"file:{f}", "hosts": ["a.t"]}),
                           secrets.parse_table("c", {"source": f"command:/bin/echo {CANARY}", "hosts": ["a.t"]})],
                          env={"GH": CANARY, "PATH": "/bin"}, run=run_helper)
    assert [s.value for s in got] == [CANARY.encode()] * 3 and got[0].placeholder == "agnsup-secret:gh"
    for s in got:
        assert CANARY not in repr(s) and CANARY not in str(s) and CANARY not in repr([s])
        with pytest.raises(TypeError):
            pickle.dumps(s)


@pytest.mark.parametrize("source, env, fragment", [
    ("env:GH", {}, "GH is not set in the controller's environment"),
    ("env:GH", {"GH": ""}, "empty"),
    ("env:GH", {"GH": CANARY + "\x01x"}, "holds a control character"),
    ("env:GH", {"GH": "agnsup-secret:x"}, "holds a placeholder"),
    ("file:/nonexistent/token", {}, "cannot be read (No such file or directory)"),
    ("file:/", {}, "cannot be read (Is a directory)"),
    ("command:/bin/false", {}, "exited 1"),
    ("command:/nonexistent/helper", {}, "/nonexistent/helper is not an executable file"),
    ("command:/bin/sh -c 'echo $X; echo $X >&2; exit 3'", {"X": CANARY}, "exited 3"),  # what it said: not quoted
    ("command:/bin/true", {}, "empty"),
])
def test_a_source_that_gives_nothing_is_one_line_without_the_value(source, env, fragment):
    with pytest.raises(UsageError) as e:
        secrets.resolve([ref(source=source)], env=env, run=run_helper)
    m = e.value.message
    assert fragment in m and "\n" not in m and CANARY not in m and m.startswith("secrets: secret 'gh': source ")


def test_the_cell_env_gets_placeholders_and_the_trust_knobs_never_a_value():
    from agnsup.spec import CellSpec
    spec = CellSpec(argv=["true"], exe="/bin/true", role="r", run_id="r", agent_id="a", cell_id="c", workdir="/",
                    timeout=None, lock_timeout=None, env={"PATH": "/bin"}, env_sources={"PATH": "policy"}, token="t")
    secrets.apply(spec, [ref(env="GITHUB_TOKEN")], "/tmp")
    assert spec.env["GITHUB_TOKEN"] == "agnsup-secret:gh" and spec.env_sources["GITHUB_TOKEN"] == "secret"
    for k in secrets.CA_ENV:
        assert spec.env[k] == "/tmp/.agnsup/ca/ca-certificates.crt"
    assert spec.env["NODE_EXTRA_CA_CERTS"] == "/tmp/.agnsup/ca/agnsup-ca.pem" and spec.env["NODE_USE_ENV_PROXY"] == "1"
    assert spec.secrets == [ref(env="GITHUB_TOKEN").table()]
    spec.env_sources["GITHUB_TOKEN"] = "call"
    with pytest.raises(UsageError, match="--env GITHUB_TOKEN: the secret 'gh' sets it"):
        secrets.apply(spec, [ref(env="GITHUB_TOKEN")], "/tmp")


def test_the_bundle_is_the_system_bundle_and_the_ca(tmp_path):
    sysb = tmp_path / "system.crt"
    sysb.write_bytes(b"-----BEGIN CERTIFICATE-----\nSYS\n-----END CERTIFICATE-----")
    ca = b"-----BEGIN CERTIFICATE-----\nCA\n-----END CERTIFICATE-----\n"
    assert secrets.bundle_text(ca, str(sysb)) == sysb.read_bytes() + b"\n" + ca
    assert secrets.bundle_text(ca, str(tmp_path / "none")) == ca


def test_returned_output_is_redacted_of_the_cells_values_whatever_the_role_redacts():
    from agnsup.redact import Redactor, for_receipt
    s = secrets.Secret(ref(), CANARY.encode())
    red = Redactor([], {}, [], secrets.redaction_rules([s]))
    assert red(f"token={CANARY} and {CANARY}") == "token=[REDACTED:redact.secret.gh] and [REDACTED:redact.secret.gh]"
    assert red.counts == {"redact.secret.gh": 2}
    secrets.remember("run", "cell", [s])
    try:
        receipt = {"run_id": "run", "cell_id": "cell", "secrets": [{"name": "gh"}], "output": {}}
        assert CANARY not in for_receipt(receipt)(f"x {CANARY} y")
        assert for_receipt({**receipt, "cell_id": "other"})(f"x {CANARY}") == f"x {CANARY}"  # not this cell's
    finally:
        secrets.forget("run", "cell")


def test_a_role_declares_secrets_and_the_policy_file_is_checked(tmp_path):
    from agnsup import policy
    from agnsup.errors import PolicyError
    src = ('[role]\nname = "s"\n[env]\npath = ["/bin"]\n[network]\nmode = "allowlist"\n'
           'allow = ["api.secret.test:8443"]\n[secrets.gh]\nsource = "env:GH"\nenv = "T"\n'
           'hosts = ["api.secret.test:8443"]\n')
    assert policy.validate(src.encode(), "s.toml")["secrets"] == {
        "gh": {"source": "env:GH", "env": "T", "hosts": ["api.secret.test:8443"], "inject": "bearer"}}
    for old, new, fragment in (('hosts = ["api.secret.test:8443"]', 'hosts = ["evil.test"]', "does not allow"),
                               ('source = "env:GH"', 'source = "GH"', "key secrets.gh: source 'GH' is not one of"),
                               ("[secrets.gh]", "[secrets.GH]", "'GH' is not a secret name"),
                               ('mode = "allowlist"\nallow = ["api.secret.test:8443"]', 'mode = "host"',
                                "use an allowlist role")):
        with pytest.raises(PolicyError) as e:
            policy.validate(src.replace(old, new).encode(), "s.toml")
        assert fragment in e.value.message and "\n" not in e.value.message
