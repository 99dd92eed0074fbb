"""OpWeave runtime: the decode operators of a model, stages built from them, and local execution.

A model's decode is a fixed sequence of operators (:func:`operator_sequence`); a plan cuts it into
contiguous stages (:class:`StageModule`) that each load only their own weights and pass a
:class:`TokenBatch` on, packed into one tensor (:func:`pack` / :func:`unpack`) at a cut.
:class:`LocalModel` runs every operator in one process with continuous batching, and is the
token-exact reference the multi-process runtime is checked against.
"""

from ._private.batch import BatchMeta, TokenBatch, pack, unpack
from ._private.config import ModelSpec, parse_config
from ._private.engine import Generation, LocalModel
from ._private.graph import OpRef, build_operator, layer_operator_names, operator_sequence
from ._private.ops import Operator, StatefulOperator
from ._private.stage import StageModule
from ._private.tiny import TINY_CONFIGS, write_tiny_model
from ._private.weights import Checkpoint
from .errors import CheckpointError, OpWeaveRuntimeError, RequestStateError, UnsupportedModelError

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
    # test models
    "TINY_CONFIGS",
    "write_tiny_model",
    # errors
    "OpWeaveRuntimeError",
    "UnsupportedModelError",
    "CheckpointError",
    "RequestStateError",
]
