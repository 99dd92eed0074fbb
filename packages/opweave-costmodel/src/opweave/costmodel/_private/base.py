"""Shared pydantic bases for every schema: frozen, no unknown fields."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import ConfigError


class Frozen(BaseModel):
    """Immutable schema object; unknown fields are an error, never silently dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class FileSchema(Frozen):
    """A schema of a file a user hands in (hardware, profile, plan): every number in it is
    finite. JSON and TOML both spell infinity and NaN (``1e999``, ``inf``, ``nan``), and either
    would pass ``gt=0`` or go through every later comparison unnoticed."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def read_data_file(path: Path, what: str) -> Any:
    """The data of a user's TOML (``.toml``) or JSON file; every way it can fail to be read is
    a one-line :class:`ConfigError` naming ``what`` the file is and ``path``."""
    if not path.is_file():
        state = "is not a regular file" if path.exists() else "does not exist"
        raise ConfigError(f"{what} {path} {state}")
    try:
        text = path.read_text()
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} is malformed: {exc}") from None
    except ValueError:  # an integer of more than 4300 digits
        raise ConfigError(f"{what} {path} holds a number too long to be one") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} nests too deeply to be a {what}") from None
