"""sandboxd's pure parts: listen addresses, and how a REST path maps into the worktree."""
import os

import pytest

from agnsup.errors import UsageError
from agnsup.doors.sandboxd import parse_address
from agnsup.doors.sandboxd.rest import Files, Refused


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


def test_the_kernel_keeps_every_open_beneath_the_worktree_whatever_resolve_saw(tmp_path):
    """The race resolve() cannot see: a name swapped for a symlink after the check. The open
    itself (openat2 RESOLVE_BENEATH) refuses it, for reads and for a write's directories."""
    wt = tmp_path / "wt"
    wt.mkdir()
    (tmp_path / "secret").write_text("s")
    os.symlink(str(tmp_path / "secret"), wt / "swapped")
    os.symlink(str(tmp_path), wt / "dir-swapped")
    os.symlink("../secret", wt / "relative")
    files = Files.__new__(Files)
    files.workdir = str(wt)
    files.root_fd = os.open(str(wt), os.O_PATH | os.O_DIRECTORY)
    try:
        for name in ("swapped", "relative", "dir-swapped/secret", "../secret"):
            with pytest.raises(Refused) as e:
                files.open(name, os.O_RDONLY)
            assert e.value.status == 403 and e.value.extra["rule"] == "sandboxd.path_escape"
        with pytest.raises(Refused):
            files.parent("dir-swapped/new.txt", create=True)
        assert not (tmp_path / "new.txt").exists()
        fd, name = files.parent("a/b/c.txt", create=True)
        os.close(fd)
        assert name == "c.txt" and (wt / "a" / "b").is_dir()
    finally:
        files.close()


def test_execute_with_limits_output_is_the_captures_bytes_cut_at_each_limit_and_redaction_never_overruns_it(tmp_path):
    from agnsup.doors.sandboxd.process import bounded_output
    (tmp_path / "stdout").write_bytes(b"\xff\x00ok token=abc123 tail")
    (tmp_path / "stderr").write_bytes(b"e")
    out = bounded_output(str(tmp_path), {"stdout": 5, "stderr": 1}, lambda text: text)
    assert out == {"stdout": b"\xff\x00ok ", "stdout_truncated": True, "stderr": b"e", "stderr_truncated": False}
    # a redaction that lengthens the text is cut again: never more than the limit comes back
    out = bounded_output(str(tmp_path), {"stdout": 16, "stderr": 0},
                         lambda text: text.replace("abc1", "[REDACTED:secret]"))
    assert out["stdout"] == b"\xff\x00ok token=[REDA" and out["stdout_truncated"] and out["stderr_truncated"]
    assert bounded_output(str(tmp_path / "absent"), {"stdout": 3, "stderr": 3}, str) == {
        "stdout": b"", "stdout_truncated": False, "stderr": b"", "stderr_truncated": False}
