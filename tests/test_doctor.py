"""`agnsup doctor` reports what this host really has."""
import json
import os

from agnsup.linux import cgroup


def test_doctor_reports_the_detected_cgroup_layout_and_namespaces(agnsup):
    r = json.loads(agnsup("doctor", "--json", check=0).out)
    layout = cgroup.detect_layout()
    assert r["cgroup"]["layout"] == layout.kind
    assert r["cgroup"]["hierarchies"]["v2"] == layout.v2
    assert r["namespaces"]["mount"]["available"] and r["namespaces"]["network"]["available"]
    if layout.v2:
        assert r["cgroup"]["cgroup_kill"] == (tuple(map(int, os.uname().release.split(".")[:2])) >= (5, 14))
        assert "cgroup" in r["will_use"]["tracking_and_kill"]
    assert r["ok"] is True


def test_mountinfo_parsing_finds_the_hybrid_hierarchies():
    mi = ("30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
          "31 30 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
          "32 30 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
          "33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
          "34 30 0:30 / /sys/fs/cgroup/my\\040dir rw - cgroup cgroup rw,pids\n")
    v2, v1 = cgroup.parse_mountinfo(mi)
    assert v2 == "/sys/fs/cgroup/unified"
    assert v1 == {"memory": "/sys/fs/cgroup/memory", "cpu": "/sys/fs/cgroup/cpu,cpuacct",
                  "pids": "/sys/fs/cgroup/my dir"}


def test_mountinfo_parsing_of_a_pure_v2_host():
    v2, v1 = cgroup.parse_mountinfo("25 24 0:22 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    assert (v2, v1) == ("/sys/fs/cgroup", {})
