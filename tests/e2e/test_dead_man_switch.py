"""The dead-man switch end to end (`agnsup selftest --dead-man`, issue 18): a
SIGKILLed `agnsup run`, `agnsup serve` and Python Supervisor each take their
cell's whole tree with them within a second, and the next janitor finds
nothing to kill but records the death. The same scenario with
on_controller_death = keep is the control: every gate must fail there."""
import json
import os
import subprocess
import sys

BIN = os.path.join(os.path.dirname(sys.executable), "agnsup")


def test_a_sigkilled_controller_of_every_kind_takes_its_cells_with_it():
    cp = subprocess.run([BIN, "selftest", "--dead-man", "--json"], capture_output=True, timeout=240,
                        stdin=subprocess.DEVNULL)
    res = json.loads(cp.stdout)
    assert cp.returncode == 0 and res["status"] == "PASS", json.dumps(res["gates"], indent=1)[:3000]
    for gate in res["gates"].values():  # each gate was checked for run, serve and the API
        assert {c["phase"] for c in gate["checks"]} == {"run", "serve", "api"}
    assert res["left"] == []


def test_with_keep_the_same_trees_outlive_their_controllers_and_every_gate_fails():
    from agnsup.selftest.deadman import DeadMan
    res = DeadMan(keep=False, mode="keep").run()
    assert res["status"] == "FAIL" and res["error"] is None, res
    assert all(v["status"] == "FAIL" for v in res["gates"].values()), {g: v["status"] for g, v in res["gates"].items()}
    assert res["left"] == []
