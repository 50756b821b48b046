"""One home for /proc, proven by reading the source: only agnsup/linux/proc.py opens, reads or lists a
/proc path (the self-test, an outside observer, reads it its own way)."""
import ast
import os

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agnsup")

PROC_READER = os.path.join(PKG, "linux", "proc.py")
OUTSIDE_READERS = (os.path.join(PKG, "selftest"),)  # the self-test reads /proc as an outside observer would
# issue 30: supervisor.py's (then agnsup/process/'s) namespace handles and thread count, until the lead
# applies proc.ns, proc.ns_id and proc.threads there after the split
PENDING = (os.path.join(PKG, "supervisor.py"), os.path.join(PKG, "process"))


def _proc_reads(path: str) -> list[str]:
    """Calls that open, read or list a /proc path given as a literal (a descriptor reopened by its
    /proc/self/fd path is not a /proc read)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        a = node.args[0]
        lead = a.values[0] if isinstance(a, ast.JoinedStr) and a.values else a
        lead = lead.value if isinstance(lead, ast.Constant) and isinstance(lead.value, str) else ""
        if name in ("open", "readlink", "listdir", "scandir") and lead.startswith("/proc") \
                and not lead.startswith("/proc/self/fd/"):
            out.append(f"{name}({lead!r}...)")
    return out


def _sources():
    for root, _, files in os.walk(PKG):
        yield from (os.path.join(root, f) for f in files if f.endswith(".py"))


def test_only_linux_proc_reads_proc():
    bad = {os.path.relpath(p, PKG): v for p in _sources()
           if p != PROC_READER and not p.startswith(OUTSIDE_READERS + PENDING) and (v := _proc_reads(p))}
    assert not bad, f"/proc read outside agnsup/linux/proc.py: {bad}"
    assert _proc_reads(PROC_READER)  # the check sees the reads where they are


def test_the_proc_check_would_catch_a_reader(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import os\nopen('/proc/self/status')\nos.readlink(f'/proc/{pid}/ns/mnt')\nos.scandir('/proc')\n"
                 "os.open(f'/proc/self/fd/{fd}', os.O_WRONLY)\nopen('/etc/passwd')\n")
    assert _proc_reads(str(p)) == ["open('/proc/self/status'...)", "readlink('/proc/'...)", "scandir('/proc'...)"]
