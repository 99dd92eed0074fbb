"""Which rank to blame when a run fails, in one line.

A rank that dies closes its control connection (on any node), one that fails reports why before
it exits, one that hangs is named by the peers that time out waiting for it (or, as a backstop,
by a step that yields no result within the timeout). By the time the driver decides, several of
these may have happened (the others notice the first); :func:`diagnose` blames one rank: a crash
over an error over the peer others waited on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .launch import RankProcess
from .messages import Error


@dataclass
class RankView:
    """What the driver knows of one rank's connection when it decides."""

    report: Error | None
    closed: bool


def diagnose(
    conns: Mapping[int, RankView],
    children: Mapping[int, RankProcess],
    world: int,
    describe: Callable[[int], str],
    *,
    hang: tuple[list[int], float] | None = None,
    first_signal: str | None = None,
) -> str:
    """The failure's one line: ``conns`` the ranks that joined, ``children`` this node's rank
    processes, ``hang`` the ranks a step's result was owed by and how long it was waited for."""
    who = describe
    reports = {r: c.report for r, c in conns.items() if c.report is not None}
    for rank, child in sorted(children.items()):
        how = child.ended()
        if how is not None and rank not in reports:
            tail = child.log_tail()
            detail = f" (its last words: {tail})" if tail and "Error" in tail else ""
            return f"{who(rank)} {how}{detail}; the run was stopped"
    for rank, conn in sorted(conns.items()):
        if conn.closed and rank not in reports and rank not in children:
            return (
                f"{who(rank)} lost its connection to the driver (its process or node died); "
                "the run was stopped"
            )
    for rank, rep in sorted(reports.items()):
        if rep.kind == "error":
            return f"{who(rank)} failed: {rep.message}"
    silent = [r for r, c in conns.items() if c.report is None and not c.closed]
    for rank, rep in sorted(reports.items()):
        if rep.peer is not None and rep.peer not in reports:
            return f"{who(rep.peer)} stopped responding: {who(rank)} reported: {rep.message}"
    for rank, rep in sorted(reports.items()):
        # peers that both report (one timed out waiting, the other then lost the connection):
        # the one that waited names who did not answer
        if rep.peer is not None and "Timed out" in rep.message:
            return f"{who(rep.peer)} stopped responding: {who(rank)} reported: {rep.message}"
    for rank, rep in sorted(reports.items()):
        # a group's collective failed: the silent rank of the group it waited in (its live
        # members time out together, within the driver's grace, and report)
        suspects = [r for r in rep.suspects if r in silent]
        if rep.peer is None and suspects:
            return f"{who(suspects[0])} stopped responding: {who(rank)} reported: {rep.message}"
    if hang is not None:
        owing, waited = hang
        culprits = [r for r in owing if r in silent] or owing or silent
        if culprits:
            return (
                f"{who(culprits[0])} stopped responding: no result within {waited:g} s; "
                "the run was stopped"
            )
    if reports:
        rank, rep = next(iter(sorted(reports.items())))
        if silent:
            return f"{who(silent[0])} stopped responding: {who(rank)} reported: {rep.message}"
        return f"{who(rank)} failed: {rep.message}"
    missing = sorted(set(range(world)) - set(conns))
    if missing:
        child = children.get(missing[0])
        tail = child.log_tail() if child is not None else ""
        return f"{who(missing[0])} did not join the run" + (f": {tail}" if tail else "")
    return f"the run failed: {first_signal}"
