"""Run quotas (quota.*): the pure decision (real cells counted by the journal: tests/test_gate_cells.py)."""
import pytest

from agnsup.gate import GateContext, check
from agnsup.gate.quota import Usage, decide

ENV = '[env]\npath = ["/usr/bin", "/bin"]\n'


def quota_role(policy_dir, name, **quota):
    lines = "".join(f"{k} = {v}\n" for k, v in quota.items())
    (policy_dir / f"{name}.toml").write_text(f'[role]\nname = "{name}"\n{ENV}[quota]\n{lines}')


def usage(cells=0, run=0, agent=0, age=None):
    return Usage(cells_in_run=cells, live_in_run=run, live_of_agent=agent, run_age=age)


@pytest.mark.parametrize("limits,use,rule", [
    ({"max_cells_per_run": 3}, usage(cells=3), "quota.cells_per_run"),
    ({"max_cells_per_run": 3}, usage(cells=2), "quota.pass"),
    ({"max_concurrent_per_run": 2}, usage(cells=9, run=2, agent=0), "quota.concurrent_run"),
    ({"max_concurrent_per_run": 2}, usage(cells=9, run=1, agent=1), "quota.pass"),
    ({"max_concurrent_per_agent": 1}, usage(run=1, agent=1), "quota.concurrent_agent"),
    ({"max_concurrent_per_agent": 1}, usage(run=5, agent=0), "quota.pass"),
    ({"max_run_seconds": 60}, usage(age=61.0), "quota.run_wall_time"),
    ({"max_run_seconds": 60}, usage(age=59.0), "quota.pass"),
    ({"max_run_seconds": 60}, usage(age=None), "quota.pass"),
])
def test_each_quota_denies_at_its_limit_and_passes_below_it(limits, use, rule):
    assert decide(tuple(limits.items()), use, "r").rule == rule


def test_a_quota_denial_names_the_policy_key_to_change():
    f = decide((("max_concurrent_per_agent", 1),), usage(run=1, agent=1), "ci", "r1", "a1")
    assert not f.allowed and "agent 'a1'" in f.reason and "quota.max_concurrent_per_agent" in f.hint
    assert "role 'ci'" in f.hint


def test_without_the_journal_only_a_limit_of_zero_is_judged():
    assert decide((("max_cells_per_run", 0),), None, "r").rule == "quota.cells_per_run"
    f = decide((("max_cells_per_run", 5), ("max_run_seconds", 60)), None, "r")
    assert f.allowed and f.rule == "quota.unjudged"
    assert "max_cells_per_run=5" in f.reason and "max_run_seconds=60" in f.reason


def test_the_gate_reports_unjudged_quotas_in_the_trail_and_keeps_the_zone_verdict():
    ctx = GateContext(worktree="/w", writable=("/",), quota=(("max_concurrent_per_agent", 1),))
    d, trail = check("run_process", {"argv": ["true"]}, ctx)
    assert d.allowed and d.rule == "allow.yellow_open"
    assert trail[-1]["check"] == "quota" and trail[-1]["rule"] == "quota.unjudged"


def test_the_gate_judges_quotas_when_the_caller_gives_it_the_usage():
    ctx = GateContext(worktree="/w", writable=("/",), quota=(("max_cells_per_run", 2),), usage=usage(cells=2))
    d, _ = check("run_shell", {"command": "make"}, ctx)
    assert (d.allowed, d.rule, d.check) == (False, "quota.cells_per_run", "quota")


def test_quotas_do_not_apply_to_tools_that_start_no_cell():
    ctx = GateContext(worktree="/w", writable=("/",), quota=(("max_cells_per_run", 0),))
    assert check("read_file", {"path": "/w/a"}, ctx)[0].allowed
    assert check("write_file", {"path": "/w/a"}, ctx)[0].allowed
    assert check("run_process", {"argv": ["true"]}, ctx)[0].rule == "quota.cells_per_run"
