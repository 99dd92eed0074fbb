"""What one rank is told about its run (:class:`RankSpec`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from .options import RunOptions


class RankSpec(BaseModel):
    """Everything one rank needs to join its run; spawned ranks read it from a file.

    ``store``: how torch.distributed rendezvous: ``{"file": path}`` (one node),
    ``{"host": h, "port": p}`` (the driver's TCP store, several nodes) or ``{"env": True}``
    (torchrun's). ``control``: the driver's address, or ``None`` to read it from the store.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: dict[str, Any]
    model_dir: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    key: str
    host: str
    store: dict[str, Any]
    options: RunOptions
    control: tuple[str, int] | None = None
    log: str | None = None  # where a launcher-forked rank writes its output
    env: dict[str, str] | None = None  # a launcher-forked rank's environment: its driver's


def read_spec(path: Path) -> RankSpec:
    """A spec file written for a spawned or launcher-forked rank; removed once read (it holds
    the run's key)."""
    spec = RankSpec.model_validate_json(path.read_text())
    path.unlink(missing_ok=True)
    return spec
