"""Shared pydantic base for every schema: frozen, no unknown fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Immutable schema object; unknown fields are an error, never silently dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")
