"""docs/cli.md lists every exit code agnsup itself uses, and errors.EXIT_CODES is the one table."""
import os
import re

from agnsup import errors

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "cli.md")


def _table() -> list[tuple[str, str]]:
    with open(DOC) as f:
        text = f.read()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+) \| [^|]+ \| ([^|]*) \|$", section, re.M)
    return [(code.strip(), types.strip()) for code, types in rows if code.strip() not in ("code", "---")]


def test_every_error_class_is_in_the_documented_table_with_its_code():
    """Issue 12 item 7: agnsup's own refusals have documented codes (cli.md)."""
    documented = {}
    for code, types in _table():
        for t in filter(None, (x.strip() for x in types.split(","))):
            documented.setdefault(t, set()).add(code)
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.AgnsupError)
               and c is not errors.AgnsupError]
    for cls in classes:
        want = str(errors.exit_code(cls("x")))
        assert want in documented.get(cls.__name__, set()), f"{cls.__name__} ({want}) missing from docs/cli.md"


def test_a_refused_start_does_not_look_like_a_command_that_exited_1():
    """Issue 12 item 7: a cancelled run or a taken cell id ends `run` with 125 (was 1)."""
    assert errors.exit_code(errors.RunNotActive("run 'R' was cancelled")) == 125
