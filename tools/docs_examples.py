"""Run the commands shown in README.md and docs/*.md, and check or refresh their output.

A fenced block with the info string ``console`` holds ``$ command`` lines, each followed by what
the command prints (stdout and stderr together). In the expected output a line that is only
``...`` stands for any number of lines, and ``...`` within a line for any text on that line. A
command ending in ``\\`` continues on the next line. An HTML comment on the line before a block
changes how it runs:

- ``<!-- docs-test: skip -->``: never run (needs a GPU, a cluster or a large download);
- ``<!-- docs-test: vllm -->``: run only where vLLM is installed.

Blocks fenced as ``bash``, ``text`` or anything else are never run. Each page's blocks run in
order in one fresh temporary folder, with ``$OPWEAVE_REPO`` set to the repository and this
Python's ``bin`` folder (the ``opweave`` command) first on ``PATH``. A command ending in ``&``
(a server) runs in the background, showing no output; when the page is done it gets SIGTERM,
and whatever of it is left after a minute, SIGKILL.

    python tools/docs_examples.py            # check every page; exit status 1 on a mismatch
    python tools/docs_examples.py --update   # rewrite the expected output from the commands
    python tools/docs_examples.py docs/planning.md   # one page
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|vllm)\s*-->\s*$")
TIMEOUT_S = 600


@dataclass
class Example:
    """One ``$ command`` of a page and the output its page shows."""

    command: str
    expected: list[str]
    line: int  # 0-based index of the command's first line in the page
    out: int  # index of its first line of output (after any continuation lines)
    end: int  # index just past its expected output


@dataclass
class Block:
    mode: str  # "run", "skip" or "vllm"
    examples: list[Example] = field(default_factory=list)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(text: str) -> list[Block]:
    """The page's ``console`` blocks, in order."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```console":
            i += 1
            continue
        before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        mark = MARKER.match(before.strip())
        block = Block(mode=mark.group(1) if mark else "run")
        i += 1
        current: Example | None = None
        while i < len(lines) and lines[i].strip() != "```":
            ln = lines[i]
            if ln.startswith("$ "):
                start = i
                command = ln[2:]
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command[:-1].rstrip() + " " + lines[i].strip()
                current = Example(command.strip(), [], line=start, out=i + 1, end=i + 1)
                block.examples.append(current)
            elif current is not None:
                current.expected.append(ln)
                current.end = i + 1
            i += 1
        blocks.append(block)
        i += 1
    return blocks


def _pattern(expected: list[str]) -> re.Pattern[str]:
    parts = []
    for ln in expected:
        if ln.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in ln.rstrip().split("...")) + r"\n")
    return re.compile("".join(parts))


def matches(expected: list[str], actual: str) -> bool:
    """Whether ``actual`` is what ``expected`` shows (``...`` elisions allowed)."""
    while expected and not expected[-1].strip():
        expected = expected[:-1]
    text = "".join(ln.rstrip() + "\n" for ln in actual.rstrip("\n").split("\n")) if actual else ""
    return _pattern(expected).fullmatch(text) is not None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OPWEAVE_REPO"] = str(ROOT)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "200"
    env.pop("OPWEAVE_DEBUG", None)
    return env


def run(command: str, cwd: Path) -> tuple[int, str]:
    """Run one command as a user would in ``cwd``; its exit status and combined output."""
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )
    return proc.returncode, proc.stdout


def start(command: str, cwd: Path) -> subprocess.Popen[bytes]:
    """Start a background command (``... &``) in a session of its own."""
    return subprocess.Popen(
        ["bash", "-c", f"exec {command.removesuffix('&').strip()}"],
        cwd=cwd,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the background command's process group, SIGKILL to what is left after a
    minute: nothing the page started outlives it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60.0)
    # the command if it is still running, and any child it left behind
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_page(path: Path, *, vllm: bool = False, update: bool = False) -> list[str]:
    """Problems with one page's examples (empty when all match): its plain blocks, and with
    ``vllm`` its vLLM blocks too; with ``update`` the page is rewritten with what the commands
    print wherever it differs."""
    text = path.read_text()
    lines = text.split("\n")
    problems: list[str] = []
    edits: list[tuple[int, int, list[str]]] = []
    background: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="opweave-docs-") as tmp:
        try:
            problems += _run_blocks(path, text, Path(tmp), vllm, update, edits, background)
        finally:
            for proc in background:
                stop(proc)
    if update and edits:
        for start_line, end, shown in sorted(edits, reverse=True):
            lines[start_line:end] = shown
        path.write_text("\n".join(lines))
    return problems


def _run_blocks(
    path: Path,
    text: str,
    tmp: Path,
    vllm: bool,
    update: bool,
    edits: list[tuple[int, int, list[str]]],
    background: list[subprocess.Popen[bytes]],
) -> list[str]:
    """Run the page's blocks in ``tmp``; the background commands go to ``background``."""
    problems: list[str] = []
    for block in parse(text):
        if block.mode == "skip" or (block.mode == "vllm" and not vllm):
            continue
        for ex in block.examples:
            if ex.command.endswith("&"):
                background.append(start(ex.command, tmp))
                continue
            status, out = run(ex.command, tmp)
            where = f"{path.relative_to(ROOT)}:{ex.line + 1}"
            if status != 0:
                problems.append(f"{where}: `{ex.command}` exited {status}:\n{out}")
                continue
            if matches(ex.expected, out):
                continue
            if update:
                _, again = run(ex.command, tmp)
                edits.append((ex.out, ex.end, _elide_changes(out, again)))
            else:
                problems.append(
                    f"{where}: `{ex.command}` printed something else:\n{out}\n"
                    f"--- the page shows:\n" + "\n".join(ex.expected)
                )
    return problems


def _elide_changes(first: str, second: str) -> list[str]:
    """The lines of ``first``, with ``...`` for each word that differs in ``second`` (timings,
    rates): what two runs of one command print alike."""
    a = first.rstrip("\n").split("\n") if first.strip() else []
    b = second.rstrip("\n").split("\n") if second.strip() else []
    if len(a) != len(b):
        return a
    out = []
    for x, y in zip(a, b, strict=True):
        wx, wy = x.split(" "), y.split(" ")
        if x == y or len(wx) != len(wy):
            out.append(x)
            continue
        out.append(" ".join(u if u == v else "..." for u, v in zip(wx, wy, strict=True)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to check (default: all)")
    parser.add_argument("--update", action="store_true", help="rewrite the expected output")
    args = parser.parse_args(argv)
    problems = []
    for page in [p.resolve() for p in args.pages] or pages():
        problems += check_page(page, vllm=has_vllm(), update=args.update)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
