"""OpWeave runtime: the decode operators of a model, stages built from them, and plan execution.

A model's decode is a fixed sequence of operators (:func:`operator_sequence`, the cost model's
order); a plan cuts it into contiguous stages (:class:`StageModule`) that each load only their
own weights (under tensor parallelism, only their shard) and pass a :class:`TokenBatch` on,
packed into one tensor (:func:`pack` / :func:`unpack`) at a cut. :class:`LocalModel` runs every
operator in one process with continuous batching and is the token-exact reference.

A plan runs on one process per rank (:class:`Cluster`): the same stage-worker program under two
drivers, offline generation (:func:`run_plan`) and vLLM's engine
(:mod:`opweave.runtime.vllm`).
"""

from ._private.batch import BatchMeta, TokenBatch, pack, unpack
from ._private.cluster import (
    Cluster,
    check_weights,
    layout_from_file,
    node_layout,
    run_node,
    run_torchrun_rank,
    torchrun_env,
)
from ._private.driver import OfflineDriver, Request, resolve_device_name, run_plan
from ._private.engine import Generation, LocalModel
from ._private.graph import (
    OpRef,
    build_operator,
    check_runtime_support,
    layer_operator_names,
    model_spec,
    operator_sequence,
)
from ._private.ops import Operator, StatefulOperator
from ._private.placement import Placement, check_plan, total_ranks
from ._private.results import (
    RUN_RESULT_SCHEMA_VERSION,
    DriverStats,
    Output,
    RankStats,
    RunResult,
)
from ._private.schedule import compile_schedule
from ._private.stage import StageModule
from ._private.tensor_parallel import Shard
from ._private.tiny import TINY_CONFIGS, write_tiny_model
from ._private.weights import Checkpoint, TensorSource
from ._private.work import SamplingParams, Work
from .errors import (
    CheckpointError,
    OpWeaveRuntimeError,
    PlanMismatchError,
    RequestStateError,
    RunFailedError,
    ShardingError,
    UnsupportedModelError,
)

__all__ = [
    # model description (the cost model's ModelSpec)
    "model_spec",
    "check_runtime_support",
    "OpRef",
    "operator_sequence",
    "layer_operator_names",
    # operators and stages
    "Operator",
    "StatefulOperator",
    "Checkpoint",
    "TensorSource",
    "Shard",
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
    # a plan on processes
    "Cluster",
    "Work",
    "SamplingParams",
    "node_layout",
    "layout_from_file",
    "run_node",
    "run_torchrun_rank",
    "torchrun_env",
    "resolve_device_name",
    "Placement",
    "check_plan",
    "check_weights",
    "total_ranks",
    "compile_schedule",
    # offline generation
    "OfflineDriver",
    "Request",
    "run_plan",
    "RunResult",
    "RankStats",
    "DriverStats",
    "Output",
    "RUN_RESULT_SCHEMA_VERSION",
    # test models
    "TINY_CONFIGS",
    "write_tiny_model",
    # errors
    "OpWeaveRuntimeError",
    "UnsupportedModelError",
    "CheckpointError",
    "RequestStateError",
    "PlanMismatchError",
    "ShardingError",
    "RunFailedError",
]
