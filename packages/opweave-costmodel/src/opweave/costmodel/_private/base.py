"""Shared pydantic bases for every schema: frozen, no unknown fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Immutable schema object; unknown fields are an error, never silently dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class FileSchema(Frozen):
    """A schema of a file a user hands in (hardware, profile, plan): every number in it is
    finite. JSON and TOML both spell infinity and NaN (``1e999``, ``inf``, ``nan``), and either
    would pass ``gt=0`` or go through every later comparison unnoticed."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
