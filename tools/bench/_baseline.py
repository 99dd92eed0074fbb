"""``--baseline REF`` for the benchmarks: one measurement on REF's code and on the working tree's,
side by side in one run.

REF (any git ref: ``main``, a branch, a commit) is checked out into a temporary git worktree.
Each side gets a worker process in this same virtual environment, with ``PYTHONPATH`` set to that
side's ``packages/*/src`` (the ``opweave.*`` namespace packages, src layout), so that REF's code
runs with REF's packages and the working tree's (uncommitted changes included) with its own.
The worker is the side's own copy of the bench script, run with ``--worker``; where REF's copy
predates this protocol, this tree's copy measures REF's packages instead (the script says so).
The parent sends each worker one task per line on its stdin (JSON) and reads one result per
line; the workers take turns, round by round, in alternating order, so that a machine whose
speed drifts (a shared VM) moves both sides alike. Everything a worker prints goes to a log file,
shown when it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

# Bumped when a task or result changes shape: a REF whose copy speaks another version is measured
# by this tree's copy of the script.
PROTOCOL = 1
ROOT = Path(__file__).resolve().parents[2]
_WORKER_FLAG = "--worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also measure git REF's code (e.g. main), checked out into a temporary worktree: "
        "both sides in worker processes, interleaved round by round, printed side by side with "
        "this tree's / REF's ratios",
    )
    parser.add_argument(_WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The command line a worker gets: this one without ``--baseline REF``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--baseline":
            skip = True
        elif not arg.startswith("--baseline="):
            out.append(arg)
    return [*out, _WORKER_FLAG]


def _git(*args: str, cwd: Path = ROOT) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[tuple[Path, str]]:
    """REF checked out (detached) into a temporary git worktree, removed afterwards; yields its
    folder and a label (the ref and its short commit)."""
    commit = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    folder = Path(tempfile.mkdtemp(prefix="opweave-baseline-"))
    _git("worktree", "add", "--detach", "--quiet", str(folder), commit)
    try:
        yield folder, f"{ref} ({commit[:9]})"
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, capture_output=True
        )
        shutil.rmtree(folder, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


def _speaks_protocol(tree: Path, script: Path) -> bool:
    """Whether ``tree``'s copy of ``script`` runs as a worker of this protocol version."""
    own = tree / "tools" / "bench" / "_baseline.py"
    copy = tree / script.relative_to(ROOT)
    if not own.is_file() or not copy.is_file() or "_baseline" not in copy.read_text():
        return False
    found = re.search(r"^PROTOCOL = (\d+)$", own.read_text(), re.MULTILINE)
    return found is not None and int(found.group(1)) == PROTOCOL


def python_path(tree: Path) -> str:
    """``tree``'s packages' source folders, for ``PYTHONPATH`` (ahead of the venv's own)."""
    return os.pathsep.join(str(p) for p in sorted((tree / "packages").glob("*/src")))


class Worker:
    """One side's worker: its script run with ``--worker`` and ``tree``'s packages."""

    def __init__(
        self,
        label: str,
        tree: Path,
        script: Path,
        argv: Sequence[str],
        logs: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: on top of this process's environment (``PYTHONPATH`` is set here)."""
        self.label = label
        script = script.resolve()
        own = _speaks_protocol(tree, script)
        self.script = tree / script.relative_to(ROOT) if own else script
        self.note = (
            None
            if own
            else (
                f"{label}'s copy of {script.name} predates --baseline (protocol {PROTOCOL}): "
                f"this tree's copy measures {label}'s packages"
            )
        )
        self.log_path = logs / f"worker-{len(list(logs.glob('worker-*')))}.log"
        environ = {**os.environ, **(env or {}), "PYTHONPATH": python_path(tree)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(self.script), *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=environ,
                cwd=tree,
            )
        hello = self._read()
        if hello.get("protocol") != PROTOCOL:
            self.close()
            sys.exit(f"error: {label}'s worker speaks protocol {hello.get('protocol')}")
        if Path(hello["code"]) != tree.resolve():
            self.close()
            sys.exit(f"error: {label}'s worker imported opweave from {hello['code']}, not {tree}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text(errors="replace")[-3000:]
            sys.exit(f"{tail}\nerror: {self.label}'s worker exited ({self.proc.returncode})")
        return json.loads(line)

    def ask(self, task: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(task) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A worker's loop: one result line per task line, until stdin closes. The protocol keeps
    the original stdout; whatever else this process (or one it starts) prints goes to stderr."""
    sys.stdout.flush()
    channel: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import opweave.costmodel

    # packages/opweave-costmodel/src/opweave/costmodel/__init__.py -> the tree it came from
    code = str(Path(opweave.costmodel.__file__).resolve().parents[5])
    channel.write(json.dumps({"protocol": PROTOCOL, "code": code}) + "\n")
    channel.flush()
    for line in sys.stdin:
        channel.write(json.dumps(handle(json.loads(line))) + "\n")
        channel.flush()


def extension_env(scratch: Path, side: str) -> dict[str, str]:
    """A side's own torch extension folder. torch names the runtime's native extension after
    its own version only and rebuilds it whenever the source's path or text differs from the
    last build's, so two trees (or another checkout on the machine) sharing the default folder
    would rebuild it by turns, inside the measured runs."""
    return {"TORCH_EXTENSIONS_DIR": str(scratch / f"torch_extensions-{side}")}


def alternate(sides: Sequence[Any], i: int) -> list[Any]:
    """Round ``i``'s order: as given on even rounds, reversed on odd ones."""
    return list(sides) if i % 2 == 0 else list(reversed(sides))


def ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}x" if old > 0 else "-"
