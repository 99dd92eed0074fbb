"""OpWeave runtime: the decode operators of a model, stages built from them, and local execution.

A model's decode is a fixed sequence of operators (:func:`operator_sequence`); a plan cuts it into
contiguous stages (:class:`StageModule`) that each load only their own weights and pass a
:class:`TokenBatch` on, packed into one tensor (:func:`pack` / :func:`unpack`) at a cut.
:class:`LocalModel` runs every operator in one process with continuous batching, and is the
token-exact reference the multi-process runtime is checked against. :func:`run_plan` installs a
plan (from ``opweave-costmodel``'s schema) on one process per rank and serves requests with it.
"""

from ._private.batch import BatchMeta, TokenBatch, pack, unpack
from ._private.config import ModelSpec, parse_config
from ._private.driver import Request
from ._private.engine import Generation, LocalModel
from ._private.graph import OpRef, build_operator, layer_operator_names, operator_sequence
from ._private.launch import run_from_env, run_plan
from ._private.ops import Operator, StatefulOperator
from ._private.placement import Placement, check_plan, total_ranks
from ._private.schedule import compile_schedule
from ._private.stage import StageModule
from ._private.tiny import TINY_CONFIGS, write_tiny_model
from ._private.weights import Checkpoint
from .errors import (
    CheckpointError,
    OpWeaveRuntimeError,
    PlanMismatchError,
    RequestStateError,
    RunFailedError,
    UnsupportedModelError,
)

__all__ = [
    # model description
    "ModelSpec",
    "parse_config",
    "OpRef",
    "operator_sequence",
    "layer_operator_names",
    # operators and stages
    "Operator",
    "StatefulOperator",
    "Checkpoint",
    "build_operator",
    "StageModule",
    # activations between operators
    "BatchMeta",
    "TokenBatch",
    "pack",
    "unpack",
    # single-process execution
    "LocalModel",
    "Generation",
    # multi-process execution of a plan
    "Request",
    "run_plan",
    "run_from_env",
    "Placement",
    "check_plan",
    "total_ranks",
    "compile_schedule",
    # test models
    "TINY_CONFIGS",
    "write_tiny_model",
    # errors
    "OpWeaveRuntimeError",
    "UnsupportedModelError",
    "CheckpointError",
    "RequestStateError",
    "PlanMismatchError",
    "RunFailedError",
]
