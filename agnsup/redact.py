"""Redaction: secrets taken out of what a cell printed before a caller gets it back.

A role turns it on with named rule sets (`[governance] redact = [...]`) and
patterns of its own (`redact_patterns = {name = "regex"}`):

    host_secrets   values of the controller's secret-looking environment
                   variables (secretkeys.looks_secret) that the cell was not
                   given; the cell can still find them (a file, a log), and
                   they must not travel back to the agent
    key_formats    cloud and service keys by their format (AWS access key ids
                   and secret keys, GitHub, GitLab, Slack, Stripe, OpenAI,
                   Anthropic, Google API, npm tokens, Azure storage keys)
    bearer_tokens  `Authorization: Bearer/Basic ...`, `Bearer xyz`, JWTs,
                   passwords in URLs (`https://user:pw@host`)
    private_keys   PEM/OpenSSH/PGP private key blocks

Each match becomes `[REDACTED:<rule id>]` and is counted under that rule id
(`redact.aws_access_key_id`, `redact.host_secret`, `redact.role.<name>`). A cell's
own secrets (agnsup/secrets.py) are always redacted, whatever the role's rules
(`redact.secret.<name>`): their values are held in the controller's memory only.
It applies where a caller's result is built from the captured output
(tool.cell_result: run_process, the LLM tool call, serve), and the receipt
carries the rule sets, the role's patterns and the counts
(`output.redaction`). What the cell writes to its own files or to a
terminal, and the capture files themselves, are not changed.

Pure and fast: nothing is compiled until output is redacted; imported only
by callers that return captured output.
"""
from __future__ import annotations

import re

RULE_SETS = ("host_secrets", "key_formats", "bearer_tokens", "private_keys")

