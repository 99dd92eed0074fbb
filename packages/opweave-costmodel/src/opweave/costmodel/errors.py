"""Errors raised by the cost model.

Every error the user can cause derives from :class:`OpWeaveError`; its message is one line that
names the problem and what to do about it, so the CLI can print it as is.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "InfeasibleError",
    "OpWeaveError",
    "UnknownGPUError",
    "UnknownModelError",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
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
