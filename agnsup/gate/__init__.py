"""agnsup governance gate: decide, before anything runs, whether a tool call may.

    from agnsup.gate import check, GateContext, Decision, judge_shell

    decision, trail = check("run_shell", {"command": "rm -rf /"}, GateContext())
    decision.rule   # "hardline.rm_root"

Pure logic: no processes, no I/O besides resolving paths (and DNS for URL
arguments). The shell parser (tree-sitter-bash) loads only when a call
carries shell text. Design, rule ids and measured figures: docs/governance.md.
"""

from .checker import check, judge_shell
from .model import Decision, GateContext, Kernel

__all__ = ["check", "judge_shell", "GateContext", "Decision", "Kernel"]
