"""NCCL's environment every rank of a run starts with (a leaf module: the launcher, the rank
and :mod:`.connect` read it)."""

from __future__ import annotations

import os

# NCCL's settings every rank starts with, unless its environment sets them: every algorithm of
# a communicator connected when it is made (NCCL 2.22 and later connect lazily by default;
# connect.py says why a rank must not), and NCCL's RAS service, a port any local process may
# query, off
NCCL_DEFAULTS = {"NCCL_RUNTIME_CONNECT": "0", "NCCL_RAS_ENABLE": "0"}


def apply_nccl_defaults() -> None:
    """Set :data:`NCCL_DEFAULTS` in this process where unset (before NCCL first reads them):
    every rank does, however it was started (the launcher, torchrun)."""
    for key, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(key, value)
