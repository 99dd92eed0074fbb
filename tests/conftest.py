"""Shared fixtures: small configs, tiny random-weight models, transformers references.

Tiny models are written once per session; torch and transformers load only when a test asks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tests that run ranks: several processes each, which between them already keep both cores of a
# small machine busy. Under pytest-xdist (``-n 2 --dist loadgroup``, the nox ``tests`` session)
# they run one after another on one worker while the other worker takes the single-process
# tests; two of them at once are slower than one after the other.
RANK_TESTS = [Path(__file__).parent / d for d in ("runtime", "integration")]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if any(d in item.path.parents for d in RANK_TESTS):
            item.add_marker(pytest.mark.xdist_group("ranks"))


@pytest.fixture
def write_config(tmp_path: Path):
    def write(config: dict[str, Any], name: str = "model") -> Path:
        folder = tmp_path / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return write


@pytest.fixture(scope="session")
def prompts() -> tuple[tuple[int, ...], ...]:
    """Prompt lengths around the tiny models' sliding window (8): shorter, longer, much longer."""
    return (
        tuple(range(5, 17)),
        (20, 21, 22),
        (30, 41, 52, 63, 74, 85, 96),
        tuple(range(100, 121)),
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(family)`` -> folder of that family's tiny model, written on first use."""
    from opweave.runtime import write_tiny_model

    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = write_tiny_model(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, Sequence[Sequence[int]], int], list[list[int]]]:
    """transformers' own greedy ``generate``, one prompt at a time (no padding), memoised."""
    import torch

    from tests.helpers import hf_causal_lm

    cache: dict[tuple[Path, tuple[int, ...], int], list[int]] = {}

    def run(
        model_dir: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[list[int]]:
        missing = [p for p in prompts if (model_dir, tuple(p), max_new_tokens) not in cache]
        if missing:
            model = hf_causal_lm(model_dir, dtype="auto")  # the config's dtype
            for p in missing:
                out = model.generate(
                    torch.tensor([list(p)]), max_new_tokens=max_new_tokens, do_sample=False
                )
                cache[(model_dir, tuple(p), max_new_tokens)] = out[0, len(p) :].tolist()
        return [cache[(model_dir, tuple(p), max_new_tokens)] for p in prompts]

    return run
