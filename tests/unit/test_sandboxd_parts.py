"""sandboxd's pure parts: listen addresses, and how a REST path maps into the worktree."""
import os

import pytest

from agnsup.errors import UsageError
from agnsup.sandboxd import parse_address
from agnsup.sandboxd.rest import Files, Refused


def test_listen_addresses_default_to_loopback_and_take_v6_brackets():
    assert parse_address("9090", "--grpc") == ("127.0.0.1", 9090)
    assert parse_address(":0", "--grpc") == ("127.0.0.1", 0)
    assert parse_address("0.0.0.0:8080", "--rest") == ("0.0.0.0", 8080)
    assert parse_address("[::1]:8080", "--rest") == ("::1", 8080)
    for bad in ("", "host:", "h:-1", "h:65536", "h:x"):
        with pytest.raises(UsageError, match="expected HOST:PORT"):
            parse_address(bad, "--rest")


def test_rest_paths_are_the_worktrees_and_never_leave_it(tmp_path):
    wt = tmp_path / "wt"
    (wt / "sub").mkdir(parents=True)
    os.symlink("/etc", wt / "etc-link")
    files = Files.__new__(Files)  # resolve() needs only the worktree
    files.workdir = str(wt)
    assert files.resolve("")[1] == str(wt)
    assert files.resolve("sub/../a.txt")[1] == str(wt / "a.txt")
    assert files.resolve("/etc/passwd")[1] == str(wt / "etc" / "passwd")  # absolute = the sandbox's
    assert files.resolve(f"{wt}/sub/x")[1] == str(wt / "sub" / "x")
    for bad in ("..", "../x", "sub/../../x", "etc-link/passwd"):
        with pytest.raises(Refused) as e:
            files.resolve(bad)
        assert e.value.status == 403 and e.value.code == "PERMISSION_DENIED"
    with pytest.raises(Refused) as e:
        files.resolve("a\0b")
    assert e.value.status == 400
