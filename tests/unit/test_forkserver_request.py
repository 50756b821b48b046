"""process/forkserver.py's request: steps.Setup as data and fds, and back (no process, no root)."""
import os

from agnsup.process import forkserver, steps

MADE_BY_THE_SERVER = {"init_name", "parent_fd", "born"}  # where its own argv lies, its pidfd, how it cloned


def test_every_setup_field_crosses_to_the_fork_server_or_is_made_there():
    """A field added to steps.Setup and forgotten by pack would reach a Supervisor's leader as its default."""
    d, fds = forkserver.pack(steps.Setup())
    assert fds == []
    assert set(steps.Setup._fields) - set(d) == MADE_BY_THE_SERVER
    assert set(d) - set(steps.Setup._fields) == {"umask"}


def test_a_setup_packed_and_unpacked_names_the_same_fds_in_their_places():
    pipes = [os.pipe() for _ in range(4)]
    ends = [fd for pair in pipes for fd in pair]
    try:
        s = steps.Setup(ids=(1000, 1000), netns_shared=True, controller=4242, in_userns=True, ctty=True,
                        barrier_r=ends[0], err_w=ends[1], status_w=ends[2], netns_watch=ends[3],
                        stdio=(ends[4], None, ends[5]), premade={"tmp": ends[6]})
        d, fds = forkserver.pack(s)
        assert len(fds) == 7
        back = forkserver.unpack(d, fds)
        for name in ("ids", "netns_shared", "controller", "in_userns", "ctty", "barrier_r", "err_w", "status_w",
                     "netns_watch", "stdio", "premade", "netns_fd", "pod_userns", "userns_fd", "ruleset", "filter",
                     "egress"):
            assert getattr(back, name) == getattr(s, name), name
    finally:
        for fd in ends:
            os.close(fd)


def _plan_reads(path: str) -> tuple[set, set]:
    """(plan.X, plan.spec.Y) read in the module at `path`."""
    import ast
    fields, spec = set(), set()
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "plan":
            fields.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "spec" \
                and isinstance(node.value.value, ast.Attribute) and node.value.value.attr == "plan":
            spec.add(node.attr)
    return fields, spec


def test_the_plan_a_request_carries_has_every_field_the_leader_steps_read():
    """A Supervisor's leader gets only steps.PLAN_FIELDS of the plan: a step reading another would fail there."""
    fields, spec = set(), set()
    for module in (steps, forkserver):
        f, sp = _plan_reads(module.__file__)
        fields |= f
        spec |= sp
    assert fields <= set(steps.PLAN_FIELDS), fields - set(steps.PLAN_FIELDS)
    assert spec <= set(steps.SPEC_FIELDS), spec - set(steps.SPEC_FIELDS)


def test_a_packed_plan_keeps_the_values_of_those_fields():
    import pickle
    from types import SimpleNamespace
    spec = SimpleNamespace(exe="/bin/true", argv=["true"], env={"A": "1"}, workdir="/w", unread="x")
    plan = SimpleNamespace(**{f: (f, 1) for f in steps.PLAN_FIELDS if f != "spec"}, spec=spec, unread="y")
    d, _ = forkserver.pack(steps.Setup(plan=plan))
    back = pickle.loads(pickle.dumps(d))["plan"]
    for f in steps.PLAN_FIELDS:
        if f != "spec":
            assert getattr(back, f) == (f, 1)
    assert (back.spec.exe, back.spec.argv, back.spec.env, back.spec.workdir) == ("/bin/true", ["true"], {"A": "1"}, "/w")
    assert not hasattr(back, "unread") and not hasattr(back.spec, "unread")
