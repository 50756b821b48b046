"""linux/sys.py's descriptor passing (SCM_RIGHTS), the one helper the cell's netns hand-off, cell_netns and the
pod keeper use: what arrives is the same open file, close-on-exec; nothing queued is (b"", []) without waiting."""
import fcntl
import os

from agnsup.linux import sys as lsys


def test_descriptors_arrive_as_the_same_files_close_on_exec_and_an_empty_queue_does_not_wait(tmp_path):
    a, b = lsys.seqpacket_pair()
    files = [os.open(tmp_path / name, os.O_CREAT | os.O_RDWR, 0o600) for name in ("one", "two")]
    try:
        assert lsys.recv_fds(b, wait=False) == (b"", [])
        lsys.send_fds(a, b"2", files)
        data, got = lsys.recv_fds(b, max_fds=2, wait=False)
        try:
            assert data == b"2" and len(got) == 2
            assert [os.fstat(fd).st_ino for fd in got] == [os.fstat(fd).st_ino for fd in files]
            assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in got)
        finally:
            for fd in got:
                os.close(fd)
        os.close(a)
        assert lsys.recv_fds(b) == (b"", [])  # the other end closed without a word
    finally:
        for fd in (b, *files):
            os.close(fd)
