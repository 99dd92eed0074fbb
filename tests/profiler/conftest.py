"""Profiler fixtures: small measured profiles, shared across the module's tests.

Timing runs keep torch's thread settings as they are (re-setting them changes how later tests
in the same process run), take two passes so a busy machine stalls few cells, and skip the
two-process transfer, the serving-loop runs and the idle-gap timing except where a test is about
them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

FAST = {"warmup": 1, "repeats": 3, "cell_budget_s": 0.005, "passes": 2}


@pytest.fixture(scope="session")
def quick_profile() -> Callable[..., Any]:
    """``quick_profile(model, **kwargs)`` -> ProfileRun on CPU with a small grid (memoised)."""
    from opweave.profiler import TimingSettings, profile_model

    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}

    def run(model: str | Path, **kwargs: Any) -> Any:
        key = (str(model), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            options: dict[str, Any] = {
                "batches": (1, 4),
                "contexts": (16, 64),
                "transfer": False,
                "orchestration": False,
                "idle": False,
                "progress": False,
                "timing": TimingSettings(**FAST),
            }
            options.update(kwargs)
            cache[key] = profile_model(model, **options)
        return cache[key]

    return run
