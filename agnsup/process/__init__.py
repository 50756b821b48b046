"""The only package that creates processes (tests/test_architecture.py): a cell's leader (leader.py, its setup
steps.py, its birth clone.py, its wait wait.py) and the throwaway children that make or probe what a cell needs
(namespaces.py; helpers.py: probe, and run_helper for a host helper)."""
