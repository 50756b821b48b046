"""The only package that creates processes (tests/test_architecture.py): a cell's leader and the throwaway
children that make or probe what a cell needs.

    leader.py      spawn a cell's leader, hold it at the barrier, release or abandon it; collect it
    steps.py       the leader's setup between fork and execve, as a table of named steps
    clone.py       the three ways a leader is born: clone3 into its cgroup, clone3 from a forked child, fork
    wait.py        the wait loop (Waiter) and how a cell ended (Outcome)
    namespaces.py  the namespaces a host gives a cell: made (cell_userns, cell_netns), probed, refused
    helpers.py     probe, run_helper: a throwaway child or a host helper, never a cell
"""
