"""Errors the profiler raises for bad input, kept one line each so the CLI can print them as is.

They derive from the cost model's :class:`OpWeaveError`, which the ``opweave`` command maps to
``error: ...`` and exit status 2.
"""

from __future__ import annotations

from opweave.costmodel.errors import OpWeaveError

__all__ = ["DeviceUnavailableError", "ProfilerError"]


class ProfilerError(OpWeaveError):
    """A profile cannot be measured as asked (unknown operator, unsupported TP degree, ...)."""


class DeviceUnavailableError(ProfilerError):
    """The requested device (e.g. ``cuda``) is not present on this machine."""
