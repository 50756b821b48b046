"""receipts.Draft: what of a cell's receipt is fixed once its command runs is encoded then, and dumps reuses it
(issue 29's seventh round). The text must stay byte for byte json.dumps(receipt, sort_keys=True) whatever changed
since: the cell's isolation dict, which the chain's backend stage holds (a change layer the kernel refused adds its
`not_in_force` at the end), a stage added, a field replaced. Checked to fail: with dumps trusting the drafted chain
without looking at the isolation and the stages, the isolation and the added-stage tests fail (seen)."""
import json
from types import SimpleNamespace

from agnsup import receipts


def _cell():
    isolation = {"cgroup_layout": "hybrid", "mount_namespace": True, "reduced": []}
    trace = [{"stage": "spec_builder", "env_keys": ["A", "PATH"]},
             {"stage": "backend", "isolation": isolation, "cgroup": {"v2": "/x"}},
             {"stage": "process_supervisor", "pid": 12}]
    spec = SimpleNamespace(env={"PATH": "/usr/bin", "A": "é\u2028", "API_TOKEN": "s"}, env_sources={"PATH": "host"},
                           argv=["sh", "-c", "echo \"hi\"\n"])
    return SimpleNamespace(spec=spec, decision={"allowed": True, "rule": "r"}, trail=[{"rule": "r", "why": "ok"}],
                           trace=trace, isolation=isolation)


def _receipt(cell, drafted=None) -> dict:
    r = {"kind": "cell", "version": 1, "chain": cell.trace, "isolation": cell.isolation, "exit_code": 0,
         "governance": {"decision": cell.decision, "trail": cell.trail}, "env": receipts.redacted_env(cell.spec),
         "env_keys": sorted(cell.spec.env), "env_sources": cell.spec.env_sources, "argv": cell.spec.argv,
         "usage": {"cpu_usec": 12, "memory_peak": None}, "released": [{"kind": "tmpdir", "path": "/t"}]}
    if drafted is not None:
        r.update((k, v) for k, (v, _) in drafted.fields.items())
    return r


def test_the_drafted_text_is_json_dumps_byte_for_byte():
    cell = _cell()
    d = receipts.Draft(cell)
    r = _receipt(cell, d)
    assert receipts.dumps(r, d) == json.dumps(r, sort_keys=True) == receipts.dumps(r)


def test_an_isolation_changed_after_the_draft_is_in_the_chain_too():
    cell = _cell()
    d = receipts.Draft(cell)
    cell.isolation["not_in_force"] = ["reversible (the cell's writes landed live, uncaptured): refused"]
    r = _receipt(cell, d)
    assert receipts.dumps(r, d) == json.dumps(r, sort_keys=True)
    assert "not_in_force" in json.loads(receipts.dumps(r, d))["chain"][1]["isolation"]


def test_a_stage_added_or_a_field_replaced_after_the_draft_is_encoded_as_it_is_now():
    cell = _cell()
    d = receipts.Draft(cell)
    cell.trace.append({"stage": "late"})
    r = _receipt(cell, d)
    r["env"] = {"OTHER": "1"}
    assert receipts.dumps(r, d) == json.dumps(r, sort_keys=True)
