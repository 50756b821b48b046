"""Redaction of returned output (agnsup/redact.py; docs/governance.md "Redaction").

The engine is pure (tables below); tests/test_redact_cells.py runs real cells and
checks what run_process, a Supervisor and the receipt give back, and that the
capture files and a terminal's output are left as the cell wrote them.
The keys below are made up in the documented formats; none is real.
"""
import pytest

from agnsup.redact import Redactor, host_secrets

AWS_ID = "AKIA" + "ABCDEFGHIJKLMNOP"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GH = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
PEM = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU=\n-----END OPENSSH PRIVATE KEY-----"
ALL = ["host_secrets", "key_formats", "bearer_tokens", "private_keys"]

CASES = [
    # (text, secret that must disappear, rule id counted)
    (f"export AWS_ACCESS_KEY_ID={AWS_ID}", AWS_ID, "redact.aws_access_key_id"),
    (f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET, "redact.aws_secret_access_key"),
    (f'{{"SecretAccessKey": "{AWS_SECRET}"}}', AWS_SECRET, "redact.aws_secret_access_key"),
    (f"token: {GH}", GH, "redact.github_token"),
    ("GITLAB=glpat-" + "x1y2z3A4B5C6D7E8F9G0", "glpat-x1y2z3A4B5C6D7E8F9G0", "redact.gitlab_token"),
    ("xoxb-" + "123456789012-abcdefABCDEF", "xoxb-123456789012-abcdefABCDEF", "redact.slack_token"),
    ("sk_live_" + "51Habcdefghijklmnop", "sk_live_51Habcdefghijklmnop", "redact.stripe_key"),
    ("OPENAI_API_KEY=sk-proj-" + "A" * 40, "sk-proj-" + "A" * 40, "redact.openai_key"),
    ("key sk-ant-api03-" + "b" * 40, "sk-ant-api03-" + "b" * 40, "redact.anthropic_key"),
    ("AIza" + "SyA1234567890abcdefghijklmnopqrstuv", "AIzaSyA1234567890abcdefghijklmnopqrstuv", "redact.google_api_key"),
    ("DefaultEndpointsProtocol=https;AccountName=x;AccountKey=" + "Q" * 86 + "==;", "Q" * 86,
     "redact.azure_storage_key"),
    ("curl -H 'Authorization: Bearer abcdef0123456789abcdef'", "abcdef0123456789abcdef", "redact.authorization"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpwYXNzd29yZA==", "redact.authorization"),
    ("token is Bearer 0123456789abcdefXYZ", "0123456789abcdefXYZ", "redact.bearer"),
    (f"cookie={JWT}", JWT, "redact.jwt"),
    ("cloning https://deploy:s3cr3tpassw0rd@git.example.com/repo.git", "s3cr3tpassw0rd", "redact.url_password"),
    (f"key:\n{PEM}\nrest", "b3BlbnNzaC1rZXktdjEAAAAABG5vbmU=", "redact.private_key"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA (truncated", "MIIEpAIBAAKCAQEA", "redact.private_key"),
]
KEPT = [
    "build finished in 12.3s", "git commit abc123def456", "AKIA is a prefix", "Bearer tokens are documented here",
    "-----BEGIN PUBLIC KEY-----\nMFkwEw\n-----END PUBLIC KEY-----", "https://github.com/org/repo.git",
    "sha256: " + "f" * 64, "user@host:~/path", "sk-short",
]


@pytest.mark.parametrize("text,secret,rule", CASES, ids=[c[2] + str(i) for i, c in enumerate(CASES)])
def test_a_known_secret_format_is_redacted_and_counted_under_its_rule(text, secret, rule):
    red = Redactor(ALL)
    out = red(text)
    assert secret not in out and f"[REDACTED:{rule}]" in out, out
    assert red.counts.get(rule) == 1, red.counts


@pytest.mark.parametrize("text", KEPT)
def test_ordinary_output_is_left_alone(text):
    red = Redactor(ALL, secrets=["not-in-the-text-1234"])
    assert red(text) == text and red.counts == {}


def test_only_the_rule_sets_a_role_names_apply():
    text = f"{AWS_ID} Bearer 0123456789abcdefXYZ"
    red = Redactor(["bearer_tokens"])
    out = red(text)
    assert AWS_ID in out and "0123456789abcdefXYZ" not in out


def test_host_secrets_are_the_secret_looking_values_the_cell_was_not_given():
    env = {"SERVICE_TOKEN": "tok-1234567890", "GIVEN_TOKEN": "given-123456789", "AWS_REGION": "eu-central-1",
           "SSL_KEY": "/etc/ssl/private/x.key", "SHORT_KEY": "abc", "HOME": "/root", "DB_PASSWORD": "hunter2hunter2"}
    values = host_secrets(env, given_keys=["GIVEN_TOKEN", "PATH"])
    assert sorted(values) == ["hunter2hunter2", "tok-1234567890"]
    red = Redactor(["host_secrets"], secrets=values)
    out = red("token tok-1234567890 and tok-1234567890, pw hunter2hunter2, given given-123456789, eu-central-1")
    assert out.count("[REDACTED:redact.host_secret]") == 3 and "given-123456789" in out and "eu-central-1" in out
    assert red.counts == {"redact.host_secret": 3}


def test_a_role_pattern_is_its_own_rule_id():
    red = Redactor([], patterns={"ticket": r"ACME-\d{6}"})
    assert red("see ACME-123456 and ACME-654321") == "see [REDACTED:redact.role.ticket] and [REDACTED:redact.role.ticket]"
    assert red.counts == {"redact.role.ticket": 2}


def test_ordinary_output_runs_no_rule_s_regular_expression(monkeypatch):
    """Every rule's cheap prefilter (a literal the match must contain) rules ordinary output out before its
    regular expression runs: that is what keeps redaction near a string scan (speed: scripts/bench redact)."""
    text = ("2024-01-01 INFO build step ok path=/src/app/module.py line=42 user@host\n" * 1000)[:65536]
    ran = []
    monkeypatch.setattr(Redactor, "_sub", lambda self, rule_id, rx, text, word_start=False: ran.append(rule_id) or text)
    red = Redactor(ALL, secrets=["x" * 20, "y" * 30])
    assert red(text) == text
    assert ran == []
    red(f"{text} Authorization: Bearer {GH}")  # the prefilters do let a candidate through
    assert "redact.authorization" in ran and "redact.github_token" in ran


# --- policy keys -----------------------------------------------------------------------

def _role(policy_dir, name, body):
    (policy_dir / f"{name}.toml").write_text(f'[role]\nname = "{name}"\n[env]\npath = ["/usr/bin", "/bin"]\n{body}')


@pytest.mark.parametrize("body,problem", [
    ('[governance]\nredact = ["everything"]', "unknown redaction rule set 'everything'"),
    ('[governance]\nredact_patterns = { bad = "(" }', "is not a regular expression"),
    ('[governance]\nredact_patterns = { empty = "x*" }', "matches the empty string"),
])
def test_a_bad_redaction_key_is_refused_with_file_key_and_problem(policy_dir, monkeypatch, body, problem):
    from agnsup import policy
    from agnsup.errors import PolicyError
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    _role(policy_dir, "bad", body)
    with pytest.raises(PolicyError, match=problem):
        policy.load("bad")


def test_the_regulated_preset_redacts_by_default_and_a_role_cannot_drop_a_rule_set(policy_dir, monkeypatch):
    from agnsup import policy
    monkeypatch.setenv("AGNSUP_POLICY_DIR", str(policy_dir))
    _role(policy_dir, "reg", '[governance]\npreset = "regulated"\nredact = ["key_formats"]\n'
                             'redact_patterns = { ticket = "ACME-[0-9]+" }')
    gov = policy.load("reg")["governance"]
    assert set(gov["redact"]) == set(ALL) and gov["redact_patterns"] == {"ticket": "ACME-[0-9]+"}
    _role(policy_dir, "std", '[governance]\npreset = "standard"')
    assert list(policy.load("std")["governance"]["redact"]) == []
