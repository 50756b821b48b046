"""agnsup: one execution authority for AI-agent tool calls on Linux.

Public API (imports are lazy so `agnsup run` starts fast):

    from agnsup import run_process, RUN_PROCESS_SCHEMA, handle_tool_call
    result = run_process(["pytest", "-q"], role="executor", workdir="/src/app")

    from agnsup import Supervisor          # many concurrent cells, in-process
    with Supervisor() as sup:
        h = sup.spawn(["make", "-j4"], run_id="R", agent_id="A")
        sup.cancel(run_id="R", agent_id="A")
"""
__all__ = ["run_process", "handle_tool_call", "RUN_PROCESS_SCHEMA", "Supervisor"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "Supervisor":
        from .supervisor import Supervisor
        return Supervisor
    if name in __all__:
        from . import tool
        return getattr(tool, name)
    raise AttributeError(name)
