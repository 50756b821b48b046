"""The container lane's engine (issue 27): Debian's docker.io run as a daemon of the test's own, with no
networking of its own, and the agnsup image built from deploy/Dockerfile on a local Debian base.

    installed()                 None, or why the engine cannot run here (an ENV_BLOCKED reason)
    Daemon()                    dockerd under a temp dir in /var/tmp: its own socket, data root, exec root and
                                cgroup parent; no bridge, no iptables, no IP forwarding. Leaving the `with`
                                removes every container and volume it holds, stops it by its recorded pid,
                                unmounts what is left under its roots, removes its cgroup parent and the temp
                                dir (its data root: the images and build cache).
    base_image(d)               agnsup-base:bookworm in `d`, imported from a debootstrap rootfs cached under
                                CACHE (keyed by suite, variant and the include list; a lock file so that two
                                processes never debootstrap at once) with the host's CA bundle for pip
    build_image(d, repo, tag)   deploy/Dockerfile of the checkout `repo`, FROM that base, `--network host`
    save(d, tag, path)          `docker save` of an image (the pure cgroup-v2 guest loads it: scripts/v2lane)

    python -m tests.containers save PATH [--repo DIR] [--tag T]   (from the repository root) builds the image
                                of a checkout in a daemon of its own and writes its `docker save` tar to PATH
    python -m tests.containers base                                warms the rootfs cache only
    python -m tests.containers check                               prints why the engine cannot run, exit 77

The cache (CACHE, default /var/cache/agnsup-containers, AGNSUP_CONTAINER_CACHE overrides) is the one thing
the lane keeps: the debootstrap rootfs, its log, and what `save` is asked to write there.
`/usr/bin/docker` is called by its path: another client earlier on PATH may not speak to this daemon.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

DOCKER = "/usr/bin/docker"
CACHE = os.environ.get("AGNSUP_CONTAINER_CACHE", "/var/cache/agnsup-containers")
SUITE = "bookworm"
VARIANT = "minbase"
MIRROR = os.environ.get("AGNSUP_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What deploy/Dockerfile needs from its base (python3 and its venv module) and installs itself when absent
# (ca-certificates git procps): present in the base, the build needs no apt-get of its own
INCLUDE = ("python3", "python3-venv", "ca-certificates", "git", "procps")
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
BASE_TAG = f"agnsup-base:{SUITE}"
# The daemon's data root is a tmpfs of this size (MB; pages used only as written): the lane's session peaks
# at about PEAK (measured below); AGNSUP_DOCKER_TMPFS_MB=0 puts it on /var/tmp's disk instead
TMPFS_MB = int(os.environ.get("AGNSUP_DOCKER_TMPFS_MB", "4096"))
IMAGE_CA = "/etc/agnsup-host-ca.crt"  # in the base: pip in `docker build` trusts what the host trusts (PIP_CERT)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = {"dockerd": "docker.io", "containerd": "containerd", "runc": "runc", "debootstrap": "debootstrap"}


def installed() -> str | None:
    """None when the engine can run here; else why not, as an ENV_BLOCKED reason naming the fix."""
    if os.geteuid() != 0:
        return "ENV_BLOCKED: root (the container lane starts a Docker daemon of its own)"
    missing = sorted({pkg for prog, pkg in PROGRAMS.items() if _which(prog) is None}
                     | (set() if os.access(DOCKER, os.X_OK) else {"docker.io"}))
    if missing:
        return (f"ENV_BLOCKED: the container engine is not installed ({', '.join(missing)}: scripts/test.sh "
                "installs them)")
    return None


def _which(prog: str) -> str | None:
    return shutil.which(prog, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin")


def _last_line(cp: subprocess.CompletedProcess) -> str:
    text = cp.stderr if isinstance(cp.stderr, str) else (cp.stderr or b"").decode(errors="replace")
    out = cp.stdout if isinstance(cp.stdout, str) else (cp.stdout or b"").decode(errors="replace")
    return ((text or out).strip().splitlines() or [f"exit {cp.returncode}"])[-1]


def mounts_under(path: str) -> list[str]:
    """Mount points at or under `path` (this mount namespace), deepest first."""
    path = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].encode().decode("unicode_escape")
            if mnt == path or mnt.startswith(path + "/"):
                found.append(mnt)
    return sorted(found, key=len, reverse=True)


def unmount_under(path: str) -> list[str]:
    """Lazily unmount everything at or under `path`; return what was mounted (a leftover to name)."""
    left = mounts_under(path)
    for mnt in left:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
    return left


class DockerError(RuntimeError):
    pass


class Daemon:
    """One dockerd of the caller's own (see the module's docstring). `netns`: start it in a network
    namespace of its own (`unshare --net`, IP forwarding off in there first), for the test that proves the
    daemon's flags leave networking alone; containers then see that namespace as the host's."""

    def __init__(self, *, netns: bool = False, start_timeout: float = 60.0, tmpfs_mb: int | None = TMPFS_MB):
        self.netns = netns
        self.tmpfs_mb = tmpfs_mb
        self.start_timeout = start_timeout
        self.root: str | None = None
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    # -- lifecycle
    def __enter__(self) -> "Daemon":
        why = installed()
        if why:
            raise DockerError(why)
        self.root = tempfile.mkdtemp(prefix="agnsup-dk-", dir="/var/tmp")
        self.name = os.path.basename(self.root)
        self.sock = os.path.join(self.root, "docker.sock")
        self.host = f"unix://{self.sock}"
        self.pidfile = os.path.join(self.root, "docker.pid")
        self.log_path = os.path.join(self.root, "dockerd.log")
        # No networking of its own: no bridge (containers only --network none or host), no iptables rule, no
        # net.ipv4.ip_forward write (dockerd's default sets it to 1 even with --bridge=none), no masquerading.
        # Its own cgroup parent, so that its containers' cgroups are under a directory it alone made.
        data = os.path.join(self.root, "data")
        os.mkdir(data, 0o710)
        if self.tmpfs_mb:
            # the data root on a tmpfs of its own: taking it down is an unmount (an ext4 data root took 13-24 s
            # to delete after one image build), and it is a local file system that holds an overlay upper layer
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.tmpfs_mb}m,mode=0710", "agnsup-dk", data],
                           check=True, capture_output=True)
        argv = [_which("dockerd"), "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-forward=false",
                "--ip-masq=false", "--userland-proxy=false", f"--cgroup-parent=/{self.name}",
                "--data-root", data, "--exec-root", os.path.join(self.root, "exec"),
                "-H", self.host, "--pidfile", self.pidfile]
        if self.netns:
            argv = ["unshare", "--net", "--", "sh", "-c", 'sysctl -qw net.ipv4.ip_forward=0 && exec "$@"', "sh", *argv]
        try:
            with open(self.log_path, "wb") as log:
                # a session of its own: a ^C at the terminal reaches the test, which then stops the daemon in order
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                             start_new_session=True)
            self.pid = self.proc.pid
            deadline = time.monotonic() + self.start_timeout
            while True:
                if self.proc.poll() is not None:
                    raise DockerError(f"dockerd exited {self.proc.returncode} at start: {self._log_tail()}")
                if os.path.exists(self.sock) and self.docker("version", check=False, timeout=10).returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise DockerError(f"dockerd did not answer within {self.start_timeout:.0f} s: {self._log_tail()}")
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> list[str]:
        """Idempotent: everything this daemon made goes; returns what had to be forced (for a leak check)."""
        forced: list[str] = []
        if self.root is None:
            return forced
        if self.proc is not None and self.proc.poll() is None:
            # containers (their mounts, shims and cgroups) and volumes by the daemon; its images and build cache
            # go with its data root below (removing them one by one first took ~10 s more)
            for what, args in (("container", ("ps", "-aq")), ("volume", ("volume", "ls", "-q"))):
                cp = self.docker(*args, check=False, timeout=60)
                ids = sorted(set(cp.stdout.split())) if cp.returncode == 0 else []
                if not ids:
                    continue
                rm = {"container": ("rm", "-f", "-v"), "volume": ("volume", "rm", "-f")}[what]
                self.docker(*rm, *ids, check=False, timeout=120)
            # SIGTERM to the pid it was started as (Popen's child is dockerd: unshare and sh exec it), then wait;
            # dockerd stops the containerd it started
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                forced.append(f"dockerd {self.pid} killed after 60 s")
                self.proc.kill()
                self.proc.wait()
        # a containerd or shim left by a dockerd that died: by the pid files under this daemon's own exec root
        for pidfile in (os.path.join(self.root, "exec", "containerd", "containerd.pid"),):
            pid = _read_pid(pidfile)
            if pid and _cmdline_has(pid, self.root):
                forced.append(f"containerd {pid} left running")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        # dockerd keeps its own network namespace bound at exec-root/netns/default and leaves it on exit
        unmount_under(os.path.join(self.root, "exec", "netns"))
        if self.tmpfs_mb:
            unmount_under(os.path.join(self.root, "data"))
        left = unmount_under(self.root)
        if left:
            forced.append("mounts left: " + ", ".join(left))
        self._remove_cgroups()
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        return forced

    def _remove_cgroups(self) -> None:
        """The cgroup parent this daemon's containers got (one per v1 hierarchy, or the v2 tree): removed
        once empty, deepest first. Only under /<self.name>, which this daemon alone made."""
        for top in ("/sys/fs/cgroup", *(os.path.join("/sys/fs/cgroup", d) for d in _listdir("/sys/fs/cgroup"))):
            base = os.path.join(top, self.name)
            if not os.path.isdir(base):
                continue
            for dirpath, _, _ in sorted(os.walk(base), key=lambda t: len(t[0]), reverse=True):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)

    def _log_tail(self, n: int = 3) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-n:])
        except OSError:
            return "(no log)"

    # -- the client
    def docker(self, *args: str, check: bool = True, timeout: float = 120, input: bytes | str | None = None,
               text: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "DOCKER_HOST": self.host, "DOCKER_CONFIG": os.path.join(self.root, "client")}
        env.pop("DOCKER_CONTEXT", None)
        if text and isinstance(input, bytes):
            input = input.decode()
        cp = subprocess.run([DOCKER, *args], env=env, capture_output=True, timeout=timeout, text=text, input=input,
                            stdin=None if input is not None else subprocess.DEVNULL)
        if check and cp.returncode != 0:
            raise DockerError(f"docker {' '.join(args[:3])}...: exit {cp.returncode}: {_last_line(cp)}")
        return cp

    def inspect(self, what: str, fmt: str = "{{json .}}") -> str:
        return self.docker("inspect", "-f", fmt, what).stdout.strip()


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return text.encode() in f.read()
    except OSError:
        return False


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# -- the base image


def cache_key() -> str:
    return hashlib.sha256(f"{SUITE} {VARIANT} {','.join(sorted(INCLUDE))} {MIRROR}".encode()).hexdigest()[:12]


@contextlib.contextmanager
def _cache_lock():
    os.makedirs(CACHE, mode=0o755, exist_ok=True)
    with open(os.path.join(CACHE, ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_rootfs(log=None) -> str:
    """The cached debootstrap rootfs (made once per key: ~45 s and ~270 MB, the network to MIRROR needed)."""
    path = os.path.join(CACHE, f"rootfs-{SUITE}-{cache_key()}")
    with _cache_lock():
        if os.path.isdir(path):
            return path
        tmp = path + ".partial"
        if os.path.exists(tmp):  # a debootstrap killed half-way (we hold the lock: nobody else is in it)
            unmount_under(tmp)
            shutil.rmtree(tmp)
        logfile = os.path.join(CACHE, f"debootstrap-{cache_key()}.log")
        t0 = time.monotonic()
        with open(logfile, "wb") as out:
            cp = subprocess.run([_which("debootstrap"), f"--variant={VARIANT}", f"--include={','.join(INCLUDE)}",
                                 SUITE, tmp, MIRROR], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=900)
        left = unmount_under(tmp)  # debootstrap mounts proc and sys in the target while it works
        if cp.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            with open(logfile, errors="replace") as f:
                tail = " | ".join(f.read().strip().splitlines()[-3:])
            raise DockerError(f"debootstrap {SUITE} failed (exit {cp.returncode}; {logfile}): {tail}")
        if left:
            raise DockerError(f"debootstrap left mounts under {tmp}: {left}")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(os.path.join(tmp, "var", "cache", "apt", "archives"))
        os.rename(tmp, path)
        if log:
            log(f"debootstrap {SUITE}: {time.monotonic() - t0:.0f} s -> {path}")
        return path


def base_image(d: Daemon, log=None) -> str:
    """agnsup-base:bookworm in daemon `d` (from the cached rootfs, the host's CA bundle added); its tag."""
    rootfs = base_rootfs(log)
    with _cache_lock():
        ca = os.path.join(rootfs, IMAGE_CA.lstrip("/"))
        shutil.copyfile(HOST_CA, ca)
        tar = subprocess.Popen(["tar", "-C", rootfs, "--numeric-owner", "-c", "."], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
        env = {**os.environ, "DOCKER_HOST": d.host, "DOCKER_CONFIG": os.path.join(d.root, "client")}
        cp = subprocess.run([DOCKER, "import", "--change", f"ENV PIP_CERT={IMAGE_CA}", "-", BASE_TAG],
                            stdin=tar.stdout, env=env, capture_output=True, text=True, timeout=300)
        tar.stdout.close()
        tar.wait()
    if cp.returncode != 0 or tar.returncode != 0:
        raise DockerError(f"docker import {BASE_TAG}: exit {cp.returncode} (tar {tar.returncode}): {_last_line(cp)}")
    return BASE_TAG


TINY_TAG = "agnsup-tiny:1"


def tiny_image(d: Daemon) -> list[str]:
    """A nearly empty image (the merged-/usr symlinks and an empty /usr, built here in memory) for the runs
    that test the engine, not agnsup; returns the `docker run` arguments that give it the host's /usr,
    read-only, and its tag last."""
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("usr", "tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name in ("bin", "lib", "lib64", "sbin"):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, f"usr/{name}"
            tar.addfile(info)
    d.docker("import", "-", TINY_TAG, input=buf.getvalue(), text=False)
    return ["-v", "/usr:/usr:ro", TINY_TAG]


def build_image(d: Daemon, repo: str = REPO, tag: str = "agnsup:lane", base: str = BASE_TAG) -> str:
    """deploy/Dockerfile of checkout `repo`, FROM `base`, built with the host's network (pip); its tag."""
    cp = d.docker("build", "--network", "host", "-f", os.path.join(repo, "deploy", "Dockerfile"),
                  "--build-arg", f"BASE={base}", "-t", tag, repo, check=False, timeout=900)
    if cp.returncode != 0:
        tail = " | ".join((cp.stdout + cp.stderr).strip().splitlines()[-4:])
        raise DockerError(f"docker build of {repo}: exit {cp.returncode}: {tail}")
    return tag


def save(d: Daemon, tag: str, path: str) -> str:
    """`docker save` of `tag` to `path` (written beside it, then renamed: never a half tar at `path`)."""
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        d.docker("save", "-o", tmp, tag, timeout=600)
        os.rename(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tests.containers", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("save", help="build a checkout's image in a daemon of its own and write its docker save tar")
    sp.add_argument("path")
    sp.add_argument("--repo", default=REPO, help="the checkout (default: this one)")
    sp.add_argument("--tag", default="agnsup:lane")
    sub.add_parser("base", help="make the cached debootstrap rootfs (no daemon)")
    sub.add_parser("check", help="say why the engine cannot run here (exit 77), or nothing (exit 0)")
    a = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(f"containers: {msg}", file=sys.stderr, flush=True)

    why = installed()
    if a.cmd == "check" or why:
        if why:
            print(why, file=sys.stderr)
        return 77 if why else 0
    t0 = time.monotonic()
    if a.cmd == "base":
        log(f"rootfs {base_rootfs(log)} ({time.monotonic() - t0:.0f} s)")
        return 0
    try:
        with Daemon() as d:
            log(f"daemon {d.root} up ({time.monotonic() - t0:.1f} s)")
            base_image(d, log)
            log(f"base {BASE_TAG} imported ({time.monotonic() - t0:.1f} s)")
            build_image(d, os.path.abspath(a.repo), a.tag)
            log(f"image {a.tag} built ({time.monotonic() - t0:.1f} s)")
            save(d, a.tag, os.path.abspath(a.path))
            log(f"saved {a.path} ({os.path.getsize(a.path) >> 20} MB, {time.monotonic() - t0:.1f} s)")
    except DockerError as e:
        print(f"containers: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