# (rule name, pattern): the secret is the named group `s` when there is one, else the whole match.
# Patterns start with a literal where they can (the regex engine then skips to it: ~50x faster on
# output without keys); "starts a word" is checked on the match instead of with a leading \b.
_FORMATS = {
    "private_keys": (
        ("private_key", r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
                        r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|.*\Z)"),
    ),
    "key_formats": (
        ("aws_access_key_id", r"A(?:KIA|SIA|GPA|IDA|ROA|NPA|NVA|IPA)[0-9A-Z]{16}(?![0-9A-Za-z])"),
        ("aws_secret_access_key", r"(?i:aws_?secret_?access_?key|secretaccesskey)[\"']?\s*[:=]\s*[\"']?"
                                  r"(?P<s>[A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])"),
        ("github_token", r"gh[pousr]_[A-Za-z0-9]{36,255}(?![A-Za-z0-9])|github_pat_[A-Za-z0-9_]{22,255}"),
        ("gitlab_token", r"glpat-[A-Za-z0-9_-]{20,}"),
        ("slack_token", r"xox[abposr]-[A-Za-z0-9-]{10,}"),
        ("stripe_key", r"[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"),
        ("anthropic_key", r"sk-ant-[A-Za-z0-9_-]{32,}"),
        ("openai_key", r"sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{32,}"),
        ("google_api_key", r"AIza[0-9A-Za-z_-]{35}"),
        ("npm_token", r"npm_[A-Za-z0-9]{36}(?![A-Za-z0-9])"),
        ("azure_storage_key", r"(?i:AccountKey)=(?P<s>[A-Za-z0-9+/=]{40,})"),
    ),
    "bearer_tokens": (
        ("authorization", r"(?i:authorization)[\"']?\s*[:=]\s*[\"']?(?i:bearer|basic|token|digest)\s+"
                          r"(?P<s>[A-Za-z0-9._~+/=-]{8,})"),
        ("bearer", r"(?i:bearer)\s+(?P<s>[A-Za-z0-9._~+/-]{16,}=*)"),
        ("jwt", r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        ("url_password", r"://[^/\s:@]+:(?P<s>[^/\s@]+)@"),
    ),
}
# A needle that must occur for a pattern to match (looked up in the lower-cased text for the
# case-insensitive ones): most output holds no key at all, and then no pattern scans it.
_PREFILTER = {"private_key": "PRIVATE KEY", "aws_access_key_id": "A", "github_token": "gh", "gitlab_token": "glpat-",
              "slack_token": "xox", "stripe_key": "k_", "anthropic_key": "sk-ant-", "openai_key": "sk-",
              "google_api_key": "AIza", "npm_token": "npm_", "jwt": "eyJ", "url_password": "://"}
_PREFILTER_LOWER = {"aws_secret_access_key": "secret", "azure_storage_key": "accountkey",
                    "authorization": "authorization", "bearer": "bearer"}
# Rules whose match must start a word (not `xAKIA...`): checked on the match.
_WORD_START = frozenset({"aws_access_key_id", "github_token", "gitlab_token", "slack_token", "stripe_key",
                         "anthropic_key", "openai_key", "google_api_key", "npm_token", "jwt", "bearer"})
# Secret-looking by name (AWS_*), but holding settings, not secrets.
_NOT_SECRET_KEYS = frozenset({"AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_OUTPUT",
                              "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PAGER", "AWS_CA_BUNDLE",
                              "AWS_SDK_LOAD_CONFIG", "AWS_EC2_METADATA_DISABLED", "AWS_ENDPOINT_URL"})
MIN_SECRET_LEN = 8
_compiled: dict[str, re.Pattern] = {}


def _rx(pattern: str, dotall: bool = False) -> re.Pattern:
    rx = _compiled.get(pattern)
    if rx is None:
        rx = _compiled[pattern] = re.compile(pattern, re.S if dotall else 0)
    return rx


def host_secrets(environ, given_keys) -> list[str]:
    """Values of the host's secret-looking variables that the cell was not given, longest first."""
    from .util.secretkeys import looks_secret
    given = set(given_keys)
    vals = {v for k, v in environ.items()
            if k not in given and k not in _NOT_SECRET_KEYS and looks_secret(k) and len(v) >= MIN_SECRET_LEN
            and not v.startswith(("/", "~")) and v.strip() == v and v.lower() not in ("true", "false")}
    return sorted(vals, key=len, reverse=True)


class Redactor:
    """Redacts text by the rule sets and patterns it was built with; `counts` accumulates per rule id."""

    def __init__(self, rules, patterns: dict[str, str] | None = None, secrets: list[str] | None = None,
                 literals: list[tuple[str, str]] | None = None):
        self.rules = [r for r in RULE_SETS if r in set(rules)]
        self.patterns = dict(patterns or {})
        self.secrets = list(secrets or []) if "host_secrets" in self.rules else []
        # (rule id, value): the cell's own secrets (agnsup/secrets.py, redact.secret.<name>), whatever the rules
        self.literals = [(rid, v) for rid, v in literals or () if v]
        self.counts: dict[str, int] = {}

    def _sub(self, rule_id: str, rx: re.Pattern, text: str, word_start: bool = False) -> str:
        def repl(m: re.Match) -> str:
            i = m.start()
            if word_start and i and (text[i - 1].isalnum() or text[i - 1] == "_"):
                return m.group(0)
            self.counts[rule_id] = self.counts.get(rule_id, 0) + 1
            if "s" in rx.groupindex and m.group("s") is not None:
                s, e = m.span("s")
                return m.group(0)[:s - m.start()] + f"[REDACTED:{rule_id}]" + m.group(0)[e - m.start():]
            return f"[REDACTED:{rule_id}]"
        return rx.sub(repl, text)

    def __call__(self, text: str) -> str:
        if not text:
            return text
        for rule_id, value in self.literals:  # first: a value may also match a format rule
            n = text.count(value)
            if n:
                self.counts[rule_id] = self.counts.get(rule_id, 0) + n
                text = text.replace(value, f"[REDACTED:{rule_id}]")
        if "private_keys" in self.rules:
            text = self._apply("private_keys", text)
        for value in self.secrets:
            n = text.count(value)
            if n:
                self.counts["redact.host_secret"] = self.counts.get("redact.host_secret", 0) + n
                text = text.replace(value, "[REDACTED:redact.host_secret]")
        for group in ("key_formats", "bearer_tokens"):
            if group in self.rules:
                text = self._apply(group, text)
        for name, pattern in self.patterns.items():
            text = self._sub(f"redact.role.{name}", _rx(pattern), text)
        return text

    def _apply(self, group: str, text: str) -> str:
        lower = None
        for name, pattern in _FORMATS[group]:
            pre = _PREFILTER.get(name)
            if pre is not None and pre not in text:
                continue
            pre = _PREFILTER_LOWER.get(name)
            if pre is not None:
                lower = text.lower() if lower is None else lower
                if pre not in lower:
                    continue
            text = self._sub(f"redact.{name}", _rx(pattern, dotall=name == "private_key"), text,
                             name in _WORD_START)
            lower = None
        return text


def config_of(gov: dict) -> dict | None:
    """What the plan and the receipt carry: {"rules": [...], "patterns": {...}}, or None when off."""
    rules, patterns = list(gov.get("redact") or ()), dict(gov.get("redact_patterns") or {})
    return {"rules": rules, "patterns": patterns} if rules or patterns else None


def captured(cell_dir: str, name: str, limit: int) -> tuple[bytes, bool]:
    """The first `limit` bytes of a capture file (what a caller gets back) and whether there was more."""
    import os
    try:
        with open(os.path.join(cell_dir, name), "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        data = b""
    return data[:limit], len(data) > limit


def receipt_section(config: dict, given_keys, cell_dir: str, limit: int, environ=None, literals=None) -> dict:
    """The receipt's output.redaction: the rule sets, the role's patterns, and how many
    matches each rule redacts from the output a caller gets back (stdout and stderr);
    `literals`: the cell's secrets as (rule id, value) (secrets.redaction_rules)."""
    import os
    red = Redactor(config["rules"], config["patterns"], host_secrets(os.environ if environ is None else environ,
                                                                     given_keys), literals)
    for name in ("stdout", "stderr"):
        red(captured(cell_dir, name, limit)[0].decode(errors="replace"))
    return {"rules": red.rules, "patterns": red.patterns, "counts": dict(sorted(red.counts.items()))}


def for_receipt(receipt: dict, environ=None):
    """A function text -> redacted text for a cell's returned output, built from its receipt
    (output.redaction and env_keys); the identity when the role redacts nothing."""
    cfg = (receipt.get("output") or {}).get("redaction")
    literals = secret_literals(receipt.get("run_id"), receipt.get("cell_id")) if receipt.get("secrets") else []
    if not cfg and not literals:
        return lambda text: text
    import os
    cfg = cfg or {}
    return Redactor(cfg.get("rules", ()), cfg.get("patterns"),
                    host_secrets(os.environ if environ is None else environ, receipt.get("env_keys", ())), literals)


def secret_literals(run_id, cell_id) -> list[tuple[str, str]]:
    """The (rule id, value) of a cell's secrets this controller holds in memory (agnsup/secrets.py); []: none."""
    import sys
    mod = sys.modules.get("agnsup.secrets")  # loaded only by a controller that started a cell with secrets
    if mod is None:
        return []
    return mod.redaction_rules(mod.held(run_id, cell_id))
