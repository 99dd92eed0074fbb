"""The pages' serving commands (blocks marked `<!-- docs-test: vllm -->`) run as written."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_examples", ROOT / "tools/docs_examples.py")
assert _spec is not None and _spec.loader is not None
docs = importlib.util.module_from_spec(_spec)
sys.modules["docs_examples"] = docs
_spec.loader.exec_module(docs)

PAGES = [p for p in docs.pages() if any(b.mode == "vllm" for b in docs.parse(p.read_text()))]


@pytest.mark.vllm
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_serving_commands_run_as_the_page_shows(page: Path) -> None:
    pytest.importorskip("vllm")
    problems = docs.check_page(page, vllm=True)
    assert not problems, "\n\n".join(problems)
