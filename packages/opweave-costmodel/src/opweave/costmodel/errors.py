"""Errors raised by the cost model.

Every error the user can cause derives from :class:`OpWeaveError`; its message is one line that
names the problem and what to do about it, so the CLI can print it as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError",
    "InfeasibleError",
    "OpWeaveError",
    "UnknownGPUError",
    "UnknownModelError",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
    "not_a_file",
    "validation_message",
]


class OpWeaveError(Exception):
    """Base of every error OpWeave raises for bad input or impossible requests."""


class UnknownModelError(OpWeaveError):
    """A model name is neither a built-in nor a path to a config."""


class UnsupportedModelError(OpWeaveError):
    """A config's ``model_type`` is not one of the supported families."""


class UnknownGPUError(OpWeaveError):
    """A GPU id is not in the catalog (nor in a ``--hardware`` or ``--profile`` file)."""


class ConfigError(OpWeaveError):
    """A config, hardware, profile or plan file is malformed or inconsistent."""


class InfeasibleError(OpWeaveError):
    """The request cannot be met: the model does not fit, or no plan meets the SLO."""


class UnsupportedPrecisionError(OpWeaveError):
    """A weight format or KV-cache dtype that a GPU (or the runtime) cannot run."""


def validation_message(error: Mapping[str, Any]) -> str:
    """The words of one pydantic validation error, without the ``Value error,`` that pydantic
    puts before a validator's own message."""
    return str(error["msg"]).removeprefix("Value error, ")


def not_a_file(path: Path) -> str:
    """Why ``path`` is not a file to read, to follow its name in a message: a folder, a device
    or pipe, a symbolic link to nothing, or absent."""
    if path.is_dir():
        return "is a folder; give the file itself"
    if path.exists():
        return "is not a regular file"
    if path.is_symlink():
        return "is a symbolic link to nothing (dangling, or a loop); give the file itself"
    return "does not exist"
