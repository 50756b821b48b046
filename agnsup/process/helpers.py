"""Throwaway children and host helpers, never a cell: here only because this is the package that may
create processes."""
from __future__ import annotations

import os


def probe(fn) -> tuple[bool, str]:
    """Run `fn()` in a throwaway child, never a cell: (succeeded, its error's text, or the bytes it returned).
    `agnsup doctor` proves a kernel feature works here by using it once."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code, said = 1, b""
        try:
            os.close(r)
            said, code = fn(), 0
        except BaseException as e:  # noqa: BLE001
            said = str(e).encode(errors="replace")[:500]
        finally:
            try:
                os.write(w, said if isinstance(said, bytes) else b"")
            finally:
                os._exit(code)
    os.close(w)
    said = read_all(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0, said.decode(errors="replace")


def run_helper(argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """Run one host helper by absolute path (never through PATH), with only the environment `env`
    (default: LC_ALL=C) and no stdin: (exit status, stdout, stderr). For the backends' one-time set-up (busctl: agnsup's
    systemd unit), never for a cell."""
    import subprocess
    if not os.path.isabs(argv[0]):
        raise ValueError(f"helper {argv[0]!r} is not an absolute path")
    try:
        cp = subprocess.run(argv, env=env if env is not None else {"LC_ALL": "C"}, stdin=subprocess.DEVNULL,
                            capture_output=True, timeout=timeout, text=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, "", str(e)
    return cp.returncode, cp.stdout, cp.stderr


def read_all(fd: int, timeout: float | None = None) -> bytes:
    """Everything until EOF on `fd`, which is closed; TimeoutError when that takes more than `timeout` s."""
    chunks = []
    if timeout is not None:
        import select
        import time
        deadline = time.monotonic() + timeout
    try:
        while True:
            if timeout is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(0, f"nothing more within {timeout:g} s")
            b = os.read(fd, 4096)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def tmp_entries(plan) -> list[tuple]:
    """What home.make writes below the cell's /tmp, in order, parents first: ("dir", rel, mode), ("link", rel,
    target), ("file", rel, mode, bytes), with the modes home.make's mkdir/open give them under the process's
    umask; every entry but the links is owned by plan.cell_ids() when not None (home.make's lchown), else by us."""
    mask = _umask()
    out: list[tuple] = [("dir", "home", 0o700 & ~mask)]
    have = {"", "home"}

    def parents(rel: str) -> None:
        todo, d = [], os.path.dirname(rel)
        while d not in have:
            todo.append(d)
            d = os.path.dirname(d)
        for d in reversed(todo):
            have.add(d)
            out.append(("dir", d, 0o755 & ~mask))
    for rel, target in plan.tmp_links:
        rel = os.path.normpath(rel)
        parents(rel)
        out.append(("link", rel, target))
    for _, _, rel in plan.caches:
        parents(os.path.join(os.path.normpath(rel), "."))
    for rel, text in plan.tmp_files:
        rel = os.path.normpath(rel)
        parents(rel)
        out.append(("file", rel, 0o666 & ~mask, text.encode()))
    return out


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it: a race with other threads)."""
    from ..linux import proc
    try:
        return int((proc.status() or {}).get("Umask", "0022"), 8)
    except ValueError:
        return 0o022


def shelve(ready: dict, key, item, slots: int, closed: bool) -> list:
    """A made-ahead thing (a /tmp tmpfs: leader.TmpSpare; a spare cell: cellspare.CellSpares) put in `ready` under
    `key`, the caller holding its lock: what must be let go of instead, returned (it, when closed or one is there
    already; else the oldest ones past `slots`)."""
    if closed or key in ready:
        return [item]
    ready[key] = item
    drop = []
    while len(ready) > slots:
        drop.append(ready.pop(next(iter(ready))))
    return drop
