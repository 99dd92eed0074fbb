"""Exceptions raised by the runtime.

User errors (a config or checkpoint the runtime cannot serve, a request id it does not know) are
kept apart from internal invariant failures so that a CLI can map them to one-line messages.
"""

from __future__ import annotations

from opweave.costmodel.errors import OpWeaveError
from opweave.costmodel.errors import UnsupportedModelError as _UnsupportedFamily

__all__ = [
    "CheckpointError",
    "OpWeaveRuntimeError",
    "PlanMismatchError",
    "RequestStateError",
    "RunFailedError",
    "ShardingError",
    "UnsupportedModelError",
]


class OpWeaveRuntimeError(OpWeaveError):
    """Base class of every error the runtime raises on purpose."""


class UnsupportedModelError(OpWeaveRuntimeError, _UnsupportedFamily):
    """The config names a family or feature (e.g. a RoPE type) the runtime does not implement."""


class CheckpointError(OpWeaveRuntimeError):
    """A weights folder is missing, malformed, or lacks a tensor an operator needs."""


class RequestStateError(OpWeaveRuntimeError):
    """A request id used out of order: unknown, admitted twice, or at the wrong context length."""


class PlanMismatchError(OpWeaveRuntimeError):
    """A plan cannot be installed here: made for another model, or for another number of ranks."""


class RunFailedError(OpWeaveRuntimeError):
    """A multi-process run failed: a rank died, hung or raised; the message names the rank."""


class ShardingError(PlanMismatchError):
    """An operator's dimension does not split over the plan's tensor-parallel degree."""
