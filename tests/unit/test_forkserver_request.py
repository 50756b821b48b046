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
