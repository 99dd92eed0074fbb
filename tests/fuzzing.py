"""What every fuzz test of the CLI checks, and the generators they share.

The contract (DESIGN.md, Testing): whatever the input, a command either succeeds with a valid
result or exits with status 2 and one ``error:`` line, without a traceback. How long the slowest
call took is in the report (``pytest -s``), not asserted (the machine's load decides it); an input
that made a command hang fails by pytest's timeout.
Commands run in-process (``opweave.cli.app.main``) so that hundreds of inputs take seconds.
A command that would start real work past its checks (``run``'s ranks, ``profile``'s timing)
gets a stand-in for that library call which records what it was given (:class:`Reached`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from opweave.cli.app import main

OUTCOMES: Counter[str] = Counter()  # "<test>: ok|error|reached" -> count, for the report
SLOWEST: dict[str, tuple[float, str]] = {}  # "<test>" -> (seconds, command), for the report


class Reached(BaseException):
    """Raised by a stand-in library call: the CLI accepted the input and called the library
    with ``kwargs``. A ``BaseException``, so that no ``except`` of the CLI maps it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs


def invoke(args: Sequence[str]) -> tuple[int | Reached, str, str, float]:
    """``main(args)``: its exit status (or the :class:`Reached` it got to), stdout, stderr and
    the seconds it took."""
    out, err = io.StringIO(), io.StringIO()
    env = os.environ.pop("OPWEAVE_DEBUG", None)
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code: int | Reached = main(list(args))
            except Reached as reached:
                code = reached
    finally:
        if env is not None:
            os.environ["OPWEAVE_DEBUG"] = env
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def one_line_error(args: Sequence[str]) -> str:
    """The ``error: ...`` line of a command that must fail on its input: exit status 2, one
    line on stderr, nothing on stdout, no traceback."""
    code, out, err, _ = invoke(args)
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def check(name: str, args: Sequence[str]) -> int | Reached:
    """Run ``args`` and assert the contract; returns the exit status or the :class:`Reached`."""
    return check_output(name, args)[0]


def check_output(name: str, args: Sequence[str]) -> tuple[int | Reached, str]:
    """:func:`check`, and what the command printed on stdout."""
    code, out, err, took = invoke(args)
    shown = " ".join(repr(a) if len(a) < 80 else repr(a[:77] + "...") for a in args)
    if took > SLOWEST.get(name, (0.0, ""))[0]:
        SLOWEST[name] = (took, shown)
    assert "Traceback" not in err, f"opweave {shown}: {err[-2000:]}"
    if isinstance(code, Reached):
        OUTCOMES[f"{name}: reached the library"] += 1
        return code, out
    if code == 0:
        OUTCOMES[f"{name}: succeeded"] += 1
        if "--json" in args:
            json.loads(out)  # one JSON document, nothing else
        return code, out
    lines = err.strip().splitlines()
    assert code == 2, f"opweave {shown} exited {code}: {err[-2000:]}"
    assert len(lines) == 1, f"opweave {shown}: not one line: {err[-2000:]}"
    assert lines[0].startswith("error: ") and lines[0][len("error: ") :].strip(), lines[0]
    assert out == "", f"opweave {shown} printed on stdout while failing: {out[:500]}"
    OUTCOMES[f"{name}: refused"] += 1
    if os.environ.get("FUZZ_SHOW"):
        print(f"{name}: {lines[0][:200]}")
    return code, out


# -- numbers as a user (or an attacker) types them --------------------------------------------
SPECIAL_NUMBERS = (
    "inf",
    "-inf",
    "Infinity",
    "nan",
    "NaN",
    "-0",
    "0",
    "1",
    "-1",
    "2",
    "3",
    "8",
    "1.5",
    "0.1",
    "1e30",
    "-1e30",
    "1e-30",
    "1e400",
    "9" * 400,
    "-" + "9" * 400,
    "infK",
    "nanK",
    "-8K",
    "8K",
    "1.5K",
    "1e30K",
    "64M",
    "0x10",
    "1_000",
    "65535",
    "65536",
    "86400",
    "86401",
    "",
    " ",
    "K",
    "1,2",
    "1,,2",
    "4,2,4",
    "1;2",
    "\x00",
    "٣",  # an Arabic-Indic digit: Python's int() takes it
)

numbers = st.one_of(
    st.sampled_from(SPECIAL_NUMBERS),
    st.integers(-(10**12), 10**12).map(str),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet="0123456789.,eEkKmM+-_ inf", max_size=10),
)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 7, 10**7, 10**12, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e40, -1e40, 0.5, 1e-300]),
    st.text(max_size=12),
    st.sampled_from(["64", "full_attention", "linear_attention", "bfloat16", "silu", "llama3"]),
)
json_values = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def deep(depth: int) -> str:
    """JSON nested ``depth`` arrays deep: past Python's recursion limit for ``json.loads``."""
    return "[" * depth + "]" * depth


def finite_or_none(value: Any) -> bool:
    """Every number inside ``value`` (a JSON document) is finite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_or_none(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_or_none(v) for v in value)
    return True


def odd_numbers(value: float) -> st.SearchStrategy[Any]:
    """Numbers near and far from ``value``: zero, its negation, 10^6 times larger or smaller,
    one more, infinity, NaN, a float where an integer was."""
    near = [0, -value, value * 10**6, value / 10**6, value + 1, value * 2]
    if isinstance(value, int):
        near += [float(value), value * 10**12, 2**63, -(2**63)]
    return st.sampled_from([*near, math.inf, -math.inf, math.nan]) | st.floats(0.001, 1e6)


@st.composite
def mutated(draw: st.DrawFn, document: Any, extra_keys: Sequence[str] = ()) -> Any:
    """``document`` (a JSON tree) with one to three edits: a value replaced, a key removed or
    added, a list shortened or doubled."""
    doc = json.loads(json.dumps(document))
    pick = draw(
        st.randoms(use_true_random=False)
    )  # uniform over keys (hypothesis favours the first)
    for _ in range(draw(st.integers(1, 3))):
        doc = _edit(draw, pick, doc, extra_keys, root=True)
    return doc


def _edit(
    draw: st.DrawFn, pick: Any, node: Any, extra_keys: Sequence[str], root: bool = False
) -> Any:
    """Descend (mostly) or edit here; the document itself stays an object or a list."""
    descend = root or pick.random() < 0.75
    if isinstance(node, dict) and node and descend:
        key = pick.choice(sorted(node))
        node[key] = _edit(draw, pick, node[key], extra_keys)
        return node
    if isinstance(node, list) and node and descend:
        i = pick.randrange(len(node))
        node[i] = _edit(draw, pick, node[i], extra_keys)
        return node
    if isinstance(node, int | float) and not isinstance(node, bool) and draw(st.booleans()):
        return draw(odd_numbers(node))  # a number of the right type, often still a valid one
    action = pick.choice(["replace", "delete", "add", "resize"])
    if action == "delete" and isinstance(node, dict) and node:
        node.pop(pick.choice(sorted(node)))
        return node
    if action == "add" and isinstance(node, dict):
        key = draw(st.sampled_from(list(extra_keys)) | st.text(max_size=8)) if extra_keys else "x"
        node[key] = draw(json_values)
        return node
    if action == "resize" and isinstance(node, list):
        return node[: draw(st.integers(0, len(node)))] if draw(st.booleans()) else node * 2
    return draw(json_values)
