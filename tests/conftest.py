"""Shared fixtures: small configs written to temp folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def write_config(tmp_path: Path):
    def write(config: dict[str, Any], name: str = "model") -> Path:
        folder = tmp_path / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return write
