"""opweave.cli: the ``opweave`` command, a thin layer over the OpWeave libraries."""

from __future__ import annotations

from .app import app, main

__all__ = ["app", "main"]
