"""The commands shown in README.md and docs/ run as written and print what the pages show
(tools/docs_examples.py; `python tools/docs_examples.py --update` refreshes the pages)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_examples", ROOT / "tools/docs_examples.py")
assert _spec is not None and _spec.loader is not None
docs = importlib.util.module_from_spec(_spec)
sys.modules["docs_examples"] = docs
_spec.loader.exec_module(docs)

PAGES = docs.pages()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_commands_print_what_the_page_shows(page: Path) -> None:
    problems = docs.check_page(page)
    assert not problems, "\n\n".join(problems)


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in [*PAGES, *sorted(ROOT.glob("packages/*/README.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_elisions_match_what_they_stand_for() -> None:
    assert docs.matches(["a", "...", "d"], "a\nb\nc\nd\n")
    assert docs.matches(["a", "...", "d"], "a\nd\n")
    assert docs.matches(["cost $... per million"], "cost $0.34 per million\n")
    assert not docs.matches(["cost $... per million"], "cost $0.34 per million\nmore\n")
    assert not docs.matches(["a", "d"], "a\nb\nd\n")
    assert not docs.matches(["... ms"], "12 ms\n13 ms\n")  # `...` within a line: one line


def test_parse_reads_commands_output_and_markers() -> None:
    page = "\n".join(
        [
            "<!-- docs-test: skip -->",
            "```console",
            "$ opweave gpus \\",
            "    --json",
            "[]",
            "```",
            "```console",
            "$ echo hi",
            "hi",
            "$ true",
            "```",
        ]
    )
    first, second = docs.parse(page)
    assert first.mode == "skip" and first.examples[0].command == "opweave gpus --json"
    assert first.examples[0].expected == ["[]"]
    assert second.mode == "run" and [e.command for e in second.examples] == ["echo hi", "true"]
    assert second.examples[0].expected == ["hi"] and second.examples[1].expected == []


def _main_job() -> str:
    """The README's main job: the set-up section's first command, as written."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up", 1)[1]
    command = next(ln for ln in section.split("\n") if "opweave plan" in ln)
    return command.strip().removeprefix("$ ")


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv")
def test_readme_main_job_runs_as_written(tmp_path: Path) -> None:
    """The first set-up command on a machine with uv (its `pip install uv` skipped): uv builds
    the lean planning environment (no torch) and the plan is written."""
    command = _main_job()
    command = command.removeprefix("pip install uv && ")
    env = dict(os.environ)
    env |= {"UV_PROJECT": str(ROOT), "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv")}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("best: ")
    written = re.search(r"-o (\S+)", command)
    assert written is not None
    plan = json.loads((tmp_path / written.group(1)).read_text())
    assert plan["prediction"]["tpot_s"] > 0
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/torch"))
